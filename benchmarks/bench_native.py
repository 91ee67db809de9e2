"""The native decode kernel against the memory floor and against xla, in one process.

    python -m benchmarks.bench_native [--max_len=8192] [--repeats=5] [--threads=1,2]

A decode step of 16 sequences of 64..max_len tokens (Hq 8, Hkv 2, D 128, pages of 16, the pool
head-major and donated each step), every figure from the same run:
- the read bandwidth: a 256 MiB `jnp.sum` (XLA's, on every core), timed beside the steps, and
  one core's: NumPy's sum of the same size on the calling thread;
- per thread count: the f32 native step's fraction of the read bandwidth (the bytes of every
  cached key and value it must read / its time / the bandwidth; for one thread also of one
  core's); the donated xla paged step / native; an int8 pool's native step against the f32
  one (f32 / int8 time);
- the fixed cache: a `KVCache` decode step through the Haiku module (`sh.MultiHeadAttention`,
  the cache donated) on native, its read fraction (the step must read every cached key and
  value and the module's four projection weights), the same step over one cached token a row
  (what the module costs besides the cache's read: its projections), the cache read's fraction
  (the cache's bytes / the step's time less that) and xla / native.
Timing: each timed call after an untimed call of the same executable (`timing`); times are
medians of `--repeats`, ratios the median over `--repeats` rounds timing both steps one after
the other (`bench_paged.ratio`: the machine's drift cancels).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_paged
from benchmarks import timing
from splash_hk.backends.native import backend as native
import splash_hk as sh

HQ, HKV, D = bench_paged.HQ, bench_paged.HKV, 128
MODEL = 1024  # the Haiku module's model size


def _config(platform: str) -> sh.AttentionConfig:
  return sh.AttentionConfig(platform=platform, allow_fallback=False)


def paged_step(lens: Sequence[int], dtype: Any, platform: str) -> Callable[[], Any]:
  """A donated decode step (one row per sequence) over a pool of `dtype` pages."""
  pages = -(-max(lens) // bench_paged.PAGE) + 1
  cache, batch = bench_paged.pool_for(lens, [1] * len(lens), pages, dim=D, dtype=dtype)
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(len(lens), HQ, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(len(lens), HKV, D)), jnp.float32)
  return bench_paged.donated_step(q, k, cache, batch, config=_config(platform))


def module_step(lens: Sequence[int], max_len: int,
                platform: str) -> tuple[Callable[[], Any], int]:
  """A donated decode step of `sh.MultiHeadAttention` over a `KVCache` whose rows hold `lens`,
  and the bytes of the module's weights (which the step reads besides the cache)."""
  rows = len(lens)

  @hk.transform
  def decode(x, cache):
    mha = sh.MultiHeadAttention(HQ, D, num_kv_heads=HKV, model_size=MODEL,
                                w_init=hk.initializers.VarianceScaling(1.0),
                                config=_config(platform), name="mha")
    return mha(x, kv_cache=cache)

  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(rows, 1, MODEL)), jnp.float32)
  kv = lambda: jnp.asarray(rng.normal(size=(rows, max_len, HKV, D)), jnp.float32)
  cache = sh.KVCache(kv(), kv(), jnp.asarray(lens, jnp.int32), owner="mha")
  params = decode.init(jax.random.key(0), x, cache)
  compiled = jax.jit(decode.apply, donate_argnums=(3,))
  held = [cache]

  def run() -> jax.Array:  # each call appends at the same slot again: the same work each time
    out, written = compiled(params, None, x, held[0])
    held[0] = written.replace(length=jnp.asarray(lens, jnp.int32))
    return out

  return run, sum(x.nbytes for x in jax.tree.leaves(params))


def seconds(step: Callable[[], Any], repeats: int) -> float:
  return float(np.median([timing.timed_call(step)[0] for _ in range(repeats)]))


