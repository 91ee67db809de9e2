"""The shard_map wrapper: runs a per-shard kernel over a mesh with `attention_specs`."""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from splash_hk.sharding.axes import AxisEntry, MeshAxes
from splash_hk.sharding.specs import attention_specs
from splash_hk.sharding.specs import repeat_kv_heads
from splash_hk.types import Facts, KernelInputs, KernelOutput

_is_spec = lambda s: isinstance(s, PartitionSpec)


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
      its log-sum-exp stays in the shard.
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
    KernelOutput(out [B, T, Hq, Dv], None, weights or None), sharded like the query.
  """
  in_specs, out_specs, kv_repeats = attention_specs(x, mesh, axes, facts.mode, ring, ulysses)
  x = repeat_kv_heads(x, kv_repeats)
  if any(t == AxisType.Explicit for t in mesh.axis_types):
    x = jax.tree.map(lambda spec, a: jax.reshard(a, NamedSharding(mesh, spec)),
                     in_specs, x, is_leaf=_is_spec)
  out_specs = out_specs._replace(lse=None,
                                 weights=out_specs.weights if facts.return_weights else None)
  sequence: AxisEntry = in_specs.query[1]
  per_shard = lambda x: body(x, sequence)._replace(lse=None)
  return jax.shard_map(per_shard, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs,
                       check_vma=False)(x)
