"""`python -m splash_hk.tune`: measures the dense TPU kernel's tiles on this machine and keeps the
winners where the library reads them first (`splash_hk.backends.tpu.tiles`).

  python -m splash_hk.tune --shapes=4x4096x16x16x128:causal,1x16384x16x16x128:window:1024
                           [--dtype=bfloat16] [--repeats=3] [--cache=PATH] [--interpret]

A shape is `BxTxHqxHkvxD:mask`, the mask `causal`, `window:W` (causal within W keys back),
`segments:N` (N packed documents, causal within) or `full`. For each shape, every forward
candidate (block_q, block_kv, block_kv_compute) is timed on `sh.attention`'s forward; then,
the fastest forward fixed, every backward candidate (block_q_bwd, block_kv_bwd,
block_kv_compute_bwd, fused) on its forward+backward (the gradients of q, k and v). Each
time is the median of `--repeats` calls, each after an untimed call of the same executable.
The winners go into the cache (`SPLASH_HK_TILE_CACHE`, default
`~/.cache/splash_hk/tiles.json`) under the shape's key (chip, dtype, head dim, length band,
mask kind), replacing what it held there. The shipped table (`backends/tpu/tiles_*.json`) is
this command's cache on the lent chips; tokamax's autotuning is the model (candidates timed
on the device, winners cached by shape).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import splash_hk as sh
from splash_hk.backends.tpu import tiles as tiles_lib

# (block_q, block_kv, block_kv_compute); (block_q_bwd, block_kv_bwd, block_kv_compute_bwd, fused)
FORWARD = ((512, 1024, 512), (1024, 1024, 512), (512, 2048, 512), (1024, 2048, 512),
           (512, 512, 512))
BACKWARD = ((512, 1024, 512, True), (1024, 1024, 512, True), (1024, 2048, 512, True),
            (512, 512, 512, True), (512, 1024, 512, False))

_SHAPES = flags.DEFINE_list("shapes", ["4x4096x16x16x128:causal"],
                            "Shapes BxTxHqxHkvxD:mask (mask: causal, window:W, segments:N, full).")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Input dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per candidate (the median is kept).")
_CACHE = flags.DEFINE_string("cache", None, "The cache file (default: tiles.cache_path()).")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Interpret mode (a CPU check of the tuner).")


@dataclasses.dataclass(frozen=True)
class Shape:
  batch: int
  length: int
  heads: int
  kv_heads: int
  dim: int
  mask: str  # "causal", "window", "segments", "full"
  arg: int = 0  # the window's width, the documents' count

  @classmethod
  def parse(cls, spec: str) -> Shape:
    dims, _, mask = spec.partition(":")
    kind, _, arg = mask.partition(":")
    numbers = [int(n) for n in dims.split("x")]
    if len(numbers) != 5 or kind not in ("causal", "window", "segments", "full"):
      raise app.UsageError(f"a shape is BxTxHqxHkvxD:mask (causal, window:W, segments:N, full), "
                           f"got {spec!r}")
    batch, length, heads, kv_heads, dim = numbers
    return cls(batch, length, heads, kv_heads, dim, kind, int(arg or 0))

  def call(self, config: sh.AttentionConfig) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A jittable attention over this shape's inputs, and the inputs."""
    keys = jax.random.split(jax.random.key(0), 3)
    draw = lambda key, h: jax.random.normal(key, (self.batch, self.length, h, self.dim),
                                            jnp.dtype(_DTYPE.value))
    q, k, v = draw(keys[0], self.heads), draw(keys[1], self.kv_heads), draw(keys[2], self.kv_heads)
    seg = None
    if self.mask == "segments":
      seg = jnp.broadcast_to(jnp.arange(self.length) // -(-self.length // self.arg),
                             (self.batch, self.length)).astype(jnp.int32)
    config = config.replace(causal=self.mask != "full",
                            sliding_window=(self.arg, 0) if self.mask == "window" else None,
                            interpret=_INTERPRET.value)
    return (lambda q, k, v, seg: sh.attention(q, k, v, config=config,
                                              q_segment_ids=seg).attention_outputs), (q, k, v, seg)

  def key(self) -> tiles_lib.Key:
    chip = jax.devices()[0].device_kind if jax.default_backend() == "tpu" else ""
    kind = {"segments": "segments", "window": "window", "full": "full"}.get(self.mask, "causal")
    return tiles_lib.Key(chip, str(jnp.dtype(_DTYPE.value)), self.dim, tiles_lib.band(self.length),
                         kind)


