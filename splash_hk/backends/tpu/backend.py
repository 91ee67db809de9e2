"""The splash backend: JAX's Pallas TPU splash kernel (CPU with `interpret=True`), adapted.

Splash masks are static: they see row/column indices, not traced positions, so
this path serves the default (end-aligned) positions only; the selector sends
calls with explicit positions or a dense mask elsewhere. A sharded query sequence gets
one static mask per slice. Sequences that do not fill whole blocks are padded, the
padding masked with segment ids, and sliced off. Kernels (and their MaskInfo) are built
once per static shape and config, except for `Causal() | Bidirectional(ids)`, whose
traced ids give each call its own plan (`splash_horizon`).
"""

from __future__ import annotations

import dataclasses
import functools

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from splash_hk.masks import _objects
from splash_hk.masks import _rules
from splash_hk.backends import base
from splash_hk.backends import guard
from splash_hk.backends.tpu import decode as splash_decode
from splash_hk.backends.tpu import documents as splash_documents
from splash_hk.backends.tpu import forward as fast_forward
from splash_hk.backends.tpu import fresh
from splash_hk.backends.tpu import horizon as splash_horizon
from splash_hk.backends.tpu import lists as splash_lists
from splash_hk.backends.tpu import paged as splash_paged
from splash_hk.backends.tpu import plan as splash_plan
from splash_hk.backends.tpu import tiles as tiles_lib
from splash_hk.backends.xla import backend as xla
from splash_hk.backends.xla import lists as xla_lists
from splash_hk.config import AttentionConfig
from splash_hk.types import Facts, KernelInputs, KernelOutput

LANE = tiles_lib.LANE  # splash blocks are multiples of this
# A sink this low adds exp(-1e30 - m) == 0 to every real row, but gives a row
# with no visible key a finite max, so the kernel returns 0 there (not mean(v)).
_SILENT_SINK = -1e30


def why_not(facts: Facts, hardware: str) -> str | None:
  """Why JAX's Pallas splash kernel cannot serve this call, or None."""
  config, query_len, kv_len = facts.config, facts.query_len, facts.kv_len
  shards = facts.query_slices
  refusal = base.plain_kernel_refusal(facts)
  if refusal is not None:
    return refusal
  if hardware != "tpu" and not config.interpret:
    return (f"the Pallas splash kernel needs a TPU (this is {hardware}); set "
            "AttentionConfig(interpret=True) to run it in interpret mode")
  if xla_lists.chooses(facts):  # chosen blocks: the library's own block-list kernel
    return splash_lists.why_not(facts)
  if splash_decode.serves_rows(facts):  # a few rows over a cache: the decode kernel
    return splash_decode.why_not(facts)
  if facts.bias is not None:
    return "a `bias` was given, and JAX's splash kernel takes no bias"
  if shards > 1 and query_len // shards < LANE:
    return (f"query_len {query_len} in {shards} sequence shards: a shard shorter "
            f"than one {LANE}-row splash block is cheaper unpadded")
  if min(query_len, kv_len) < LANE:
    return (f"query_len {query_len} / kv_len {kv_len}: a sequence shorter than one "
            f"{LANE}-row splash block is cheaper unpadded")
  if splash_horizon.serves(facts.rule):
    if facts.load_balanced or shards > 1 or query_len > kv_len:
      return ("Causal | Bidirectional runs on splash over the whole sequence in its own order, "
              "with query_len <= kv_len, only (each query must see a prefix of the keys); "
              "this call's query is sharded, load-balanced or longer than the keys")
  else:
    refusal = base.rule_refusal(facts, "the splash kernel's static mask",
                                lambda mask: mask.is_static(), BUILDS)
    if refusal is not None:
      return refusal
  if not facts.default_positions:
    return ("explicit q_positions/kv_positions were given and splash masks are static "
            "(built from indices at trace time)")
  return tiles_lib.refusal(config.block_sizes)


