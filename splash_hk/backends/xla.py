"""Block-sparse attention in pure JAX: the portable ("xla") backend, on any hardware.

For each (row group, query block) an inner loop runs over the key blocks some
query of the block may see (`xla_blocks.Views.schedule`, decided at run time
from positions, segments and padding), with an online (flash) softmax. A
`jax.custom_vjp` backward recomputes the probabilities from the saved
log-sum-exp, over the same kind of schedule, so memory stays linear in T and
neither loop is differentiated.

Blocks whose every (query, key) pair is visible run unmasked. Other blocks
apply the element mask and keep invisible garbage out: values, keys and
queries are used with non-finite entries zeroed where they multiply a
probability (0 * NaN would spread it); a NaN in a visible query or key still
reaches its rows through the logits, and a visible non-finite value is put
back as NaN in its column of the rows that see it. GQA groups query heads over their
kv head; keys and values are never repeated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from splash_hk.backends import base
from splash_hk.backends.xla_blocks import Pair, Schedule, Views
from splash_hk.config import AttentionConfig
from splash_hk.types import Facts, KernelInputs, KernelOutput

Tiles = tuple[int, int, int, int]  # (block_q, block_kv, block_q_bwd, block_kv_bwd)


def default_tiles(config: AttentionConfig) -> Tiles:
  """Tiles measured fastest on a 2-core CPU: (block_q, block_kv, block_q_bwd, block_kv_bwd).

  512-row query blocks keep XLA's batched dots on both cores (256-row ones ran
  on about one); 256-key forward blocks halve the masked diagonal of causal
  masks for the same work. A sliding window narrower than 512 gets query
  blocks about its span, so few keys outside it are computed.
  """
  fwd_q, fwd_kv, bwd_q, bwd_kv = 512, 256, 512, 128
  if config.window is not None:
    span = config.window[0] + config.window[1] + 1
    fwd_q = bwd_q = max(128, min(512, 1 << (span.bit_length() - 1)))
  return fwd_q, fwd_kv, bwd_q, bwd_kv


def why_not(facts: Facts, hardware: str) -> str | None:
  """The xla path serves every call except one that asks for the weights."""
  del hardware
  return base.WEIGHTS_REFUSAL if facts.return_weights else None


def attend(x: KernelInputs, facts: Facts) -> KernelOutput:
  """Block-sparse attention on one shard: out [B, T, Hq, Dv] and a differentiable lse [B, T, Hq]."""
  tiles = facts.config.block_sizes.resolve(*default_tiles(facts.config))

  @jax.custom_vjp
  def run(y):
    return forward(y, facts, tiles)

  def run_fwd(y):
    out, lse = forward(y, facts, tiles)
    return (out, lse), (y, out, lse)

  def run_bwd(residuals, cotangents):
    y, out, lse = residuals
    dq, dk, dv, d_sinks = backward(y, facts, tiles, out, lse, *cotangents)
    none = jax.tree.map(lambda _: None, y)  # integer and boolean inputs get no cotangent
    return (none._replace(query=dq, key=dk, value=dv, sinks=d_sinks),)

  run.defvjp(run_fwd, run_bwd)
  return KernelOutput(*run(x))


def _logits(q: jax.Array, k: jax.Array, cap: float | None) -> tuple[jax.Array, jax.Array | None]:
  """f32 logits [r, Hkv, G, bq, bk] from pre-scaled q, and tanh(s / cap) (None without cap)."""
  s = jnp.einsum("bkgqd,bksd->bkgqs", q, k, preferred_element_type=jnp.float32)
  if cap is None:
    return s, None
  t = jnp.tanh(s / cap)
  return cap * t, t


def _finite(a: jax.Array) -> jax.Array:
  return jnp.where(jnp.isfinite(a), a, 0)


def _block_scores(views: Views, q, pair: Pair, masked: bool):
  """(logits, tanh or None, v, mask or None) of a block pair.

  A masked block gets invisible logits at -inf and v with non-finite entries
  zeroed (k only enters the logits, which the mask replaces).
  """
  s, t = _logits(q, pair.k, views.facts.config.logits_soft_cap)
  if not masked:
    return s, t, pair.v, None
  mask = views.element_mask(pair)
  return jnp.where(mask, s, -jnp.inf), t, _finite(pair.v), mask


def _visible_garbage(pv: jax.Array, mask: jax.Array, v: jax.Array) -> jax.Array:
  """p @ v of a masked block with NaN where a visible value holds NaN/Inf (a rare case).

  Such values were zeroed so they cannot reach rows that do not see them; the
  rows that do see one get NaN in that value column.
  """
  bad = ~jnp.isfinite(v)  # [r, Hkv, bk, Dv]

  def poison(pv):
    seen = jnp.einsum("bkgqs,bksd->bkgqd", jnp.broadcast_to(mask, pv.shape[:4] + mask.shape[-1:])
                      .astype(jnp.float32), bad.astype(jnp.float32))
    return jnp.where(seen > 0, jnp.nan, pv)

  return jax.lax.cond(jnp.any(bad), poison, lambda pv: pv, pv)


def _update(views: Views, q, pair: Pair, masked: bool, state):
  """One online-softmax step of a query block over a key block."""
  m, l, acc = state
  s, _, v, mask = _block_scores(views, q, pair, masked)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  probs = jnp.exp(s - m_safe[..., None])
  correction = jnp.exp(m - m_safe)
  pv = jnp.einsum("bkgqs,bksd->bkgqd", probs.astype(v.dtype), v,
                  preferred_element_type=jnp.float32)
  if masked:
    pv = _visible_garbage(pv, mask, pair.v)
  return m_new, l * correction + jnp.sum(probs, axis=-1), acc * correction[..., None] + pv


def _finalize(m, l, acc, sinks):
  """Normalised block output and its lse (+inf for rows that see nothing; NaN stays NaN)."""
  m_all, l_all = m, l
  if sinks is not None:  # [Hkv, G, 1, n]
    m_all = jnp.maximum(m, jnp.max(sinks, axis=-1))
    l_all = l * jnp.exp(m - m_all) + jnp.sum(jnp.exp(sinks - m_all[..., None]), axis=-1)
  has_key, has_mass = l != 0, l_all != 0
  scale = jnp.exp(m - m_all) / jnp.where(has_key, l_all, 1.0)
  out = jnp.where(has_key[..., None], acc * scale[..., None], 0.0)
  return out, jnp.where(has_mass, m_all + jnp.log(jnp.where(has_mass, l_all, 1.0)), jnp.inf)


def forward(x: KernelInputs, facts: Facts, tiles: Tiles) -> tuple[jax.Array, jax.Array]:
  """out [B, T, Hq, Dv] (query dtype), lse [B, T, Hq] f32 (-inf for a row with nothing to see)."""
  views = Views(x, facts, tiles[0], tiles[1])
  sched = views.schedule()
  batch, num_kv_heads, groups, padded_q, _ = views.q.shape
  r, bq, nq = views.rows, views.block_q, views.num_q_blocks
  row_shape = (r, num_kv_heads, groups, bq)
  sinks = None if x.sinks is None else x.sinks.reshape(num_kv_heads, groups, 1, -1)

  def q_step(step, carry):
    out, lse = carry
    g, i = step // nq, step % nq
    q = views.q_block(views.q, g, i)  # [r, Hkv, G, bq, D]
    update = lambda masked, pair, state: _update(views, q, pair, masked, state)
    kv_step = lambda t, state: _branch(views, sched, g, i, t, update, state)[1]
    init = (jnp.full(row_shape, -jnp.inf), jnp.zeros(row_shape),
            jnp.zeros((*row_shape, x.value.shape[-1])))
    o, lse_i = _finalize(*jax.lax.fori_loop(0, sched.count[g, i], kv_step, init), sinks)
    out = jax.lax.dynamic_update_slice(out, o.astype(out.dtype), (g * r, 0, 0, i * bq, 0))
    return out, jax.lax.dynamic_update_slice(lse, lse_i, (g * r, 0, 0, i * bq))

  init = (jnp.zeros((batch, num_kv_heads, groups, padded_q, x.value.shape[-1]), x.query.dtype),
          jnp.zeros((batch, num_kv_heads, groups, padded_q), jnp.float32))
  out, lse = jax.lax.fori_loop(0, (batch // r) * nq, q_step, init)
  return _to_public(out[:, :, :, :views.query_len], lse[:, :, :, :views.query_len])


def _branch(views: Views, sched: Schedule, g, i, t, step_fn, state):
  """(j, step_fn(masked, pair, state)) for the t-th live key block j, unmasked when it is full."""
  j = sched.order[g, i, t]
  pair = views.pair(g, i, j)
  return j, jax.lax.cond(sched.full[g, i, j], functools.partial(step_fn, False),
                         functools.partial(step_fn, True), pair, state)


def _to_public(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[B, Hkv, G, T, Dv], [B, Hkv, G, T] (+inf = nothing seen) -> BTHD and -inf for nothing."""
  batch, num_kv_heads, groups, query_len, value_dim = out.shape
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, query_len, -1, value_dim)
  lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(batch, query_len, -1)
  return out, jnp.where(lse == jnp.inf, -jnp.inf, lse)


