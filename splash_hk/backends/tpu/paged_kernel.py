"""The block-list kernel over a paged pool (Pallas TPU): a paged step's rows against their pages.

A step's lists of pages (`splash_hk.lists`: each sequence's page-table row, or the pages a
selection chose for each kv head) are lists of blocks: a tile of `block_q` query rows of one
sequence reads its list, one grid step per entry, the entry's page and first key position read
from the lists in scalar prefetch by the key/value `BlockSpec` index maps (so only its pages are
copied to VMEM). A page-table row serves every kv head, so its page block holds all of them (the
pool's layout, head-major [P, Hkv, page, D]: one copy serves all the tile's query heads, each
group reading its own head's [page, D] block); a selection's lists differ per kv head, so the
grid has a step per kv head and its page block holds that head's [page, D] only. Online softmax
in VMEM scratch per head; keys past the sequence's length are invisible and their values zeroed
(free slots may hold anything). The new tokens are written into the pool before this kernel runs.

Glossary: W tiles (static bound), Hq query heads, Hkv kv heads (G = Hq // Hkv), Hl list heads
(1: a page table; Hkv: a selection), Hb = Hkv // Hl kv heads a block, page keys per page, K
entries a list, D key size, Dv value size.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from splash_hk.backends import base
from splash_hk.backends.tpu import list_kernel as tpu_lists
from splash_hk.masks._mask import Mask

LANES, SUBLANES = tpu_lists.LANES, tpu_lists.SUBLANES


@dataclasses.dataclass(frozen=True)
class Spec:
  """What the paged kernel knows statically (hashable)."""

  block_q: int  # bq, a multiple of 8
  page_size: int
  num_pages: int  # P
  num_kv_heads: int  # Hkv
  groups: int  # G
  list_heads: int  # Hl: 1 (a page table, every kv head) or Hkv (a list per kv head)
  entries: int  # K
  scale: float
  soft_cap: float | None
  rule: Mask | None  # a position rule (its `visible`), or None: every key of the sequence
  interpret: bool


  @property
  def block_heads(self) -> int:  # Hb
    return self.num_kv_heads // self.list_heads


def _list(spec: Spec, seq_ref: Any, t: Any, h: Any) -> Any:
  """Where tile t's list for list head h starts in the flat lists ([max_seqs, Hl, K])."""
  return (seq_ref[t] * spec.list_heads + h) * spec.entries


def _page(spec: Spec, seq_ref: Any, blocks_ref: Any, count_ref: Any, t: Any, h: Any,
          j: Any) -> Any:
  """The physical page of tile t's j-th entry for list head h: past its count, its last page
  (no new copy)."""
  count = jnp.maximum(count_ref[seq_ref[t] * spec.list_heads + h], 1)
  page = blocks_ref[_list(spec, seq_ref, t, h) + jnp.minimum(j, count - 1)]
  return jnp.clip(page, 0, spec.num_pages - 1)


def _poison(seen: jax.Array, finite: jax.Array) -> jax.Array:
  """[bq, Dv]: NaN in value column c of the rows that see a key whose column c is not finite
  (`finite` [page, Dv]; a visible NaN shows there, and only there), else 0."""
  bad = (~finite).astype(jnp.float32)  # [page, Dv]
  hits = jax.lax.dot_general(seen.astype(jnp.float32), bad, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)  # [bq, Dv]
  return jnp.where(hits > 0, jnp.nan, 0.0)


