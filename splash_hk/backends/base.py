"""The interface every backend implements, and the small helpers they share.

A backend is a `Backend`: a name, `why_not(facts, hardware)` (why it cannot
serve a call, or None: its own limits, consulted by the selector in order) and
`attend(x, facts)`, which runs it on one shard of KernelInputs and returns a
KernelOutput. Adding a backend is one file that defines one of these and one
line in `splash_hk.kernel.BACKENDS`.

The log-sum-exp convention, for every backend and every consumer: `lse[b, t, h]`
is the log of query row (b, t, h)'s softmax denominator over the keys it sees
and its sinks. A row that sees nothing and has no sink has -inf (the log of an
empty sum); +inf or NaN only come from the logits themselves (an Inf key the row
sees). Code that recomputes probabilities as exp(s - lse) reads it through
`probability_lse`, where such rows get +inf, so their probabilities are 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from splash_hk.types import Facts, KernelInputs, KernelOutput

WhyNot = Callable[[Facts, str], "str | None"]
Attend = Callable[[KernelInputs, Facts], KernelOutput]

WEIGHTS_REFUSAL = "attention weights were requested and only the reference path materialises them"


class Partial(NamedTuple):
  """A forward half's result over the keys it was given."""

  out: jax.Array  # [B, T, Hq, Dv]: softmax-weighted values over those keys (and the sinks)
  lse: jax.Array  # [B, T, Hq] float32, in the module's log-sum-exp convention


class Grads(NamedTuple):
  """A backward half's result (and, without d_sinks, its accumulators)."""

  dq: jax.Array  # [B, T, Hq, D]
  dk: jax.Array  # [B, S, Hkv, D]
  dv: jax.Array  # [B, S, Hkv, Dv]
  d_sinks: jax.Array | None = None  # [Hq, n]


class ForwardHalf(Protocol):
  def __call__(self, x: KernelInputs, facts: Facts) -> Partial:
    """out in float32 and lse of `x`'s queries over `x`'s keys, sinks included."""


class BackwardHalf(Protocol):
  def __call__(self, x: KernelInputs, facts: Facts, lse: jax.Array, d_out: jax.Array,
               delta: jax.Array, into: Grads | None = None) -> Grads:
    """Gradients with probabilities taken from `lse` (possibly a ring's global one).

    delta = sum(d_out * out, -1) - d_lse, [B, T, Hq]. With `into` (float32
    accumulators dq, dk, dv) the result is into + this call's gradients, in
    float32; without, the gradients in the inputs' dtypes.
    """


@dataclasses.dataclass(frozen=True)
class Backend:
  """A kernel backend: its limits and its call, with the same signature for all.

  Attributes:
    name: the platform name ("splash", "triton", "xla", "reference").
    why_not: (facts, hardware) -> why this backend cannot serve the call, or None.
    attend: (KernelInputs of one shard, facts) -> KernelOutput; `out` always,
      `lse` where the backend computes it, `weights` when asked for and served.
    forward, backward: the two halves of `attend`, for a caller that owns the
      gradient and keeps memory tight (the context-parallel ring), or None.
    count_pairs: (facts, q_positions [B, T], kv_positions [B, S], q_segment_ids,
      kv_segment_ids, rule=None) -> the block pairs this backend computes per head
      for such inputs (NumPy, static; `rule` with NumPy arrays when the call's rule
      has arrays), or None for a backend that does not say.
    plan: (KernelInputs, facts) -> what the backend builds before it computes
      (the xla backend's block plan), for a caller that measures it, or None.
  """

  name: str
  why_not: WhyNot
  attend: Attend
  forward: ForwardHalf | None = None
  backward: BackwardHalf | None = None
  count_pairs: Callable[..., int] | None = None
  plan: Callable[[KernelInputs, Facts], Any] | None = None


def rule_refusal(facts: Facts, kernel: str, serves: tuple[type, ...],
                 combinations: bool = True) -> str | None:
  """Why `kernel` cannot build the call's position rule, naming the parts it cannot, or None.

  `serves`: the mask object types it builds; `combinations`: whether it builds
  any `&`/`|` of them, or only an AND of at most one of each (config-style rules).
  """
  if facts.rule is None:
    return None
  names = sorted({type(p).__name__ for p in facts.rule.parts() if not isinstance(p, serves)})
  if names:
    what = " and ".join(f"a {n} part" for n in names)
    return (f"the mask holds {what}, which {kernel} cannot build (it builds "
            f"{', '.join(t.__name__ for t in serves)})")
  if not combinations and facts.static_rules is None:
    return (f"the mask combines its rules with | or repeats one; {kernel} takes an AND of at "
            "most one Causal, SlidingWindow and Chunked")
  return None


def probability_lse(lse: jax.Array) -> jax.Array:
  """`lse` with rows that see nothing at +inf: exp(s - it) is then 0 there, never NaN."""
  return jnp.where(lse == -jnp.inf, jnp.inf, lse)


def round_up(n: int, multiple: int) -> int:
  """The smallest multiple of `multiple` that is >= n."""
  return -(-n // multiple) * multiple


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
  """`x` padded at the end of `axis` to `size` with `value`."""
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def sink_logsumexp(sinks: jax.Array) -> jax.Array:
  """[Hq, n] -> [Hq]: n sinks of a head act exactly as one sink of their logsumexp."""
  return jax.nn.logsumexp(sinks, axis=-1)


def sink_grads(sinks: jax.Array | None, lse: jax.Array, delta: jax.Array) -> jax.Array | None:
  """d sinks [Hq, n] = -sum over rows of exp(sink - lse) * delta (lse [B, T, Hq])."""
  if sinks is None:
    return None
  weight = jnp.exp(sinks[None, None] - probability_lse(lse)[..., None])  # [B, T, Hq, n]
  return -jnp.sum(weight * delta[..., None], axis=(0, 1))


def to_bhtd(x: jax.Array) -> jax.Array:
  """[B, T, H, D] <-> [B, H, T, D] (its own inverse)."""
  return jnp.swapaxes(x, 1, 2)


def zero_padding(x: KernelInputs) -> KernelInputs:
  """A copy of `x` with padding query rows and padding keys/values (negative segment ids) zeroed."""
  if x.q_segment_ids is None:
    return x
  keep = lambda a, ids: jnp.where((ids >= 0)[:, :, None, None], a, jnp.zeros((), a.dtype))
  return x._replace(query=keep(x.query, x.q_segment_ids), key=keep(x.key, x.kv_segment_ids),
                    value=keep(x.value, x.kv_segment_ids))


def guard_garbage(kernel: Attend, exact: Attend) -> Attend:
  """`kernel` (one we do not own) kept from spreading garbage that no query should see.

  Padding is zeroed in a copy (a pass that is small next to the attention such
  kernels serve: training and prefill). A NaN or Inf left in the queries, keys
  or values is visible to someone, and a kernel that multiplies probabilities
  of 0 by it would also spread it to rows that do not see it (0 * NaN = NaN),
  so such a call runs `exact` instead (decided at run time, `lax.cond`).
  """

  def attend(x: KernelInputs, facts: Facts) -> KernelOutput:
    x = zero_padding(x)
    finite = [jnp.all(jnp.isfinite(a)) for a in (x.query, x.key, x.value)]
    return jax.lax.cond(finite[0] & finite[1] & finite[2],
                        lambda y: KernelOutput(kernel(y, facts).out),
                        lambda y: KernelOutput(exact(y, facts).out), x)

  return attend
