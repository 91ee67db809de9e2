"""The block plan's questions, answered for a whole call: its sides cut into blocks, and which
block pairs some / every (query, key) pair may see (segments, padding and the rule together).

`blocks_see` is what every block-sparse backend plans from; `block_map` draws it.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from splash_hk.masks._blocks import Blocks, block_ranges
from splash_hk.masks._chosen import Blocks as Chosen
from splash_hk.masks._chosen import CallIndex
from splash_hk.masks._objects import Mask
from splash_hk.masks._rules import end_aligned_positions

ArrayLike = Any  # np.ndarray or jax.Array


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


def count_pairs(rule: Mask | None, q_positions: ArrayLike, kv_positions: ArrayLike,
                block_q: int, block_kv: int, q_segment_ids: ArrayLike | None = None,
                kv_segment_ids: ArrayLike | None = None) -> int:
  """How many block pairs a block plan with these tiles computes, per head (NumPy, static).

  `rule` with NumPy arrays (or none); positions and segment ids [B, T] / [B, S]
  (segments None: one document). Tiles are clamped to the lengths, as the kernels
  clamp them, so this is what a plan computes, not an idealised count.
  """
  block_q, block_kv = min(block_q, q_positions.shape[-1]), min(block_kv, kv_positions.shape[-1])
  blocks = plan_blocks(np.asarray(q_positions), np.asarray(kv_positions), q_segment_ids,
                       kv_segment_ids, block_q, block_kv, np)
  may, _ = blocks_see(rule, blocks)
  return int(np.broadcast_to(may, (q_positions.shape[0], *may.shape[1:])).sum())


def block_map(rule: Mask | None, query_len: int, kv_len: int, block_q: int,
              block_kv: int | None = None) -> str:
  """A picture of the block plan at default positions: '#' full, '+' partial, '.' skipped.

  One line per query block, one character per key block (batch row 0).
  """
  block_kv = block_kv or block_q
  q_pos, kv_pos = end_aligned_positions(1, query_len, kv_len, np)
  blocks = plan_blocks(q_pos, kv_pos, None, None, block_q, block_kv, np)
  if rule is not None:  # objects that derive arrays from the call (a choice of blocks), for row 0
    heads = lambda part: part.kv_blocks.shape[1] if isinstance(part, Chosen) else 1
    index = lambda part: CallIndex(1, query_len, kv_len, heads(part), heads(part),
                                   np.arange(query_len)[None], np.arange(kv_len)[None])
    rule = rule.map_parts(lambda part: part.for_call(index(part)))
  may, full = blocks_see(rule, blocks)
  chars = np.where(full[0], "#", np.where(may[0], "+", "."))
  return "\n".join("".join(row) for row in chars)
