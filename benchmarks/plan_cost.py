"""What planning a call costs: the xla backend's block plan (`Backend.plan`), timed alone.

  python -m benchmarks.bench --workloads= --plan_workloads=causal@1048576,prefix:262144@1048576

The plan is everything the xla path builds before its loops (block ranges of
positions and segment ids, the rule's classification, the order of the blocks);
it runs inside every call, so its time is a part of each forward's. Where the
splash (TPU) kernel can serve the workload, its build is timed too: the
MaskInfo of its forward, dq and dK/dV grids (`backends/tpu/plan.py`), built
once per static shape at trace time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import bench_workloads
from benchmarks import timing
from splash_hk import inputs
from splash_hk import kernel
from splash_hk.backends.tpu import backend as splash
from splash_hk.backends.tpu import tiles as tiles_lib
from splash_hk.types import Extras


def plan_seconds(workload: bench_workloads.Workload, repeats: int) -> float:
  """Median seconds of the xla block plan of `workload` (B = 1, one head: it reads no q/k/v)."""
  zeros = jnp.zeros((1, workload.query_len, 1, 8), jnp.float32)
  keys = jnp.zeros((1, workload.kv_len, 1, 8), jnp.float32)
  config = workload.config.replace(platform="xla")
  x, facts = inputs.normalise(zeros, keys, keys, config=config,
                              extras=Extras(**workload.extras(1)))
  plan = jax.jit(lambda x: kernel.backend("xla").plan(x, facts))
  return timing.median_seconds(plan, x, repeats=repeats)


def splash_build_seconds(workload: bench_workloads.Workload, repeats: int) -> float | None:
  """Median seconds of building the splash kernel of `workload` (its MaskInfo), or None
  where splash cannot serve it (it then never builds one)."""
  zeros = jax.ShapeDtypeStruct((1, workload.query_len, 1, 128), jnp.float32)
  keys = jax.ShapeDtypeStruct((1, workload.kv_len, 1, 128), jnp.float32)
  config = workload.config.replace(platform="splash", interpret=True)
  facts = inputs.facts(zeros, keys, keys, config=config, extras=Extras(**workload.extras(1)))
  if splash.why_not(facts, "tpu") is not None:
    return None
  tiles, t_pad, s_pad = tiles_lib.padded_layout(workload.query_len, workload.kv_len,
                                             tiles_lib.for_call(facts))
  build = lambda: splash.build_kernel.__wrapped__(
      padded=(t_pad, s_pad), offset=workload.kv_len - workload.query_len, is_mqa=False,
      config=config, rule=facts.rule, tiles=tiles)
  return timing.median_seconds(build, repeats=repeats)


def report(specs: list[str], repeats: int) -> dict[str, float]:
  """Prints and returns {spec: plan seconds} (and {spec + " splash": build seconds})."""
  seconds = {}
  for spec in specs:
    workload = bench_workloads.parse(spec)
    seconds[spec] = plan_seconds(workload, repeats)
    line = f"plan of {spec}: {seconds[spec] * 1e3:.1f} ms (xla block plan, B=1)"
    built = splash_build_seconds(workload, repeats)
    if built is not None:
      seconds[f"{spec} splash"] = built
      line += f"; splash MaskInfo (fwd, dq, dK/dV) {built * 1e3:.1f} ms"
    print(line)
  return seconds

