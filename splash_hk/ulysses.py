"""Ulysses context parallelism: swap the sharded axis from sequence to heads, inside `shard_map`.

One all-to-all turns this device's sequence shard of q, k, v `[B, T/n, H, D]`
into the whole sequence of its share of the heads `[B, T, H/n, D]`; the
backend runs unchanged (any backend: the accelerator kernel stays); one
all-to-all turns the output back. Positions, segment ids and a mask object's
arrays are gathered (a dense mask arrives with the heads it serves); sinks
arrive sharded with their heads (`sharding.attention_specs`). Gradients are
autodiff of the same program: an all-to-all's transpose is the reverse one.

`sharding/` builds the specs and hands this the sequence axis name.
"""

from __future__ import annotations

import jax

from splash_hk import kernel
from splash_hk.sharding.axes import AxisEntry
from splash_hk.sharding.specs import kv_head_repeats
from splash_hk.sharding.specs import repeat_kv_heads
from splash_hk.types import Facts, KernelInputs, KernelOutput


def attend(backend: str, x: KernelInputs, axis: AxisEntry, *, facts: Facts) -> KernelOutput:
  """This device's query shard attending every key, computed head-sharded: out [B, T/n, Hq, Dv].

  Args:
    backend: any backend; it sees the whole sequence and Hq / n of this shard's heads.
    x: this device's shard: queries and keys/values of its sequence shard (in sequence
      order along the axis), with their positions and segment ids; sinks of the
      heads it attends.
    axis: the mesh axis (or axes) the sequence is sharded over.
    facts: the call's facts as the kernel sees them (`Facts.on_whole_sequence`).
  """
  # Only as many kv-head copies as make the kv heads split with their query heads.
  x = repeat_kv_heads(x, kv_head_repeats(x.query.shape[2], x.key.shape[2],
                                         facts.sequence_shards))
  to_heads = lambda a: jax.tree.map(lambda t: jax.lax.all_to_all(t, axis, 2, 1, tiled=True), a)
  gather = lambda a: None if a is None else _gather(a, axis, 1)
  whole: KernelInputs = x._replace(
      query=to_heads(x.query),  # [B, T, Hq/n, D]
      key=to_heads(x.key),  # [B, S, Hkv * r / n, D]
      value=to_heads(x.value),  # [B, S, Hkv * r / n, Dv]
      q_positions=_gather(x.q_positions, axis, 1),  # [B, T]
      kv_positions=_gather(x.kv_positions, axis, 1),  # [B, S]
      q_segment_ids=gather(x.q_segment_ids),  # [B, T]
      kv_segment_ids=gather(x.kv_segment_ids),  # [B, S]
      rule=None if x.rule is None else x.rule.map_arrays(
          lambda side, a, **_: _whole_rule_array(side, a, axis)),
      bias=None if x.bias is None else x.bias.map_arrays(
          lambda side, a, **_: _whole_rule_array(side, a, axis) if side == "qk" else a),
      dropout=None if x.dropout is None else x.dropout._replace(
          q_index=_gather(x.dropout.q_index, axis, 1),  # [B, T]
          kv_index=_gather(x.dropout.kv_index, axis, 1),  # [B, S]
          mask=None if x.dropout.mask is None else _whole_rule_array("qk", x.dropout.mask, axis)))
  result = kernel.run(backend, whole, facts)  # out [B, T, Hq/n, Dv], lse [B, T, Hq/n]
  back = lambda a: jax.lax.all_to_all(a, axis, 1, 2, tiled=True)  # [B, T/n, Hq, ...]
  lse = result.lse if facts.return_residuals and result.lse is not None else None
  return KernelOutput(back(result.out), None if lse is None else back(lse))


def _whole_rule_array(side: str, a: jax.Array, axis: AxisEntry) -> jax.Array:
  """A mask object's array for the whole sequence and this device's heads."""
  if side in ("free", "head"):  # whole along the sequence already ("head": this device's heads)
    return a
  if side != "qk":
    return _gather(a, axis, 1)  # [B, T] or [B, S]
  if a.shape[1] == 1:  # one mask for every head: all its rows
    return _gather(a, axis, 2)  # [B, 1, T, S]
  return jax.lax.all_to_all(a, axis, 1, 2, tiled=True)  # [B, Hq/n, T, S]


def _gather(a: jax.Array, axis: AxisEntry, dim: int) -> jax.Array:
  """`a` whole along `dim` (its sequence dimension), from every device's shard."""
  return jax.lax.all_gather(a, axis, axis=dim, tiled=True)