# What splash's static masks are made of, in words (the objects say themselves: `is_static`).
BUILDS = ("rules of positions alone, known at trace time: Causal, SlidingWindow, Chunked and "
          "MaskFn without traced values, combined with & and |; of objects with arrays, "
          "Causal() | Bidirectional(ids); a Dense mask, being traced, cannot be proven a "
          "segment mask")


class PositionMask(splash_mask._ComputableMask):  # pylint: disable=protected-access
  """A position rule (a mask object without arrays) on padded row/column indices,
  queries shifted by `offset`.

  With `balanced=(length, shards)` indices are places in the load-balanced
  order and map to the tokens' original positions (`_rules.load_balanced_position`).
  """

  def __init__(self, shape: tuple[int, int], offset: int, rule: _objects.Mask,
               balanced: tuple[int, int] | None = None):
    self.params = (shape, offset, rule, balanced)
    super().__init__(shape, lambda q_ids, kv_ids: rule.visible(*places(q_ids, kv_ids, offset,
                                                                       balanced)))

  def __eq__(self, other):
    return isinstance(other, PositionMask) and self.params == other.params

  def __hash__(self):
    return hash(self.params)


def places(q_ids, kv_ids, offset: int, balanced: tuple[int, int] | None):
  """The positions of padded query / key indices (queries shifted by `offset`): the indices
  themselves, or with `balanced=(length, shards)` the tokens' original positions."""
  if balanced is None:
    return q_ids + offset, kv_ids
  return (_rules.load_balanced_position(q_ids + offset, *balanced),
          _rules.load_balanced_position(kv_ids, *balanced))


def call_tiles(x: KernelInputs, facts: Facts) -> tiles_lib.Tiles:
  """This call's tiles: `facts`' own, for the dtype its kernel runs in."""
  return tiles_lib.for_call(facts, str(x.query.dtype))


@functools.lru_cache(maxsize=64)
def build_kernel(*, padded: tuple[int, int], offset: int, is_mqa: bool,
                 config: AttentionConfig, rule: _objects.Mask | None,
                 tiles: tiles_lib.Tiles, balanced: tuple[int, int] | None = None):
  """The splash kernel for one static shape and config (cached: built once).

  Its MaskInfo comes from the rule's per-block answers (`splash_plan`), in O(blocks),
  not from JAX's per-block Python loop; partial blocks compute `PositionMask`.
  """
  bq, bkv, bq_bwd, bkv_bwd = tiles.blocks
  fused = tiles.fused_backward
  q_pos, kv_pos = places(np.arange(padded[0]), np.arange(padded[1]), offset, balanced)
  computed = rule is not None

  @functools.cache
  def values(block_shape):
    return splash_plan.block_mask(rule, q_pos, kv_pos, block_shape)

  @functools.cache
  def info(block_shape, is_dkv, shrink=True):
    plan = splash_plan.mask_info(values(block_shape), padded[0], is_dkv=is_dkv, shrink=shrink,
                                 computed=computed)
    with jax.ensure_compile_time_eval():  # constants, not tracers of the caller
      return jax.tree.map(jnp.array, plan)

  return _kernel(info((bq, bkv), False), None if fused else info((bq_bwd, bkv_bwd), False),
                 info((bq_bwd, bkv_bwd), True, shrink=not fused), config, tiles, is_mqa,
                 None if rule is None else PositionMask(padded, offset, rule, balanced).mask_function)


def _kernel(fwd, dq, dkv, config: AttentionConfig, tiles: tiles_lib.Tiles,
            is_mqa: bool, mask_function) -> splash.SplashAttentionKernel:
  """JAX's splash kernel over the given (forward, dq, dK/dV) MaskInfo, at `tiles`."""
  t, fused = tiles, tiles.fused_backward
  block_sizes = splash.BlockSizes(
      block_q=t.block_q, block_kv=t.block_kv, block_kv_compute=t.block_kv_compute,
      block_q_dkv=t.block_q_bwd, block_kv_dkv=t.block_kv_bwd,
      block_kv_dkv_compute=t.block_kv_compute_bwd, block_q_dq=None if fused else t.block_q_bwd,
      block_kv_dq=None if fused else t.block_kv_bwd, use_fused_bwd_kernel=fused)
  return splash.SplashAttentionKernel(
      fwd, dq, dkv, block_sizes=block_sizes, is_mqa=is_mqa, save_residuals=False,
      mask_value=splash.DEFAULT_MASK_VALUE, attn_logits_soft_cap=config.logits_soft_cap,
      residual_checkpoint_name=None, interpret=config.interpret, mask_function=mask_function)


