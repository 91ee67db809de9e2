"""A computation chosen per lowering platform: one primitive whose lowering rule on each
platform runs that platform's branch.

`jax.export.export(jax.jit(f), platforms=["tpu"])` traces `f` once, on this host, and lowers
it for TPU: a choice made with `jax.default_backend()` at trace time is this host's, the wrong
program. `per_platform({"cpu": f_cpu, "tpu": f_tpu, ...}, x)` defers the choice to lowering:
each platform's rule lowers its own branch (its platforms narrowed, so a Pallas TPU kernel is
never lowered for CPU: one artifact for `["cpu", "tpu"]` holds each platform's program), and a
plain call lowers only this host's branch, the program it ran before.

`jax.lax.platform_dependent` is not enough on jax 0.10.2: it lowers the branch it keeps with
every platform of the module, so the TPU branch of a `["cpu", "tpu"]` export fails ("Only
interpret mode is supported on CPU backend").

Differentiation: the primitive sits under a custom VJP whose forward runs each platform's
`jax.vjp` and returns the union of their residuals (a branch emits zeros for the others'); the
backward runs the platform's own pullback on its own residuals. Lowered for one platform, the
others' residuals are dead code (XLA removes them): the host's gradient program is unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.extend import core
from jax.interpreters import batching
from jax.interpreters import mlir
import jax.numpy as jnp
import numpy as np

from splash_hk import platforms

# jax.export's platform names -> the hardware names branches are keyed by.
LOWERING_PLATFORMS = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


@dataclasses.dataclass(frozen=True)
class Unlowerable:
  """A branch that cannot be built on this host: lowering for its platform raises `reason`."""

  reason: str


Branch = Callable[[Any], Any] | Unlowerable  # a pytree -> a pytree (the same for every branch)


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a primitive's parameter
class _Flat:
  """Branches on flat lists of arrays, keyed by hardware, and their outputs' avals."""

  rules: Mapping[str, Callable[..., Sequence[jax.Array]] | Unlowerable]  # by hardware
  out_avals: tuple[Any, ...]


_choice_p = core.Primitive("splash_hk_per_platform")
_choice_p.multiple_results = True
_choice_p.def_impl(functools.partial(jax._src.dispatch.apply_primitive, _choice_p))  # pylint: disable=protected-access
_choice_p.def_abstract_eval(lambda *avals, flat, traced: flat.out_avals)


def _lower(platform: str) -> Callable[..., Sequence[Any]]:
  def rule(ctx: Any, *args: Any, flat: _Flat, traced: Any) -> Sequence[Any]:
    del traced
    branch = flat.rules[LOWERING_PLATFORMS[platform]]
    if isinstance(branch, Unlowerable):
      raise ValueError(f"cannot lower for {platform!r}: {branch.reason}")
    return mlir.lower_fun(branch, multiple_results=True)(ctx, *args)
  return rule


for _platform in LOWERING_PLATFORMS:
  mlir.register_lowering(_choice_p, _lower(_platform), platform=_platform)


def _batch(args: Sequence[Any], dims: Sequence[int | None], *, flat: _Flat,
           traced: Any) -> tuple[list[Any], list[int]]:
  """vmap: every branch vmapped over the same axes; outputs batched on axis 0."""
  del traced
  def vmapped(branch: Rule) -> Rule:
    if isinstance(branch, Unlowerable):
      return branch
    return lambda *a: jax.vmap(lambda *b: list(branch(*b)), in_axes=tuple(dims))(*a)
  outs = _bind({h: vmapped(b) for h, b in flat.rules.items()}, args)
  return outs, [0] * len(outs)


batching.primitive_batchers[_choice_p] = _batch


def _host() -> str:
  """This host's hardware: its branch states the primitive's avals."""
  return platforms.hardware(jax.default_backend()) or "cpu"


Rule = Callable[..., Sequence[Any]] | Unlowerable  # flat leaves -> flat leaves
Rules = Mapping[str, Rule]  # by hardware


def _bind(rules: Rules, leaves: Sequence[Any]) -> list[Any]:
  """Binds the primitive; its avals (and that branch's lowering) from tracing this host's
  branch, or the first other that can be (the host's then raises its reason when lowered)."""
  first = next(h for h in (_host(), *platforms.HARDWARE) if not isinstance(rules[h], Unlowerable))
  rule = rules[first]
  assert not isinstance(rule, Unlowerable)
  closed = jax.make_jaxpr(rule)(*leaves)
  rules = {**rules, first: core.jaxpr_as_fun(closed)}  # traced once: lowered as traced
  # `traced`, the traced branch, is visible to JAX's walks over sub-jaxprs (a mesh it uses then
  # sets the program's devices: without it a shard_map inside does not partition).
  return _choice_p.bind(*leaves, flat=_Flat(rules, tuple(closed.out_avals)), traced=closed)


