"""Block-sparse attention in pure JAX: the portable ("xla") backend, on any hardware.

For each (row group, query block) an inner loop runs over the key blocks some
query of the block may see (the block plan, `xla_plan.block_plan`, decided at
run time from positions, segments and padding), with an online (flash) softmax.
A `jax.custom_vjp` backward recomputes the probabilities from the saved
log-sum-exp, over the same kind of plan, so memory stays linear in T and
neither loop is differentiated.

Blocks whose every (query, key) pair is visible run unmasked. Other blocks apply the element
mask and keep invisible garbage out: values, keys and queries are used with non-finite entries
zeroed where they multiply a probability (0 * NaN would spread it); a NaN in a visible query or
key still reaches its rows through the logits, and a visible non-finite value is put back as NaN
in its column of the rows that see it. GQA groups query heads over their kv head; keys and
values are never repeated.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from splash_hk import quant
from splash_hk.backends import base
from splash_hk.backends.xla import bias as xla_bias
from splash_hk.backends.xla import garbage
from splash_hk.backends.xla import gather as xla_gather
from splash_hk.backends.xla import lists as xla_lists
from splash_hk.backends.xla import paged as xla_paged
from splash_hk.backends.xla import plan as xla_plan
from splash_hk.backends.xla.blocks import Pair, Views
from splash_hk.masks import _plan
from splash_hk.tiles import Tiles, tiles_for
from splash_hk.types import Facts, KernelInputs, KernelOutput

def why_not(facts: Facts, hardware: str) -> str | None:
  """The xla path serves every call except one that asks for the weights."""
  del hardware
  return base.WEIGHTS_REFUSAL if facts.return_weights else None


def with_xla_gradients(run: Callable[[KernelInputs], tuple[jax.Array, ...]], facts: Facts,
                       fields: int) -> Callable[[KernelInputs], tuple[jax.Array, ...]]:
  """A kernel with no backward (`run`: inputs -> the first `fields` fields of its
  `KernelOutput`) whose calls, when differentiated, run this backend's forward and backward
  instead (the kernel does not run then)."""

  @jax.custom_vjp
  def call(x):
    return run(x)

  def forward(x):
    return jax.vjp(lambda y: tuple(attend(y, facts)[:fields]), x)

  call.defvjp(forward, lambda pullback, cotangents: pullback(cotangents))
  return call


def attend(x: KernelInputs, facts: Facts) -> KernelOutput:
  """Block-sparse attention on one shard: out [B, T, Hq, Dv] and a differentiable lse [B, T, Hq].

  Key blocks chosen by data run on gathered tiles (`xla_gather`) where those serve the call."""
  if xla_lists.chooses(facts) and xla_lists.why_not(facts) is None:
    return xla_gather.attend(x, facts)
  tiles = tiles_for(facts)
  # A dense bias's gradient is a [T, S] accumulator: JAX says (symbolic zeros) whether anything
  # differentiates the bias, and the backward skips it when nothing does.
  dense_bias = x.bias is not None and "qk" in x.bias.array_sides()
  wanted = {"bias": True}

  @jax.custom_vjp
  def run(y):
    return forward(y, facts, tiles)

  def run_fwd(y):
    if dense_bias:
      wanted["bias"] = base.perturbed(y.bias)
      y = base.primal_values(y)
    partial = forward(y, facts, tiles)
    return partial, (y, *partial)

  def run_bwd(residuals, cotangents):
    y, out, lse = residuals
    d_out, d_lse = (base.instantiate(c) for c in cotangents)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    grads = backward(y, facts, tiles, lse, d_out, delta, bias_grads=wanted["bias"])
    none = jax.tree.map(lambda _: None, y)  # integer and boolean inputs get no cotangent
    return (none._replace(query=grads.dq, key=quant.cotangent(y.key, grads.dk),
                          value=quant.cotangent(y.value, grads.dv), sinks=grads.d_sinks,
                          bias=grads.d_bias),)

  run.defvjp(run_fwd, run_bwd, symbolic_zeros=dense_bias)
  return KernelOutput(*run(x))


def _merge_heads(a: jax.Array) -> jax.Array:
  """[r, Hkv, Gq, bq, X] -> [r, Hkv, Gq * bq, X]: a kv head's query rows as one axis.

  Dots over them: with Gq as an axis of its own XLA:CPU copied the other operand
  transposed per block pair.
  """
  return a.reshape(*a.shape[:2], -1, a.shape[-1])


def _dot_merged(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [r, Hkv, Gq, bq, X] . b [r, Hkv, Y, X] over X: f32 [r, Hkv, Gq, bq, Y]."""
  out = jnp.einsum("bkqx,bkyx->bkqy", _merge_heads(a), b, preferred_element_type=jnp.float32)
  return out.reshape(*a.shape[:-1], b.shape[-2])