def attend(x: KernelInputs, facts: Facts) -> KernelOutput:
  """Splash attention on one shard, unguarded (`BACKEND` guards it): KernelInputs (default
  positions) -> out [B, T, Hq, Dv]; chosen blocks (`masks.Blocks`) on the block-list kernel
  (`splash_lists`), the rest on the dense kernel (`attend_head_major`)."""
  if xla_lists.chooses(facts):
    return splash_lists.attend(x, facts)
  if splash_decode.serves_rows(facts):
    return splash_decode.attend(x, facts)
  out = attend_head_major(guard.head_major(x, facts), facts).out  # [B, Hq, T, Dv]
  return KernelOutput(base.to_bhtd(out))


def attend_head_major(x: KernelInputs, facts: Facts) -> KernelOutput:
  """The dense kernel on `guard.head_major` inputs (q scaled; q, k, v [B, H, T, D]) -> out
  [B, Hq, T, Dv].

  With `facts.query_slices` n > 1, `x` holds one of n equal query slices
  (T = T_global / n) and its positions are the defaults over the whole query.
  The mask of slice i is the static mask shifted by i * T (in load-balanced
  order: of the places i * T onwards), so one kernel per slice is built (once
  per shape) and `lax.switch` runs the slice's own, chosen by its first query
  position.
  """
  if splash_horizon.serves(facts.rule):  # exact for most ids; where not, the xla path runs
    h, exact = splash_horizon.horizon(x.rule, x.query.shape[2], x.key.shape[2])  # [B, T]
    return jax.lax.cond(exact, lambda y: _attend_to_horizon(y, facts, h),
                        lambda y: KernelOutput(_EXACT(y, facts).out), x)
  n = facts.query_slices
  query_len, kv_len = x.query.shape[2], x.key.shape[2]
  balanced = (kv_len, facts.sequence_shards) if facts.load_balanced else None
  if n == 1:  # the whole query (balanced: all places, so offset 0)
    offset = 0 if balanced else kv_len - query_len
    return KernelOutput(_run_at_offset(x, facts, offset, balanced))
  if balanced:  # slice i starts with chunk i: its first original position is i * T_global / 2n
    first, index = 0, x.q_positions[0, 0] // (kv_len // (2 * n))
  else:
    first = kv_len - n * query_len  # position of the global query's row 0
    index = (x.q_positions[0, 0] - first) // query_len
  branches = [functools.partial(_run_at_offset, facts=facts, offset=first + i * query_len,
                                balanced=balanced) for i in range(n)]
  return KernelOutput(jax.lax.switch(jnp.clip(index, 0, n - 1), branches, x))


_EXACT = guard.exact_head_major(xla.attend)  # the xla path on head-major inputs


def _attend_to_horizon(x: KernelInputs, facts: Facts, h: jax.Array) -> KernelOutput:
  """Splash with each example's own plan: query i sees keys [0, h[i]] (`splash_horizon`)."""
  (batch, _, query_len, _), kv_len = x.query.shape, x.key.shape[2]  # [B, H, T, D]
  tiles, t_pad, s_pad = tiles_lib.padded_layout(query_len, kv_len, call_tiles(x, facts))
  padding = kv_len + jnp.arange(t_pad - query_len, dtype=jnp.int32)  # padded rows: own place
  h = jnp.concatenate([h, jnp.broadcast_to(padding, (batch, t_pad - query_len))], 1)  # [B, Tp]
  fwd, dq, dkv = splash_horizon.mask_infos(h, (t_pad, s_pad), tiles.blocks,
                                           tiles.fused_backward)
  kernel = _kernel(fwd, dq, dkv, facts.config, tiles, x.query.shape[1] > x.key.shape[1],
                   splash_horizon.within_horizon)
  return KernelOutput(_run(x, facts, kernel, per_example=True))


