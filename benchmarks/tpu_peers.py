"""The TPU attention kernels the TPU bench compares splash_hk against (not part of the library).

Each peer computes the bench's attention (q scaled by D ** -0.5; the row's causal, window or
packed-document rule; GQA) on inputs laid out as splash_hk's ([B, T, H, D]), at each of its
candidate tiles; `best` keeps the fastest forward and the fastest forward+backward.

- `jax_splash`: JAX's Pallas splash kernel (`jax.experimental.pallas.ops.tpu.splash_attention`),
  a kernel per kv head's group (MQA kernels vmapped over kv heads) vmapped over the batch.
- `tokamax_splash`: tokamax's experimental TPU splash kernel
  (`tokamax._src.ops.experimental.tpu.splash_attention`), laid out the same way.
- `tokamax_mosaic`: `tokamax.dot_product_attention(implementation="mosaic")` (no segment ids).
- `xla`: `jax.nn.dot_product_attention(implementation="xla")`, dense (a segment mask as bool).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

# Candidate tiles: (block_q, block_kv, block_kv_compute) for the forward and the fused backward
# (block_q_dkv, block_kv_dkv, block_kv_dkv_compute). 512/1024/512 is JAX's and tokamax's tuned
# choice on v5e (issue 72's table); the second is the larger neighbour.
TILES = ((512, 1024, 512), (1024, 2048, 512))
SMOKE_TILES = ((128, 128, 128),)


class CannotServe(Exception):
  """The peer does not serve the row (a rule it lacks, a package that is not installed)."""


class Best(NamedTuple):
  seconds: tuple[float, float]  # the fastest forward, the fastest forward+backward
  tiles: list[str]  # the tiles of each


def best(peer: str, row: Any, x: Any, time: Callable[[Callable[..., jax.Array]],
                                                      tuple[float, float]],
         interpret: bool, candidates: tuple[tuple[int, int, int], ...] = ()) -> Best:
  """`peer`'s fastest forward and forward+backward over its candidate tiles (`TILES` unless
  `candidates` are given)."""
  if peer in ("tokamax_mosaic", "xla"):
    return Best(time(_CALLS[peer](row, x)), ["-", "-"])
  found: list[tuple[tuple[float, float], str]] = []
  for tiles in SMOKE_TILES if interpret else candidates or TILES:
    if max(tiles[:2]) > row.length:
      continue
    try:
      found.append((time(_CALLS[peer](row, x, tiles, interpret)), "/".join(map(str, tiles))))
    except CannotServe:
      raise
    except Exception as failure:  # a candidate the kernel refuses (VMEM at D 256): the next
      found.append(((np.inf, np.inf), f"{tiles}: {type(failure).__name__}"))
  fwd = min(found, key=lambda f: f[0][0])
  both = min(found, key=lambda f: f[0][1])
  if not np.isfinite(fwd[0][0]):
    raise CannotServe(f"no candidate tiles compiled: {[f[1] for f in found]}")
  return Best((fwd[0][0], both[0][1]), [fwd[1], both[1]])


def _scaled(q: jax.Array) -> jax.Array:
  return q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)


def _per_head_layout(kernel_of_group: Callable[..., jax.Array], q, k, v, segments,
                     segment_type: Any) -> jax.Array:
  """q [B, T, Hq, D], k, v [B, T, Hkv, D] -> [B, T, Hq, D] through an MQA kernel per kv head
  (vmapped over kv heads, then the batch): q [G, T, D], k, v [T, D]."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  qg = jnp.moveaxis(_scaled(q).reshape(b, t, hkv, hq // hkv, d), 1, 3)  # [B, Hkv, G, T, D]
  kh, vh = (jnp.moveaxis(a, 1, 2) for a in (k, v))  # [B, Hkv, T, D]
  seg = None if segments is None else segment_type(segments, segments)
  per_kv = jax.vmap(lambda q, k, v, s: kernel_of_group(q, k, v, segment_ids=s),
                    in_axes=(0, 0, 0, None))
  out = jax.vmap(per_kv, in_axes=(0, 0, 0, None if seg is None else 0))(qg, kh, vh, seg)
  return jnp.moveaxis(out, 3, 1).reshape(b, t, hq, -1)  # [B, T, Hq, Dv]


def jax_splash(row: Any, x: Any, tiles: tuple[int, int, int], interpret: bool):
  """JAX's splash kernel at `tiles` (forward and fused backward alike)."""
  t, group = row.length, row.heads // row.kv_heads
  mask = (splash_mask.LocalMask((t, t), row.window, offset=0) if row.window
          else splash_mask.CausalMask((t, t)))
  bq, bkv, bkvc = tiles
  sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, block_q_dkv=bq,
                            block_kv_dkv=bkv, block_kv_dkv_compute=bkvc,
                            use_fused_bwd_kernel=True)
  kernel = splash.make_splash_mqa(splash_mask.MultiHeadMask([mask] * group), block_sizes=sizes,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)
  return lambda q, k, v, segments: _per_head_layout(kernel, q, k, v, segments,
                                                    splash.SegmentIds)


def tokamax_splash(row: Any, x: Any, tiles: tuple[int, int, int], interpret: bool):
  """tokamax's experimental TPU splash kernel at `tiles` (its fused backward)."""
  try:
    from tokamax._src.ops.experimental.tpu.splash_attention import base as tbase  # pylint: disable=g-import-not-at-top
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as tsk  # pylint: disable=g-import-not-at-top
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as tsm  # pylint: disable=g-import-not-at-top
  except ImportError as missing:
    raise CannotServe(f"tokamax is not installed ({missing})") from missing
  t = row.length
  mask = (tsm.LocalMask((t, t), row.window, offset=0) if row.window else tsm.CausalMask((t, t)))
  bq, bkv, bkvc = tiles
  config = tsk.SplashConfig(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, block_q_dkv=bq,
                            block_kv_dkv=bkv, block_kv_dkv_compute=bkvc, interpret=interpret)
  kernel = tsk.make_splash_mqa(mask, config=config, q_seq_shards=1)
  return lambda q, k, v, segments: _per_head_layout(kernel, q, k, v, segments, tbase.SegmentIds)


def tokamax_mosaic(row: Any, x: Any):
  """`tokamax.dot_product_attention(implementation="mosaic")`: causal or a window, no segments."""
  if row.mask == "packed":
    raise CannotServe("tokamax's dot_product_attention takes no segment ids (a dense mask of "
                      "16384^2 per call instead would not be the same kernel)")
  try:
    import tokamax  # pylint: disable=g-import-not-at-top
  except ImportError as missing:
    raise CannotServe(f"tokamax is not installed ({missing})") from missing
  def call(q, k, v, segments):
    del segments
    return tokamax.dot_product_attention(q, k, v, is_causal=True, local_window_size=row.window,
                                         implementation="mosaic")

  return call


def xla(row: Any, x: Any):
  """jax.nn's dense xla attention (packed documents as a bool mask [B, 1, T, T])."""
  def call(q, k, v, segments):
    mask = None if segments is None else (segments[:, None, :, None] ==
                                          segments[:, None, None, :])
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                        local_window_size=row.window, implementation="xla")

  return call


_CALLS = {"jax_splash": jax_splash, "tokamax_splash": tokamax_splash,
          "tokamax_mosaic": tokamax_mosaic, "xla": xla}
