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
  fetched = (next_step(order, xp) % order.shape[-1]).reshape(order.shape).astype(np.int32)
  return xp.swapaxes(fetched, -1, -2) if is_dkv else fetched


def next_step(order: ArrayLike, xp: Any = np) -> ArrayLike:
  """[..., rows, cols] in grid order -> [..., rows * cols]: per step, the flat index of the first
  non-empty step at or after it, wrapping to the first one (0 if none)."""
  *lead, rows, cols = order.shape
  n = rows * cols
  steps = xp.where(order.reshape(*lead, n) != 0, xp.arange(n), n)
  following: ArrayLike = (np.flip(np.minimum.accumulate(np.flip(steps, -1), axis=-1), -1)
                          if xp is np else jax.lax.cummin(steps, axis=steps.ndim - 1, reverse=True))
  return xp.where(following == n, following[..., :1], following) % n  # wrap to the first


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
