"""Per-block summaries of one call's sides: what mask objects classify block pairs from.

A side (the queries, or the keys) is cut into blocks of a static size; each
block's valid entries (inside the sequence, not padding) are summarised by
their count and the ranges of their positions and segment ids.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

ArrayLike = Any  # np.ndarray or jax.Array


class BlockRanges(NamedTuple):
  """What the valid entries of each block of a sequence hold: [B, n] arrays (NumPy or jnp).

  An entry is valid when it is inside the sequence and not padding (segment
  id >= 0). Blocks with no valid entry hold count 0 and empty ranges.
  """

  count: Any  # valid entries
  pos_min: Any
  pos_max: Any
  seg_min: Any  # 0 when the call has no segment ids
  seg_max: Any


_FAR = 2**30  # beyond every position, segment id and span id: the empty range is [_FAR, -_FAR]


def blocks(a: ArrayLike, block: int, fill, xp) -> ArrayLike:
  """[B, L] -> [B, n, block], the last block padded with `fill`."""
  batch, length = a.shape
  n = -(-length // block)
  tail = xp.full((batch, n * block - length), fill, a.dtype)
  return xp.concatenate([a, tail], axis=1).reshape(batch, n, block)


def ranges(values: ArrayLike, valid: ArrayLike, xp) -> tuple[ArrayLike, ArrayLike]:
  """Per-block (min, max) of `values` [B, n, b] over `valid` entries (empty: [_FAR, -_FAR])."""
  return (xp.min(xp.where(valid, values, _FAR), axis=-1),
          xp.max(xp.where(valid, values, -_FAR), axis=-1))


def block_ranges(positions: ArrayLike, segment_ids: ArrayLike | None, block: int,
                 xp: Any = jnp) -> BlockRanges:
  """Per-block ranges of positions and segment ids over valid entries.

  Args:
    positions: [B, L] int.
    segment_ids: [B, L] int or None (no segments: everything valid, segment 0).
    block: block size; the last block may be partial (its missing entries are invalid).
    xp: numpy (static plans, work counts) or jax.numpy (inside kernels).
  """
  seg = xp.zeros_like(positions) if segment_ids is None else segment_ids
  valid = blocks(seg >= 0, block, False, xp)
  pos, seg = blocks(positions, block, 0, xp), blocks(seg, block, 0, xp)
  return BlockRanges(xp.sum(valid, axis=-1), *ranges(pos, valid, xp), *ranges(seg, valid, xp))


@dataclasses.dataclass(frozen=True)
class Blocks:
  """What `Mask.classify` reads: one call's sides cut into blocks."""

  q: BlockRanges  # [B, nq] per query block
  kv: BlockRanges  # [B, nk] per key block
  q_pos: ArrayLike  # [B, T]
  kv_pos: ArrayLike  # [B, S]
  q_valid: ArrayLike  # [B, T] bool
  kv_valid: ArrayLike  # [B, S] bool
  block_q: int
  block_kv: int
  xp: Any = jnp

  def pairs(self, rows: ArrayLike) -> ArrayLike:
    """[B|1, 1|H, T, S] -> [B|1, 1|H, nq, bq, nk, bk], padded with False."""
    xp, (bq, bk) = self.xp, (self.block_q, self.block_kv)
    t, s = rows.shape[-2:]
    nq, nk = -(-t // bq), -(-s // bk)
    if (nq * bq, nk * bk) != (t, s):
      rows = xp.pad(rows, [(0, 0), (0, 0), (0, nq * bq - t), (0, nk * bk - s)])
    return rows.reshape(*rows.shape[:2], nq, bq, nk, bk)

  def reduce(self, see: ArrayLike) -> tuple[ArrayLike, ArrayLike]:
    """(may, full) [B|1, nq, nk] of an elementwise visibility [B|1, 1|H, T, S], read whole.

    Padding is left to `blocks_see`: a block with some is never full there, and a
    `may` that counts its pairs is still never a false no.
    """
    blocks = self.pairs(see)  # [B|1, 1|H, nq, bq, nk, bk]
    return any_all(blocks, (1, 3, 5), self.xp)

  def evaluate(self, fn: Callable[[Any, Any], Any]) -> tuple[ArrayLike, ArrayLike]:
    """(may, full) [B, nq, nk] of an elementwise rule `fn(q_pos, kv_pos)`, evaluated on every
    pair where each block pair's pairs are contiguous: [B, nq, 1, bq, 1] x [B, 1, nk, 1, bk]."""
    xp, (bq, bk) = self.xp, (self.block_q, self.block_kv)
    q = blocks(self.q_pos, bq, 0, xp)[:, :, None, :, None]  # [B, nq, 1, bq, 1]
    kv = blocks(self.kv_pos, bk, 0, xp)[:, None, :, None, :]  # [B, 1, nk, 1, bk]
    try:
      see = xp.broadcast_to(xp.asarray(fn(q, kv)), xp.broadcast_shapes(q.shape, kv.shape))
    except ValueError:  # not elementwise: read it whole
      whole = fn(self.q_pos[:, None, :, None], self.kv_pos[:, None, None, :])
      shape = (*self.q_pos.shape[:1], 1, self.q_pos.shape[1], self.kv_pos.shape[1])
      return self.reduce(xp.broadcast_to(xp.asarray(whole), shape))  # [B, 1, T, S]
    return any_all(see, (3, 4), self.xp)


def any_all(see: ArrayLike, axes: tuple[int, ...], xp) -> tuple[ArrayLike, ArrayLike]:
  """(any, all) of bool `see` over `axes`; under jnp in one pass (a two-result reduction:
  XLA:CPU evaluates `see` once instead of once per answer)."""
  if xp is not jnp:
    return xp.any(see, axis=axes), xp.all(see, axis=axes)
  small = see.astype(jnp.int8)
  most, least = jax.lax.reduce((small, small), (jnp.int8(0), jnp.int8(1)),
                               lambda a, b: (jnp.maximum(a[0], b[0]), jnp.minimum(a[1], b[1])),
                               axes)
  return most > 0, least > 0
