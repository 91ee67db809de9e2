"""The one mask semantics every backend shares.

Key j is visible to query i when all of these hold:
  causal:          kv_pos[j] <= q_pos[i]
  sliding window:  q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right
  chunk:           q_pos[i] // chunk_size == kv_pos[j] // chunk_size
  segments:        q_seg[i] == kv_seg[j], and both >= 0 (negative = padding)
  dense mask:      mask[b, h, i, j]

The position and segment rules are written with operators only, so they work
on NumPy arrays (static block structure, at trace time) and on traced jnp
arrays (inside kernels) alike.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk.types import KernelInputs

ArrayLike = Any  # np.ndarray or jax.Array


def end_aligned_positions(batch: int, query_len: int, kv_len: int,
                          xp: Any = jnp) -> tuple[ArrayLike, ArrayLike]:
  """End-aligned default positions (FlashAttention-2 convention), in `xp` (jnp or NumPy).

  Returns:
    q_positions [B, T] = arange(T) + (S - T), kv_positions [B, S] = arange(S), int32.
  """
  kv_pos = xp.arange(kv_len, dtype=xp.int32)  # [S]
  q_pos = xp.arange(query_len, dtype=xp.int32) + (kv_len - query_len)  # [T]
  return (xp.broadcast_to(q_pos, (batch, query_len)),
          xp.broadcast_to(kv_pos, (batch, kv_len)))


def position_rules(
    q: ArrayLike,
    k: ArrayLike,
    *,
    causal: bool,
    window: tuple[int, int] | None,
    chunk_size: int | None,
) -> ArrayLike | None:
  """Visibility of keys at positions `k` to queries at positions `q` (broadcast elementwise).

  Returns None when no positional rule applies (everything visible).
  """
  mask = None

  def conj(a, b):
    return b if a is None else a & b

  if causal:
    mask = conj(mask, k <= q)
  if window is not None:
    left, right = window
    mask = conj(mask, (k >= q - left) & (k <= q + right))
  if chunk_size is not None:
    mask = conj(mask, (q // chunk_size) == (k // chunk_size))
  return mask


def position_mask(
    q_pos: ArrayLike,
    kv_pos: ArrayLike,
    *,
    causal: bool,
    window: tuple[int, int] | None,
    chunk_size: int | None,
) -> ArrayLike | None:
  """Visibility from positions: q_pos [..., T], kv_pos [..., S] -> [..., T, S] (or None)."""
  return position_rules(q_pos[..., :, None], kv_pos[..., None, :], causal=causal, window=window,
                        chunk_size=chunk_size)


def load_balanced_order(length: int, shards: int) -> np.ndarray:
  """The dual-chunk swap: entry p of the balanced sequence is entry order[p] of the original.

  The sequence is cut into 2n chunks; shard i holds chunks i and 2n - 1 - i, in
  that order, so every shard gets as much causal work as any other.
  """
  if shards < 1 or length % (2 * shards):
    raise ValueError(f"a sequence of length {length} does not split into 2 * {shards} equal "
                     f"chunks; pad it to a multiple of {2 * max(shards, 1)}.")
  chunk = length // (2 * shards)
  chunks = np.array([c for i in range(shards) for c in (i, 2 * shards - 1 - i)])
  return (chunks[:, None] * chunk + np.arange(chunk)).reshape(-1)


def load_balanced_position(index: ArrayLike, length: int, shards: int) -> ArrayLike:
  """`load_balanced_order(length, shards)[index]`, in arithmetic (works on traced indices)."""
  chunk = length // (2 * shards)
  slot, within = index // chunk, index % chunk
  shard, second = slot // 2, slot % 2
  return (shard + second * (2 * shards - 1 - 2 * shard)) * chunk + within


def visible_interval(q_pos: np.ndarray, kv_len: int, *, causal: bool,
                     window: tuple[int, int] | None, chunk_size: int | None
                     ) -> tuple[np.ndarray, np.ndarray]:
  """The keys each query may see when `kv_positions = arange(kv_len)` (static, NumPy).

  The position rules leave every row one interval of key positions; this is
  that interval clipped to the keys. Segments and dense masks only narrow it.

  Returns:
    (lo, hi) [T] int64, inclusive; a row with no visible key has lo > hi.
  """
  q_pos = np.asarray(q_pos, np.int64)
  lo = np.zeros_like(q_pos)
  hi = np.full_like(q_pos, kv_len - 1)
  if causal:
    hi = np.minimum(hi, q_pos)
  if window is not None:
    lo, hi = np.maximum(lo, q_pos - window[0]), np.minimum(hi, q_pos + window[1])
  if chunk_size is not None:
    first = (q_pos // chunk_size) * chunk_size
    lo, hi = np.maximum(lo, first), np.minimum(hi, first + chunk_size - 1)
  return lo, hi


def visible_pairs(query_len: int, kv_len: int, **rules) -> int:
  """How many (query, key) pairs the position rules let through at default positions."""
  q_pos = end_aligned_positions(1, query_len, kv_len, np)[0][0]
  lo, hi = visible_interval(q_pos, kv_len, **rules)
  return int(np.maximum(hi - lo + 1, 0).sum())


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


_FAR = 2**30  # beyond every position and segment id: the empty range is [_FAR, -_FAR]


def block_ranges(positions: ArrayLike, segment_ids: ArrayLike | None, block: int,
                 xp: Any = jnp) -> BlockRanges:
  """Per-block ranges of positions and segment ids over valid entries.

  Args:
    positions: [B, L] int.
    segment_ids: [B, L] int or None (no segments: everything valid, segment 0).
    block: block size; the last block may be partial (its missing entries are invalid).
    xp: numpy (static plans, work counts) or jax.numpy (inside kernels).
  """
  batch, length = positions.shape
  n = -(-length // block)
  pad = lambda a, fill: xp.concatenate(
      [a, xp.full((batch, n * block - length), fill, a.dtype)], axis=1).reshape(batch, n, block)
  valid = pad(xp.ones((batch, length), bool) if segment_ids is None else segment_ids >= 0, False)
  pos = pad(positions, 0)
  seg = pad(xp.zeros_like(positions) if segment_ids is None else segment_ids, 0)
  lo = lambda a: xp.min(xp.where(valid, a, _FAR), axis=-1)
  hi = lambda a: xp.max(xp.where(valid, a, -_FAR), axis=-1)
  return BlockRanges(xp.sum(valid, axis=-1), lo(pos), hi(pos), lo(seg), hi(seg))


def _query_side(a: ArrayLike) -> ArrayLike:
  """Per-query-block [B, nq] -> [B, nq, 1], to meet key blocks."""
  return a[:, :, None]


def _key_side(a: ArrayLike) -> ArrayLike:
  """Per-key-block [B, nk] -> [B, 1, nk], to meet query blocks."""
  return a[:, None, :]


def blocks_may_see(q: BlockRanges, kv: BlockRanges, *, causal: bool,
                   window: tuple[int, int] | None, chunk_size: int | None) -> ArrayLike:
  """Whether some query of block i may see some key of block j: [B, nq, nk] bool.

  A necessary condition from the ranges alone (each rule's, and their
  conjunction): a pair it rules out has no visible (query, key) pair, whatever
  the order of the positions and segment ids inside the blocks.
  """
  qa, ka = _query_side, _key_side
  see = (qa(q.count) > 0) & (ka(kv.count) > 0)
  see = see & (ka(kv.seg_min) <= qa(q.seg_max)) & (qa(q.seg_min) <= ka(kv.seg_max))
  if causal:
    see = see & (ka(kv.pos_min) <= qa(q.pos_max))
  if window is not None:
    see = see & (ka(kv.pos_max) >= qa(q.pos_min) - window[0])
    see = see & (ka(kv.pos_min) <= qa(q.pos_max) + window[1])
  if chunk_size is not None:
    see = see & (ka(kv.pos_min) // chunk_size <= qa(q.pos_max) // chunk_size)
    see = see & (qa(q.pos_min) // chunk_size <= ka(kv.pos_max) // chunk_size)
  return see


def blocks_fully_see(q: BlockRanges, kv: BlockRanges, q_block: int, kv_block: int, *,
                     causal: bool, window: tuple[int, int] | None,
                     chunk_size: int | None) -> ArrayLike:
  """Whether every query of block i sees every key of block j: [B, nq, nk] bool.

  Sufficient from the ranges: full blocks with one shared segment whose every
  position pair passes the rules. Such blocks need no element mask.
  """
  qa, ka = _query_side, _key_side
  full = (qa(q.count) == q_block) & (ka(kv.count) == kv_block)
  full = full & (qa(q.seg_min) == qa(q.seg_max)) & (ka(kv.seg_min) == ka(kv.seg_max))
  full = full & (qa(q.seg_min) == ka(kv.seg_min))
  if causal:
    full = full & (ka(kv.pos_max) <= qa(q.pos_min))
  if window is not None:
    full = full & (ka(kv.pos_min) >= qa(q.pos_max) - window[0])
    full = full & (ka(kv.pos_max) <= qa(q.pos_min) + window[1])
  if chunk_size is not None:
    chunk = qa(q.pos_min) // chunk_size
    full = full & (qa(q.pos_max) // chunk_size == chunk)
    full = full & (ka(kv.pos_min) // chunk_size == chunk) & (ka(kv.pos_max) // chunk_size == chunk)
  return full


def segment_mask(q_segment_ids: ArrayLike, kv_segment_ids: ArrayLike) -> ArrayLike:
  """Visibility from segments: [..., T], [..., S] -> [..., T, S]; negative ids are padding."""
  q = q_segment_ids[..., :, None]  # [..., T, 1]
  k = kv_segment_ids[..., None, :]  # [..., 1, S]
  return (q == k) & (q >= 0) & (k >= 0)


def disjoint_padding(q_segment_ids: jax.Array, kv_segment_ids: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
  """Segment ids for kernels that only test equality: padding (-1 on the query
  side, -2 on the key side) can then never match anything."""
  return (jnp.where(q_segment_ids < 0, -1, q_segment_ids),
          jnp.where(kv_segment_ids < 0, -2, kv_segment_ids))


def full_mask(x: KernelInputs, *, causal: bool, window: tuple[int, int] | None,
              chunk_size: int | None) -> jax.Array:
  """Every rule at once over a call's positions, segments and dense mask, materialised.

  Returns:
    [B, 1 or H, T, S] bool (H when `x.mask` has heads).
  """
  batch, query_len = x.q_positions.shape
  kv_len = x.kv_positions.shape[-1]
  out = jnp.ones((batch, 1, query_len, kv_len), jnp.bool_)  # [B, 1, T, S]
  pos = position_mask(x.q_positions, x.kv_positions, causal=causal, window=window,
                      chunk_size=chunk_size)
  if pos is not None:
    out = out & pos[:, None]
  if x.q_segment_ids is not None:
    out = out & segment_mask(x.q_segment_ids, x.kv_segment_ids)[:, None]
  if x.mask is not None:
    out = out & x.mask
  return out
