"""The block-list kernel's dK/dV (Pallas TPU): a grid step per chosen (key block, query tile).

A kv head's work is the pairs its program heads' lists choose (`lists.pairs`: at most
G / n * nq * K, sorted by key block; a program head is the n query heads one list serves
together, n = G where lists serve whole groups, as in the forward), so the grid is (batch, kv
head, pair) and a step past the kv head's count
repeats its last pair's blocks (no copy) and computes nothing: no step for a pair nobody chose
(walking every query tile for every key block cost a step each, most of them empty: nk / K
times the chosen work's steps). A key block's pairs are consecutive, so its dK/dV accumulate in
VMEM scratch from its first pair and its output block is written at its last; a key block no
list chose is no step's, and `dkv` zeroes it after the kernel.

Glossary: B batch, Hkv kv heads, G query heads a kv head, nq query tiles of bq rows, nk key
blocks of bk keys, n query heads a program head, P = G / n * nq * K pairs (K the longest list), D
key size, Dv value size.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from splash_hk.backends import base
from splash_hk.backends.tpu import list_kernel as tpu_lists
from splash_hk.backends.tpu import softmax

LANES = tpu_lists.LANES


def _kernel(spec: tpu_lists.Spec, rows: int, block_ref, row_ref, count_ref, q_ref, k_ref, v_ref,
            qs_ref, ks_ref, lse_ref, delta_ref, do_ref, dk_ref, dv_ref, dk_scr, dv_scr):
  b, hk, p = (pl.program_id(n) for n in range(3))
  count, last = count_ref[b, hk], pl.num_programs(2) - 1
  block = block_ref[b, hk, p]

  @pl.when((p == 0) | (block != block_ref[b, hk, jnp.maximum(p - 1, 0)]))
  def _():  # a key block's first pair
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  @pl.when(p < count)
  def _():
    entry = row_ref[b, hk, p]  # head * nq + query tile, `FULL` flagged
    k, v = k_ref[...], v_ref[...]

    def fold(seen):  # seen [bq, bk] or None: every pair
      for g in range(spec.per_program):  # the pair's program heads: one copy of the block
        q, do = q_ref[g], do_ref[g]
        prob, t = tpu_lists.probabilities(spec, q, k, lse_ref[g], seen)
        dv_scr[...] += softmax.dot(prob.astype(do.dtype), do, (0, 0))  # [bk, Dv]
        ds = tpu_lists.d_logits(spec, prob, t, softmax.dot(do, v, (1, 1)),
                                delta_ref[g])  # [bq, bk]
        dk_scr[...] += softmax.dot(ds.astype(q.dtype), q, (0, 0))  # [bk, D]

    row = jax.lax.rem(tpu_lists.block_of(entry), rows)  # the query tile
    tpu_lists.masked(spec, entry, row, block, qs_ref[...], ks_ref[...], fold)

  following = block_ref[b, hk, jnp.minimum(p + 1, last)]

  @pl.when((p < count) & ((p + 1 >= count) | (following != block)))
  def _():  # a key block's last pair
    dk_ref[...] = (dk_scr[...] * spec.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _maps(spec: tpu_lists.Spec, rows: int):
  """Index maps of a step's q-side blocks, k/v (and dk/dv) blocks and the two segment sides."""
  programs = spec.groups // spec.per_program  # program heads a kv head
  pair_row = lambda b, hk, p, pair_rows: tpu_lists.block_of(pair_rows[b, hk, p])  # flag off
  head = lambda b, hk, p, blocks, pair_rows, counts: (
      hk * programs + jax.lax.div(pair_row(b, hk, p, pair_rows), rows))
  tile = lambda b, hk, p, blocks, pair_rows, counts: jax.lax.rem(pair_row(b, hk, p, pair_rows),
                                                                 rows)
  q_map = lambda b, hk, p, *refs: (b, head(b, hk, p, *refs), 0, tile(b, hk, p, *refs), 0)
  kv_map = lambda b, hk, p, blocks, *_: (b, hk, blocks[b, hk, p], 0)
  q_seg_map = lambda b, hk, p, *refs: (b, tile(b, hk, p, *refs), 0)
  kv_seg_map = lambda b, hk, p, blocks, *_: (b, 0, blocks[b, hk, p])
  return q_map, kv_map, q_seg_map, kv_seg_map


def dkv(spec: tpu_lists.Spec, pair_blocks: jax.Array, pair_rows: jax.Array, counts: jax.Array,
        q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array, kv_seg: jax.Array,
        lse: jax.Array, delta: jax.Array, d_out: jax.Array) -> tuple[jax.Array, jax.Array]:
  """dk [B, Hkv, Sp, D], dv [B, Hkv, Sp, Dv] over each kv head's chosen pairs (`lists.pairs`
  over its program heads, `Spec.per_program` query heads each: pair_blocks and pair_rows
  [B, Hkv, P], counts [B, Hkv]); the group's heads summed, a key block no pair names zero.
  q [B, H, Tp, D], lse / delta [B, H, Tp, 128] f32, d_out as out."""
  (batch, heads, t_pad, d), (kv_heads, s_pad, dv) = q.shape, v.shape[1:]
  bq, bk, rows = spec.block_q, spec.block_kv, t_pad // spec.block_q
  q_map, kv_map, q_seg_map, kv_seg_map = _maps(spec, rows)
  side = lambda width: pl.BlockSpec((None, None, spec.per_program, bq, width), q_map)
  in_specs = tpu_lists.sides(spec, d, dv, kv_map, side(d), q_seg_map, kv_seg_map)
  in_specs += [side(LANES), side(LANES), side(dv)]
  out_specs = [pl.BlockSpec((None, None, bk, d), kv_map),
               pl.BlockSpec((None, None, bk, dv), kv_map)]
  out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  scratch = [pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, dv), jnp.float32)]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3, grid=(batch, kv_heads, pair_blocks.shape[-1]), in_specs=in_specs,
      out_specs=out_specs, scratch_shapes=scratch)
  params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
  with base.kernel_precision(q.dtype):
    dk, dv_ = pl.pallas_call(functools.partial(_kernel, spec, rows), grid_spec=grid_spec,
                             out_shape=out_shape, compiler_params=params,
                             interpret=spec.interpret)(
                                 pair_blocks, pair_rows, counts, tpu_lists.programs(spec, q),
                                 k, v, q_seg, kv_seg,
                                 *(tpu_lists.programs(spec, a) for a in (lse, delta, d_out)))
  chosen = _chosen_blocks(pair_blocks, counts, s_pad // bk)  # [B, Hkv, nk]
  keep = lambda a: jnp.where(jnp.repeat(chosen, bk, axis=2)[..., None], a, 0).astype(a.dtype)
  return keep(dk), keep(dv_)


def _chosen_blocks(pair_blocks: jax.Array, counts: jax.Array, kv_blocks: int) -> jax.Array:
  """[B, Hkv, nk] bool: the key blocks some pair of the kv head names (the others' dK/dV are no
  step's: unwritten)."""
  named = jnp.where(jnp.arange(pair_blocks.shape[-1]) < counts[..., None], pair_blocks,
                    kv_blocks)  # [B, Hkv, P]
  b, h = (i[..., None] for i in jnp.indices(named.shape[:2]))
  return jnp.zeros((*named.shape[:2], kv_blocks + 1), bool).at[b, h, named].set(True)[
      ..., :kv_blocks]
