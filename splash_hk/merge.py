"""`merge_attention`: attention over disjoint sets of keys, combined by their log-sum-exps.

Attention over keys K = K_1 + ... + K_n is the softmax over all of them; each part's output is
its own softmax's average, and its log-sum-exp the log of its denominator. So the whole is
`lse = logsumexp_i(lse_i)` and `out = sum_i exp(lse_i - lse) * out_i` (flash-decoding's merge,
FlashInfer's `merge_state`), computed in float32.
"""

from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp

from splash_hk.types import Array, AttentionOutput

__all__ = ("merge_attention",)


def _parts(outputs: Iterable[Array | AttentionOutput], lses: Iterable[Array] | None
           ) -> tuple[list[Array], list[Array]]:
  """(outputs, lses) as lists of arrays: `attention`'s AttentionOutputs give their own lse."""
  items = list(outputs)  # any iterable, a generator too
  states = [o for o in items if isinstance(o, AttentionOutput)]
  arrays = [o for o in items if not isinstance(o, AttentionOutput)]
  if states and arrays:
    raise ValueError("`outputs` must all be arrays or all be AttentionOutputs (what attention "
                     "returns), not a mix.")
  if not states:
    if lses is None:
      raise ValueError("`lses` is needed with array `outputs` (one lse per part); or pass the "
                       "AttentionOutputs of attention(..., return_residuals=True) as `outputs`.")
    return arrays, list(lses)
  if lses is not None:
    raise ValueError("`outputs` are AttentionOutputs, which carry their lse: pass lses=None "
                     "(or the arrays `o.attention_outputs` with their lses).")
  lse_of = [o.lse for o in states]
  if any(lse is None for lse in lse_of):
    raise ValueError("`outputs` holds an AttentionOutput without its lse: call attention with "
                     "return_residuals=True for every part.")
  return [o.attention_outputs for o in states], [lse for lse in lse_of if lse is not None]


def _check(outputs: list[Array], lses: list[Array]) -> None:
  if not len(outputs) or len(outputs) != len(lses):
    raise ValueError(f"`outputs` and `lses` must be equally long, non-empty sequences (one output "
                     f"and one lse per part), got {len(outputs)} and {len(lses)}.")
  shape = tuple(jnp.shape(outputs[0]))
  for i, (out, lse) in enumerate(zip(outputs, lses)):
    if tuple(jnp.shape(out)) != shape or tuple(jnp.shape(lse)) != shape[:-1]:
      raise ValueError(f"part {i}: `outputs[{i}]` must have the shape of `outputs[0]` {shape} and "
                       f"`lses[{i}]` that shape without its last axis {shape[:-1]}, got "
                       f"{tuple(jnp.shape(out))} and {tuple(jnp.shape(lse))}.")
    if not (jnp.issubdtype(jnp.result_type(out), jnp.floating)
            and jnp.issubdtype(jnp.result_type(lse), jnp.floating)):
      raise ValueError(f"part {i}: `outputs` and `lses` must be floating, got "
                       f"{jnp.result_type(out)} and {jnp.result_type(lse)}.")


def merge_attention(outputs: Iterable[Array | AttentionOutput],
                    lses: Iterable[Array] | None = None) -> tuple[jax.Array, jax.Array]:
  """The attention over the union of the parts' keys, from each part's output and lse.

  Glossary of shapes: `[..., Dv]` an output (e.g. [B, T, Hq, Dv] from `attention`, [N, Hq, Dv]
  from `paged_attention`), `[...]` its lse.

  Args:
    outputs: the parts' outputs (any iterable), each `[..., Dv]` (e.g.
      `attention(...).attention_outputs`); or the `AttentionOutput`s of
      `attention(..., return_residuals=True)` themselves, each with its lse (then `lses` is None).
    lses: their log-sum-exps, each `[...]` (`attention(..., return_residuals=True).lse`);
      -inf where a part sees nothing (its output is then ignored). Sinks belong to one part
      only (each part's lse counts them).

  Returns:
    The pair of the merged output, shaped like each part's and in their dtype, and its
    log-sum-exp in float32, with `lse = logsumexp_i(lse_i)` and `out = sum_i exp(lse_i -
    lse) * out_i`. A row that sees nothing in every part gives 0 and -inf (never NaN).
    Differentiable in both.
  """
  outputs, lses = _parts(outputs, lses)
  _check(outputs, lses)
  dtype = jnp.result_type(*outputs)
  lse = jnp.stack([jnp.asarray(a, jnp.float32) for a in lses])  # [P, ...]
  out = jnp.stack([jnp.asarray(a, jnp.float32) for a in outputs])  # [P, ..., Dv]
  top = jnp.max(lse, axis=0)  # [...]
  empty = top == -jnp.inf  # every part sees nothing
  top = jnp.where(empty, 0.0, top)
  absent = lse == -jnp.inf  # [P, ...]
  weight = jnp.where(absent, 0.0, jnp.exp(jnp.where(absent, 0.0, lse - top)))  # [P, ...]
  total = jnp.sum(weight, axis=0)  # [...]
  safe = jnp.where(empty, 1.0, total)
  merged = jnp.sum(jnp.where(absent[..., None], 0.0, weight[..., None] * out), axis=0)
  out = jnp.where(empty[..., None], 0.0, merged / safe[..., None])  # [..., Dv]
  lse = jnp.where(empty, -jnp.inf, top + jnp.log(safe))  # [...]
  return out.astype(dtype), lse