def _kernel(spec: Spec, seq_ref, len_ref, blocks_ref, first_ref, count_ref, q_ref, pos_ref,
            k_ref, v_ref, sink_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr):
  t, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length = len_ref[t]

  @pl.when(j == 0)
  def _():
    tpu_lists.init_state(m_scr, l_scr, acc_scr)

  @pl.when((j < count_ref[seq_ref[t] * spec.list_heads + h]) & (length > 0))
  def _():
    shape = (spec.block_q, spec.page_size)
    first = first_ref[_list(spec, seq_ref, t, h) + j]  # the entry's first key position
    kv_pos = first + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    q_pos = jnp.broadcast_to(pos_ref[...][:, :1], shape)  # [bq, page]; -1: not a row
    seen = (kv_pos < length) & (q_pos >= 0)
    if spec.rule is not None:
      seen = seen & spec.rule.visible(q_pos, kv_pos)
    held = (first + jax.lax.broadcasted_iota(
        jnp.int32, (spec.page_size, 1), 0)) < length  # [page, 1]: slots of the sequence
    for hk in range(spec.block_heads):
      k = k_ref[hk]  # [page, D]
      v = jnp.where(held, v_ref[hk], 0).astype(v_ref.dtype)  # [page, Dv]
      finite = jnp.isfinite(v.astype(jnp.float32))  # [page, Dv] (Mosaic tests f32 only)
      poison = _poison(seen, finite)  # [bq, Dv]: NaN where a row sees a non-finite value
      v = jnp.where(finite, v, 0).astype(v.dtype)  # 0 * NaN must not reach the other rows
      for g in range(spec.groups):
        b = hk * spec.groups + g  # the head within the block
        s, _ = tpu_lists.scores(q_ref[b], k, spec.scale, spec.soft_cap)  # [bq, page]
        tpu_lists.online_step(b, jnp.where(seen, s, -jnp.inf), v, m_scr, l_scr, acc_scr)
        acc_scr[b] = acc_scr[b] + poison

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    heads = spec.block_heads * spec.groups
    for b in range(heads):
      tpu_lists.finish(b, sink_ref[0, h * heads + b], m_scr, l_scr, acc_scr, o_ref, lse_ref)


def vmem_bytes(block_q: int, page_size: int, heads: int, kv_heads: int, head_dim: int,
               value_dim: int, itemsize: int) -> int:
  """The kernel's VMEM per grid step, estimated (blocks double-buffered, scratch, scores)."""
  blocks = 2 * itemsize * (heads * block_q * (head_dim + value_dim)
                           + page_size * kv_heads * (head_dim + value_dim))
  lanes = 2 * 4 * block_q * LANES * (1 + heads)
  scratch = 4 * heads * block_q * (2 * LANES + value_dim)
  return blocks + lanes + scratch + 4 * 3 * block_q * page_size


def attend(spec: Spec, tile_seq: jax.Array, tile_len: jax.Array, blocks: jax.Array,
           first_key: jax.Array, count: jax.Array, q: jax.Array, pos: jax.Array, key: jax.Array,
           value: jax.Array, sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """q [W, Hq, bq, D], pos [W, bq, 128] int32 (-1: no row), the pool key [P, Hkv, page, D] and
  value [P, Hkv, page, Dv], tile_seq / tile_len [W] (each tile's sequence and its length after
  the write; 0: no tile), the lists' blocks and first_key [max_seqs, Hl, K] and count
  [max_seqs, Hl], sinks [8, Hq] -> out [W, Hq, bq, Dv], lse [W, Hq, bq, 128]."""
  tiles, heads, bq, d = q.shape
  dv, hb = value.shape[-1], spec.block_heads
  qb = hb * spec.groups  # query heads a block
  page = lambda t, h, j, seqs, _, blocks, __, count: (
      _page(spec, seqs, blocks, count, t, h, j), h, 0, 0)
  tile = lambda t, h, *_: (t, h, 0, 0)
  in_specs = [pl.BlockSpec((None, qb, bq, d), tile),
              pl.BlockSpec((None, bq, LANES), lambda t, *_: (t, 0, 0)),
              pl.BlockSpec((None, hb, spec.page_size, d), page),
              pl.BlockSpec((None, hb, spec.page_size, dv), page),
              pl.BlockSpec((SUBLANES, heads), lambda *_: (0, 0), memory_space=pltpu.SMEM)]
  out_specs = [pl.BlockSpec((None, qb, bq, dv), tile), pl.BlockSpec((None, qb, bq, LANES), tile)]
  out_shape = [jax.ShapeDtypeStruct((tiles, heads, bq, dv), q.dtype),
               jax.ShapeDtypeStruct((tiles, heads, bq, LANES), jnp.float32)]
  scratch = [pltpu.VMEM((qb, bq, LANES), jnp.float32),
             pltpu.VMEM((qb, bq, LANES), jnp.float32), pltpu.VMEM((qb, bq, dv), jnp.float32)]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=5, grid=(tiles, spec.list_heads, spec.entries), in_specs=in_specs,
      out_specs=out_specs, scratch_shapes=scratch)
  params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
  flat = lambda a: a.astype(jnp.int32).reshape(-1)
  with base.kernel_precision(q.dtype):
    return pl.pallas_call(functools.partial(_kernel, spec), grid_spec=grid_spec,
                          out_shape=out_shape, compiler_params=params,
                          interpret=spec.interpret)(tile_seq, tile_len, flat(blocks),
                                                    flat(first_key), flat(count), q, pos, key,
                                                    value, sinks)
