"""The block-list kernel over a paged pool (Pallas TPU): a paged step's rows against their pages.

A page table row is a list of blocks: a tile of `block_q` query rows of one sequence reads its
sequence's pages, one grid step per page, the page's index read from the table in scalar
prefetch by the key/value `BlockSpec` index maps (so only its pages are copied to VMEM). A
page block holds every kv head (the pool's layout, head-major [P, Hkv, page, D]): one copy
serves all the tile's query heads, each group reading its own head's [page, D] block. Online softmax in VMEM scratch per
head; keys past the sequence's length are invisible and their values zeroed (free slots may
hold anything). The new tokens are written into the pool before this kernel runs.

Glossary: W tiles (static bound), Hq query heads, Hkv kv heads (G = Hq // Hkv), page keys per
page, K pages per sequence, D key size, Dv value size.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from splash_hk.backends import tpu_lists
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
  scale: float
  soft_cap: float | None
  rule: Mask | None  # a position rule (its `visible`), or None: every key of the sequence
  interpret: bool


def _page(spec: Spec, seq_ref: Any, len_ref: Any, table_ref: Any, t: Any, j: Any) -> Any:
  """The physical page of tile t's j-th step: past its count, its last page (no new copy)."""
  count = jnp.maximum(jax.lax.div(len_ref[t] + spec.page_size - 1, spec.page_size), 1)
  page = table_ref[seq_ref[t], jnp.minimum(j, count - 1)]
  return jnp.clip(page, 0, spec.num_pages - 1)


def _poison(seen: jax.Array, finite: jax.Array) -> jax.Array:
  """[bq, Dv]: NaN in value column c of the rows that see a key whose column c is not finite
  (`finite` [page, Dv]; a visible NaN shows there, and only there), else 0."""
  bad = (~finite).astype(jnp.float32)  # [page, Dv]
  hits = jax.lax.dot_general(seen.astype(jnp.float32), bad, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)  # [bq, Dv]
  return jnp.where(hits > 0, jnp.nan, 0.0)


def _kernel(spec: Spec, seq_ref, len_ref, table_ref, q_ref, pos_ref, k_ref, v_ref, sink_ref,
            o_ref, lse_ref, m_scr, l_scr, acc_scr):
  t, j = pl.program_id(0), pl.program_id(1)
  length = len_ref[t]

  @pl.when(j == 0)
  def _():
    tpu_lists.init_state(m_scr, l_scr, acc_scr)

  @pl.when(j * spec.page_size < length)
  def _():
    shape = (spec.block_q, spec.page_size)
    kv_pos = j * spec.page_size + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    q_pos = jnp.broadcast_to(pos_ref[...][:, :1], shape)  # [bq, page]; -1: not a row
    seen = (kv_pos < length) & (q_pos >= 0)
    if spec.rule is not None:
      seen = seen & spec.rule.visible(q_pos, kv_pos)
    held = (j * spec.page_size + jax.lax.broadcasted_iota(
        jnp.int32, (spec.page_size, 1), 0)) < length  # [page, 1]: slots of the sequence
    for hk in range(spec.num_kv_heads):
      k = k_ref[hk]  # [page, D]
      v = jnp.where(held, v_ref[hk], 0).astype(v_ref.dtype)  # [page, Dv]
      finite = jnp.isfinite(v.astype(jnp.float32))  # [page, Dv] (Mosaic tests f32 only)
      poison = _poison(seen, finite)  # [bq, Dv]: NaN where a row sees a non-finite value
      v = jnp.where(finite, v, 0).astype(v.dtype)  # 0 * NaN must not reach the other rows
      for g in range(spec.groups):
        h = hk * spec.groups + g
        s, _ = tpu_lists.scores(q_ref[h], k, spec.scale, spec.soft_cap)  # [bq, page]
        tpu_lists.online_step(h, jnp.where(seen, s, -jnp.inf), v, m_scr, l_scr, acc_scr)
        acc_scr[h] = acc_scr[h] + poison

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    for h in range(spec.num_kv_heads * spec.groups):
      tpu_lists.finish(h, sink_ref[0, h], m_scr, l_scr, acc_scr, o_ref, lse_ref)


def vmem_bytes(block_q: int, page_size: int, heads: int, kv_heads: int, head_dim: int,
               value_dim: int, itemsize: int) -> int:
  """The kernel's VMEM per grid step, estimated (blocks double-buffered, scratch, scores)."""
  blocks = 2 * itemsize * (heads * block_q * (head_dim + value_dim)
                           + page_size * kv_heads * (head_dim + value_dim))
  lanes = 2 * 4 * block_q * LANES * (1 + heads)
  scratch = 4 * heads * block_q * (2 * LANES + value_dim)
  return blocks + lanes + scratch + 4 * 3 * block_q * page_size


def attend(spec: Spec, tile_seq: jax.Array, tile_len: jax.Array, table: jax.Array,
           q: jax.Array, pos: jax.Array, key: jax.Array, value: jax.Array,
           sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """q [W, Hq, bq, D], pos [W, bq, 128] int32 (-1: no row), the pool key [P, Hkv, page, D] and
  value [P, Hkv, page, Dv], tile_seq / tile_len [W] (each tile's sequence and its length after
  the write; 0: no tile), table [max_seqs, K], sinks [8, Hq] -> out [W, Hq, bq, Dv], lse
  [W, Hq, bq, 128]."""
  tiles, heads, bq, d = q.shape
  dv = value.shape[-1]
  page = lambda t, j, seqs, lens, table: (_page(spec, seqs, lens, table, t, j), 0, 0, 0)
  tile = lambda t, j, *_: (t, 0, 0, 0)
  in_specs = [pl.BlockSpec((None, heads, bq, d), tile),
              pl.BlockSpec((None, bq, LANES), lambda t, j, *_: (t, 0, 0)),
              pl.BlockSpec((None, spec.num_kv_heads, spec.page_size, d), page),
              pl.BlockSpec((None, spec.num_kv_heads, spec.page_size, dv), page),
              pl.BlockSpec((SUBLANES, heads), lambda *_: (0, 0), memory_space=pltpu.SMEM)]
  out_specs = [pl.BlockSpec((None, heads, bq, dv), tile),
               pl.BlockSpec((None, heads, bq, LANES), tile)]
  out_shape = [jax.ShapeDtypeStruct((tiles, heads, bq, dv), q.dtype),
               jax.ShapeDtypeStruct((tiles, heads, bq, LANES), jnp.float32)]
  scratch = [pltpu.VMEM((heads, bq, LANES), jnp.float32),
             pltpu.VMEM((heads, bq, LANES), jnp.float32), pltpu.VMEM((heads, bq, dv), jnp.float32)]
  grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=3, grid=(tiles, table.shape[1]),
                                           in_specs=in_specs, out_specs=out_specs,
                                           scratch_shapes=scratch)
  params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
  return pl.pallas_call(functools.partial(_kernel, spec), grid_spec=grid_spec,
                        out_shape=out_shape, compiler_params=params,
                        interpret=spec.interpret)(tile_seq, tile_len, table, q, pos, key, value,
                                                  sinks)
