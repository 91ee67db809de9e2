"""`attention` and `explain`: normalise -> select -> (shard) -> kernel.

The public functions name every per-call argument; below them one `Extras` value
carries the call's arrays (`attend`, `decide`: what the modules call).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from splash_hk import inputs
from splash_hk import kernel
from splash_hk import lowering
from splash_hk import platforms
from splash_hk import ring
from splash_hk import sharding
from splash_hk import ulysses
from splash_hk.config import AttentionConfig, staged
from splash_hk.fallback import selector
from splash_hk.masks import Mask
from splash_hk.masks._chosen import misused_rows
from splash_hk.nodes import Static
from splash_hk.scores import Score
from splash_hk.sharding.axes import AxisEntry
from splash_hk.types import Array, AttentionOutput, Decision, Extras, Facts, KernelInputs
from splash_hk.types import KernelOutput
from splash_hk.types import Shaped


def explain(
    query: Shaped,
    key: Shaped,
    value: Shaped,
    *,
    config: AttentionConfig = AttentionConfig(),
    q_segment_ids: Shaped | None = None,
    kv_segment_ids: Shaped | None = None,
    q_positions: Shaped | None = None,
    kv_positions: Shaped | None = None,
    mask: Shaped | Mask | None = None,
    bias: Shaped | Score | None = None,
    softmax_aux: Shaped | None = None,
    mesh: jax.sharding.Mesh | None = None,
    axes: sharding.MeshAxes = sharding.MeshAxes(),
    return_weights: bool = False,
    return_residuals: bool = False,
    dropout_rng: Any = None,
    dropout_mask: Shaped | None = None,
    for_platform: str | None = None,
) -> Decision:
  """The backend `attention` would use for these arguments, and why.

  Takes the same arguments as `attention`; arrays may be `jax.ShapeDtypeStruct` specs.
  Validates the inputs; with `allow_fallback=False` a fallback raises ValueError.
  `for_platform` ("cpu", "gpu" or "tpu"; jax.export's "cuda" and "rocm" name a GPU): the
  choice on that hardware instead of this host's (the decision table evaluated for it).
  """
  extras = Extras(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                  q_positions=q_positions, kv_positions=kv_positions, mask=mask, bias=bias,
                  softmax_aux=softmax_aux, dropout_rng=dropout_rng, dropout_mask=dropout_mask)
  return decide(query, key, value, extras, config=config, mesh=mesh, axes=axes,
                return_weights=return_weights, return_residuals=return_residuals,
                for_platform=for_platform)


def decide(query: Shaped, key: Shaped, value: Shaped, extras: Extras, *, config: AttentionConfig,
           mesh: jax.sharding.Mesh | None = None, axes: sharding.MeshAxes = sharding.MeshAxes(),
           return_weights: bool = False, return_residuals: bool = False,
           for_platform: str | None = None) -> Decision:
  """`explain` with the call's arrays as one `Extras`."""
  hardware = platforms.hardware(for_platform)
  facts = inputs.facts(query, key, value, config=config, extras=extras, mesh=mesh, axes=axes,
                       return_weights=return_weights, return_residuals=return_residuals,
                       need_key=False)
  return selector.select(facts, hardware)


def attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    config: AttentionConfig = AttentionConfig(),
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    mask: Array | Mask | None = None,
    bias: Array | Score | None = None,
    softmax_aux: Array | None = None,
    mesh: jax.sharding.Mesh | None = None,
    axes: sharding.MeshAxes = sharding.MeshAxes(),
    return_weights: bool = False,
    return_residuals: bool = False,
    dropout_rng: Any = None,
    dropout_mask: Array | None = None,
) -> AttentionOutput:
  """Block-sparse ("splash") attention on the fastest backend that can serve the call.

  Glossary of shapes:
  - B: batch size; T: query length; S: key/value length.
  - Hq: query heads; Hkv: key/value heads (Hq % Hkv == 0: GQA/MQA).
  - D: query/key head dim; Dv: value head dim (may differ from D).

  Key j is visible to query i when the position rule (the config's causal,
  sliding window and chunk with a dense mask, or a mask object) and the
  segments allow it (see `splash_hk.masks`),
  with positions end-aligned by default: `kv_positions = arange(S)`,
  `q_positions = arange(T) + S - T`, so decode and chunked prefill against a
  KV cache need no extra arguments. Rows that see no key output exactly 0.

  Args:
    query: [B, T, Hq, D].
    key: [B, S, Hkv, D].
    value: [B, S, Hkv, Dv].
    config: an AttentionConfig (static: mask rules, scale, soft cap, platform).
    q_segment_ids: [B, T] int; equal ids attend, negative ids are padding.
    kv_segment_ids: [B, S] int; defaults to `q_segment_ids` when S == T.
    q_positions: [B, T] int positions of the queries; when S == T and only
      `kv_positions` is given, they default to it (as segment ids do).
    kv_positions: [B, S] int positions of the keys; when S == T, defaults to
      `q_positions` (packed documents with restarting positions need only one).
    mask: [B, 1 or Hq, T, S] bool, True = may attend (ANDed with the config's
      rules); or a mask object (`splash_hk.masks.Causal() | Bidirectional(ids)`,
      ...), the whole position rule: the config then states none.
    bias: added to the scaled logits before the soft cap: [B|1, Hq|1, T, S] float, or a
      score object (`splash_hk.scores.Alibi(slopes)`, `RelativePosition(table)`,
      `ScoreFn(fn, params)`, `Dense(array)`, added with `+`), computed per block from
      positions; read only where a pair is visible (a -inf bias removes its pair).
    softmax_aux: attention sinks, [Hq], [Hq, n] or [Hkv, n]: logits that join
      the softmax denominator and add nothing to the output.
    mesh: if given, the kernel runs under `jax.shard_map` over this mesh (Auto
      or Explicit axes), batch and heads sharded as `axes` says wherever they
      divide; the result equals the unsharded one.
    axes: which mesh axes carry batch, heads and (optionally) query sequence.
    return_weights: also return the [B, Hq, T, S] weights (reference path only).
    return_residuals: also return `lse` [B, T, Hq] (float32, differentiable): the
      log-sum-exp of each row's visible logits and sinks, -inf for a row that sees nothing;
      `merge_attention` combines outputs over disjoint keys by it. Served by the xla and
      reference backends (others fall back, saying so), under every mesh.
    dropout_rng: with `AttentionConfig(dropout_rate=p)`, a jax.random key (may be traced):
      each visible pair is kept with probability 1 - p by a hash of the key and the pair's
      global coordinates (`splash_hk.dropout_mask` draws it densely), kept probabilities
      scaled by 1 / (1 - p): the same mask on every backend, tile and mesh.
    dropout_mask: [B|1, Hq|1, T, S] bool (True = keep) in place of the hash (needs p > 0).

  Returns:
    AttentionOutput with `attention_outputs` [B, T, Hq, Dv] in the input (or
    runtime) dtype, `attention_weights` and `lse` (each None unless asked for).
  """
  extras = Extras(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                  q_positions=q_positions, kv_positions=kv_positions, mask=mask, bias=bias,
                  softmax_aux=softmax_aux, dropout_rng=dropout_rng, dropout_mask=dropout_mask)
  return attend(query, key, value, extras, config=config, mesh=mesh, axes=axes,
                return_weights=return_weights, return_residuals=return_residuals)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _whole(backend: str, x: KernelInputs, facts: Static) -> KernelOutput:
  """A backend on the whole eager call, jitted: one compile (cached per facts) instead of one
  per operation."""
  return kernel.run(backend, x, facts.value)


