"""The splash kernel's block plan (its `MaskInfo`), built from a mask object in O(blocks).

JAX builds a static mask's `MaskInfo` with a Python loop over every block pair
(`splash_attention_mask_info._process_mask`: O(blocks) Python steps). Here the
same arrays come from the object's own per-block answers (`_plan.blocks_see`),
vectorised in NumPy, in the format the kernel reads:

- block_mask [1, nq, w] int: 0 skip, 1 partial (the kernel computes the mask
  function on the block), 2 full; one row for every head (every head has the
  same mask).
- data_next [1, nq, w] int: the key block (query block for dK/dV) each grid step
  fetches.
- With grid shrinking (forward, dq, and dK/dV unless the backward is fused),
  each query row keeps only its non-empty key blocks, in order, padded to the
  widest row with 0 at the end (dK/dV: each key column keeps its non-empty
  query blocks, padded at the front); without it, data_next holds the next
  non-empty block at or after each step in grid order (wrapping to the first).
- q_sequence [Tp] int32: the query indices the mask function reads.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info_lib

from splash_hk.masks import _objects
from splash_hk.masks import _plan
from splash_hk.masks._blocks import ArrayLike


def block_mask(rule: _objects.Mask | None, q_positions: np.ndarray,
               kv_positions: np.ndarray, block_shape: tuple[int, int]) -> np.ndarray:
  """[nq, nk] int8: 0 no pair visible, 1 some, 2 all (never a false 0 or 2).

  The positions are the padded indices' places: every block is whole (the
  padding is masked by segment ids in the kernel, not here).
  """
  (length, kv_length), (bq, bk) = (len(q_positions), len(kv_positions)), block_shape
  if length % bq or kv_length % bk:
    raise ValueError(f"padded lengths {(length, kv_length)} must be whole blocks {block_shape}")
  shape = (length // bq, kv_length // bk)
  if rule is None:
    return np.full(shape, 2, np.int8)
  blocks = _plan.plan_blocks(q_positions[None], kv_positions[None], None, None, bq, bk, np)
  may, full = (np.broadcast_to(a, (1, *shape))[0] for a in rule.classify(blocks))
  return may.view(np.int8) + (full & may).view(np.int8)


def mask_info(block_values: np.ndarray, q_len: int, *, is_dkv: bool, shrink: bool,
              computed: bool) -> info_lib.MaskInfo:
  """The kernel's MaskInfo for one head mask's block values [nq, nk] (see the module doc).

  `computed`: partial blocks are computed in the kernel (a mask function), so the
  MaskInfo carries q_sequence; else no block may be partial.
  """
  if not computed and (block_values == 1).any():
    raise ValueError("a mask without a mask function cannot have partial blocks")
  if not shrink:
    values, data_next = block_values, next_nonzero(block_values, is_dkv)
  elif is_dkv:  # each key column's non-empty query blocks, in order, 0-padded at the front
    values, data_next = (_transposed(a) for a in _packed(_transposed(block_values), front=True))
  else:  # each query row's non-empty key blocks, in order, 0-padded at the end
    values, data_next = _packed(block_values, front=False)
  return info_lib.MaskInfo(
      data_next=_small(data_next)[None], mask_next=None, block_mask=_small(values)[None],
      partial_mask_blocks=None,
      q_sequence=np.arange(q_len, dtype=np.int32) if computed else None)


def next_nonzero(values: ArrayLike, is_dkv: bool, xp: Any = np) -> ArrayLike:
  """[..., nq, nk]: per grid step (row-major; dK/dV column-major), the index along the fetched
  axis of the first non-empty block at or after it, wrapping to the first one (0 if none).

  NumPy for static plans; jax.numpy for traced ones (`splash_horizon`).
  """
  order = xp.swapaxes(values, -1, -2) if is_dkv else values  # grid order: rows outermost
  *lead, rows, cols = order.shape
  n = rows * cols
  steps = xp.where(order.reshape(*lead, n) != 0, xp.arange(n), n)
  following: ArrayLike = (np.flip(np.minimum.accumulate(np.flip(steps, -1), axis=-1), -1)
                          if xp is np else jax.lax.cummin(steps, axis=steps.ndim - 1, reverse=True))
  wrapped = xp.where(following == n, following[..., :1], following) % cols  # wrap to the first
  fetched = wrapped.reshape(order.shape).astype(np.int32)
  return xp.swapaxes(fetched, -1, -2) if is_dkv else fetched


def _packed(values: np.ndarray, front: bool) -> tuple[np.ndarray, np.ndarray]:
  """Each row's non-empty blocks (values, column indices) in order, zero-padded to the
  widest row at the end (or at the front).

  A row whose non-empty blocks are one run (every row of a built-in rule but
  a union's) is a window of the row: all such rows are taken at once; any
  other row is packed on its own.
  """
  rows, cols = values.shape
  nonzero = values != 0
  counts = np.count_nonzero(nonzero, axis=1)
  first = nonzero.argmax(axis=1)
  last = cols - 1 - nonzero[:, ::-1].argmax(axis=1)
  width = max(1, int(counts.max()))
  dtype = small_dtype(int(last[counts > 0].max()) if counts.any() else 0)
  start = last + 1 - width if front else first  # where each run row's window starts
  padded = np.pad(values, [(0, 0), (width, 0) if front else (0, width)])
  kept = np.lib.stride_tricks.sliding_window_view(padded, width, axis=1)[
      np.arange(rows), start + width if front else start]  # zero outside the run
  fetched = start[:, None].astype(dtype) + np.arange(width, dtype=dtype)
  np.multiply(fetched, kept != 0, out=fetched)
  for r in np.flatnonzero((last - first + 1 != counts) & (counts > 0)):
    taken = np.flatnonzero(nonzero[r])
    at = slice(width - taken.size, width) if front else slice(0, taken.size)
    kept[r], fetched[r] = 0, 0
    kept[r, at], fetched[r, at] = values[r, taken], taken
  return kept, fetched


def _transposed(array: np.ndarray, tile: int = 256) -> np.ndarray:
  """A C-ordered transpose, tile by tile (NumPy's own strides through memory are slower)."""
  out = np.empty(array.shape[::-1], array.dtype)
  for i in range(0, array.shape[0], tile):
    for j in range(0, array.shape[1], tile):
      out[j:j + tile, i:i + tile] = array[i:i + tile, j:j + tile].T
  return out


def _small(array: np.ndarray) -> np.ndarray:
  """`array` in the smallest of int8, int16, int32 that holds it (scalar memory is scarce)."""
  return array.astype(small_dtype(int(array.max()) if array.size else 0), copy=False)


def small_dtype(top: int) -> type:
  """The smallest of int8, int16, int32 that holds 0..top."""
  for dtype in (np.int8, np.int16):
    if top <= np.iinfo(dtype).max:
      return dtype
  return np.int32


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
  values = jnp.asarray(static.block_mask[0], jnp.int32)  # [r, c]
  fetched = jnp.asarray(static.data_next[0], jnp.int32)  # [r, c]
  rows, cols = jnp.arange(values.shape[0])[:, None], jnp.arange(values.shape[1])[None, :]
  q_block, kv_block = (fetched, cols) if is_dkv else (rows, fetched)
  kept = jnp.where(keep[:, q_block, kv_block], values, 0)  # [B, r, c]
  order = (lambda a: jnp.swapaxes(a, -1, -2)) if is_dkv else (lambda a: a)  # grid order
  steps_kept, steps_fetched = order(kept), order(fetched)
  batch, (r, c) = kept.shape[0], steps_kept.shape[1:]
  n = r * c
  steps = jnp.where(steps_kept.reshape(batch, n) != 0, jnp.arange(n), n)
  following = jax.lax.cummin(steps, axis=1, reverse=True)  # [B, n]: the next step that runs
  following = jnp.where(following == n, following[:, :1], following) % n  # wrap to the first
  data_next = order(steps_fetched.reshape(n)[following].reshape(batch, r, c))
  small = lambda a, top: a.astype(small_dtype(top))
  top = int(np.asarray(static.data_next).max()) if static.data_next.size else 0
  q_sequence = (None if static.q_sequence is None
                else jnp.broadcast_to(static.q_sequence, (batch, *static.q_sequence.shape)))
  # JAX annotates MaskInfo's fields as NumPy arrays; its kernel takes traced ones (a pytree).
  return info_lib.MaskInfo._make((small(data_next, top)[:, None], None,
                                  small(kept, 2)[:, None], None, q_sequence, None))