def _to_blocks(a: jax.Array, views: Views, fill=0.0) -> jax.Array:
  """[B, T, Hq, ...] -> [B, Hkv, G, Tp, ...] f32, padded with `fill`."""
  batch, query_len = a.shape[:2]
  a = a.astype(jnp.float32).reshape(batch, query_len, views.num_kv_heads, views.groups,
                                    *a.shape[3:])
  a = jnp.moveaxis(a, 1, 3)
  return base.pad_axis(a, 3, views.padded_q, fill)


def _grads(views: Views, q, do, lse, delta, pair: Pair, masked: bool):
  """(dq_i, dk_j, dv_j) of a block pair, probabilities recomputed from the saved lse."""
  s, t, v, _ = _block_scores(views, q, pair, masked)
  k = pair.k
  if masked:  # ds is 0 where the mask is False: garbage in q or k must not meet it (0 * NaN)
    q, k = _finite(q), _finite(k)
  probs = jnp.exp(s - lse[..., None])  # [r, Hkv, G, bq, bk]
  dv = jnp.einsum("bkgqs,bkgqd->bksd", probs, do)
  dp = jnp.einsum("bkgqd,bksd->bkgqs", do, v, preferred_element_type=jnp.float32)
  ds = probs * (dp - delta[..., None])
  if t is not None:
    ds = ds * (1.0 - t * t)
  dq = jnp.einsum("bkgqs,bksd->bkgqd", ds, k, preferred_element_type=jnp.float32)
  dk = jnp.einsum("bkgqs,bkgqd->bksd", ds, q, preferred_element_type=jnp.float32)
  return dq, dk, dv


