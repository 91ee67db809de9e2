"""The interface every backend implements, and the small helpers they share.

A backend is a `Backend`: a name, the hardware it is made for and its rank in
the order of choice there, `why_not(facts, hardware)` (why it cannot serve a
call, or None: its own limits, consulted by the selector in order) and
`attend(x, facts)`, which runs it on one shard of KernelInputs and returns a
KernelOutput. Adding a backend is one file that defines one of these and one
line in `splash_hk.kernel`, which registers it (`splash_hk.platforms`).

The log-sum-exp convention, for every backend and every consumer: `lse[b, t, h]`
is the log of query row (b, t, h)'s softmax denominator over the keys it sees
and its sinks. A row that sees nothing and has no sink has -inf (the log of an
empty sum); +inf or NaN only come from the logits themselves (an Inf key the row
sees). Code that recomputes probabilities as exp(s - lse) reads it through
`probability_lse`, where such rows get +inf, so their probabilities are 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, NamedTuple, Protocol

import jax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
import jax.numpy as jnp

from splash_hk import pages
from splash_hk.masks import _rules
from splash_hk.masks._objects import Mask
from splash_hk.scores import Score
from splash_hk.types import Facts, KernelInputs, KernelOutput

WhyNot = Callable[[Facts, str], "str | None"]
Attend = Callable[[KernelInputs, Facts], KernelOutput]

WEIGHTS_REFUSAL = "attention weights were requested and only the reference path materialises them"
DROPOUT_REFUSAL = ("attention dropout was asked for (dropout_rate > 0) and this kernel does not "
                   "apply the library's dropout hash")
RESIDUALS_REFUSAL = ("the log-sum-exp was requested (return_residuals=True) and this kernel does "
                     "not return a differentiable one")


def plain_kernel_refusal(facts: Facts) -> str | None:
  """Why a kernel that computes plain attention only (no weights, differentiable lse, dropout
  hash or quantized inputs: splash's and Triton's) cannot serve the call, or None."""
  if facts.return_weights:
    return WEIGHTS_REFUSAL
  if facts.return_residuals:
    return RESIDUALS_REFUSAL
  if facts.config.dropout_rate > 0:
    return DROPOUT_REFUSAL
  if facts.quantized:
    names = " and ".join(f"`{name}`" for name in facts.quantized)
    return (f"{names} {'is' if len(facts.quantized) == 1 else 'are'} quantized (sh.Quantized or "
            "qwix.QArray) and this kernel takes floating inputs only")
  return None


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
  d_bias: Score | None = None  # the bias leaves' gradients (a ring sums them over its steps)


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
    name: the platform name ("splash", "triton", "xla", "reference"): what
      `AttentionConfig(platform=...)` asks for.
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
    hardware: the `jax.default_backend()` names it is made for ("tpu", "gpu"), where
      `platform="auto"` tries it first; () for a portable backend, tried after those
      (and after an explicitly requested one) on any hardware.
    rank: its place in the order of choice (lower first) among the backends made
      for the hardware, and among the portable ones.
    traces_off_host: whether its call can be traced on a host of other hardware (to lower it
      for its own, as `jax.export` does); False where the kernel exists only on its hardware.
    optional: a kernel for some calls only (the native decode kernel), tried first on its
      hardware where it serves: on "auto" its refusal is said beside the next backend's choice,
      not a fallback (that backend is its hardware's first choice for the call).
    describe: facts -> what the backend runs for a call it serves, in words (the TPU kernel's
      tiles and where they came from: `explain` says it), or None.
    paged_why_not, paged_attend: the same two for a paged call (`splash_hk.pages`:
      (PagedFacts, hardware) -> reason or None; (PagedInputs, PagedFacts) -> (out
      [N, Hq, Dv], lse [N, Hq]) over the cache with the call's tokens written); `paged_attend`
      None for a backend without a paged kernel (its `paged_why_not` may say why).
  """

  name: str
  why_not: WhyNot
  attend: Attend
  hardware: tuple[str, ...] = ()
  rank: int = 0
  forward: ForwardHalf | None = None
  backward: BackwardHalf | None = None
  count_pairs: Callable[..., int] | None = None
  plan: Callable[[KernelInputs, Facts], Any] | None = None
  traces_off_host: bool = True
  optional: bool = False
  describe: Callable[[Facts], str | None] | None = None
  paged_why_not: Callable[[pages.PagedFacts, str], str | None] | None = None
  paged_attend: Callable[[pages.PagedInputs, pages.PagedFacts],
                         tuple[jax.Array, jax.Array]] | None = None


def rule_refusal(facts: Facts, kernel: str, serves: Callable[[Mask], bool],
                 builds: str) -> str | None:
  """Why `kernel` cannot build the call's position rule, or None.

  `serves(mask)` asks a mask object (each part, then the whole, for the ways parts
  combine) whether the kernel builds it; `builds` says in words what it builds.
  The parts it cannot build are named.
  """
  rule = facts.rule
  if rule is None or serves(rule):
    return None
  names = sorted({part.name for part in rule.parts() if not serves(part)})
  what = (" and ".join(f"a {n} part" for n in names) if names
          else "parts combined in a way (| or a repeated rule)")
  return f"the mask holds {what}, which {kernel} cannot build (it builds {builds})"


