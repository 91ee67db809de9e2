"""The block-list kernel (Pallas TPU): attention over lists of key blocks, forward and backward.

The grid is (batch, kv head, query tile, run of m listed blocks): a program's query tile of
`block_q` rows, for every query head of the kv head's group, reads the key blocks its list
names, m = `blocks_a_step` of them a grid step, each through its own `BlockSpec` (one copy of a
block for the group; m copies in flight together); where each query head has its own lists, a
program is one query head. The lists sit in scalar prefetch and the key/value `BlockSpec` index
maps read them, so only listed blocks are copied to VMEM. The online softmax lives in VMEM
scratch across a tile's steps; entries past a tile's count repeat its last block's index (no
copy) and compute nothing; an entry whose block the tile sees whole (`FULL`) skips the element
mask. The backward is two kernels: dq over the same lists, dK/dV over the chosen
(key block, query tile) pairs sorted by key block (`list_dkv`), the group's query heads summed
in the kernel's accumulators.

Glossary (head-major, padded): B batch, H query heads, Hkv kv heads (G = H // Hkv), L list
heads (each serves H // L query heads), Tp = nq * bq query rows, Sp = nk * bk keys, K the
longest list, D key size, Dv value size. Inside a block, keys are visible by the position rule
(end-aligned default positions) and by segment ids (padding disjoint: -1 queries, -2 keys).
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
from splash_hk.backends.tpu import softmax
from splash_hk.masks._mask import Mask

LANES, SUBLANES = 128, 8  # a TPU vector register's (sublanes, lanes): Mosaic's tiling
# The kernels' VMEM for one grid step (blocks double-buffered, scores and scratch), kept under a
# v5e's 16 MiB of scoped VMEM with room for Mosaic's own.
VMEM_BUDGET = 12 * 2 ** 20
# Keys the forward and dq kernels read a grid step: m = STEP_KEYS // bk listed blocks (each its
# own pipelined BlockSpec, so m copies are in flight together), not one: a 128-key block alone
# is a small step for the chip, bound by its copy's latency.
STEP_KEYS = 512
# A forward step's stacked rows (its heads' query tiles) times its keys at most: the f32 logits
# and probabilities it holds in VMEM (1 MiB each); a program of many rows reads fewer blocks.
STEP_LOGITS = 512 * 512
# A list entry at or above FULL names block `entry - FULL`, every (query, key) pair of which the
# tile sees (one segment, no padding, the rule beside the choice true throughout): the kernels
# skip its element mask, most of the elementwise work a block costs.
FULL = 1 << 24


@dataclasses.dataclass(frozen=True)
class Spec:
  """What the three kernels know statically (hashable)."""

  block_q: int  # bq, a multiple of 8
  block_kv: int  # bk, a multiple of 128
  query_len: int  # T (unpadded)
  kv_len: int  # S (unpadded)
  groups: int  # G: query heads per kv head
  list_group: int  # query heads per list head
  per_program: int  # query heads in one forward / dq program: G where lists serve whole groups
  scale: float
  soft_cap: float | None
  rule: Mask | None  # a static position rule beside the choice (its `visible`), or None
  interpret: bool

  def list_head(self, h: Any) -> Any:
    return _div(h, self.list_group)

  def program_heads(self, p: Any) -> tuple[Any, Any]:
    """The kv head and the list head of forward / dq program head p."""
    return _div(p * self.per_program, self.groups), self.list_head(p * self.per_program)


def _div(a: Any, b: int) -> Any:
  """a // b for a >= 0 (grid indices) without `floor_divide`, whose `sign` Mosaic lowers only
  where it knows the TPU's version (never when lowered on another host)."""
  return jax.lax.div(a, b)


def _visible(spec: Spec, row: Any, block: Any, q_seg: jax.Array,
             kv_seg: jax.Array) -> jax.Array:
  """[bq, bk] bool: query tile `row` against key block `block`, by segments and the rule."""
  shape = (spec.block_q, spec.block_kv)
  seen = q_seg[:, :1] == kv_seg[:1, :]  # [bq, bk]
  if spec.rule is not None:
    q_pos = (row * spec.block_q + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
             + (spec.kv_len - spec.query_len))  # end-aligned default positions
    kv_pos = block * spec.block_kv + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    seen = seen & spec.rule.visible(q_pos, kv_pos)
  return seen


def _listed(lists_ref: Any, counts_ref: Any, b: Any, l: Any, row: Any, j: Any) -> Any:
  """The j-th list entry of (b, l, row); past the count, the last listed one (no new copy)."""
  last = jnp.maximum(counts_ref[b, l, row] - 1, 0)
  return lists_ref[b, l, row, jnp.minimum(j, last)]