def _flat_rules(branches: Mapping[str, Branch], in_tree: Any, out_trees: dict[str, Any]) -> Rules:
  """Branches on pytrees -> rules on flat leaves (each records its output's tree in
  `out_trees`), both by hardware."""
  missing = sorted(set(platforms.HARDWARE) - set(branches))
  if missing:
    raise ValueError(f"`branches` must have one branch per hardware {platforms.HARDWARE}; "
                     f"missing {missing}")

  def flat(hardware: str, branch: Branch) -> Rule:
    if isinstance(branch, Unlowerable):
      return branch
    def rule(*leaves: Any) -> list[Any]:
      out, out_trees[hardware] = jax.tree.flatten(branch(jax.tree.unflatten(in_tree, leaves)))
      return out
    return rule

  return {h: flat(h, branches[h]) for h in platforms.HARDWARE}


def _zeros(aval: Any) -> jax.Array:
  return jnp.zeros(aval.shape, aval.dtype)


def _halves(rules: Rules, leaves: Sequence[Any],
            inexact: Sequence[bool]) -> tuple[Rules, Rules, int]:
  """The forward rules (leaves -> outputs and the union of every branch's residuals, zeros in
  the others' places) and the backward rules (all residuals and the outputs' cotangents -> the
  inexact leaves' cotangents), both by hardware; and the number of outputs."""
  traced: dict[str, tuple[Any, Any, int]] = {}  # hardware -> (jaxpr, pullback tree, outputs)
  for hardware, rule in rules.items():
    if isinstance(rule, Unlowerable):
      continue
    trees: list[Any] = []
    def with_pullback(*leaves: Any, rule: Callable[..., Sequence[Any]] = rule,
                      trees: list[Any] = trees) -> list[Any]:
      out, pullback = jax.vjp(rule, *leaves)
      residuals, tree = jax.tree.flatten(pullback)
      trees[:] = [tree, len(out)]
      return [*out, *residuals]
    try:
      closed = jax.make_jaxpr(with_pullback)(*leaves)
    except Exception as error:  # pylint: disable=broad-except
      if hardware == _host():
        raise
      # Another platform's branch that fails to trace must not break this host's call: its
      # own lowering raises instead.
      rules = {**rules, hardware: Unlowerable(f"its branch failed to trace here: {error!r}")}
      continue
    traced[hardware] = (closed, *trees)
  slots = {h: closed.out_avals[n:] for h, (closed, _, n) in traced.items()}

  def forward(hardware: str) -> Rule:
    closed, _, n_out = traced[hardware]
    def rule(*leaves: Any) -> list[Any]:
      own = core.jaxpr_as_fun(closed)(*leaves)
      return own[:n_out] + [a for h in traced
                            for a in (own[n_out:] if h == hardware else map(_zeros, slots[h]))]
    return rule

  def backward(hardware: str) -> Rule:
    _, tree, n_out = traced[hardware]
    order = list(traced)
    start = sum(len(slots[h]) for h in order[:order.index(hardware)])
    def rule(*args: Any) -> list[Any]:
      residuals, cts = args[:-n_out], args[-n_out:]
      pullback = jax.tree.unflatten(tree, residuals[start:start + len(slots[hardware])])
      return [g for g, d in zip(pullback(list(cts)), inexact) if d]
    return rule

  pick = lambda half: {h: (r if isinstance(r, Unlowerable) else half(h)) for h, r in rules.items()}
  return pick(forward), pick(backward), next(n for _, _, n in traced.values())


def branches_of(choices: Mapping[str, Any], build: Callable[[Any], Branch]) -> dict[str, Branch]:
  """Each hardware's branch, `build(choice)`, from its choice; a str is the reason it has none
  (an `Unlowerable`)."""
  return {hardware: Unlowerable(choice) if isinstance(choice, str) else build(choice)
          for hardware, choice in choices.items()}


def per_platform(branches: Mapping[str, Branch], x: Any) -> Any:
  """`branches[h](x)` for the hardware `h` ("cpu", "gpu", "tpu") the program is lowered for.

  Every branch maps the pytree `x` to pytrees of one structure and avals (this host's branch
  states them; another's mismatch fails when it is lowered); an `Unlowerable` branch raises
  its reason when lowered. Differentiable in `x`'s inexact leaves (module docstring).
  """
  leaves, in_tree = jax.tree.flatten(x)
  out_trees: dict[str, Any] = {}
  rules = _flat_rules(branches, in_tree, out_trees)
  inexact = [jnp.issubdtype(jnp.result_type(a), jnp.inexact) for a in leaves]
  shapes = [np.shape(a) for a in leaves]
  backward_rules: list[Rules] = []

  @jax.custom_vjp
  def call(*leaves: Any) -> list[Any]:
    return _bind(rules, leaves)

  def forward(*leaves: Any) -> tuple[list[Any], list[Any]]:
    fwd, bwd, n_out = _halves(rules, leaves, inexact)
    backward_rules[:] = [bwd]
    outs = _bind(fwd, leaves)
    return outs[:n_out], outs[n_out:]

  def backward(residuals: list[Any], cts: Sequence[Any]) -> tuple[Any, ...]:
    grads = iter(_bind(backward_rules[0], [*residuals, *cts]))
    return tuple(next(grads) if d else np.zeros(s, jax.dtypes.float0)
                 for s, d in zip(shapes, inexact))

  call.defvjp(forward, backward)
  outs = call(*leaves)
  return jax.tree.unflatten(next(iter(out_trees.values())), outs)