def _run_at_offset(x: KernelInputs, facts: Facts, offset: int,
                   balanced: tuple[int, int] | None = None) -> jax.Array:
  """Splash with the static mask of queries at places offset + arange(T) (see PositionMask)."""
  tiles, t_pad, s_pad = tiles_lib.padded_layout(x.query.shape[2], x.key.shape[2], call_tiles(x, facts))
  is_mqa = x.query.shape[1] > x.key.shape[1]
  kernel = build_kernel(padded=(t_pad, s_pad), offset=offset, is_mqa=is_mqa,
                        config=facts.config, rule=facts.rule, tiles=tiles, balanced=balanced)
  if facts.segments:  # documents: each example skips the block pairs its ids keep apart
    seg = splash_documents.padded_segment_ids(x, t_pad, s_pad)
    assert seg is not None, "a call with segment ids"
    return _run(x, facts, splash_documents.apart(kernel, seg, tiles), per_example=True)
  forward = None
  if fast_forward.serves(facts.rule):
    mask = (None if facts.rule is None
            else PositionMask((t_pad, s_pad), offset, facts.rule, balanced))
    forward = fast_forward.kernel(padded=(t_pad, s_pad), is_mqa=is_mqa, config=facts.config,
                                  tiles=tiles, mask=mask)
  return _run(x, facts, kernel, per_example=False, forward=forward)


@jax.custom_vjp
def _float32_cotangent(sinks: jax.Array) -> jax.Array:
  """`sinks` (float32) unchanged; its cotangent cast to float32. JAX's splash kernel returns the
  sinks' cotangent in the query's dtype, and a bfloat16 cotangent of float32 sinks fails to
  transpose (`lax.div` of bfloat16 by float32)."""
  return sinks


_float32_cotangent.defvjp(lambda sinks: (sinks, None),
                          lambda _, ct: (jnp.asarray(ct, jnp.float32),))


def _run(x: KernelInputs, facts: Facts, kernel, per_example: bool,
         forward: Any = None) -> jax.Array:
  """A splash kernel (one for the batch, or one per example: leaves [B, ...]) on x [B, H, T, D];
  `forward`: a faster forward-only kernel (`fast_forward`) for the call's primal, JAX's kernel
  then serving the differentiated call (forward and backward)."""
  batch, num_heads, query_len, head_dim = x.query.shape
  num_kv_heads, kv_len = x.key.shape[1], x.key.shape[2]
  _, t_pad, s_pad = tiles_lib.padded_layout(query_len, kv_len, call_tiles(x, facts))
  q = base.pad_axis(x.query, 2, t_pad)  # [B, Hq, Tp, D], scaled
  k = base.pad_axis(x.key, 2, s_pad)  # [B, Hkv, Sp, D]
  v = base.pad_axis(x.value, 2, s_pad)  # [B, Hkv, Sp, Dv]
  seg = splash_documents.padded_segment_ids(x, t_pad, s_pad)
  sinks = None  # [Hq]: the call's, or a silent one where a real row may see no key
  if x.sinks is not None:
    sinks = _float32_cotangent(base.sink_logsumexp(x.sinks))
  elif not every_row_sees_a_key(facts, per_example):
    sinks = jnp.full((num_heads,), _SILENT_SINK, jnp.float32)
  run: Callable[..., jax.Array] = functools.partial(_apply, kernel, num_kv_heads, per_example)
  if forward is not None:
    run = fast_forward.apart(functools.partial(_apply, forward, num_kv_heads, False), run)
  out = run(q, k, v, sinks, seg)  # [B, Hq, Tp, Dv]
  return out[:, :, :query_len].astype(x.query.dtype)  # [B, Hq, T, Dv]


