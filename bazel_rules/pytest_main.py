"""Runs one test file under pytest as a Bazel `py_test`.

Bazel's test protocol, honoured here:
- `TEST_TOTAL_SHARDS` / `TEST_SHARD_INDEX`: this shard runs every
  `TEST_TOTAL_SHARDS`-th collected test, and touches `TEST_SHARD_STATUS_FILE`
  so Bazel knows the runner shards.
- `XML_OUTPUT_FILE`: pytest's JUnit XML goes there (test cases in Bazel's UI).
- `TEST_TMPDIR`: HOME and ejkernel's caches live there, inside the sandbox.
A shard that selects no test fails: a `shard_count` larger than the file's
test count is a BUILD mistake, not a pass.
"""

import os
import sys

import pytest


class _Shard:
  """pytest plugin keeping the tests of one Bazel shard."""

  def __init__(self, index: int, total: int):
    self.index = index
    self.total = total

  def pytest_collection_modifyitems(self, config, items):
    keep = [item for i, item in enumerate(items) if i % self.total == self.index]
    drop = [item for i, item in enumerate(items) if i % self.total != self.index]
    if drop:
      config.hook.pytest_deselected(items=drop)
    items[:] = keep


def main(argv: list[str]) -> int:
  tmp = os.environ.get("TEST_TMPDIR")
  if tmp:
    os.environ["HOME"] = os.path.join(tmp, "home")
    os.environ["EJKERNEL_PERSISTENT_CACHE_DIR"] = os.path.join(tmp, "ejkernel")
    os.makedirs(os.environ["HOME"], exist_ok=True)
  args = ["-q", *argv]
  xml = os.environ.get("XML_OUTPUT_FILE")
  if xml:
    args.append(f"--junitxml={xml}")
  plugins = []
  total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
  if total > 1:
    status = os.environ.get("TEST_SHARD_STATUS_FILE")
    if status:
      open(status, "a").close()
    plugins.append(_Shard(int(os.environ["TEST_SHARD_INDEX"]), total))
  code = pytest.main(args, plugins=plugins)
  if code == pytest.ExitCode.NO_TESTS_COLLECTED:
    shard = os.environ.get("TEST_SHARD_INDEX", "0")
    print(f"pytest_main: no test selected by {argv} (shard {shard} of {total});"
          " lower shard_count in BUILD.", file=sys.stderr)
  return int(code)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