def report(max_len: int, repeats: int, threads: Sequence[int]) -> dict[str, float]:
  """Prints and returns the figures (keys suffixed `_t{threads}`)."""
  lens = np.linspace(64, max_len - 1, 16).astype(np.int32)
  page = bench_paged.PAGE
  paged_bytes = sum(-(-(int(n) + 1) // page) for n in lens) * page * HKV * D * 4 * 2
  cache_bytes = int(sum(lens + 1)) * HKV * D * 4 * 2
  bandwidth = timing.read_bandwidth(0.25, repeats)
  one_core = timing.one_core_bandwidth(0.25, repeats)
  xla_paged = paged_step(lens, jnp.float32, "xla")
  xla_module, weight_bytes = module_step(lens, max_len, "xla")
  figures = {"bandwidth_gbs": bandwidth / 1e9, "one_core_bandwidth_gbs": one_core / 1e9}
  print(f"16 sequences of 64..{max_len} (Hq {HQ}, Hkv {HKV}, D {D}, pages of {page}, donated); "
        f"read bandwidth {bandwidth / 1e9:.2f} GB/s (one core {one_core / 1e9:.2f}); pool "
        f"{paged_bytes / 2**20:.0f} MiB; module weights {weight_bytes / 2**20:.0f} MiB")
  for n in threads:
    os.environ[native.THREADS_ENV] = str(n)  # read when the steps are traced (their first call)
    f32, int8 = paged_step(lens, jnp.float32, "native"), paged_step(lens, jnp.int8, "native")
    module, _ = module_step(lens, max_len, "native")
    fixed, _ = module_step(np.ones_like(lens), max_len, "native")  # one cached token a row
    for step in (f32, int8, module, fixed):
      step()
    f32_s, module_s = seconds(f32, repeats), seconds(module, repeats)
    rows = {"read_fraction": paged_bytes / f32_s / bandwidth,
            "xla_over_native": bench_paged.ratio([xla_paged], [f32], repeats),
            "f32_over_int8": bench_paged.ratio([f32], [int8], repeats),
            "module_read_fraction": (cache_bytes + weight_bytes) / module_s / bandwidth,
            "module_xla_over_native": bench_paged.ratio([xla_module], [module], repeats),
            "module_fixed_ms": seconds(fixed, repeats) * 1e3}
    rows["module_cache_fraction"] = (  # the cache's read alone: the step less its fixed cost
        cache_bytes / max(module_s - rows["module_fixed_ms"] / 1e3, 1e-9) / bandwidth)
    if n == 1:
      rows["read_fraction_one_core"] = paged_bytes / f32_s / one_core
    figures.update({f"{k}_t{n}": v for k, v in rows.items()})
    _print_row(n, f32_s, module_s, rows)
  return figures


def _print_row(n: int, f32_s: float, module_s: float, rows: dict[str, float]) -> None:
  core = (f" ({rows['read_fraction_one_core']:.2f} of one core's)"
          if "read_fraction_one_core" in rows else "")
  print(f"  {n} thread(s): f32 pool {f32_s * 1e3:.1f} ms = {rows['read_fraction']:.2f} of the "
        f"read bandwidth{core}; donated xla paged / native {rows['xla_over_native']:.2f}x; f32 "
        f"/ int8 pool {rows['f32_over_int8']:.2f}x; KVCache through the Haiku module "
        f"{module_s * 1e3:.1f} ms = {rows['module_read_fraction']:.2f} of the bandwidth (its "
        f"step over one cached token a row {rows['module_fixed_ms']:.1f} ms: the cache read "
        f"{rows['module_cache_fraction']:.2f}), xla / native "
        f"{rows['module_xla_over_native']:.2f}x")


def main(argv: Sequence[str]) -> None:
  del argv
  f = flags.FLAGS
  report(f.max_len, f.repeats, [int(t) for t in f.threads])


if __name__ == "__main__":
  flags.DEFINE_integer("max_len", 8192, "The longest decoding sequence.")
  flags.DEFINE_integer("repeats", 5, "Timed calls per figure (the median).")
  flags.DEFINE_list("threads", ["1", "2"], "Thread counts of the native kernel.")
  app.run(main)
