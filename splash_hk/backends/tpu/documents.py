"""Packed documents on the TPU kernel: each example's plan skips the block pairs its segment ids
keep apart.

JAX's MaskInfo is static and segment ids arrive at run time, so the static plan computes every
pair the rule allows, however the documents fall. Here each example's plan is the static plan's
grid with a step skipped where its query block's and key block's id ranges are apart, riding in
the kernel's scalar prefetch (leaves [B, ...]: one kernel call per example, as the horizon plans).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info_lib

from splash_hk.backends import base
from splash_hk.backends.tpu import plan as splash_plan
from splash_hk.backends.tpu import tiles as tiles_lib
from splash_hk.types import KernelInputs


def padded_segment_ids(x: KernelInputs, t_pad: int,
                       s_pad: int) -> tuple[jax.Array, jax.Array] | None:
  """(q [B, Tp], kv [B, Sp]) segment ids over the padded lengths (padding: -1 on the query side,
  -2 on the key side, never equal), or None where the call has no ids and no padding."""
  if x.q_segment_ids is None and t_pad == x.query.shape[2] and s_pad == x.key.shape[2]:
    return None
  q_seg, kv_seg = base.disjoint_padding(*base.segment_ids(x))
  return base.pad_axis(q_seg, 1, t_pad, -1), base.pad_axis(kv_seg, 1, s_pad, -2)


def apart(kernel: splash.SplashAttentionKernel, seg: tuple[jax.Array, jax.Array],
          tiles: tiles_lib.Tiles) -> splash.SplashAttentionKernel:
  """`kernel` with per-example plans (leaves [B, ...]) that skip every block pair whose segment
  ids are apart (`segment_blocks`): packed documents cost their own blocks, not the rule's.
  The static plan's grid stays (its shrinking too); its skipped steps fetch nothing."""
  bq, bkv, bq_bwd, bkv_bwd = tiles.blocks
  backward_keep = segment_blocks(*seg, (bq_bwd, bkv_bwd))  # [B, nq, nk]

  def backward(info: info_lib.MaskInfo | None, is_dkv: bool) -> info_lib.MaskInfo | None:
    return None if info is None else restricted(info, backward_keep, is_dkv)

  return splash.SplashAttentionKernel(
      restricted(kernel.fwd_mask_info, segment_blocks(*seg, (bq, bkv)), False),
      backward(kernel.dq_mask_info, False), backward(kernel.dkv_mask_info, True), **kernel.kwargs)


def segment_blocks(q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                   block_shape: tuple[int, int]) -> jax.Array:
  """[B, nq, nk] bool: whether a query block and a key block may hold a pair of equal segment
  ids, from each block's least and greatest id (negative ids, padding, match nothing). A False
  is exact (their ranges are apart); a True may be loose where ids interleave.

  Args:
    q_segment_ids: [B, Tp] int, Tp a multiple of block_shape[0].
    kv_segment_ids: [B, Sp] int, Sp a multiple of block_shape[1].
  """
  def ranges(ids: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    ids = ids.reshape(ids.shape[0], -1, block)  # [B, n, block]
    real = ids >= 0
    top = jnp.iinfo(ids.dtype).max
    return (jnp.min(jnp.where(real, ids, top), axis=-1),
            jnp.max(jnp.where(real, ids, -1), axis=-1))  # [B, n]: empty where all padding

  (q_lo, q_hi), (kv_lo, kv_hi) = (ranges(q_segment_ids, block_shape[0]),
                                  ranges(kv_segment_ids, block_shape[1]))
  return ((q_lo[:, :, None] <= kv_hi[:, None, :])
          & (kv_lo[:, None, :] <= q_hi[:, :, None]))  # [B, nq, nk]


def restricted(static: info_lib.MaskInfo, keep: jax.Array, is_dkv: bool) -> info_lib.MaskInfo:
  """Per-example MaskInfo (leaves [B, ...]): the static plan's grid, each step skipped where
  `keep` [B, nq, nk] says its block pair holds nothing (`segment_blocks`), and each step's
  fetch moved to the next step that runs (in grid order: rows outermost, dK/dV columns).

  The static plan's grid (shrunk or not) is kept: a step's block pair is its row (its column
  for dK/dV) and the block its `data_next` names.
  """
  assert static.block_mask is not None and static.data_next is not None, "a static plan"
  values = jnp.asarray(static.block_mask[0], jnp.int32)  # [r, c]
  fetched = jnp.asarray(static.data_next[0], jnp.int32)  # [r, c]
  rows, cols = jnp.arange(values.shape[0])[:, None], jnp.arange(values.shape[1])[None, :]
  q_block, kv_block = (fetched, cols) if is_dkv else (rows, fetched)
  kept = jnp.where(keep[:, q_block, kv_block], values, 0)  # [B, r, c]
  order = (lambda a: jnp.swapaxes(a, -1, -2)) if is_dkv else (lambda a: a)  # grid order
  steps_kept, steps_fetched = order(kept), order(fetched)
  batch, (r, c) = kept.shape[0], steps_kept.shape[1:]
  following = splash_plan.next_step(steps_kept, jnp)  # [B, r * c]: the next step that runs
  data_next = order(steps_fetched.reshape(r * c)[following].reshape(batch, r, c))
  small = lambda a, top: a.astype(splash_plan.small_dtype(top))
  top = int(np.asarray(static.data_next).max()) if static.data_next.size else 0
  q_sequence = (None if static.q_sequence is None
                else jnp.broadcast_to(static.q_sequence, (batch, *static.q_sequence.shape)))
  # JAX annotates MaskInfo's fields as NumPy arrays; its kernel takes traced ones (a pytree).
  return info_lib.MaskInfo._make((small(data_next, top)[:, None], None,
                                  small(kept, 2)[:, None], None, q_sequence, None))
