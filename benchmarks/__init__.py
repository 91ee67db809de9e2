"""The bench binary and its baselines, kept beside the library (not in its wheel).

  python -m benchmarks.bench --impls=splash_hk_xla --workloads=causal@4096
"""
