"""The environment of the tests and of the processes they start (imports no jax: conftest.py
reads it before jax is imported).

Most of the suite's time is XLA compiling programs it runs a few times. The tests, and the
binaries and scripts they start, compile with XLA's backend optimisations off
(`JAX_DISABLE_MOST_OPTIMIZATIONS`) and with XLA:CPU's quicker code generators (`FAST_COMPILE`):
the same programs, numbers equal up to rounding, which the tolerances allow, compiled in about
half the time (tests/test_scores.py: 80 s without the two flags, 31-42 s with them). The one long training run (test_train's defaults) keeps XLA's defaults.
"""

import os

FAST_COMPILE = ("--xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_copy_insertion_use_region_analysis=false")


def env(optimized: bool = False, drop: tuple[str, ...] = ()) -> dict[str, str]:
  """os.environ for a process a test starts: without the tests' forced device count (a binary
  asks for its devices itself; a README or guide block as a user's script does), without `drop`, and
  compiling as the tests do unless `optimized` (XLA's defaults)."""
  out = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and k not in drop}
  if optimized:
    out["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"
  else:
    out["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    out["XLA_FLAGS"] = FAST_COMPILE
  return out
