"""The one mask semantics every backend shares: the rules, the mask objects, per pair and per block.

Key j is visible to query i when all of these hold:
  the position rule:  the config's (causal, sliding window, chunk; with a dense
                      `mask` array ANDed in), or one mask object given as `mask`
                      (`Causal()`, `SlidingWindow(w)`, `Chunked(c)`,
                      `Bidirectional(ids)`, `MaskFn(fn)`, `Dense(mask)`, `&`, `|`)
  segments:           q_seg[i] == kv_seg[j], and both >= 0 (negative = padding)

The rules are written with operators only, so they work on NumPy arrays
(static block structure, at trace time) and on traced jnp arrays (inside
kernels) alike. The objects themselves live in `splash_hk.mask_objects`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk.mask_blocks import BlockRanges, Blocks, block_ranges
from splash_hk.mask_objects import And, Bidirectional, Causal, Chunked, Dense, Mask, MaskFn, Or
from splash_hk.mask_objects import SlidingWindow, as_rules, from_rules
from splash_hk.types import KernelInputs

__all__ = ("And", "Bidirectional", "BlockRanges", "Blocks", "Causal", "Chunked", "Dense", "Mask",
           "MaskFn", "Or", "SlidingWindow", "as_rules", "block_ranges", "block_map",
           "blocks_see", "disjoint_padding", "end_aligned_positions", "from_rules", "full_mask",
           "load_balanced_order", "load_balanced_position", "plan_blocks", "position_mask",
           "position_rules", "segment_mask", "visible_interval", "visible_pairs")

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

  The config's rules, as `from_rules` makes them one object. Returns None when
  no positional rule applies (everything visible).
  """
  rule = from_rules(causal, window, chunk_size)
  return None if rule is None else rule.visible(q, k)


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


def plan_blocks(q_positions: ArrayLike, kv_positions: ArrayLike, q_segment_ids: ArrayLike | None,
                kv_segment_ids: ArrayLike | None, block_q: int, block_kv: int,
                xp: Any = jnp) -> Blocks:
  """One call's sides cut into blocks, as `Mask.classify` and `blocks_see` read them."""
  valid = lambda ids, pos: xp.ones(pos.shape, bool) if ids is None else ids >= 0
  return Blocks(block_ranges(q_positions, q_segment_ids, block_q, xp),
                block_ranges(kv_positions, kv_segment_ids, block_kv, xp),
                q_positions, kv_positions, valid(q_segment_ids, q_positions),
                valid(kv_segment_ids, kv_positions), block_q, block_kv, xp)


def blocks_see(rule: Mask | None, blocks: Blocks) -> tuple[ArrayLike, ArrayLike]:
  """(may, full) [B, nq, nk]: whether some / every (query, key) pair of a block pair is visible.

  From the ranges alone: `may` is never a false no and `full` never a false yes,
  whatever the order of positions and segment ids inside the blocks. Segments and
  padding (one shared segment, every entry valid) join the rule's own answers.
  """
  q, kv = blocks.q, blocks.kv
  qa, ka = (lambda a: a[:, :, None]), (lambda a: a[:, None, :])
  may = (qa(q.count) > 0) & (ka(kv.count) > 0)
  may = may & (ka(kv.seg_min) <= qa(q.seg_max)) & (qa(q.seg_min) <= ka(kv.seg_max))
  full = (qa(q.count) == blocks.block_q) & (ka(kv.count) == blocks.block_kv)
  full = full & (qa(q.seg_min) == qa(q.seg_max)) & (ka(kv.seg_min) == ka(kv.seg_max))
  full = full & (qa(q.seg_min) == ka(kv.seg_min))
  if rule is not None:
    rule_may, rule_full = rule.classify(blocks)
    may, full = may & rule_may, full & rule_full
  return may, full & may


def block_map(rule: Mask | None, query_len: int, kv_len: int, block_q: int,
              block_kv: int | None = None) -> str:
  """A picture of the block plan at default positions: '#' full, '+' partial, '.' skipped.

  One line per query block, one character per key block (batch row 0).
  """
  block_kv = block_kv or block_q
  q_pos, kv_pos = end_aligned_positions(1, query_len, kv_len, np)
  blocks = plan_blocks(q_pos, kv_pos, None, None, block_q, block_kv, np)
  may, full = blocks_see(rule, blocks)
  chars = np.where(full[0], "#", np.where(may[0], "+", "."))
  return "\n".join("".join(row) for row in chars)


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


def full_mask(x: KernelInputs) -> jax.Array:
  """Every rule at once over a call's positions, segments and position rule, materialised.

  Returns:
    [B, 1 or H, T, S] bool (H when the rule holds a per-head dense mask).
  """
  batch, query_len = x.q_positions.shape
  kv_len = x.kv_positions.shape[-1]
  out = jnp.ones((batch, 1, query_len, kv_len), jnp.bool_)  # [B, 1, T, S]
  if x.rule is not None:
    out = out & x.rule.visible(x.q_positions[:, None, :, None], x.kv_positions[:, None, None, :])
  if x.q_segment_ids is not None:
    out = out & segment_mask(x.q_segment_ids, x.kv_segment_ids)[:, None]
  return out