def _misuse_as_nan(result: KernelOutput, rule: Mask | None) -> KernelOutput:
  """The query rows whose chosen blocks (`masks.Blocks`) break the rules output NaN (their lse
  too): under `jit` a misuse is visible, never a finite wrong answer."""
  bad = misused_rows(rule)  # [B|1, T, Hq] or None
  if bad is None:
    return result
  lse = None if result.lse is None else jnp.where(bad, jnp.nan, result.lse)
  return result._replace(out=jnp.where(bad[..., None], jnp.nan, result.out), lse=lse)


def attend(query: Array, key: Array, value: Array, extras: Extras, *,
           config: AttentionConfig, mesh: jax.sharding.Mesh | None = None,
           axes: sharding.MeshAxes = sharding.MeshAxes(),
           return_weights: bool = False, return_residuals: bool = False) -> AttentionOutput:
  """`attention` with the call's arrays as one `Extras`: the backend chosen per lowering
  platform (`splash_hk.lowering`) where the platforms' choices differ."""
  x, facts = inputs.normalise(query, key, value, config=config, extras=extras, mesh=mesh,
                              axes=axes, return_weights=return_weights,
                              return_residuals=return_residuals)
  decisions = selector.per_platform(lambda hardware: selector.select(facts, hardware))
  host = decisions[jax.default_backend()]
  run = functools.partial(_run, facts=facts, mesh=mesh, axes=axes)
  if selector.same_program(decisions):
    assert isinstance(host, Decision), "per_platform raises when no hardware has a decision"
    selector.log_fallback(host)
    result = run(host, x)
  elif mesh is None and not staged(x):
    result = _whole_per_platform(tuple(decisions.items()), x, Static(facts))
  else:
    result = _per_platform(decisions, x, run)
  result = _misuse_as_nan(result, x.rule)
  lse = result.lse if return_residuals else None  # [B, T, Hq]
  return AttentionOutput(result.out, result.weights, lse)  # [B, T, Hq, Dv], [B, Hq, T, S]


