"""The xla backend's block plan: which (query block, key block) pairs a call computes.

Like splash's `MaskInfo` (`jax/experimental/pallas/ops/tpu/splash_attention/
splash_attention_mask_info.py`), the plan is one structure with documented
fields, built apart from the kernel that reads it. Unlike `MaskInfo` it is
built at run time, from per-block ranges of the call's positions and segment
ids, and the position rule's own classification (`splash_hk.masks._plan.blocks_see`): for default
positions that is exactly the static causal/window/chunk plan; for packed
documents, padding, a cache's filled length or a query shard it skips what no
query can see. `masks._plan.count_pairs` counts the same plan in NumPy, at trace time.

Words: a *row group* is the batch rows one plan entry serves (the whole batch
when blocks are small, else one row, so each row skips its own blocks); a
block pair is *live* when some (query, key) pair in it may be visible and
*full* when every pair in it is (it then runs without an element mask).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk.masks import _plan
from splash_hk.masks import _rules
from splash_hk.types import Facts, KernelInputs
from splash_hk.tiles import FEW_ROWS, on_tpu

# Blocks smaller than this many (row, key, head, dim) products run for the whole
# batch at once; larger ones per batch row, so each row skips its own blocks (not a few
# rows' blocks on a TPU: there a loop step costs more than the batch's rows, `tiles.on_tpu`).
PER_ROW_WORK = 1 << 22


@dataclasses.dataclass(frozen=True)
class Grid:
  """The static tiling of one call: block sizes (clamped to the lengths) and counts."""

  batch: int
  query_len: int  # T
  kv_len: int  # S
  block_q: int  # bq <= T
  block_kv: int  # bk <= S
  rows_per_group: int  # batch rows per row group: B or 1

  @classmethod
  def of(cls, x: KernelInputs, block_q: int, block_kv: int) -> Grid:
    """The grid of the arrays in `x` (one shard, or one ring step) with these tiles."""
    batch, query_len, num_heads, head_dim = x.query.shape
    kv_len = x.key.shape[1]
    block_q, block_kv = min(block_q, query_len), min(block_kv, kv_len)
    work = block_q * block_kv * num_heads * head_dim
    per_row = work >= PER_ROW_WORK and not (query_len <= FEW_ROWS and on_tpu())
    return cls(batch, query_len, kv_len, block_q, block_kv, 1 if per_row else batch)

  @property
  def num_q_blocks(self) -> int:  # nq: the last block may be partial
    return -(-self.query_len // self.block_q)

  @property
  def num_kv_blocks(self) -> int:  # nk
    return -(-self.kv_len // self.block_kv)

  @property
  def num_groups(self) -> int:  # G
    return self.batch // self.rows_per_group


class BlockPlan(NamedTuple):
  """Which key blocks each (row group, query block) computes, full ones first. A pytree.

  Attributes:
    kv_order: [G, nq, nk] int32, a permutation of range(nk) per (group, query
      block): the full blocks, then the live ones that need an element mask, then
      the dead ones, each in increasing index order.
    live_count: [G, nq] int32 in [0, nk]: the first `live_count` of `kv_order` run.
    full_count: [G, nq] int32 in [0, live_count]: the first `full_count` of
      `kv_order` run without an element mask.
  """

  kv_order: jax.Array
  live_count: jax.Array
  full_count: jax.Array


def block_plan(x: KernelInputs, grid: Grid) -> BlockPlan:
  """The plan of one call, from the block ranges of its positions, segment ids and rule."""
  blocks = _plan.plan_blocks(x.q_positions, x.kv_positions, x.q_segment_ids, x.kv_segment_ids,
                             grid.block_q, grid.block_kv)
  live, full = _plan.blocks_see(x.rule, blocks)  # [B|1, nq, nk], as `_plan.count_pairs` counts them
  live = jnp.broadcast_to(live, (grid.batch, *live.shape[1:]))
  if grid.rows_per_group > 1:  # one group: the whole batch
    live, full = jnp.any(live, axis=0, keepdims=True), jnp.all(full, axis=0, keepdims=True)
  full = full & live
  count = lambda a: jnp.sum(a, axis=-1, dtype=jnp.int32)
  return BlockPlan(_full_then_live(full, live), count(live), count(full))


def _full_then_live(full: jax.Array, live: jax.Array) -> jax.Array:
  """[G, nq, nk] int32: each row's kv blocks, full, then live, then dead, each in index order.

  Places by running counts and one scatter, O(nk) a row: a stable sort by rank did the
  same in O(nk log nk) a row, several times slower at 2^20 tokens (`--plan_workloads` times it).
  """
  partial, dead = live & ~full, ~live
  at = lambda a: jnp.cumsum(a, axis=-1, dtype=jnp.int32) - 1
  first = lambda a: jnp.sum(a, axis=-1, keepdims=True, dtype=jnp.int32)
  place = jnp.where(full, at(full), jnp.where(partial, first(full) + at(partial),
                                              first(live) + at(dead)))  # [G, nq, nk]
  groups, rows, blocks = place.shape
  g = jnp.arange(groups)[:, None, None]
  i = jnp.arange(rows)[None, :, None]
  j = jnp.broadcast_to(jnp.arange(blocks, dtype=jnp.int32), place.shape)
  return jnp.zeros(place.shape, jnp.int32).at[g, i, place].set(j, unique_indices=True)


def reads_per_kv_block(facts: Facts, grid: Grid) -> float:
  """How many query blocks read a key block on average, in the plan of default positions.

  A rule not known at trace time (ids, a dense mask, traced values) is not known here:
  every query block is taken to read every key block.
  """
  if grid.num_q_blocks <= 2 or not (facts.rule is None or facts.rule.is_static()):
    return float(grid.num_q_blocks)
  q_pos, kv_pos = _rules.end_aligned_positions(1, grid.query_len, grid.kv_len, np)
  return _plan.count_pairs(facts.rule, q_pos, kv_pos, grid.block_q, grid.block_kv) / grid.num_kv_blocks
