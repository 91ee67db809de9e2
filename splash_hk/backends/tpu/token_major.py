"""JAX's splash kernels with the operands each reads once in the call's [T, H * D] layout.

JAX's splash kernel takes q, k, v head-major ([H, T, D]), so a [B, T, H, D] call changes the
layout of q, k, v and the output around it, and of the cotangent and the three gradients
around the backward: on the lent v5e at B1 T16384 H16 D128 bf16 those eight transposes cost
about 1.9 ms a forward (a fifth of it; at B4 T4096, two fifths), which the peers handed the
same arrays pay too. Here the same kernel bodies (`flash_attention_kernel`,
`_flash_attention_dkv_kernel`: the online softmax, the masks, the fused dK/dV/dq) run under
block specs that cut head h's (block, D) tile straight out of [T, H * D] at column h * D for
the operands a kernel reads or writes once per tile: the forward's q and output (a query tile
stays while the key tiles stream past), the backward's k, v, dk and dv (a key tile stays while
the query tiles stream past). The streamed operands stay head-major (the forward's k and v,
the backward's q, cotangent and dq), transposed as before: a strided (block, D) tile is 256-byte
rows, and read once per grid step it measured a third slower than the whole kernel's
head-major reads (the token-major k and v of the first try, the TPU bench). So four of the
eight layout changes remain. Grids, MaskInfo (scalar prefetch) and the kernels' semantics are
JAX's; only where a tile lives changes.

Serves a fused backward with head dims that are multiples of the 128 lanes (a (block, D) tile
of a wider row must be lane-aligned); other calls run JAX's head-major kernel
(`backend._run`). Glossary: Tp, Sp padded query / key lengths; Hq, Hkv query / kv heads
(Hq = G * Hkv); D, Dv the key and value head dims.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

LANES, SUBLANES = splash.NUM_LANES, splash.NUM_SUBLANES
_MINOR = splash.QKVLayout.HEAD_DIM_MINOR


@dataclasses.dataclass(frozen=True)
class Shape:
  """What the token-major kernels are built for (hashable: a custom VJP's static argument)."""

  heads: int  # Hq
  kv_heads: int  # Hkv
  head_dim: int  # D
  head_dim_v: int  # Dv
  block_q: int
  block_kv: int
  block_kv_compute: int
  block_q_bwd: int
  block_kv_bwd: int
  block_kv_compute_bwd: int
  soft_cap: float | None
  mask_function: Callable[..., Any] | None
  interpret: bool

  @property
  def groups(self) -> int:
    return self.heads // self.kv_heads


def head_major(x: jax.Array, heads: int) -> jax.Array:
  """[T, H * D] -> [H, T, D]."""
  return jnp.swapaxes(x.reshape(x.shape[0], heads, -1), 0, 1)


def _kv_head(h, groups: int):
  """The kv head of query head `h` (`lax.div`: Python's // lowers a sign op Mosaic lacks here)."""
  return h if groups == 1 else jax.lax.div(h, groups)


def serves(head_dim: int, head_dim_v: int, fused_backward: bool) -> bool:
  """Whether the token-major kernels serve a call: lane-aligned head dims, a fused backward."""
  return fused_backward and head_dim % LANES == 0 and head_dim_v % LANES == 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(shape: Shape, infos: tuple[Any, Any], q: jax.Array, k: jax.Array, v: jax.Array,
              seg: splash.SegmentIds | None, sinks: jax.Array | None) -> jax.Array:
  """One example: q [Tp, Hq * D] (scaled), k [Sp, Hkv * D], v [Sp, Hkv * Dv], `infos` the
  (forward, dK/dV) MaskInfo, segment ids or None, sinks [Hq] or None -> out [Tp, Hq * Dv]."""
  return _forward(shape, infos[0], q, k, v, seg, sinks, residuals=False)[0]


def _attention_fwd(shape, infos, q, k, v, seg, sinks):
  out, lse = _forward(shape, infos[0], q, k, v, seg, sinks, residuals=True)
  return out, (infos, q, k, v, seg, sinks, out, lse)


def _attention_bwd(shape: Shape, residuals, do: jax.Array):
  infos, q, k, v, seg, sinks, out, lse = residuals
  tp = q.shape[0]
  per_head = lambda a: a.reshape(tp, shape.heads, -1).astype(jnp.float32)  # [Tp, Hq, Dv]
  di = jnp.einsum("thd,thd->ht", per_head(out), per_head(do))  # [Hq, Tp]
  dq, dk, dv = _dkv(shape, infos[1], q, k, v, seg, sinks, lse, do, di)
  dsinks = None
  if sinks is not None:  # d/ds of the normaliser: -exp(s - lse) * sum_d(o * do), per head
    dsinks = -jnp.sum(jnp.exp(sinks.astype(jnp.float32)[:, None] - lse) * di, axis=1)
  return None, dq, dk, dv, None, dsinks


attention.defvjp(_attention_fwd, _attention_bwd)


def _prefetch_map(fn: Callable[..., tuple[Any, ...]], *, next_i: bool = False):
  """An index map of (grid indices, prefetch refs) that hands `fn` the grid indices and the
  next nonzero block (`_next_nonzero`: the kv block in the forward, the q block in dK/dV)."""

  def index_map(a, b, c, data_next, block_mask, mask_next=None):
    head, row, col = (b, c, a) if next_i else (a, b, c)
    nxt, next_m, *_ = splash._next_nonzero(head, row, col, data_next, block_mask,  # pylint: disable=protected-access
                                           mask_next, next_i=next_i)
    return fn(a, b, c, nxt, next_m)

  return index_map


def _segment_inputs(seg, tp: int, sp: int, q_lanes: bool):
  """The segment ids broadcast to tiles, as JAX's kernels read them (forward: q in lanes)."""
  if seg is None:
    return None, None
  if q_lanes:
    return (jax.lax.broadcast_in_dim(seg.q, (tp, LANES), (0,)),
            jax.lax.broadcast_in_dim(seg.kv, (SUBLANES, sp), (1,)))
  return (jax.lax.broadcast_in_dim(seg.q, (SUBLANES, tp), (1,)),
          jax.lax.broadcast_in_dim(seg.kv, (sp, LANES), (0,)))


def _sinks_input(sinks, heads: int):
  """sinks [Hq] as JAX's kernels read them (SMEM, aligned to sublanes), and their spec."""
  if sinks is None:
    return None, None
  spec = pl.BlockSpec((SUBLANES, heads), lambda *_: (0, 0), memory_space=pltpu.SMEM)
  return jnp.broadcast_to(sinks.astype(jnp.float32)[None, :], (SUBLANES, heads)), spec


def _forward(shape: Shape, info, q, k, v, seg, sinks, *, residuals: bool):
  """The forward kernel: q and the output token-major, k and v head-major -> (out
  [Tp, Hq * Dv], lse [Hq, Tp] or None)."""
  s, (tp, sp) = shape, (q.shape[0], k.shape[0])
  bq, bkv = s.block_q, s.block_kv
  grid_width = info.data_next.shape[-1] if info.data_next is not None else sp // bkv
  kv_map = _prefetch_map(lambda h, i, j, nxt, m: (_kv_head(h, s.groups), nxt, 0))
  q_seg, kv_seg = _segment_inputs(seg, tp, sp, q_lanes=True)
  sinks_in, sinks_spec = _sinks_input(sinks, s.heads)
  q_sequence = (None if info.q_sequence is None
                else jax.lax.broadcast_in_dim(info.q_sequence, (tp, LANES), (0,)))
  row_map = lambda h, i, *_: (i, 0)
  in_specs = [
      pl.BlockSpec((bq, s.head_dim), lambda h, i, *_: (i, h)),  # q [Tp, Hq * D]
      pl.BlockSpec((None, bkv, s.head_dim), kv_map),  # k [Hkv, Sp, D]
      pl.BlockSpec((None, bkv, s.head_dim_v), kv_map),  # v [Hkv, Sp, Dv]
      None if seg is None else pl.BlockSpec((bq, LANES), row_map),
      None if seg is None else pl.BlockSpec(
          (SUBLANES, bkv), _prefetch_map(lambda h, i, j, nxt, m: (0, nxt))),
      sinks_spec,
      None if info.partial_mask_blocks is None else pl.BlockSpec(
          (None, bq, bkv), _prefetch_map(lambda h, i, j, nxt, m: (m, 0, 0))),
      None if q_sequence is None else pl.BlockSpec((bq, LANES), row_map),
  ]
  scratch = lambda width: (jax.ShapeDtypeStruct((bq, width), jnp.float32),
                           pl.BlockSpec((bq, width), lambda *_: (0, 0)))
  outs = [scratch(LANES), scratch(LANES), scratch(s.head_dim_v),
          (jax.ShapeDtypeStruct((tp, s.heads * s.head_dim_v), q.dtype),
           pl.BlockSpec((bq, s.head_dim_v), lambda h, i, *_: (i, h))),
          (jax.ShapeDtypeStruct((s.heads, tp, LANES), jnp.float32),
           pl.BlockSpec((None, bq, LANES), lambda h, i, *_: (h, i, 0))) if residuals
          else (None, None)]
  kernel = functools.partial(
      splash.flash_attention_kernel, mask_value=splash.DEFAULT_MASK_VALUE,
      grid_width=grid_width, bq=bq, bkv=bkv, bkv_compute=s.block_kv_compute,
      head_dim_v=s.head_dim_v, q_layout=_MINOR, k_layout=_MINOR, v_layout=_MINOR,
      attn_logits_soft_cap=s.soft_cap, mask_function=s.mask_function)
  *_, out, lse = pl.pallas_call(
      kernel, out_shape=[o[0] for o in outs], interpret=s.interpret,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, in_specs=in_specs, out_specs=[o[1] for o in outs],
          grid=(s.heads, tp // bq, grid_width)),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      name="splash_hk_token_major_fwd",
  )(info.data_next, info.block_mask, info.mask_next, q, head_major(k, s.kv_heads),
    head_major(v, s.kv_heads), q_seg, kv_seg, sinks_in, info.partial_mask_blocks, q_sequence)
  return out, (None if lse is None else lse[..., 0])


def _dkv(shape: Shape, info, q, k, v, seg, sinks, lse, do, di):
  """The fused backward: k, v, dk and dv token-major, q, do and dq head-major -> dq
  [Tp, Hq * D], dk, dv [Sp, Hkv * .]."""
  s, (tp, sp) = shape, (q.shape[0], k.shape[0])
  bq, bkv, bkvc = s.block_q_bwd, s.block_kv_bwd, s.block_kv_compute_bwd
  grid_width = info.data_next.shape[-2] if info.data_next is not None else tp // bq
  q_map = _prefetch_map(lambda kv, h, i, nxt, m: (h, nxt, 0), next_i=True)
  kv_map = lambda kv, h, *_: (kv, _kv_head(h, s.groups))
  per_row = lambda a: jnp.broadcast_to(a[:, None, :], (s.heads, SUBLANES, tp))  # [Hq, 8, Tp]
  row_spec = pl.BlockSpec((None, SUBLANES, bq),
                          _prefetch_map(lambda kv, h, i, nxt, m: (h, 0, nxt), next_i=True))
  q_seg, kv_seg = _segment_inputs(seg, tp, sp, q_lanes=False)
  sinks_in, sinks_spec = _sinks_input(sinks, s.heads)
  q_sequence = (None if info.q_sequence is None
                else jax.lax.broadcast_in_dim(info.q_sequence, (SUBLANES, tp), (1,)))
  q_row_spec = pl.BlockSpec((SUBLANES, bq),
                            _prefetch_map(lambda kv, h, i, nxt, m: (0, nxt), next_i=True))
  in_specs = [
      pl.BlockSpec((None, bq, s.head_dim), q_map),  # q [Hq, Tp, D]
      pl.BlockSpec((bkv, s.head_dim), kv_map),  # k [Sp, Hkv * D]
      pl.BlockSpec((bkv, s.head_dim_v), kv_map),  # v [Sp, Hkv * Dv]
      None if seg is None else q_row_spec,
      None if seg is None else pl.BlockSpec((bkv, LANES), lambda kv, *_: (kv, 0)),
      sinks_spec, row_spec,  # logsumexp [Hq, 8, Tp]
      pl.BlockSpec((None, bq, s.head_dim_v), q_map),  # do [Hq, Tp, Dv]
      row_spec,  # di [Hq, 8, Tp]
      None if info.partial_mask_blocks is None else pl.BlockSpec(
          (None, bkv, bq), _prefetch_map(lambda kv, h, i, nxt, m: (m, 0, 0), next_i=True)),
      None if q_sequence is None else q_row_spec,
  ]
  outs = _dkv_outputs(s, q, k, v)
  kernel = functools.partial(
      splash._flash_attention_dkv_kernel, mask_value=splash.DEFAULT_MASK_VALUE,  # pylint: disable=protected-access
      num_q_heads=s.heads, num_kv_heads=s.kv_heads, is_mqa=False, grid_width=grid_width,
      bq=bq, bkv_compute=bkvc, attn_logits_soft_cap=s.soft_cap, q_layout=_MINOR,
      k_layout=_MINOR, v_layout=_MINOR, bkv=bkv, mask_function=s.mask_function)
  *_, dq_parts, dk, dv = pl.pallas_call(
      kernel, out_shape=[o[0] for o in outs], interpret=s.interpret,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, in_specs=in_specs, out_specs=[o[1] for o in outs],
          grid=(sp // bkv, s.heads, grid_width)),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("arbitrary", "arbitrary", "arbitrary")),
      name="splash_hk_token_major_dkv",
  )(info.data_next, info.block_mask, info.mask_next, head_major(q, s.heads), k, v, q_seg,
    kv_seg, sinks_in, per_row(lse), head_major(do, s.heads), per_row(di),
    info.partial_mask_blocks, q_sequence)
  dq = jnp.sum(dq_parts, axis=0, dtype=jnp.float32).astype(q.dtype)  # [Hq, Tp, D]
  return jnp.swapaxes(dq, 0, 1).reshape(tp, -1), dk, dv  # [Tp, Hq * D]


def _dkv_outputs(s: Shape, q, k, v) -> list[tuple[Any, Any]]:
  """The dK/dV kernel's outputs and their specs: the dq accumulator (where a key tile is
  computed in runs), dk and dv accumulators, dq per key tile [Sp / bkv, Hq, Tp, D], dk, dv."""
  bq, bkv, bkvc = s.block_q_bwd, s.block_kv_bwd, s.block_kv_compute_bwd
  fixed = lambda rows, width: (jax.ShapeDtypeStruct((rows, width), jnp.float32),
                               pl.BlockSpec((rows, width), lambda *_: (0, 0)))
  kv_map = lambda kv, h, *_: (kv, _kv_head(h, s.groups))
  return [
      (None, None) if bkv == bkvc else fixed(bq, s.head_dim),
      fixed(bkv, s.head_dim), fixed(bkv, s.head_dim_v),
      (jax.ShapeDtypeStruct((k.shape[0] // bkv, s.heads, q.shape[0], s.head_dim), q.dtype),
       pl.BlockSpec((None, None, bq, s.head_dim), lambda kv, h, i, *_: (kv, h, i, 0))),
      (jax.ShapeDtypeStruct.like(k), pl.BlockSpec((bkv, s.head_dim), kv_map)),
      (jax.ShapeDtypeStruct.like(v), pl.BlockSpec((bkv, s.head_dim_v), kv_map)),
  ]
