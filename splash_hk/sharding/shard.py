"""The shard_map wrapper: runs a per-shard kernel over a mesh with `attention_specs`."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from splash_hk.sharding.axes import AxisEntry, MeshAxes
from splash_hk.pages import PagedCall, PagedFacts, PagedKVCache
from splash_hk.sharding.specs import attention_specs
from splash_hk.sharding.specs import entry_size, stable_spec
from splash_hk.sharding.specs import repeat_kv_heads
from splash_hk.types import Facts, KernelInputs, KernelOutput

_is_spec = lambda s: isinstance(s, PartitionSpec)


def _jitted(sharded: Callable) -> Callable:
  """A shard_map, jitted: eagerly it runs op by op (~10x a compile here), and the xla path's
  custom VJP of a dense bias needs a traced one. Under the caller's jit it is inlined."""
  return jax.jit(sharded)


def shard_kernel(
    body: Callable[[KernelInputs, AxisEntry], KernelOutput],
    x: KernelInputs,
    *,
    mesh: Mesh,
    axes: MeshAxes,
    facts: Facts,
    ring: bool = False,
    ulysses: bool = False,
) -> KernelOutput:
  """Runs `body` on every shard of `x` and reassembles its output (and weights, if asked for).

  Args:
    body: (per-shard KernelInputs, the sequence axis entry or None) -> KernelOutput;
      its log-sum-exp leaves the shard only when the facts ask for it.
    x: global kernel inputs (BTHD).
    mesh: a mesh with Auto or Explicit axes; inputs with another sharding are
      resharded to the specs (Explicit meshes require it).
    axes: which mesh axes carry batch, heads and query sequence.
    facts: the call's facts (its mode: DECODE never shards the query axis; whether
      weights are returned).
    ring: keys/values stay sharded over the sequence axis (the body runs the ring).
    ulysses: keys/values stay sharded over the sequence axis and the sinks follow the
      heads each device attends (the body runs the all-to-alls).

  Returns:
    KernelOutput(out [B, T, Hq, Dv], lse [B, T, Hq] when the facts ask for it, weights or
    None), sharded like the query.
  """
  in_specs, out_specs, kv_repeats = attention_specs(x, mesh, axes, facts.mode, ring, ulysses)
  x = repeat_kv_heads(x, kv_repeats)
  if any(t == AxisType.Explicit for t in mesh.axis_types):
    x = jax.tree.map(lambda spec, a: jax.reshard(a, NamedSharding(mesh, spec)),
                     in_specs, x, is_leaf=_is_spec)
  lse = facts.return_residuals
  out_specs = out_specs._replace(lse=out_specs.lse if lse else None,
                                 weights=out_specs.weights if facts.return_weights else None)
  sequence: AxisEntry = in_specs.query[1]
  def per_shard(x: KernelInputs) -> KernelOutput:
    result = body(x, sequence)
    return result if lse else result._replace(lse=None)

  return _jitted(jax.shard_map(per_shard, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs,
                               check_vma=False))(x)


def shard_paged(
    step: Callable[[PagedCall, PagedFacts], tuple[jax.Array, PagedKVCache, jax.Array]],
    call: PagedCall,
    facts: PagedFacts,
    *,
    mesh: Mesh,
    axes: MeshAxes,
) -> tuple[jax.Array, PagedKVCache, jax.Array]:
  """Runs a paged `step` on every shard of heads: the query heads and the pool's kv heads over
  the head axis (`MeshAxes.heads`) where it divides the kv heads (else whole), the rest whole
  on every device.

  Returns:
    (out [N, Hq, Dv] sharded like the query, the cache sharded like the given one, lse
    [N, Hq] like the query).
  """
  heads = stable_spec((None, axes.heads), (facts.num_tokens, facts.num_kv_heads), mesh,
                      keep=(1,))[1]
  shards, whole = entry_size(heads, mesh), PartitionSpec()
  at_heads = lambda axis, ndim: PartitionSpec(*(heads if d == axis % ndim else None
                                                for d in range(ndim)))
  by_side = lambda side, a, axis=0: at_heads(axis, a.ndim) if side == "head" else whole
  specs: PagedCall[PartitionSpec] = PagedCall(
      query=at_heads(1, 3), key=jax.tree.map(lambda a: at_heads(1, 3), call.key),
      value=jax.tree.map(lambda a: at_heads(1, 3), call.value),
      cache=jax.tree.map(lambda a: at_heads(1, a.ndim), call.cache),  # [P, Hkv, ...]
      layout=jax.tree.map(lambda a: whole, call.layout),
      lists=jax.tree.map(lambda a: whole, call.lists),
      rule=None if call.rule is None else call.rule.map_arrays(lambda side, a: whole),
      bias=None if call.bias is None else call.bias.map_arrays(by_side),
      sinks=None if call.sinks is None else at_heads(0, 2), heads=at_heads(0, 1))
  n, num_heads, head_dim = facts.query_shape
  local = dataclasses.replace(
      facts, query_shape=(n, num_heads // shards, head_dim),
      cache_shape=(facts.cache_shape[0], facts.num_kv_heads // shards, *facts.cache_shape[2:]))
  return _jitted(jax.shard_map(lambda c: step(c, local), mesh=mesh, in_specs=(specs,),
                               out_specs=(at_heads(1, 3), specs.cache, at_heads(1, 2)),
                               check_vma=False))(call)
