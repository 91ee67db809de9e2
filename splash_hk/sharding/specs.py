"""PartitionSpecs that are always valid for their tensors.

Specs here are for kernel-layout (BHTD) tensors: dimension 0 is batch and
dimension 1 is heads, which `stable_spec` keeps sharded wherever it can.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from jax.sharding import PartitionSpec

from splash_hk.inputs import KernelInputs
from splash_hk.sharding.axes import AxisEntry, MeshAxes, _as_tuple
from splash_hk.types import Mode

Mesh = Any  # jax.sharding.Mesh or AbstractMesh: anything with .shape {name: size}


def _entry(names: Sequence[str]) -> AxisEntry:
  return None if not names else names[0] if len(names) == 1 else tuple(names)


def entry_size(entry: AxisEntry, mesh: Mesh) -> int:
  """How many shards a spec entry splits a dimension into on `mesh`."""
  return math.prod(mesh.shape[n] for n in _as_tuple(entry))


def stable_spec(
    spec: PartitionSpec | Sequence[AxisEntry],
    shape: Sequence[int],
    mesh: Mesh,
    keep: Sequence[int] = (0, 1),
) -> PartitionSpec:
  """`spec` with every mesh axis it cannot use dropped, so it is valid for `shape`.

  Within each entry, axis by axis, an axis is dropped when it is not in the
  mesh, is already used by another dimension, or would leave the dimension
  indivisible by the product of the axes kept so far. The dimensions in `keep`
  (batch and heads in kernel layout) are served first, so they keep their
  axes wherever those divide them, and an axis named twice goes to them.

  Raises:
    ValueError: if `spec` has more entries than `shape` has dimensions.
  """
  entries = list(spec)
  if len(entries) > len(shape):
    raise ValueError(f"stable_spec: spec {PartitionSpec(*entries)} has {len(entries)} entries but "
                     f"the tensor has rank {len(shape)} (shape {tuple(shape)}).")
  entries += [None] * (len(shape) - len(entries))
  order = [i for i in keep if 0 <= i < len(shape)]
  order += [i for i in range(len(shape)) if i not in order]
  used: set[str] = set()
  out: list[AxisEntry] = [None] * len(shape)
  for dim in order:
    kept, size = [], 1
    for name in _as_tuple(entries[dim]):
      if name in mesh.shape and name not in used and shape[dim] % (size * mesh.shape[name]) == 0:
        kept.append(name)
        used.add(name)
        size *= mesh.shape[name]
    out[dim] = _entry(kept)
  return PartitionSpec(*out)


def query_sequence_shards(query_shape: Sequence[int], mesh: Mesh, axes: MeshAxes) -> int:
  """How many shards the query sequence of a public [B, T, Hq, D] query is split into."""
  batch, query_len, num_heads, head_dim = query_shape
  if query_len == 1:
    return 1
  spec = stable_spec((axes.batch, axes.heads, axes.sequence), (batch, num_heads, query_len, head_dim),
                     mesh)
  return entry_size(spec[2], mesh)


def kv_head_repeats(num_heads: int, num_kv_heads: int, head_shards: int) -> int:
  """How often to repeat each kv head so the kv heads split evenly with their query heads.

  With `head_shards` dividing `num_heads`, shard j holds query heads
  [j * Hq / n, (j + 1) * Hq / n); repeating every kv head r = n / gcd(Hkv, n)
  times puts exactly their kv heads on the same shard, and r divides the
  group size Hq / Hkv, so grouping stays exact.
  """
  return head_shards // math.gcd(num_kv_heads, head_shards)


def attention_specs(
    x: KernelInputs,
    mesh: Mesh,
    axes: MeshAxes,
    mode: Mode,
) -> tuple[KernelInputs, PartitionSpec, int]:
  """Specs for every kernel input and the output, and the kv-head repeat factor.

  Args:
    x: the (global) kernel inputs; only shapes are read.
    mesh: the device mesh.
    axes: which mesh axes carry batch, heads and query sequence.
    mode: DECODE never shards the query axis.

  Returns:
    (in_specs, out_spec, kv_repeats): a KernelInputs of PartitionSpecs (None
    where the input is None), the output [B, Hq, T, Dv] spec, and how often
    each kv head must be repeated before sharding (see `kv_head_repeats`).
  """
  batch, num_heads, query_len, _ = x.query.shape
  num_kv_heads = x.key.shape[1]
  sequence = None if mode is Mode.DECODE else axes.sequence
  q_spec = stable_spec((axes.batch, axes.heads, sequence), x.query.shape, mesh)
  batch_entry, head_entry, seq_entry = q_spec[0], q_spec[1], q_spec[2]
  repeats = kv_head_repeats(num_heads, num_kv_heads, entry_size(head_entry, mesh))
  kv_spec = PartitionSpec(batch_entry, head_entry, None, None)
  q_rows = PartitionSpec(batch_entry, seq_entry)
  kv_rows = PartitionSpec(batch_entry, None)
  mask_spec = None
  if x.mask is not None:
    mask_spec = PartitionSpec(batch_entry if x.mask.shape[0] == batch else None,
                              head_entry if x.mask.shape[1] == num_heads else None,
                              seq_entry, None)
  present = lambda value, spec: None if value is None else spec
  in_specs = KernelInputs(
      query=PartitionSpec(batch_entry, head_entry, seq_entry, None),
      key=kv_spec,
      value=kv_spec,
      q_positions=q_rows,
      kv_positions=kv_rows,
      q_segment_ids=present(x.q_segment_ids, q_rows),
      kv_segment_ids=present(x.kv_segment_ids, kv_rows),
      mask=present(x.mask, mask_spec),
      sinks=present(x.sinks, PartitionSpec(head_entry, None)),
  )
  return in_specs, PartitionSpec(batch_entry, head_entry, seq_entry, None), repeats
