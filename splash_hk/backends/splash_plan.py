"""The splash kernel's block plan (its `MaskInfo`), built from a mask object in O(blocks).

JAX builds a static mask's `MaskInfo` with a Python loop over every block pair
(`splash_attention_mask_info._process_mask`: 46 s for causal at T=64k). Here the
same arrays come from the object's own per-block answers (`masks.blocks_see`),
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

import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info_lib

from splash_hk import masks
from splash_hk import mask_objects


def block_mask(rule: mask_objects.Mask | None, q_positions: np.ndarray,
               kv_positions: np.ndarray, block_shape: tuple[int, int]) -> np.ndarray:
  """[nq, nk] int32: 0 no pair visible, 1 some, 2 all (never a false 0 or 2)."""
  blocks = masks.plan_blocks(q_positions[None], kv_positions[None], None, None, *block_shape, np)
  may, full = masks.blocks_see(rule, blocks)  # [1, nq, nk]
  return np.where(full[0], 2, np.where(may[0], 1, 0)).astype(np.int32)


def mask_info(block_values: np.ndarray, q_len: int, *, is_dkv: bool, shrink: bool,
              computed: bool) -> info_lib.MaskInfo:
  """The kernel's MaskInfo for one head mask's block values [nq, nk] (see the module doc).

  `computed`: partial blocks are computed in the kernel (a mask function), so the
  MaskInfo carries q_sequence; else no block may be partial.
  """
  if not computed and (block_values == 1).any():
    raise ValueError("a mask without a mask function cannot have partial blocks")
  if shrink:
    values, data_next = (_shrunk_columns if is_dkv else _shrunk_rows)(block_values)
  else:
    values, data_next = block_values, _next_nonzero(block_values, is_dkv)
  return info_lib.MaskInfo(
      data_next=_small(data_next)[None], mask_next=None, block_mask=_small(values)[None],
      partial_mask_blocks=None,
      q_sequence=np.arange(q_len, dtype=np.int32) if computed else None)


def _next_nonzero(values: np.ndarray, is_dkv: bool) -> np.ndarray:
  """[nq, nk]: per grid step (row-major; dK/dV column-major), the index along the fetched
  axis of the first non-empty block at or after it, wrapping to the first one (0 if none)."""
  order = values.T if is_dkv else values  # grid order: rows are the outer loop
  flat = order.ravel() != 0
  n = flat.size
  steps = np.where(flat, np.arange(n), n)
  following = np.minimum.accumulate(steps[::-1])[::-1]
  if not flat.any():
    return np.zeros(values.shape, np.int32)
  following = np.where(following == n, following[0], following)
  fetched = (following % order.shape[1]).reshape(order.shape).astype(np.int32)
  return fetched.T if is_dkv else fetched


def _shrunk_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Forward/dq: each row's non-empty blocks in order, 0-padded at the end."""
  nonzero = values != 0
  counts = nonzero.sum(axis=1)
  width = max(1, int(counts.max()))
  rows, cols = np.nonzero(nonzero)
  slot = np.cumsum(nonzero, axis=1)[rows, cols] - 1
  kept, fetched = (np.zeros((values.shape[0], width), np.int32) for _ in range(2))
  kept[rows, slot] = values[rows, cols]
  fetched[rows, slot] = cols
  return kept, fetched


def _shrunk_columns(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """dK/dV: each column's non-empty blocks in order, 0-padded at the front."""
  kept, fetched = _shrunk_rows(values.T[:, ::-1])  # reversed columns: padding goes first
  return kept[:, ::-1].T, (values.shape[0] - 1 - fetched[:, ::-1].T) * (kept[:, ::-1].T != 0)


def _small(array: np.ndarray) -> np.ndarray:
  """The smallest of int8, int16, int32 that holds `array` (scalar memory is scarce)."""
  top = int(array.max()) if array.size else 0
  for dtype in (np.int8, np.int16):
    if top <= np.iinfo(dtype).max:
      return array.astype(dtype)
  return array.astype(np.int32)
