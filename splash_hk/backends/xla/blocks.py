"""Block views of one call for the xla backend: slices of q, K/V and mask inputs per block pair.

Queries and everything else with a query axis stay in the caller's [B, T, H, ...]
layout (padded to whole blocks only when T needs it); each query block is
transposed to [r, Hkv, Gq, bq, ...] when its row of blocks starts, and outputs
are written back block by block. Keys and values are never padded:
blocks are dynamic slices, the last one clamped to end at S (its keys before
the block's nominal start are masked as duplicates). With one query block (a
decode step, a prefill chunk against a cache) they are sliced in place from
the caller's [B, S, Hkv, D] arrays, so a call costs what its computed blocks
cost, not the capacity of the cache; with several query blocks each key block
is read several times, so K/V are transposed to [B, Hkv, S, D] once instead
(unless each is read about twice or less, as under a narrow window, or the
caller keeps memory tight: a ring step reads them in place).

Which pairs run is the block plan's business (`xla_plan`); `group` below is a
row group of the plan (r = `grid.rows_per_group` batch rows), `Gq` the query
heads per kv head.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from splash_hk import dropout
from splash_hk import quant
from splash_hk.masks import _objects
from splash_hk.masks import _rules
from splash_hk.scores import Score
from splash_hk.backends import base
from splash_hk.backends.xla import plan as xla_plan
from splash_hk.types import Facts, KernelInputs

# Transposing all of K/V once pays off only when a key block is read by more than
# this many query blocks in the plan of default positions: a narrow window (about 2
# reads a block) and a chunk ran faster in place, causal (4-5 reads) transposed
# (the bench's window, chunk and causal rows).
READS_FOR_HEADS_MAJOR = 2


class PairMask(NamedTuple):
  """What the element mask of one block pair reads, all block-sized. A pytree."""

  q_real: jax.Array  # [bq] bool: the query row is inside T (not block padding)
  kv_fresh: jax.Array  # [bk] bool: the key is not a duplicate of the clamped last block
  q_pos: jax.Array  # [r, bq] int32
  kv_pos: jax.Array  # [r, bk] int32
  q_seg: jax.Array | None  # [r, bq] int32, None without segment ids
  kv_seg: jax.Array | None  # [r, bk] int32
  rule: _objects.Mask | None  # the call's rule with its arrays cut to the pair


class Pair(NamedTuple):
  """The block-sized inputs of one (query block, key block) pair."""

  k: jax.Array  # [r, Hkv, bk, D]
  v: jax.Array  # [r, Hkv, bk, Dv]
  mask: PairMask
  bias: Score | None = None  # the call's bias with its "qk" arrays cut to the pair
  drop: jax.Array | None = None  # f32 keep / (1 - rate), broadcastable to [r, Hkv, Gq, bq, bk]
  k_scale: jax.Array | None = None  # quantized keys' per-token scales: [r|1, Hkv|1, 1, 1, bk|1]
  v_scale: jax.Array | None = None  # quantized values' per-token scales, as k_scale


class Views:
  """One call's arrays as the block loops read them (static tiles, traced arrays)."""

  def __init__(self, x: KernelInputs, facts: Facts, grid: xla_plan.Grid,
               kv_in_place: bool = False, columns: bool = False):
    self.x, self.facts, self.grid, self.columns = x, facts, grid, columns
    # Quantized integer values are finite: only their scales can carry NaN or Inf.
    self.integer_values = (isinstance(x.value, quant.Quantized) and
                           jnp.issubdtype(x.value.values.dtype, jnp.integer))
    self.num_kv_heads = x.key.shape[2]
    self.heads_per_kv = x.query.shape[2] // self.num_kv_heads  # Gq
    self.padded_q = grid.num_q_blocks * grid.block_q  # Tp
    self.q = self.pad_queries(x.query)  # [B, Tp, Hq, D]
    self.heads_major = (not kv_in_place and
                        xla_plan.reads_per_kv_block(facts, grid) > READS_FOR_HEADS_MAJOR)
    to_heads = (lambda a: jax.tree.map(lambda t: jnp.swapaxes(t, 1, 2), a)) if (
        self.heads_major) else (lambda a: a)
    self.k, self.v = to_heads(x.key), to_heads(x.value)  # [B, Hkv, S, D] or as given
    self.kv_axis = 2 if self.heads_major else 1
    self.q_pos = base.pad_axis(x.q_positions, 1, self.padded_q)  # [B, Tp]
    self.q_seg = None if x.q_segment_ids is None else base.pad_axis(
        x.q_segment_ids, 1, self.padded_q, -1)  # [B, Tp]
    pad = {"q": lambda a: base.pad_axis(a, 1, self.padded_q, -1),  # [B, Tp]
           "kv": lambda a: a,  # [B, S]
           "qk": lambda a: base.pad_axis(a, 2, self.padded_q, False),  # [B|1, 1|Hq, Tp, S]
           "free": lambda a: a, "head": lambda a: a}  # whole: read by index
    self.rule = None if x.rule is None else x.rule.map_arrays(lambda side, a, **_: pad[side](a))
    self.bias = None if x.bias is None else x.bias.map_arrays(
        lambda side, a, **_: base.pad_axis(a, 2, self.padded_q) if side == "qk" else a)
    self.dropout = None if x.dropout is None else x.dropout._replace(
        q_index=base.pad_axis(x.dropout.q_index, 1, self.padded_q),  # [B, Tp]
        mask=None if x.dropout.mask is None else pad["qk"](x.dropout.mask))

  def of_group(self, a: jax.Array, group) -> jax.Array:
    """Row group `group` of a batch-major array (the whole batch when groups are the batch)."""
    rows = self.grid.rows_per_group
    if a.shape[0] == 1 or rows == a.shape[0]:
      return a
    return jax.lax.dynamic_slice_in_dim(a, group * rows, rows, 0)

  def q_block(self, a: jax.Array, group, i, axis: int = 3) -> jax.Array:
    bq = self.grid.block_q
    return jax.lax.dynamic_slice_in_dim(self.of_group(a, group), i * bq, bq, axis)

  def pad_queries(self, a: jax.Array, fill=0) -> jax.Array:
    """[B, T, ...] -> [B, Tp, ...] (no copy when T fills whole blocks)."""
    return a if a.shape[1] == self.padded_q else base.pad_axis(a, 1, self.padded_q, fill)

  def head_rows(self, a: jax.Array, group, i) -> jax.Array:
    """Query block i of a [B, Tp, Hq, ...] array as [r, Hkv, Gq, bq, ...]."""
    block = self.q_block(a, group, i, 1)
    block = block.reshape(block.shape[0], self.grid.block_q, self.num_kv_heads,
                          self.heads_per_kv, *block.shape[3:])
    return jnp.moveaxis(block, 1, 3)

  def write_rows(self, buf: jax.Array, block: jax.Array, group, i) -> jax.Array:
    """`buf` [B, Tp, Hq, ...] with query block i of `group` set to `block` [r, Hkv, Gq, bq, ...]."""
    block = jnp.moveaxis(block, 3, 1)
    block = block.reshape(block.shape[0], self.grid.block_q, -1, *block.shape[4:])
    rows = self.grid.rows_per_group
    start = (group * rows if rows < buf.shape[0] else 0, i * self.grid.block_q)
    return jax.lax.dynamic_update_slice(buf, block.astype(buf.dtype), start + (0,) * (buf.ndim - 2))

  def kv_start(self, j):
    """Where kv block j's slice starts: its nominal start, clamped so the slice ends by S."""
    return jnp.minimum(j * self.grid.block_kv, self.grid.kv_len - self.grid.block_kv)

  def kv_block(self, a: jax.Array, group, j, axis: int = 1) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(self.of_group(a, group), self.kv_start(j),
                                        self.grid.block_kv, axis)

  def keys(self, group, j) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """Key block [r, Hkv, bk, D] and value block [r, Hkv, bk, Dv] in the query's dtype, and
    their scales as columns of the logits [r, Hkv, 1, 1, bk] (or None). A quantized block's
    scale multiplies its tile, or with `columns` and one scale per token (and head) is left to
    multiply the logits' columns (keys) and the probabilities' (values): fewer products."""
    def block(a):
      a = quant.cut(a, 0, lambda t: self.of_group(t, group))
      a = quant.cut(a, self.kv_axis, lambda t: jax.lax.dynamic_slice_in_dim(
          t, self.kv_start(j), self.grid.block_kv, self.kv_axis))
      if not self.columns or not isinstance(a, quant.Quantized) or a.scale.shape[-1] != 1:
        return to_heads(quant.tile(a, self.x.query.dtype)), None
      column = jnp.swapaxes(to_heads(a.scale), -1, -2)[:, :, None]  # [r|1, Hkv|1, 1, 1, bk|1]
      return to_heads(a.values).astype(self.x.query.dtype), column
    to_heads = (lambda a: a) if self.heads_major else (lambda a: jnp.swapaxes(a, 1, 2))
    (k, k_scale), (v, v_scale) = block(self.k), block(self.v)
    return k, v, k_scale, v_scale

  def add_kv(self, buf: jax.Array, block: jax.Array, group, j) -> jax.Array:
    """buf (laid out like `self.k`) += block [r, Hkv, bk, D] at kv block j of `group`."""
    block = block if self.heads_major else jnp.swapaxes(block, 1, 2)
    start = [0] * buf.ndim
    rows = self.grid.rows_per_group
    start[0] = group * rows if rows < buf.shape[0] else 0
    start[self.kv_axis] = self.kv_start(j)
    current = jax.lax.dynamic_slice(buf, start, block.shape)
    return jax.lax.dynamic_update_slice(buf, current + block, start)

  def kv_layout(self, a: jax.Array) -> jax.Array:
    """A [B, Hkv, S, D] array laid out like the caller's keys ([B, S, Hkv, D])."""
    return jnp.swapaxes(a, 1, 2) if self.heads_major else a

  def pair(self, group, i, j) -> Pair:
    """Slices of block pair (i, j), and what its element mask reads."""
    k, v, k_scale, v_scale = self.keys(group, j)
    bq, bk = self.grid.block_q, self.grid.block_kv
    q_idx = i * bq + jnp.arange(bq)  # [bq]
    k_idx = self.kv_start(j) + jnp.arange(bk)  # [bk]
    q_side = lambda a: None if a is None else self.q_block(a, group, i, 1)
    kv_side = lambda a: None if a is None else self.kv_block(a, group, j)
    cut = {"q": q_side, "kv": kv_side,
           "qk": lambda a: self.kv_block(self.q_block(a, group, i, 2), group, j, 3),
           "free": lambda a: a, "head": lambda a: a}
    rule = None if self.rule is None else self.rule.map_arrays(
        lambda side, a, **_: cut[side](a))
    bias = None if self.bias is None else self.bias.map_arrays(
        lambda side, a, **_: cut["qk"](a) if side == "qk" else a)
    mask = PairMask(q_idx < self.grid.query_len, k_idx >= j * bk,
                    self.q_block(self.q_pos, group, i, 1), self.kv_block(self.x.kv_positions, group, j),
                    q_side(self.q_seg), kv_side(self.x.kv_segment_ids), rule)
    return Pair(k, v, mask, bias, self._drop(group, i, j, cut["qk"]), k_scale, v_scale)

  def _drop(self, group, i, j, cut_qk) -> jax.Array | None:
    """The pair's dropout scale (`splash_hk.dropout.scale`), or None without dropout."""
    d = self.dropout
    if d is None:
      return None
    rows = self.of_group(d.rows, group)[:, None, None, None, None]  # [r, 1, 1, 1, 1]
    q_index = self.q_block(d.q_index, group, i, 1)[:, None, None, :, None]  # [r, 1, 1, bq, 1]
    kv_index = self.kv_block(d.kv_index, group, j)[:, None, None, None, :]  # [r, 1, 1, 1, bk]
    mask = None if d.mask is None else dropout.mask_by_kv(cut_qk(d.mask), self.num_kv_heads)
    return dropout.scale(d.key, self.facts.config.dropout_rate, rows,
                         dropout.heads_by_kv(d.heads, self.num_kv_heads), q_index, kv_index, mask)

  def add_pair(self, buf: jax.Array, block: jax.Array, group, i, j) -> jax.Array:
    """buf [B|1, H|1, Tp, S] += block [r|1, H|1, bq, bk] at block pair (i, j) of `group`."""
    rows = self.grid.rows_per_group
    start = (group * rows if buf.shape[0] > 1 and rows < buf.shape[0] else 0, 0,
             i * self.grid.block_q, self.kv_start(j))
    current = jax.lax.dynamic_slice(buf, start, block.shape)
    return jax.lax.dynamic_update_slice(buf, current + block, start)

  def element_mask(self, m: PairMask) -> jax.Array:
    """Visibility inside a block pair: broadcastable to [r, Hkv, Gq, bq, bk]."""
    mask = (m.q_real[:, None] & m.kv_fresh[None, :])[None, None]  # [1, 1, bq, bk]
    if m.rule is not None:
      mask = mask & m.rule.visible(m.q_pos[:, None, :, None], m.kv_pos[:, None, None, :])
    if m.q_seg is not None:
      mask = mask & _rules.segment_mask(m.q_seg, m.kv_seg)[:, None]  # [r, 1|Hq, bq, bk]
    if mask.shape[1] == 1:
      return mask[:, :, None]  # [r, 1, 1, bq, bk]
    return mask.reshape(mask.shape[0], self.num_kv_heads, self.heads_per_kv, *mask.shape[2:])