def block_of(entry: Any) -> Any:
  """The key block a list entry names (`FULL` flag dropped)."""
  return jnp.bitwise_and(entry, FULL - 1)


def masked(spec: Spec, entry: Any, row: Any, block: Any, q_seg: jax.Array, kv_seg: jax.Array,
           body: Any) -> None:
  """`body(seen)` for query tile `row` and key block `block` (`entry`: the list entry or pair
  row that names them, `FULL` flagged or not): seen [bq, bk] bool, or None where the block is
  full (no element mask to build or apply)."""
  full = entry >= FULL

  @pl.when(full)
  def _():
    body(None)

  @pl.when(jnp.logical_not(full))
  def _():
    body(_visible(spec, row, block, q_seg, kv_seg))


def step_blocks(block_q: int, block_kv: int, rows: int) -> int:
  """The listed blocks a forward / dq step reads at most: about `STEP_KEYS` keys, fewer where
  the step's `rows` (the forward's stacked heads' tiles; dq's one tile) times its keys would
  pass `STEP_LOGITS`; at least one."""
  return max(1, min(STEP_KEYS, STEP_LOGITS // rows) // block_kv)


def blocks_a_step(spec: Spec, most: int, stacked: bool) -> int:
  """m: the listed blocks a forward (`stacked`: its heads' rows one operand) or dq grid step
  reads (`step_blocks`), spread evenly over the steps a list of `most` (K) takes (K 9 at 4 a
  step: 3 steps of 3, not 4 4 1: a forward step computes all its m blocks)."""
  most = max(1, most)
  rows = spec.block_q * (spec.per_program if stacked else 1)
  steps = -(-most // min(most, step_blocks(spec.block_q, spec.block_kv, rows)))
  return -(-most // steps)


def _split(m: int, refs: tuple[Any, ...]) -> tuple[Any, ...]:
  """A forward / dq kernel's refs after q: (m k refs, m v refs, q_seg, m kv_seg refs, rest)."""
  return refs[:m], refs[m:2 * m], refs[2 * m], refs[2 * m + 1:3 * m + 1], refs[3 * m + 1:]


def _step_logits(spec: Spec, q: jax.Array, k_ref: Any, ks_ref: Any, qs: jax.Array, row: Any,
                 entry: Any, listed: Any, s: int, s_scr: Any) -> None:
  """Listed block s of a forward step: the stacked rows' logits [R, bk] into its columns of
  `s_scr` [R, m * bk], masked (-inf where unseen; every column where the list ends before s)."""
  cols = pl.ds(s * spec.block_kv, spec.block_kv)

  def fold(seen):  # seen [bq, bk] or None: every pair
    logits, _ = softmax.scores(q, k_ref[...], spec.scale, spec.soft_cap)  # [R, bk]
    if seen is not None:  # the same pairs for each of the program's heads
      logits = jnp.where(jnp.concatenate([seen] * spec.per_program, axis=0), logits, -jnp.inf)
    s_scr[:, cols] = logits

  @pl.when(listed)
  def _():
    masked(spec, entry, row, block_of(entry), qs, ks_ref[...], fold)

  @pl.when(jnp.logical_not(listed))
  def _():
    s_scr[:, cols] = jnp.full((q.shape[0], spec.block_kv), -jnp.inf, jnp.float32)


def _forward_kernel(spec: Spec, m: int, lists_ref, counts_ref, q_ref, *refs):
  """A step: the program's heads' rows stacked ([R = n * bq, D]) against its m listed blocks'
  keys side by side ([R, m * bk] logits in `s_scr`), one online-softmax update a step (one
  row max and sum over m * bk keys, one rescale of the accumulator)."""
  k_refs, v_refs, qs_ref, ks_refs, rest = _split(m, refs)
  sink_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, s_scr = rest
  b, p, i, j = (pl.program_id(n) for n in range(4))
  l = spec.program_heads(p)[1]  # the list head
  count = counts_ref[b, l, i]

  @pl.when(j == 0)
  def _():
    softmax.init_state(m_scr, l_scr, acc_scr)

  @pl.when(j * m < count)
  def _():
    q = q_ref[...].reshape(-1, q_ref.shape[-1])  # [R, D]
    qs = qs_ref[...]
    for s in range(m):  # the step's m listed blocks, in list order
      entry = _listed(lists_ref, counts_ref, b, l, i, j * m + s)
      _step_logits(spec, q, k_refs[s], ks_refs[s], qs, i, entry, j * m + s < count, s, s_scr)
    v = jnp.concatenate([v_ref[...] for v_ref in v_refs], axis=0)  # [m * bk, Dv]
    softmax.online_step(None, s_scr[...], v, m_scr, l_scr, acc_scr)

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    for g in range(spec.per_program):  # each head's sinks as one logit
      sink = sink_ref[0, p * spec.per_program + g]
      softmax.finish(g, sink, m_scr, l_scr, acc_scr, o_ref, lse_ref)


def probabilities(spec: Spec, q: jax.Array, k: jax.Array, lse: jax.Array,
                  seen: jax.Array | None) -> tuple[jax.Array, Any]:
  """p [bq, bk] from the saved lse (+inf for rows that see nothing: p 0) where `seen` [bq, bk]
  (None: every pair), and the cap's tanh."""
  s, t = softmax.scores(q, k, spec.scale, spec.soft_cap)
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)[:, :1]  # [bq, 1]
  p = jnp.exp(s - lse)  # [bq, bk]
  return (p if seen is None else jnp.where(seen, p, 0.0)), t


def d_logits(spec: Spec, p: jax.Array, t: Any, dp: jax.Array, delta: jax.Array) -> jax.Array:
  """d(scaled logits) [bq, bk] from p, dO.V^T and delta, through the soft cap."""
  ds = p * (dp - delta[:, :1])
  return ds if t is None else ds * (1.0 - t * t)


def _dq_kernel(spec: Spec, m: int, lists_ref, counts_ref, q_ref, *refs):
  k_refs, v_refs, qs_ref, ks_refs, (lse_ref, delta_ref, do_ref, dq_ref, dq_scr) = _split(m, refs)
  b, p, i, j = (pl.program_id(n) for n in range(4))
  l = spec.program_heads(p)[1]  # the list head

  @pl.when(j == 0)
  def _():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

  for s in range(m):  # the step's m listed blocks
    @pl.when(j * m + s < counts_ref[b, l, i])
    def _():
      k, v = k_refs[s][...], v_refs[s][...]

      def fold(seen):  # seen [bq, bk] or None: every pair
        for g in range(spec.per_program):
          prob, t = probabilities(spec, q_ref[g], k, lse_ref[g], seen)
          dp = softmax.dot(do_ref[g], v, (1, 1))  # [bq, bk]
          ds = d_logits(spec, prob, t, dp, delta_ref[g])  # [bq, bk]
          dq_scr[g] += softmax.dot(ds.astype(k.dtype), k, (1, 0))  # [bq, D]

      entry = _listed(lists_ref, counts_ref, b, l, i, j * m + s)
      masked(spec, entry, i, block_of(entry), qs_ref[...], ks_refs[s][...], fold)

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    dq_ref[...] = (dq_scr[...] * spec.scale).astype(dq_ref.dtype)


def _call(kernel: Any, grid: tuple[int, ...], in_specs: list[Any], out_specs: Any,
          out_shape: Any, scratch: list[Any], interpret: bool, *args: Any) -> Any:
  grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=grid, in_specs=in_specs,
                                           out_specs=out_specs, scratch_shapes=scratch)
  params = pltpu.CompilerParams(dimension_semantics=("parallel",) * 3 + ("arbitrary",))
  with base.kernel_precision(args[2].dtype):  # q's
    return pl.pallas_call(kernel, grid_spec=grid_spec, out_shape=out_shape,
                          compiler_params=params, interpret=interpret)(*args)


def sides(spec: Spec, d: int, dv: int, kv_map: Any, q_spec: Any, q_seg_map: Any,
           kv_seg_map: Any) -> list[Any]:
  """BlockSpecs of q (given), k, v and the two segment-id sides."""
  bq, bk = spec.block_q, spec.block_kv
  return [q_spec, pl.BlockSpec((None, None, bk, d), kv_map),
          pl.BlockSpec((None, None, bk, dv), kv_map), pl.BlockSpec((None, bq, LANES), q_seg_map),
          pl.BlockSpec((None, SUBLANES, bk), kv_seg_map)]


def programs(spec: Spec, a: jax.Array) -> jax.Array:
  """[B, H, Tp, X] -> [B, H / n, n, Tp, X]: the query heads of each forward / dq program."""
  return a.reshape(a.shape[0], -1, spec.per_program, *a.shape[2:])


def _list_sides(spec: Spec, m: int, d: int, dv: int, q_spec: Any) -> list[Any]:
  """BlockSpecs of a forward / dq step's q (given), its m listed blocks' k and v, q's segment
  ids and the m blocks' segment ids (block s: listed entry j * m + s; past the count, the last
  listed block again: no copy)."""
  bq, bk = spec.block_q, spec.block_kv
  listed = lambda s, b, p, i, j, lists, counts: block_of(_listed(
      lists, counts, b, spec.program_heads(p)[1], i, j * m + s))
  kv_map = lambda s: lambda b, p, i, j, *refs: (b, spec.program_heads(p)[0],
                                                listed(s, b, p, i, j, *refs), 0)
  kv_seg_map = lambda s: lambda b, p, i, j, *refs: (b, 0, listed(s, b, p, i, j, *refs))
  return ([q_spec] + [pl.BlockSpec((None, None, bk, d), kv_map(s)) for s in range(m)]
          + [pl.BlockSpec((None, None, bk, dv), kv_map(s)) for s in range(m)]
          + [pl.BlockSpec((None, bq, LANES), lambda b, p, i, j, *_: (b, i, 0))]
          + [pl.BlockSpec((None, SUBLANES, bk), kv_seg_map(s)) for s in range(m)])


def _q_map(b, p, i, j, *_):
  return b, p, 0, i, 0


def forward(spec: Spec, lists: jax.Array, counts: jax.Array, q: jax.Array, k: jax.Array,
            v: jax.Array, q_seg: jax.Array, kv_seg: jax.Array,
            sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """q [B, H, Tp, D], k [B, Hkv, Sp, D], v [B, Hkv, Sp, Dv], lists [B, L, nq, K] and counts
  [B, L, nq] int32, q_seg [B, Tp, 128], kv_seg [B, 8, Sp], sinks [8, H] f32 (one logit per
  head, -inf for none) -> out [B, H, Tp, Dv], lse [B, H, Tp, 128] f32 (lanes equal). The grid
  is (batch, program head, query tile, run of m listed blocks)."""
  (batch, heads, t_pad, d), dv = q.shape, v.shape[-1]
  bq, n, m = spec.block_q, spec.per_program, blocks_a_step(spec, lists.shape[-1], True)
  in_specs = _list_sides(spec, m, d, dv, pl.BlockSpec((None, None, n, bq, d), _q_map))
  in_specs.append(pl.BlockSpec((SUBLANES, heads), lambda *_: (0, 0), memory_space=pltpu.SMEM))
  out_specs = [pl.BlockSpec((None, None, n, bq, dv), _q_map),
               pl.BlockSpec((None, None, n, bq, LANES), _q_map)]
  out_shape = [jax.ShapeDtypeStruct((batch, heads // n, n, t_pad, dv), q.dtype),
               jax.ShapeDtypeStruct((batch, heads // n, n, t_pad, LANES), jnp.float32)]
  scratch = [pltpu.VMEM((n, bq, LANES), jnp.float32), pltpu.VMEM((n, bq, LANES), jnp.float32),
             pltpu.VMEM((n, bq, dv), jnp.float32),
             pltpu.VMEM((n * bq, m * spec.block_kv), jnp.float32)]
  grid = (batch, heads // n, t_pad // bq, -(-lists.shape[-1] // m))
  out, lse = _call(functools.partial(_forward_kernel, spec, m), grid, in_specs, out_specs,
                   out_shape, scratch, spec.interpret, lists, counts, programs(spec, q),
                   *[k] * m, *[v] * m, q_seg, *[kv_seg] * m, sinks)
  return out.reshape(batch, heads, t_pad, dv), lse.reshape(batch, heads, t_pad, LANES)


def dq(spec: Spec, lists: jax.Array, counts: jax.Array, q: jax.Array, k: jax.Array,
       v: jax.Array, q_seg: jax.Array, kv_seg: jax.Array, lse: jax.Array, delta: jax.Array,
       d_out: jax.Array) -> jax.Array:
  """dq [B, H, Tp, D] over the lists (lse, delta [B, H, Tp, 128] f32; d_out as out)."""
  (batch, heads, t_pad, d), dv = q.shape, v.shape[-1]
  bq, n, m = spec.block_q, spec.per_program, blocks_a_step(spec, lists.shape[-1], False)
  side = lambda width: pl.BlockSpec((None, None, n, bq, width), _q_map)
  in_specs = _list_sides(spec, m, d, dv, side(d)) + [side(LANES), side(LANES), side(dv)]
  grid = (batch, heads // n, t_pad // bq, -(-lists.shape[-1] // m))
  grads = _call(functools.partial(_dq_kernel, spec, m), grid, in_specs, side(d),
                jax.ShapeDtypeStruct((batch, heads // n, n, t_pad, d), q.dtype),
                [pltpu.VMEM((n, bq, d), jnp.float32)], spec.interpret, lists, counts,
                programs(spec, q), *[k] * m, *[v] * m, q_seg, *[kv_seg] * m,
                *(programs(spec, a) for a in (lse, delta, d_out)))
  return grads.reshape(q.shape)
