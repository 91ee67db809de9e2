"""The online softmax of the TPU's list and paged kernels (Pallas TPU): logits of a tile, and
the running max, sum and accumulator in VMEM scratch that a kernel folds each block into.

State refs are [H', bq, X] (H' heads of a program, their `bq` rows, X = 128 lanes for the max
and sum, Dv for the accumulator); a step folds one head's rows, or every head's stacked as
[H' * bq, X] rows of one product.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def scores(q: jax.Array, k: jax.Array, scale: float, soft_cap: float | None,
           key_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
  """Scaled (and soft-capped) logits [bq, bk] f32 of q [bq, D] and k [bk, D] (quantized keys'
  codes with `key_scale` [1, bk]: each key's scale, applied to its column), and tanh of the cap
  (for its derivative)."""
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32) * scale  # [bq, bk]
  if key_scale is not None:
    s = s * key_scale
  if soft_cap is None:
    return s, None
  t = jnp.tanh(s / soft_cap)
  return soft_cap * t, t


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
  return jax.lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())),
                             preferred_element_type=jnp.float32)


def poison(seen: jax.Array, finite: jax.Array) -> jax.Array:
  """[R, Dv]: NaN in value column c of the rows that see a key whose column c is not finite
  (`finite` [E, Dv]; a visible NaN shows there, and only there), else 0."""
  bad = (~finite).astype(jnp.float32)  # [E, Dv]
  hits = jax.lax.dot_general(seen.astype(jnp.float32), bad, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)  # [R, Dv]
  return jnp.where(hits > 0, jnp.nan, 0.0)


def init_state(m_scr: Any, l_scr: Any, acc_scr: Any) -> None:
  """The online softmax's state in VMEM scratch, emptied: max -inf, sum 0, accumulator 0."""
  m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
  l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
  acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)


def _rows(ref: Any, g: int | None) -> Any:
  """Head g's [bq, X] of a state ref [H', bq, X], or (g None) every head's rows as [H' * bq, X]."""
  return ref[g] if g is not None else ref[...].reshape(-1, ref.shape[-1])


def online_step(g: int | None, s: jax.Array, v: jax.Array, m_scr: Any, l_scr: Any,
                acc_scr: Any, value_scale: jax.Array | None = None) -> None:
  """Head g's state (m, l [H', bq, 128], acc [H', bq, Dv]; g None: every head's, their rows
  stacked): visible logits s [R, bk] of one block and its values v [bk, Dv] (quantized values'
  codes with `value_scale` [1, bk]: each value's scale, applied to its probability's column)
  folded in."""
  m_prev = _rows(m_scr, g)  # [R, 128]
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [R, 128]
  m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
  p = jnp.exp(s - m_safe[:, :1])  # [R, bk]
  alpha = jnp.exp(m_prev - m_safe)  # [R, 128]
  pv = p if value_scale is None else p * value_scale  # [R, bk]
  acc = alpha[:, :1] * _rows(acc_scr, g) + dot(pv.astype(v.dtype), v, (1, 0))  # [R, Dv]
  states = ((l_scr, alpha * _rows(l_scr, g) + jnp.sum(p, axis=1, keepdims=True)),
            (acc_scr, acc), (m_scr, m_next))
  for ref, value in states:
    if g is None:
      ref[...] = value.reshape(ref.shape)
    else:
      ref[g] = value


def finish(g: int, sink: Any, m_scr: Any, l_scr: Any, acc_scr: Any, o_ref: Any,
           lse_ref: Any) -> None:
  """Head g's output and lse from its state, its sinks joining the denominator as one logit
  (-inf: none); a row that sees nothing outputs 0 with lse -inf."""
  m = m_scr[g]  # [bq, 128]
  top = jnp.maximum(m, sink)
  top = jnp.where(top == -jnp.inf, 0.0, top)
  norm = l_scr[g] * jnp.exp(m - top) + jnp.exp(sink - top)  # [bq, 128]
  seen = norm != 0  # NaN (a visible NaN) too: it must show, not read as a row seeing nothing
  safe = jnp.where(seen, norm, 1.0)
  out = acc_scr[g] * (jnp.exp(m - top) / safe)[:, :1]  # [bq, Dv]
  o_ref[g] = jnp.where(seen[:, :1], out, 0.0).astype(o_ref.dtype)
  lse_ref[g] = jnp.where(seen, top + jnp.log(safe), -jnp.inf)