def _logits(q: jax.Array, k: jax.Array, cap: float | None, bias: jax.Array | None = None,
            k_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
  """f32 logits [r, Hkv, Gq, bq, bk] from pre-scaled q (times quantized keys' per-token
  `k_scale`, plus `bias`), and tanh(s / cap) (None without cap); a -inf bias keeps its pair at
  -inf (`base.soft_cap`)."""
  s = _dot_merged(q, k)
  if k_scale is not None:
    s = s * k_scale
  if bias is not None:
    s = s + bias
  if cap is None:
    return s, None
  capped = cap * (t := jnp.tanh(s / cap))  # [r, Hkv, Gq, bq, bk]
  return (capped if bias is None else jnp.where(bias == -jnp.inf, -jnp.inf, capped)), t


def _integer(views: Views, pair: Pair) -> bool:
  """The pair's values are integers (finite) with their scales apart: nothing to clean in them."""
  return views.integer_values and pair.v_scale is not None


def _block_scores(views: Views, q, pair: Pair, masked: bool):
  """(logits, tanh or None, v, mask or None) of a block pair.

  A masked block gets invisible logits at -inf (k only enters the logits, which the mask
  replaces); its values are cleaned only where p @ v shows they must be (`garbage.visible_garbage`).
  """
  mask = views.element_mask(pair.mask) if masked and pair.bias is not None else None
  s, t = _logits(q, pair.k, views.facts.config.logits_soft_cap, xla_bias.block(views, pair, mask),
                 pair.k_scale)
  if not masked:
    return s, t, pair.v, None
  mask = views.element_mask(pair.mask) if mask is None else mask
  return jnp.where(mask, s, -jnp.inf), t, pair.v, mask


def _update(views: Views, q, pair: Pair, masked: bool, state):
  """One online-softmax step of a query block over a key block."""
  m, l, acc = state
  s, _, v, mask = _block_scores(views, q, pair, masked)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  probs = jnp.exp(s - m_safe[..., None])
  correction = jnp.exp(m - m_safe)
  kept = probs if pair.drop is None else probs * pair.drop  # dropout: on the normalised p
  v_scale = pair.v_scale
  if v_scale is not None:  # quantized values' per-token scales: a column of p
    kept = kept * (base.finite(v_scale) if masked else v_scale)
  p_v = kept.astype(v.dtype)
  pv = jnp.einsum("bkgqs,bksd->bkgqd", p_v, v, preferred_element_type=jnp.float32)
  if masked:
    pv = garbage.visible_garbage(p_v, pv, mask, None if _integer(views, pair) else v, v_scale,
                                 not views.heads_major)
  return m_new, l * correction + jnp.sum(probs, axis=-1), acc * correction[..., None] + pv


def _finalize(m, l, acc, sinks):
  """Normalised block output and its lse (`base.Backend`'s convention: -inf for no mass)."""
  m_all, l_all = m, l
  if sinks is not None:  # [Hkv, Gq, 1, n]
    m_all = jnp.maximum(m, jnp.max(sinks, axis=-1))
    l_all = l * jnp.exp(m - m_all) + jnp.sum(jnp.exp(sinks - m_all[..., None]), axis=-1)
  has_key, has_mass = l != 0, l_all != 0
  scale = jnp.exp(m - m_all) / jnp.where(has_key, l_all, 1.0)
  out = jnp.where(has_key[..., None], acc * scale[..., None], 0.0)
  return out, jnp.where(has_mass, m_all + jnp.log(jnp.where(has_mass, l_all, 1.0)), -jnp.inf)


def forward(x: KernelInputs, facts: Facts, tiles: Tiles, out_dtype=None,
            kv_in_place: bool = False) -> base.Partial:
  """out [B, T, Hq, Dv] (query dtype or `out_dtype`) and lse [B, T, Hq] f32 (`base`'s convention)."""
  grid = xla_plan.Grid.of(x, tiles[0], tiles[1])
  views = Views(x, facts, grid, kv_in_place, columns=True)
  plan = xla_plan.block_plan(x, grid)
  batch, padded_q, num_heads, _ = views.q.shape
  nq = grid.num_q_blocks
  row_shape = (grid.rows_per_group, views.num_kv_heads, views.heads_per_kv, grid.block_q)
  sinks = None if x.sinks is None else x.sinks.reshape(*row_shape[1:3], 1, -1)  # [Hkv, Gq, 1, n]
  scale = jnp.asarray(facts.scale, x.query.dtype)

  def q_step(step, carry):
    out, lse = carry
    group, i = step // nq, step % nq
    q = views.head_rows(views.q, group, i) * scale  # [r, Hkv, Gq, bq, D]
    update = lambda masked, j, pair, state: _update(views, q, pair, masked, state)
    init = (jnp.full(row_shape, -jnp.inf), jnp.zeros(row_shape),
            jnp.zeros((*row_shape, x.value.shape[-1])))
    o, lse_i = _finalize(*_over_live_blocks(views, plan, group, i, update, init), sinks)
    return views.write_rows(out, o, group, i), views.write_rows(lse, lse_i, group, i)

  init = (jnp.zeros((batch, padded_q, num_heads, x.value.shape[-1]), out_dtype or x.query.dtype),
          jnp.zeros((batch, padded_q, num_heads), jnp.float32))
  out, lse = jax.lax.fori_loop(0, grid.num_groups * nq, q_step, init)
  return base.Partial(out[:, :grid.query_len], lse[:, :grid.query_len])  # [B, T, Hq, Dv], [B, T, Hq]


def _over_live_blocks(views: Views, plan: xla_plan.BlockPlan, group, i, step_fn, state):
  """`state = step_fn(masked, j, pair, state)` over the live key blocks j of query block i.

  Full blocks (listed first) run unmasked in one loop, the rest masked in a second: no per-block
  branch (a `lax.cond` a pair cost XLA:CPU as much as its mask). One key block runs with no loop
  (masked): a loop's values got a layout of their own on a TPU (a copy of a decode's cache).
  """
  def body(masked: bool):
    def step(t, state):
      j = plan.kv_order[group, i, t]
      return step_fn(masked, j, views.pair(group, i, j), state)
    return step

  full, live = plan.full_count[group, i], plan.live_count[group, i]
  if views.grid.num_kv_blocks == 1:  # masked: right for a full block too
    new = step_fn(True, 0, views.pair(group, i, 0), state)
    return jax.tree.map(lambda a, b: jnp.where(live > 0, a, b), new, state)
  return jax.lax.fori_loop(full, live, body(True), jax.lax.fori_loop(0, full, body(False), state))


def _t(a: jax.Array) -> jax.Array:
  """Swaps the last two axes. dK and dV are computed transposed (q^T ds, do^T p): asked
  for as ds^T q and p^T do, XLA:CPU transposed the [bq, bk] operands, the larger ones
  (the bench's causal and packed rows say by how much)."""
  return jnp.swapaxes(a, -1, -2)


def _grads(views: Views, q, q_t, do, do_t, lse, delta, pair: Pair, masked: bool,
           bias_grads: bool = True):
  """(dq_i, dk_j, dv_j, d_bias or None) of a block pair, probabilities recomputed from the
  saved lse.

  q_t and do_t are the query block's q and dO as [r, Hkv, D, Gq * bq] (`_merge_heads`, then `_t`).
  """
  s, t, v, mask = _block_scores(views, q, pair, masked)
  k = pair.k
  if masked:  # ds is 0 where the mask is False: garbage in q, k or v must not meet it (0 * NaN)
    q_t, k = base.finite(q_t), base.finite(k)
    v = v if _integer(views, pair) else base.finite(v)
  probs = jnp.exp(s - lse[..., None])  # [r, Hkv, Gq, bq, bk]
  kept = probs if pair.drop is None else probs * pair.drop  # what the forward multiplied v by
  dv = _t(jnp.einsum("bkdq,bkqs->bkds", do_t, _merge_heads(kept)))  # as do^T p: see `_t`
  dp = _dot_merged(do, v)
  ds = probs * ((dp if pair.drop is None else dp * pair.drop) - delta[..., None])
  if t is not None:
    ds = ds * (1.0 - t * t)
  if masked:  # where p = 0, dP may be inf (finite garbage values near the float limit)
    ds = jnp.where(mask, ds, 0.0)
  dq = jnp.einsum("bkgqs,bksd->bkgqd", ds, k, preferred_element_type=jnp.float32)
  dk = _t(jnp.einsum("bkdq,bkqs->bkds", q_t, _merge_heads(ds), preferred_element_type=jnp.float32))
  return dq, dk, dv, xla_bias.pair_grads(views, pair, ds) if bias_grads else None


def backward(x: KernelInputs, facts: Facts, tiles: Tiles, lse, d_out, delta,
             into: base.Grads | None = None, kv_in_place: bool = False,
             bias_grads: bool = True) -> base.Grads:
  """Gradients of q, k, v and sinks, probabilities recomputed from the saved lse [B, T, Hq].

  Args:
    lse: [B, T, Hq] in `base`'s convention, from this call's forward or a ring's
      merged one.
    delta: [B, T, Hq] = sum(d_out * out, -1) - d_lse; the lse's cotangent enters
      where `delta` does, with the opposite sign (d lse_i / d s_ij = p_ij).
    into: float32 accumulators (dq, dk, dv in the inputs' layouts) to add the
      gradients to (a ring accumulates over its steps), or None.
    kv_in_place: read K/V (and accumulate dK/dV) in the caller's layout, no copies.
    bias_grads: compute the bias leaves' gradients (off when nothing differentiates them: a
      dense bias's would cost a [T, S] accumulator).

  Returns:
    Grads; dq, dk, dv in the inputs' dtypes, or float32 sums with `into` when given.
  """
  grid = xla_plan.Grid.of(x, tiles[2], tiles[3])
  views = Views(x, facts, grid, kv_in_place)
  plan = xla_plan.block_plan(x, grid)
  lse = base.probability_lse(lse)
  rows = [views.pad_queries(d_out), views.pad_queries(delta), views.pad_queries(lse, jnp.inf)]
  nq = grid.num_q_blocks
  scale = jnp.asarray(facts.scale, x.query.dtype)

  def q_step(step, carry):
    dq, dk, dv, d_bias = carry
    group, i = step // nq, step % nq
    q = views.head_rows(views.q, group, i) * scale  # [r, Hkv, Gq, bq, D]
    do, delta_i, lse_i = (views.head_rows(a, group, i).astype(jnp.float32) for a in rows)
    q_t, do_t = _t(_merge_heads(q)), _t(_merge_heads(do))  # [r, Hkv, D, Gq * bq], once per block

    def kv_step(masked, j, pair, acc):
      dq_i, dk, dv, d_bias = acc
      dq_ij, dk_j, dv_j, db = _grads(views, q, q_t, do, do_t, lse_i, delta_i, pair, masked,
                                     bias_grads)
      return (dq_i + dq_ij, views.add_kv(dk, dk_j, group, j), views.add_kv(dv, dv_j, group, j),
              xla_bias.add(views, d_bias, db, group, i, j))

    dq_i, dk, dv, d_bias = _over_live_blocks(views, plan, group, i, kv_step,
                                             (jnp.zeros(q.shape, jnp.float32), dk, dv, d_bias))
    dq_i = views.head_rows(dq, group, i) + dq_i * facts.scale  # dq may hold earlier gradients
    return views.write_rows(dq, dq_i, group, i), dk, dv, d_bias

  # `into` serves as the loop's own accumulators when the loop's layouts are the caller's
  # (K/V not transposed, no query padding); otherwise the loop sums from zeros and adds.
  zeros = lambda a: jnp.zeros(a.shape, jnp.float32)
  in_place = into is not None and not views.heads_major and views.q.shape == x.query.shape
  init = (into.dq, into.dk, into.dv) if into is not None and in_place else (
      zeros(views.q), zeros(views.k), zeros(views.v))
  dq, dk, dv, d_bias = jax.lax.fori_loop(0, grid.num_groups * nq, q_step,
                                         (*init, xla_bias.zeros(views) if bias_grads else None))
  grads = dq[:, :grid.query_len], views.kv_layout(dk), views.kv_layout(dv)
  if into is None:
    grads = tuple(g.astype(a.dtype) for g, a in zip(grads, (x.query, x.key, x.value)))
  elif not in_place:
    grads = tuple(a + g for a, g in zip((into.dq, into.dk, into.dv), grads))
  return base.Grads(*grads, base.sink_grads(x.sinks, lse, delta),
                    xla_bias.finish(x, d_bias, grid.query_len))


def count_pairs(facts: Facts, q_positions, kv_positions, q_segment_ids=None,
                kv_segment_ids=None, rule=None) -> int:
  """The block pairs the forward computes per head for such inputs, with the call's tiles.

  `rule`: the position rule with NumPy arrays, when it has arrays (else `facts.rule`).
  """
  block_q, block_kv = tiles_for(facts)[:2]
  return _plan.count_pairs(facts.rule if rule is None else rule, q_positions, kv_positions,
                           block_q, block_kv, q_segment_ids, kv_segment_ids)


BACKEND = base.Backend(
    name="xla", why_not=why_not, attend=attend, rank=10,
    paged_why_not=lambda facts, hardware: None, paged_attend=xla_paged.attend,
    forward=lambda x, facts: forward(x, facts, tiles_for(facts), jnp.float32, kv_in_place=True),
    backward=lambda x, facts, lse, d_out, delta, into=None: backward(
        x, facts, tiles_for(facts), lse, d_out, delta, into, kv_in_place=True),
    count_pairs=count_pairs,
    plan=lambda x, facts: xla_plan.block_plan(x, xla_plan.Grid.of(x, *tiles_for(facts)[:2])))