def _per_platform(decisions: dict[str, Decision | str], x: KernelInputs,
                  run: Callable[[Decision, KernelInputs], KernelOutput]) -> KernelOutput:
  """`run` with each hardware's decision, one program per lowering platform."""
  return lowering.per_platform(lowering.branches_of(decisions, lambda d: functools.partial(run, d)),
                               x)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _whole_per_platform(decisions: tuple[tuple[str, Decision | str], ...], x: KernelInputs,
                        facts: Static) -> KernelOutput:
  """`_per_platform` on a whole eager call, jitted: one compile per decisions and facts."""
  run = functools.partial(_run, facts=facts.value, mesh=None, axes=sharding.MeshAxes())
  return _per_platform(dict(decisions), x, run)


def _run(decision: Decision, x: KernelInputs, *, facts: Facts, mesh: jax.sharding.Mesh | None,
         axes: sharding.MeshAxes) -> KernelOutput:
  """`decision`'s backend (and sequence strategy) on the call; the output has the fields the
  call asked for (the same on every backend: `out`, `lse` with residuals, `weights`)."""
  if mesh is None and staged(x):
    result = kernel.run(decision.backend, x, facts)
  elif mesh is None:
    result = _whole(decision.backend, x, Static(facts))
  else:
    body: Callable[[KernelInputs, AxisEntry], KernelOutput]
    if decision.ring:
      body = functools.partial(ring.attend, decision.backend, facts=facts)
    elif decision.ulysses:
      body = functools.partial(ulysses.attend, decision.backend, facts=facts.on_whole_sequence())
    else:
      body = lambda y, _: kernel.run(decision.backend, y, facts)
    result = sharding.shard_kernel(body, x, mesh=mesh, axes=axes, facts=facts,
                                   ring=decision.ring, ulysses=decision.ulysses)
  return KernelOutput(result.out, result.lse if facts.return_residuals else None,
                      result.weights if facts.return_weights else None)