def _apply(kernel, num_kv_heads: int, per_example: bool, q, k, v, sinks, seg) -> jax.Array:
  """`kernel` over q [B, Hq, Tp, D], k, v [B, Hkv, Sp, .], sinks [Hq] or None and segment ids
  (q [B, Tp], kv [B, Sp]) or None: vmapped over the batch and, for GQA, the kv heads."""
  batch, num_heads, t_pad, head_dim = q.shape
  groups = num_heads // num_kv_heads
  if seg is not None:  # JAX's or tokamax's SegmentIds, by the kernel's own module
    seg = (splash.SegmentIds if isinstance(kernel, splash.SplashAttentionKernel)
           else fast_forward.segment_ids)(*seg)
  seg_axes = None if seg is None else type(seg)(0, 0)  # vmap's in_axes
  if groups == 1:
    one = lambda kernel, q, k, v, seg: kernel(q, k, v, segment_ids=seg, sinks=sinks)
  else:
    q = q.reshape(batch, num_kv_heads, groups, t_pad, head_dim)  # [B, Hkv, G, Tp, D]
    per_kv_head = jax.vmap(lambda kern, q, k, v, s, seg: kern(q, k, v, segment_ids=seg, sinks=s),
                           in_axes=(None, 0, 0, 0, None if sinks is None else 0, None))
    grouped_sinks = None if sinks is None else sinks.reshape(num_kv_heads, groups)  # [Hkv, G]
    one = lambda kernel, q, k, v, seg: per_kv_head(kernel, q, k, v, grouped_sinks, seg)
  with base.kernel_precision(q.dtype):
    run = jax.vmap(one, in_axes=(0 if per_example else None, 0, 0, 0, seg_axes))
    out = run(kernel, q, k, v, seg)
  return out.reshape(batch, num_heads, t_pad, -1)  # [B, Hq, Tp, Dv]


def every_row_sees_a_key(facts: Facts, per_example: bool) -> bool:
  """Whether every real query row sees at least one key, so the kernel needs no silent sink to
  output 0 for a row that sees none (it gives such a row mean(v)): no segment ids, and a rule
  of the config's kind (causal, window, chunk or none) over the default positions, each of which
  shows a row its own position (end-aligned, a key there)."""
  if facts.segments or per_example or not facts.default_positions or facts.query_slices > 1:
    return False
  return facts.query_len <= facts.kv_len and (
      facts.rule is None or _objects.as_rules(facts.rule) is not None)


def describe(facts: Facts) -> str | None:
  """The dense kernel's tiles for a call and their source (chosen blocks: the list kernel's)."""
  if xla_lists.chooses(facts):
    return None
  if splash_decode.serves_rows(facts):
    return splash_decode.describe(facts)
  documents = ("; segment ids: each example runs only the block pairs its documents share"
               if facts.segments and not splash_horizon.serves(facts.rule) else "")
  return "JAX's splash kernel at " + tiles_lib.for_call(facts).words() + documents


_GUARDED_DENSE = guard.guard_head_major(attend_head_major, xla.attend)
_GUARDED_LISTS = guard.guard_garbage(splash_lists.attend, xla.attend,  # values checked first
                                     check_first=guard.values_finite)


def guarded_attend(x: KernelInputs, facts: Facts) -> KernelOutput:
  """`attend` kept from spreading garbage (`guard`): the dense kernel on the arrays it reads;
  a few rows over a cache on the decode kernel (which guards its own values)."""
  if splash_decode.serves_rows(facts) and not xla_lists.chooses(facts):
    return splash_decode.attend(x, facts)
  return (_GUARDED_LISTS if xla_lists.chooses(facts) else _GUARDED_DENSE)(x, facts)


_PAGED = functools.partial(splash_paged.attend, dense=fresh.Dense(why_not, guarded_attend))
BACKEND = base.Backend(name="splash", why_not=why_not, describe=describe, attend=guarded_attend,
                       hardware=("tpu",), rank=0, paged_why_not=splash_paged.why_not,
                       paged_attend=_PAGED)  # prompts with nothing cached: the dense kernel