def segment_ids(x: KernelInputs) -> tuple[jax.Array, jax.Array]:
  """The call's (q [B, T], kv [B, S]) segment ids, or zeros (one document) when it has none."""
  if x.q_segment_ids is None or x.kv_segment_ids is None:  # positions are [B, T] in any layout
    return (jnp.zeros(x.q_positions.shape, jnp.int32), jnp.zeros(x.kv_positions.shape, jnp.int32))
  return x.q_segment_ids, x.kv_segment_ids


def disjoint_padding(q_segment_ids: jax.Array, kv_segment_ids: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
  """Segment ids for kernels that only test equality: padding (-1 on the query
  side, -2 on the key side) can then never match anything."""
  return (jnp.where(q_segment_ids < 0, -1, q_segment_ids),
          jnp.where(kv_segment_ids < 0, -2, kv_segment_ids))


def full_mask(x: KernelInputs) -> jax.Array:
  """Every rule at once over a call's positions, segments and position rule, materialised.

  Returns:
    [B, 1 or H, T, S] bool (H when the rule holds a per-head dense mask).
  """
  batch, query_len = x.q_positions.shape
  kv_len = x.kv_positions.shape[-1]
  out = jnp.ones((batch, 1, query_len, kv_len), jnp.bool_)  # [B, 1, T, S]
  if x.rule is not None:
    out = out & x.rule.visible(x.q_positions[:, None, :, None], x.kv_positions[:, None, None, :])
  if x.q_segment_ids is not None:
    out = out & _rules.segment_mask(x.q_segment_ids, x.kv_segment_ids)[:, None]
  return out


def soft_cap(logits: jax.Array, cap: float | None, bias: jax.Array | None = None) -> jax.Array:
  """`cap * tanh(logits / cap)` (or `logits` without a cap), where a -inf `bias` (already in
  `logits`) keeps its pair at -inf: such a bias removes the pair, soft cap or not."""
  if cap is None:
    return logits
  capped = cap * jnp.tanh(logits / cap)
  return capped if bias is None else jnp.where(bias == -jnp.inf, -jnp.inf, capped)


def bias_block(bias: Score, q_positions: jax.Array, kv_positions: jax.Array,
               heads: jax.Array | None, groups: int) -> jax.Array:
  """The bias of rows q_positions [r, bq] and keys kv_positions [r, bk] for query heads `heads`
  [Hkv * G] (global indices), float32, broadcastable to [r, Hkv, G, bq, bk] (arrays on the
  "qk" side cut to these rows and keys by the caller)."""
  assert heads is not None, "inputs.normalise gives a call with a bias its heads' indices"
  head = heads.reshape(1, -1, groups, 1, 1)  # [1, Hkv, G, 1, 1]
  return bias.scores(q_positions[:, None, None, :, None], kv_positions[:, None, None, None, :],
                     head)


def perturbed(tree: Any) -> bool:
  """Whether any leaf of `tree` (a custom VJP's forward arguments, with symbolic zeros on:
  `CustomVJPPrimal`s) is being differentiated."""
  leaves = jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, CustomVJPPrimal))
  return any(leaf.perturbed for leaf in leaves)


def primal_values(tree: Any) -> Any:
  """`tree` with each `CustomVJPPrimal` replaced by its value."""
  return jax.tree.map(lambda a: a.value, tree, is_leaf=lambda a: isinstance(a, CustomVJPPrimal))


def instantiate(cotangent: Any) -> Any:
  """A cotangent as an array: zeros for a symbolic zero."""
  if isinstance(cotangent, SymbolicZero):
    return jnp.zeros(cotangent.shape, cotangent.dtype)
  return cotangent


def probability_lse(lse: jax.Array) -> jax.Array:
  """`lse` with rows that see nothing at +inf: exp(s - it) is then 0 there, never NaN."""
  return jnp.where(lse == -jnp.inf, jnp.inf, lse)


def finite(a: jax.Array) -> jax.Array:
  """`a` with its non-finite entries (NaN, Inf) zeroed: what a probability of 0 may multiply."""
  return jnp.where(jnp.isfinite(a), a, 0)


def kernel_precision(dtype: Any) -> Any:
  """The matmul precision a TPU kernel of `dtype` inputs is traced under: the caller's for
  float32 (`jax.default_matmul_precision("highest")` is honoured), the default for narrower
  inputs, whose products are exact in the kernels' float32 accumulators anyway (Mosaic refuses
  a bf16 product asked for at float32 precision: "Bad lhs type")."""
  if jnp.dtype(dtype) == jnp.float32:
    return contextlib.nullcontext()
  return jax.default_matmul_precision("default")


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
