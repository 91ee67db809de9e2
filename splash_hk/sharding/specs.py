"""PartitionSpecs that are always valid for their tensors.

`stable_spec` keeps the batch and head dimensions sharded wherever it can;
its default `keep=(0, 1)` suits BHTD tensors, and the attention specs (for the
BTHD normal form) keep dimensions 0 and 2 (`BTHD_KEEP`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from splash_hk.sharding.axes import AxisEntry, MeshAxes, _as_tuple
from splash_hk.types import KernelInputs, KernelOutput, Mode

Mesh = Any  # jax.sharding.Mesh or AbstractMesh: anything with .shape {name: size}
BTHD_KEEP = (0, 2)  # batch and heads of a [B, T, H, D] tensor


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
  if query_shape[1] == 1:
    return 1
  spec = stable_spec((axes.batch, axes.sequence, axes.heads), query_shape, mesh, keep=BTHD_KEEP)
  return entry_size(spec[1], mesh)


def query_head_shards(query_shape: Sequence[int], mesh: Mesh, axes: MeshAxes) -> int:
  """How many shards the heads of a public [B, T, Hq, D] query are split into (the head axis)."""
  spec = stable_spec((axes.batch, None, axes.heads), query_shape, mesh, keep=BTHD_KEEP)
  return entry_size(spec[2], mesh)


def check_load_balanced(query_len: int, kv_len: int, mesh: Mesh | None, axes: MeshAxes,
                        shards: int) -> None:
  """load_balanced=True needs self-attention over a sequence that the mesh really splits."""
  fix = "pass inputs in contiguous order with MeshAxes(load_balanced=False)"
  if query_len != kv_len:
    raise ValueError(f"MeshAxes(load_balanced=True) needs self-attention (query_len == kv_len), "
                     f"got query_len {query_len}, kv_len {kv_len}; {fix} (decode and prefill "
                     "against a cache are never load-balanced).")
  if mesh is None or shards == 1:
    where = "mesh=None" if mesh is None else (
        f"sequence axis {axes.sequence!r} does not split query_len {query_len} on the mesh "
        f"{dict(mesh.shape)} (missing, not dividing it, or taken by batch/heads)")
    raise ValueError(f"MeshAxes(load_balanced=True) needs a mesh whose sequence axis splits the "
                     f"sequence into shards, but {where}; {fix}.")
  if query_len % (2 * shards):
    raise ValueError(f"MeshAxes(load_balanced=True): query_len {query_len} must be a multiple of "
                     f"2 * {shards} sequence shards (two chunks per shard); pad the sequence.")


def kv_head_repeats(num_heads: int, num_kv_heads: int, head_shards: int) -> int:
  """How often to repeat each kv head so the kv heads split evenly with their query heads.

  With `head_shards` dividing `num_heads`, shard j holds query heads
  [j * Hq / n, (j + 1) * Hq / n); repeating every kv head r = n / gcd(Hkv, n)
  times puts exactly their kv heads on the same shard, and r divides the
  group size Hq / Hkv, so grouping stays exact.
  """
  return head_shards // math.gcd(num_kv_heads, head_shards)


def repeat_kv_heads(x: KernelInputs, repeats: int) -> KernelInputs:
  """x with every kv head repeated `repeats` times in place (see `kv_head_repeats`)."""
  if repeats == 1:
    return x
  repeat = lambda a: jax.tree.map(lambda t: jnp.repeat(t, repeats, axis=2), a)  # quantized too
  return x._replace(key=repeat(x.key),  # [B, S, Hkv * r, D]
                    value=repeat(x.value))  # [B, S, Hkv * r, Dv]


def attention_specs(
    x: KernelInputs,
    mesh: Mesh,
    axes: MeshAxes,
    mode: Mode,
    ring: bool = False,
    ulysses: bool = False,
) -> tuple[KernelInputs[PartitionSpec], KernelOutput[PartitionSpec], int]:
  """Specs for every kernel input and output, and the kv-head repeat factor.

  Args:
    x: the (global) kernel inputs, BTHD; only shapes are read.
    mesh: the device mesh.
    axes: which mesh axes carry batch, heads and query sequence.
    mode: DECODE never shards the query axis.
    ring: keys/values (and their positions and segment ids) are sharded over the
      sequence axes too (context-parallel ring); otherwise every shard gets them whole.
    ulysses: keys/values are sharded over the sequence axes too, and the sinks (and the
      bias's per-head arrays, and the heads' indices) over the head axes then the sequence
      axes (the heads each device attends after the all-to-all).

  Returns:
    The tuple (in_specs, out_specs, kv_repeats), with in_specs a KernelInputs of
    PartitionSpecs (None where the input is None), out_specs a KernelOutput of specs for
    the output [B, T, Hq, Dv], the log-sum-exp [B, T, Hq] and the weights [B, Hq, T, S],
    and kv_repeats how often each kv head must be repeated before sharding.
  """
  batch, _, num_heads, _ = x.query.shape
  sequence = None if mode is Mode.DECODE else axes.sequence
  q_spec = stable_spec((axes.batch, sequence, axes.heads), x.query.shape, mesh, keep=BTHD_KEEP)
  batch_entry, seq_entry, head_entry = q_spec[0], q_spec[1], q_spec[2]
  repeats = kv_head_repeats(num_heads, x.key.shape[2], entry_size(head_entry, mesh))
  kv_seq = seq_entry if ring or ulysses else None
  sink_heads = _entry(_as_tuple(head_entry) + _as_tuple(seq_entry)) if ulysses else head_entry
  kv_spec = PartitionSpec(batch_entry, kv_seq, head_entry, None)
  q_rows = PartitionSpec(batch_entry, seq_entry)
  kv_rows = PartitionSpec(batch_entry, kv_seq)
  side_spec = {"q": lambda a: q_rows, "kv": lambda a: kv_rows,
               "qk": lambda a: PartitionSpec(batch_entry if a.shape[0] == batch else None,
                                             head_entry if a.shape[1] == num_heads else None,
                                             seq_entry, None)}
  bias_spec: dict[str, Callable[..., PartitionSpec]] = {
               "qk": side_spec["qk"], "free": lambda a: PartitionSpec(),
               "head": lambda a, axis: PartitionSpec(*(sink_heads if d == axis else None
                                                       for d in range(len(a.shape))))}
  present = lambda value, spec: None if value is None else spec
  in_specs: KernelInputs[PartitionSpec] = KernelInputs(
      query=PartitionSpec(batch_entry, seq_entry, head_entry, None),
      key=jax.tree.map(lambda a: kv_spec, x.key),  # a quantized one's scale: spread like it
      value=jax.tree.map(lambda a: kv_spec, x.value),
      q_positions=q_rows,
      kv_positions=kv_rows,
      q_segment_ids=present(x.q_segment_ids, q_rows),
      kv_segment_ids=present(x.kv_segment_ids, kv_rows),
      rule=None if x.rule is None else x.rule.map_arrays(
          lambda side, a, **axis: (side_spec | bias_spec)[side](a, **axis)),
      sinks=present(x.sinks, PartitionSpec(sink_heads, None)),
      bias=None if x.bias is None else x.bias.map_arrays(
          lambda side, a, **axis: bias_spec[side](a, **axis)),
      heads=present(x.heads, PartitionSpec(sink_heads)),
      dropout=None if x.dropout is None else x.dropout._replace(
          key=present(x.dropout.key, PartitionSpec()), rows=PartitionSpec(batch_entry),
          heads=PartitionSpec(sink_heads), q_index=q_rows, kv_index=kv_rows,
          mask=present(x.dropout.mask, None if x.dropout.mask is None
                       else side_spec["qk"](x.dropout.mask))),
  )
  out_specs: KernelOutput[PartitionSpec] = KernelOutput(out=PartitionSpec(batch_entry, seq_entry, head_entry, None),
                           lse=PartitionSpec(batch_entry, seq_entry, head_entry),
                           weights=PartitionSpec(batch_entry, head_entry, seq_entry, None))
  return in_specs, out_specs, repeats
