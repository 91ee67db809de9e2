"""The absl serving binary: continuous batching over pages, chunked prefill, shared prefixes.

  python -m examples.serve
"""
