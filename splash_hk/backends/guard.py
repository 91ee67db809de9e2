"""The garbage guard: a kernel we do not own kept from spreading garbage no query should see.

Such a kernel multiplies probabilities of 0 by the values (0 * NaN = NaN), so a NaN or Inf in a
key or value some rows do not see (padding, a later token, a stale slot) can reach them. Finite
inputs give finite outputs and gradients, so the kernel runs first and an output (or,
differentiated, a gradient) that is not all finite (a visible NaN, or garbage it spread) has the
call run an exact path (the xla backend) instead.

On the TPU the guard holds the arrays the kernel itself reads (`guard_head_major`): q scaled and
q, k, v head-major ([B, H, T, D]), each made in one pass. Guarding the caller's [B, T, H, D]
arrays instead made XLA write each of q, k and v twice (the kernel's layout and the exact path's,
carried by the guard's loop: seen in the chip's compiled program), 3.3-4.8% of a forward at B1
T16384 H16 (now 1.6%); see the performance guide.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from splash_hk.backends import base
from splash_hk.types import Facts, KernelInputs, KernelOutput

Keep = Callable[[jax.Array, Any, Callable[[], Any]], Any]


def kept_unless(ok: jax.Array, value: Any, recompute: Callable[[], Any]) -> Any:
  """`value` where `ok`, else `recompute()` (the same pytree of shapes and dtypes).

  A while loop run zero times or once, not a `lax.cond`: XLA returns a loop's state in place,
  but copies a value computed before a `cond` that one of its branches returns (copy insertion;
  seen in the CPU-compiled HLO), a full pass over an attention output or its gradients. (On the
  TPU the two measured the same: what cost there was the layout of the loop's other state.)"""
  state = (value, jnp.asarray(ok, bool))
  return jax.lax.while_loop(lambda s: ~s[1], lambda s: (recompute(), jnp.asarray(True)),
                            state)[0]


def all_finite(*arrays: Any) -> jax.Array:
  """Whether every entry of every array (pytree leaves; None skipped) is finite."""
  leaves = jax.tree.leaves(arrays)
  return functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(a)) for a in leaves])


def values_finite(x: KernelInputs) -> jax.Array:
  """Whether a call's values are all finite: not differentiated, the only way garbage a query
  should not see reaches a kernel's output that replaces masked logits by its mask value (a
  hidden key or query reaches only those logits)."""
  return all_finite(x.value)


def guard_garbage(kernel: base.Attend, exact: base.Attend, keep: Keep = kept_unless,
                  check_first: Callable[[KernelInputs], jax.Array] | None = None) -> base.Attend:
  """`kernel` guarded: an output, or a gradient, that is not all finite is recomputed by `exact`
  (`keep(ok, value, recompute)` keeps the kernel's: `kept_unless`). One read of the output, not
  of q, k and v (a training step at 16k tokens spent 3% of its time reading them). With
  `check_first`, a call that is not differentiated asks it of the inputs instead and runs one of
  the two (`lax.cond`: no output kept across a branch). Gradients reach query, key, value and
  sinks."""

  def attend(x: KernelInputs, facts: Facts) -> KernelOutput:

    def outputs(f: base.Attend, y: KernelInputs) -> Callable[..., jax.Array]:
      return lambda q, k, v, s: f(y._replace(query=q, key=k, value=v, sinks=s), facts).out

    floats = lambda y: (y.query, y.key, y.value, y.sinks)

    @jax.custom_vjp
    def run(y):
      if check_first is not None:
        return jax.lax.cond(check_first(y), lambda y: outputs(kernel, y)(*floats(y)),
                            lambda y: outputs(exact, y)(*floats(y)), y)
      out = outputs(kernel, y)(*floats(y))
      return keep(all_finite(out), out, lambda: outputs(exact, y)(*floats(y)))

    def run_fwd(y):
      out, pull = jax.vjp(outputs(kernel, y), *floats(y))
      ok = all_finite(out)
      return keep(ok, out, lambda: outputs(exact, y)(*floats(y))), (y, pull, ok)

    def run_bwd(saved, cotangent):
      y, pull, ok = saved
      with base.kernel_precision(y.query.dtype):  # the kernel's backward is traced here
        grads = pull(cotangent)
      grads = keep(ok & all_finite(grads), grads,
                   lambda: jax.vjp(outputs(exact, y), *floats(y))[1](cotangent))
      none = jax.tree.map(lambda _: None, y)  # integer and boolean inputs get no cotangent
      return (none._replace(query=grads[0], key=grads[1], value=grads[2], sinks=grads[3]),)

    run.defvjp(run_fwd, run_bwd)
    return KernelOutput(run(x))

  return attend


def head_major(x: KernelInputs, facts: Facts) -> KernelInputs:
  """`x` as a head-major kernel reads it: q times the call's scale, q, k, v [B, H, T, D]."""
  scale = jnp.asarray(facts.config.scale(x.query.shape[-1]), x.query.dtype)
  return x._replace(query=base.to_bhtd(x.query * scale), key=base.to_bhtd(x.key),
                    value=base.to_bhtd(x.value))  # [B, H, T, D]


def exact_head_major(exact: base.Attend) -> base.Attend:
  """`exact` (an attend of [B, T, H, D] inputs) on `head_major` inputs: out [B, H, T, Dv]."""

  def attend(x: KernelInputs, facts: Facts) -> KernelOutput:
    unscaled = dataclasses.replace(facts, config=facts.config.replace(softmax_scale=1.0))
    back = x._replace(query=base.to_bhtd(x.query), key=base.to_bhtd(x.key),
                      value=base.to_bhtd(x.value))  # [B, T, H, D], q scaled
    return KernelOutput(base.to_bhtd(exact(back, unscaled).out))  # [B, H, T, Dv]

  return attend


def guard_head_major(kernel: base.Attend, exact: base.Attend,
                     values_first: bool = True) -> base.Attend:
  """An attend of [B, T, H, D] inputs: `kernel` (of `head_major` inputs, out [B, H, T, Dv])
  guarded on the arrays it reads, `exact` its recompute. Not differentiated (`values_first`),
  the call first asks whether the values are finite: a key or query the mask hides only reaches
  a kernel's logits, which it replaces by the mask value, so garbage a query should not see
  spreads through values alone (differentiated, q and k reach the gradients too: the outputs
  are checked there)."""
  guarded = guard_garbage(kernel, exact_head_major(exact),
                          check_first=values_finite if values_first else None)
  return lambda x, facts: KernelOutput(base.to_bhtd(guarded(head_major(x, facts), facts).out))