def backward(x: KernelInputs, facts: Facts, tiles: Tiles, out, lse, d_out, d_lse):
  """Gradients of q, k, v and sinks from the saved out/lse (both BTHD, as `forward` returns them).

  `d_lse` enters where `delta` does, with the opposite sign: d lse_i / d s_ij = p_ij.
  """
  views = Views(x, facts, tiles[2], tiles[3])
  sched = views.schedule()
  d_out = d_out.astype(jnp.float32)
  delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1) - d_lse  # [B, T, Hq]
  lse_b = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # rows that see nothing: probabilities 0
  do_b, delta_b, lse_bl = _to_blocks(d_out, views), _to_blocks(delta, views), _to_blocks(
      lse_b, views, jnp.inf)
  r, bq, nq = views.rows, views.block_q, views.num_q_blocks

  def q_step(step, carry):
    dq, dk, dv = carry
    g, i = step // nq, step % nq
    q, do, lse_i, delta_i = (views.q_block(a, g, i) for a in (views.q, do_b, lse_bl, delta_b))
    grads = lambda masked, pair, _: _grads(views, q, do, lse_i, delta_i, pair, masked)

    def kv_step(t, acc):
      dq_i, dk, dv = acc
      j, (dq_ij, dk_j, dv_j) = _branch(views, sched, g, i, t, grads, None)
      return dq_i + dq_ij, views.add_kv(dk, dk_j, g, j), views.add_kv(dv, dv_j, g, j)

    dq_i, dk, dv = jax.lax.fori_loop(0, sched.count[g, i], kv_step,
                                     (jnp.zeros(q.shape, jnp.float32), dk, dv))
    return jax.lax.dynamic_update_slice(dq, dq_i, (g * r, 0, 0, i * bq, 0)), dk, dv

  init = (jnp.zeros(views.q.shape, jnp.float32), jnp.zeros(views.k.shape, jnp.float32),
          jnp.zeros(views.v.shape, jnp.float32))
  dq, dk, dv = jax.lax.fori_loop(0, (x.query.shape[0] // r) * nq, q_step, init)
  dq = jnp.moveaxis(dq[:, :, :, :views.query_len], 3, 1).reshape(x.query.shape) * facts.scale
  dk, dv = views.kv_layout(dk), views.kv_layout(dv)
  return (dq.astype(x.query.dtype), dk.astype(x.key.dtype), dv.astype(x.value.dtype),
          _sink_grads(x, lse_b, delta))


def _sink_grads(x: KernelInputs, lse: jax.Array, delta: jax.Array) -> jax.Array | None:
  """d sinks [Hq, n] = -sum over rows of exp(sink - lse) * delta."""
  if x.sinks is None:
    return None
  weight = jnp.exp(x.sinks[None, None] - lse[..., None])  # [B, T, Hq, n]
  return -jnp.sum(weight * delta[..., None], axis=(0, 1))


BACKEND = base.Backend(name="xla", why_not=why_not, attend=attend)
