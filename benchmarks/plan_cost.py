"""What planning a call costs: the xla backend's block plan (`Backend.plan`), timed alone.

  python -m benchmarks.bench --workloads= --plan_workloads=causal@1048576,prefix:262144@1048576

The plan is everything the xla path builds before its loops (block ranges of
positions and segment ids, the rule's classification, the order of the blocks);
it runs inside every call, so its time is a part of each forward's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import bench_workloads
from benchmarks import timing
from splash_hk import inputs
from splash_hk import kernel
from splash_hk.types import Extras


def plan_seconds(workload: bench_workloads.Workload, repeats: int) -> float:
  """Median seconds of the xla block plan of `workload` (B = 1, one head: it reads no q/k/v)."""
  zeros = jnp.zeros((1, workload.query_len, 1, 8), jnp.float32)
  keys = jnp.zeros((1, workload.kv_len, 1, 8), jnp.float32)
  config = workload.config.replace(platform="xla")
  x, facts = inputs.normalise(zeros, keys, keys, config=config,
                              extras=Extras(**workload.extras(1)))
  plan = jax.jit(lambda x: kernel.BACKENDS["xla"].plan(x, facts))
  return timing.median_seconds(plan, x, repeats=repeats)


def report(specs: list[str], repeats: int) -> dict[str, float]:
  """Prints and returns {spec: plan seconds}."""
  seconds = {}
  for spec in specs:
    seconds[spec] = plan_seconds(bench_workloads.parse(spec), repeats)
    print(f"plan of {spec}: {seconds[spec] * 1e3:.1f} ms (xla block plan, B=1)")
  return seconds

