"""The shard_map wrapper: runs a per-shard kernel over a mesh with `attention_specs`."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from splash_hk.inputs import KernelInputs
from splash_hk.sharding.axes import MeshAxes
from splash_hk.sharding.specs import attention_specs
from splash_hk.types import Mode

_is_spec = lambda s: isinstance(s, PartitionSpec)


def shard_kernel(
    body: Callable[[KernelInputs], tuple[jax.Array, jax.Array | None]],
    x: KernelInputs,
    *,
    mesh: Mesh,
    axes: MeshAxes,
    mode: Mode,
    with_weights: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
  """Runs `body` on every shard of `x` and reassembles its outputs.

  Args:
    body: per-shard KernelInputs -> (output [b, h, t, Dv], weights [b, h, t, S] or None).
    x: global kernel inputs.
    mesh: a mesh with Auto or Explicit axes; inputs with another sharding are
      resharded to the specs (Explicit meshes require it).
    axes: which mesh axes carry batch, heads and query sequence.
    mode: the call's mode (DECODE never shards the query axis).
    with_weights: whether `body` returns weights (else its second output is None).

  Returns:
    (output [B, Hq, T, Dv], weights or None), sharded over batch/heads/sequence.
  """
  in_specs, out_spec, kv_repeats = attention_specs(x, mesh, axes, mode)
  if kv_repeats > 1:
    x = x._replace(key=jnp.repeat(x.key, kv_repeats, axis=1),  # [B, Hkv * r, S, D]
                   value=jnp.repeat(x.value, kv_repeats, axis=1))  # [B, Hkv * r, S, Dv]
  if any(t == AxisType.Explicit for t in mesh.axis_types):
    x = jax.tree.map(lambda spec, a: jax.reshard(a, NamedSharding(mesh, spec)),
                     in_specs, x, is_leaf=_is_spec)
  out_specs = (out_spec, out_spec if with_weights else None)
  return jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs,
                       check_vma=False)(x)
