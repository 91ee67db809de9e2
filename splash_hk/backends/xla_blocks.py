"""Block views of one call for the xla backend, and its schedule: which block pairs to compute.

Queries and everything else with a query axis stay in the caller's [B, T, H, ...]
layout (padded to whole blocks only when T needs it); each query block is
transposed to [r, Hkv, G, bq, ...] when its row of blocks starts, and outputs
are written back block by block. Keys and values are never padded:
blocks are dynamic slices, the last one clamped to end at S (its keys before
the block's nominal start are masked as duplicates). With one query block (a
decode step, a prefill chunk against a cache) they are sliced in place from
the caller's [B, S, Hkv, D] arrays, so a call costs what its computed blocks
cost, not the capacity of the cache; with several query blocks each key block
is read several times, so K/V are transposed to [B, Hkv, S, D] once instead
(unless each is read about twice or less, as under a narrow window, or the
caller keeps memory tight: a ring step reads them in place).

The schedule is decided at run time from per-block ranges of positions and
segment ids (`splash_hk.masks.blocks_may_see`): for default positions that is
exactly the static causal/window/chunk plan; for packed documents, padding, a
cache's filled length or a query shard it skips what no query can see.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk import masks
from splash_hk.backends import base
from splash_hk.types import Facts, KernelInputs

# Blocks smaller than this many (row, key, head, dim) products run for the whole
# batch at once; larger ones per batch row, so each row skips its own blocks.
PER_ROW_WORK = 1 << 22


class Schedule(NamedTuple):
  """The kv blocks each (row group, query block) computes, full ones first. A pytree."""

  order: jax.Array  # [G, nq, nk] int32: kv block indices: full, then partly visible, then dead
  count: jax.Array  # [G, nq] int32: how many of `order` are live
  full_count: jax.Array  # [G, nq] int32: how many of `order` are full (they come first)
  full: jax.Array  # [G, nq, nk] bool: every (query, key) pair of the block is visible


class Pair(NamedTuple):
  """The block-sized inputs of one (query block, key block) pair."""

  k: jax.Array  # [r, Hkv, bk, D]
  v: jax.Array  # [r, Hkv, bk, Dv]
  mask_inputs: tuple  # what `element_mask` reads, all block-sized


class Views:
  """One call's arrays as the block loops read them (static tiles, traced arrays)."""

  def __init__(self, x: KernelInputs, facts: Facts, block_q: int, block_kv: int,
               kv_in_place: bool = False):
    batch, query_len, num_heads, head_dim = x.query.shape
    self.kv_len, self.num_kv_heads = x.key.shape[1], x.key.shape[2]
    self.groups = num_heads // self.num_kv_heads
    self.query_len, self.facts, self.x = query_len, facts, x
    self.block_q, self.block_kv = min(block_q, query_len), min(block_kv, self.kv_len)
    self.num_q_blocks = -(-query_len // self.block_q)
    self.num_kv_blocks = -(-self.kv_len // self.block_kv)
    self.padded_q = self.num_q_blocks * self.block_q
    work = self.block_q * self.block_kv * num_heads * head_dim
    self.rows = 1 if work >= PER_ROW_WORK else batch  # batch rows per group
    self.q = self.pad_rows(x.query)  # [B, Tp, Hq, D]
    self.heads_major = not kv_in_place and self._reads_per_kv_block() > 2
    to_heads = (lambda a: jnp.swapaxes(a, 1, 2)) if self.heads_major else (lambda a: a)
    self.k, self.v = to_heads(x.key), to_heads(x.value)  # [B, Hkv, S, D] or as given
    self.kv_axis = 2 if self.heads_major else 1
    self.q_pos = base.pad_axis(x.q_positions, 1, self.padded_q)  # [B, Tp]
    self.q_seg = None if x.q_segment_ids is None else base.pad_axis(
        x.q_segment_ids, 1, self.padded_q, -1)  # [B, Tp]
    self.mask = None
    if x.mask is not None:  # [B|1, 1|Hq, T, S] -> [B|1, 1|Hkv, 1|G, Tp, S]
      m = base.pad_axis(x.mask, 2, self.padded_q, False)
      heads = self.num_kv_heads if m.shape[1] > 1 else 1
      self.mask = m.reshape(m.shape[0], heads, m.shape[1] // heads, *m.shape[2:])

  def _reads_per_kv_block(self) -> float:
    """How many query blocks read a key block on average, in the plan of default positions.

    Transposing all of K/V once pays off only above two (measured on a 2-core
    CPU: window 512 at T=8192, 1.9 reads, 7% faster in place; causal 4096, 4.5, 7% slower).
    """
    if self.num_q_blocks <= 2:
      return float(self.num_q_blocks)
    q_pos = np.arange(self.query_len)[None] + (self.kv_len - self.query_len)  # end-aligned
    kv_pos = np.arange(self.kv_len)[None]
    pairs = count_pairs(q_pos, kv_pos, self.facts.rules, self.block_q, self.block_kv)
    return pairs / self.num_kv_blocks

  def rows_of(self, a: jax.Array, g) -> jax.Array:
    """Row group g of a batch-major array (the whole batch when groups are the batch)."""
    if a.shape[0] == 1 or self.rows == a.shape[0]:
      return a
    return jax.lax.dynamic_slice_in_dim(a, g * self.rows, self.rows, 0)

  def q_block(self, a: jax.Array, g, i, axis: int = 3) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(self.rows_of(a, g), i * self.block_q, self.block_q, axis)

  def pad_rows(self, a: jax.Array, fill=0) -> jax.Array:
    """[B, T, ...] -> [B, Tp, ...] (no copy when T fills whole blocks)."""
    return a if a.shape[1] == self.padded_q else base.pad_axis(a, 1, self.padded_q, fill)

  def head_rows(self, a: jax.Array, g, i) -> jax.Array:
    """Query block i of a [B, Tp, Hq, ...] array as [r, Hkv, G, bq, ...]."""
    block = self.q_block(a, g, i, 1)
    block = block.reshape(block.shape[0], self.block_q, self.num_kv_heads, self.groups,
                          *block.shape[3:])
    return jnp.moveaxis(block, 1, 3)

  def write_rows(self, buf: jax.Array, block: jax.Array, g, i) -> jax.Array:
    """`buf` [B, Tp, Hq, ...] with query block i of row group g set to `block` [r, Hkv, G, bq, ...]."""
    block = jnp.moveaxis(block, 3, 1)
    block = block.reshape(block.shape[0], self.block_q, -1, *block.shape[4:])
    start = (g * self.rows if self.rows < buf.shape[0] else 0, i * self.block_q)
    return jax.lax.dynamic_update_slice(buf, block.astype(buf.dtype), start + (0,) * (buf.ndim - 2))

  def kv_start(self, j):
    """Where kv block j's slice starts: its nominal start, clamped so the slice ends by S."""
    return jnp.minimum(j * self.block_kv, self.kv_len - self.block_kv)

  def kv_block(self, a: jax.Array, g, j, axis: int = 1) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(self.rows_of(a, g), self.kv_start(j), self.block_kv, axis)

  def keys(self, g, j) -> tuple[jax.Array, jax.Array]:
    """Key block [r, Hkv, bk, D] and value block [r, Hkv, bk, Dv]."""
    block = lambda a: self.kv_block(a, g, j, self.kv_axis)
    if self.heads_major:
      return block(self.k), block(self.v)
    return jnp.swapaxes(block(self.k), 1, 2), jnp.swapaxes(block(self.v), 1, 2)

  def add_kv(self, buf: jax.Array, block: jax.Array, g, j) -> jax.Array:
    """buf (laid out like `self.k`) += block [r, Hkv, bk, D] at kv block j of row group g."""
    block = block if self.heads_major else jnp.swapaxes(block, 1, 2)
    start = [0] * buf.ndim
    start[0] = g * self.rows if self.rows < buf.shape[0] else 0
    start[self.kv_axis] = self.kv_start(j)
    current = jax.lax.dynamic_slice(buf, start, block.shape)
    return jax.lax.dynamic_update_slice(buf, current + block, start)

  def kv_layout(self, a: jax.Array) -> jax.Array:
    """A [B, Hkv, S, D] array laid out like the caller's keys ([B, S, Hkv, D])."""
    return jnp.swapaxes(a, 1, 2) if self.heads_major else a

  def pair(self, g, i, j) -> Pair:
    """Slices of block pair (i, j), and what its element mask reads."""
    k, v = self.keys(g, j)
    q_idx = i * self.block_q + jnp.arange(self.block_q)  # [bq]
    k_idx = self.kv_start(j) + jnp.arange(self.block_kv)  # [bk]
    inputs = (q_idx < self.query_len, k_idx >= j * self.block_kv,
              self.q_block(self.q_pos, g, i, 1), self.kv_block(self.x.kv_positions, g, j))
    if self.q_seg is not None:
      inputs += (self.q_block(self.q_seg, g, i, 1), self.kv_block(self.x.kv_segment_ids, g, j))
    if self.mask is not None:
      inputs += (self.kv_block(self.q_block(self.mask, g, i, 3), g, j, 4),)
    return Pair(k, v, inputs)

  def element_mask(self, pair: Pair) -> jax.Array:
    """Visibility inside a block pair: broadcastable to [r, Hkv, G, bq, bk]."""
    q_real, k_fresh, q_pos, kv_pos, *rest = pair.mask_inputs
    mask = (q_real[:, None] & k_fresh[None, :])[None]  # [1, bq, bk]
    pos = masks.position_mask(q_pos, kv_pos, **self.facts.rules)
    if pos is not None:
      mask = mask & pos  # [r, bq, bk]
    if self.q_seg is not None:
      mask = mask & masks.segment_mask(rest[0], rest[1])
    mask = mask[:, None, None]  # [r, 1, 1, bq, bk]
    return mask if self.mask is None else mask & rest[-1]

  def schedule(self) -> Schedule:
    """The live kv blocks of every (row group, query block), from the data's block ranges."""
    x = self.x
    q = masks.block_ranges(x.q_positions, x.q_segment_ids, self.block_q)
    kv = masks.block_ranges(x.kv_positions, x.kv_segment_ids, self.block_kv)
    rules = self.facts.rules
    live = masks.blocks_may_see(q, kv, **rules)  # [B, nq, nk], as `count_pairs` counts them
    full = masks.blocks_fully_see(q, kv, self.block_q, self.block_kv, **rules)
    if self.mask is not None:
      live = live & self._mask_blocks()
      full = full & False
    if self.rows > 1:  # one group: the whole batch
      live, full = jnp.any(live, axis=0, keepdims=True), jnp.all(full, axis=0, keepdims=True)
    full = full & live
    rank = jnp.where(full, 0, jnp.where(live, 1, 2))  # full blocks first: they need no mask
    order = jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)
    count = lambda a: jnp.sum(a, axis=-1, dtype=jnp.int32)
    return Schedule(order, count(live), count(full), full)

  def _mask_blocks(self) -> jax.Array:
    """Whether the dense mask lets anything through per block pair: [B|1, nq, nk]."""
    m = jnp.any(self.mask, axis=(1, 2))  # [B|1, Tp, S]
    m = base.pad_axis(m, 2, self.num_kv_blocks * self.block_kv, False)
    m = m.reshape(m.shape[0], self.num_q_blocks, self.block_q, self.num_kv_blocks, self.block_kv)
    return jnp.any(m, axis=(2, 4))


def count_pairs(q_positions, kv_positions, rules: dict, block_q: int, block_kv: int,
                q_segment_ids=None, kv_segment_ids=None) -> int:
  """How many block pairs `Views.schedule` computes for these inputs (NumPy, per head).

  `rules` as `Facts.rules`; positions and segment ids [B, T] / [B, S] (segments
  None: one document). The same tiles (clamped to the lengths) and the same
  rule as the kernel, so this is what it computes, not an idealised count.
  """
  block_q, block_kv = min(block_q, q_positions.shape[-1]), min(block_kv, kv_positions.shape[-1])
  q = masks.block_ranges(q_positions, q_segment_ids, block_q, np)
  kv = masks.block_ranges(kv_positions, kv_segment_ids, block_kv, np)
  return int(masks.blocks_may_see(q, kv, **rules).sum())
