#!/usr/bin/env bash
echo "bazel coverage is not available offline: remote_coverage_tools is a local stand-in." >&2
echo "Measure coverage with pytest instead." >&2
exit 1