def seconds(fn: Callable[..., Any], args: tuple[Any, ...], repeats: int) -> float:
  """Median seconds of `fn(*args)`, each timed call after an untimed one."""
  times = []
  for _ in range(repeats):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _forward(shape: Shape, tiles: tuple[int, int, int]) -> float:
  bq, bkv, bkvc = tiles
  config = sh.AttentionConfig(block_sizes=sh.BlockSizes(block_q=bq, block_kv=bkv,
                                                        block_kv_compute=bkvc),
                              platform="splash", allow_fallback=False)
  call, args = shape.call(config)
  return seconds(jax.jit(call), args, _REPEATS.value)


def _both(shape: Shape, fwd: tuple[int, int, int], bwd: tuple[int, int, int, bool]) -> float:
  (bq, bkv, bkvc), (bq_b, bkv_b, bkvc_b, fused) = fwd, bwd
  config = sh.AttentionConfig(
      block_sizes=sh.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, block_q_bwd=bq_b,
                                block_kv_bwd=bkv_b, block_kv_compute_bwd=bkvc_b),
      fused_backward=fused, platform="splash", allow_fallback=False)
  call, (q, k, v, seg) = shape.call(config)
  grad = jax.jit(jax.grad(lambda q, k, v, seg: jnp.sum(call(q, k, v, seg).astype(jnp.float32)),
                          argnums=(0, 1, 2)))
  return seconds(grad, (q, k, v, seg), _REPEATS.value)


def _best(label: str, candidates, measure: Callable[[Any], float]) -> tuple[Any, float]:
  """The fastest candidate (a candidate that fails to compile is skipped, and said)."""
  found = []
  for candidate in candidates:
    try:
      found.append((measure(candidate), candidate))
      print(f"  {label} {candidate}: {found[-1][0] * 1e3:.3f} ms", flush=True)
    except Exception as failure:  # pylint: disable=broad-except
      print(f"  {label} {candidate}: failed ({type(failure).__name__}: {str(failure)[:160]})",
            flush=True)
  if not found:
    raise RuntimeError(f"no {label} candidate ran")
  best = min(found, key=lambda f: f[0])
  return best[1], best[0]


def tune(shape: Shape) -> dict[str, Any]:
  """The winners of `shape`, as a cache entry (with the times measured)."""
  longest = tiles_lib.longest_tile(shape.length)  # candidates cut to the length, once each
  fit = lambda cs: list(dict.fromkeys(tuple(min(n, longest) for n in c[:3]) + tuple(c[3:])
                                      for c in cs))
  fwd, fwd_s = _best("forward", fit(FORWARD), lambda c: _forward(shape, c))
  bwd, both_s = _best("backward", fit(BACKWARD), lambda c: _both(shape, fwd, c))
  tiles = dict(block_q=fwd[0], block_kv=fwd[1], block_kv_compute=fwd[2], block_q_bwd=bwd[0],
               block_kv_bwd=bwd[1], block_kv_compute_bwd=bwd[2], fused_backward=bwd[3])
  return {"key": dataclasses.asdict(shape.key()), "tiles": tiles,
          "measured": {"shape": dataclasses.asdict(shape), "forward_ms": round(fwd_s * 1e3, 3),
                       "forward_backward_ms": round(both_s * 1e3, 3)}}


def store(path: Path, entries: list[dict[str, Any]]) -> None:
  """`entries` into the cache at `path`, replacing entries of the same keys."""
  held = json.loads(path.read_text())["entries"] if path.exists() else []
  keys = {json.dumps(e["key"], sort_keys=True) for e in entries}
  kept = [e for e in held if json.dumps(e["key"], sort_keys=True) not in keys]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"version": 1, "entries": kept + entries}, indent=1) + "\n")


def main(argv: list[str]) -> None:
  del argv
  shapes = [Shape.parse(spec) for spec in _SHAPES.value]
  path = Path(_CACHE.value) if _CACHE.value else tiles_lib.cache_path()
  print(f"tuning on {jax.devices()[0].device_kind}, into {path}", flush=True)
  entries = []
  for shape in shapes:
    print(f"{shape}", flush=True)
    entries.append(tune(shape))
    store(path, entries)  # after each shape: a call cut short keeps what it measured
    print(f"  -> {entries[-1]['tiles']}", flush=True)


if __name__ == "__main__":
  app.run(main)
