"""Ring attention: the context-parallel loop over a sharded sequence, inside `shard_map`.

Every device keeps its query shard; key/value blocks (with their positions and
segment ids) travel around the ring with `jax.lax.ppermute`, the transfer of
the next block issued before the current one is computed, so a device holds
its own block and the one in flight, never the whole sequence. Each step is a
backend's `forward` on (local queries, current block), which also returns its
log-sum-exp; steps merge by it, and the sinks join once at the end. A custom
VJP runs the ring again backwards: dq stays, dK/dV travel with their blocks
and take one more hop home. Steps whose block no local query can see cost the
backend's schedule and nothing else (it computes no block pair).

`sharding/` builds the specs and hands this the sequence axis name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from splash_hk import kernel
from splash_hk import quant
from splash_hk.backends import base
from splash_hk.sharding.axes import AxisEntry
from splash_hk.types import Facts, KernelInputs, KernelOutput


def attend(backend: str, x: KernelInputs, axis: AxisEntry, *, facts: Facts) -> KernelOutput:
  """Attention of this device's queries to every device's keys: out [B, T/n, Hq, Dv].

  Args:
    backend: a backend with `forward`/`backward` halves (the selector checked it).
    x: this device's shard: queries and its own key/value block, both in
      sequence order along the axis, with their positions and segment ids.
    facts: the whole call's facts (`sequence_shards` is the ring's length).
    axis: the mesh axis (or axes) the sequence is sharded over.
  """
  halves = kernel.backend(backend)
  n = facts.sequence_shards

  @jax.custom_vjp
  def run(y):
    out, lse = _forward(halves, y, facts, axis, n)
    return out.astype(y.query.dtype), lse

  def run_fwd(y):
    out, lse = _forward(halves, y, facts, axis, n)
    return (out.astype(y.query.dtype), lse), (y, out, lse)

  def run_bwd(residuals, cotangents):
    y, out, lse = residuals
    d_out, d_lse = cotangents
    grads = _backward(halves, y, facts, axis, n, out, lse, d_out, d_lse)
    none = jax.tree.map(lambda _: None, y)
    return (none._replace(query=grads.dq, key=quant.cotangent(y.key, grads.dk),
                          value=quant.cotangent(y.value, grads.dv), sinks=grads.d_sinks,
                          bias=grads.d_bias),)

  run.defvjp(run_fwd, run_bwd)
  return KernelOutput(*run(x))


def _block(x: KernelInputs) -> tuple:
  """What travels: the key/value block, its positions, segment ids, the rule's key-side arrays
  and the keys' dropout indices."""
  kv_arrays = []
  if x.rule is not None:
    x.rule.map_arrays(lambda side, a, **_: kv_arrays.append(a) if side == "kv" else a)
  dropout_index = None if x.dropout is None else x.dropout.kv_index
  return (x.key, x.value, x.kv_positions, x.kv_segment_ids, tuple(kv_arrays), dropout_index)


def _with_block(x: KernelInputs, block: tuple) -> KernelInputs:
  key, value, positions, segment_ids, kv_arrays, dropout_index = block
  rule = x.rule
  if rule is not None:
    arrays = iter(kv_arrays)
    rule = rule.map_arrays(lambda side, a, **_: next(arrays) if side == "kv" else a)
  dropout = None if x.dropout is None else x.dropout._replace(kv_index=dropout_index)
  return x._replace(key=key, value=value, kv_positions=positions, kv_segment_ids=segment_ids,
                    rule=rule, sinks=None, dropout=dropout)


def _pass_on(tree, axis: AxisEntry, n: int):
  """Every device sends `tree` to the next one on the ring (device i -> i + 1)."""
  perm = [(i, (i + 1) % n) for i in range(n)]
  return jax.tree.map(lambda a: jax.lax.ppermute(a, axis, perm), tree)


def _merge(out, lse, step_out, step_lse):
  """Two partial softmaxes over disjoint keys -> one, by their log-sum-exps (`base`'s convention)."""
  new = jnp.logaddexp(lse, step_lse)
  safe = jnp.where(jnp.isfinite(new), new, 0.0)
  scale = lambda l: jnp.where(l == -jnp.inf, 0.0, jnp.exp(l - safe))[..., None]
  return out * scale(lse) + step_out * scale(step_lse), new


def _forward(halves: base.Backend, x: KernelInputs, facts: Facts, axis, n: int):
  """(out [B, T, Hq, Dv] f32, lse [B, T, Hq]) over every block of the ring, sinks included."""

  def step(block, out, lse):
    part = halves.forward(_with_block(x, block), facts)
    return _merge(out, lse, part.out, part.lse)

  def hop(_, carry):
    block, out, lse = carry
    incoming = _pass_on(block, axis, n)  # issued before this block's compute
    return (incoming, *step(block, out, lse))

  shape = (*x.query.shape[:3], x.value.shape[-1])
  init = (_block(x), jnp.zeros(shape, jnp.float32), jnp.full(shape[:3], -jnp.inf))
  block, out, lse = jax.lax.fori_loop(0, n - 1, hop, init)
  out, lse = step(block, out, lse)
  if x.sinks is None:
    return out, lse
  total = jnp.logaddexp(lse, base.sink_logsumexp(x.sinks))  # [B, T, Hq]
  return out * jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - total))[..., None], total


def _backward(halves: base.Backend, x: KernelInputs, facts: Facts, axis, n: int, out, lse,
              d_out, d_lse) -> base.Grads:
  """Each step's gradients from the global lse; dK/dV ride along, the bias's add up here."""
  delta = jnp.sum(d_out.astype(jnp.float32) * out, axis=-1) - d_lse  # [B, T, Hq]; out can go

  def step(block, dq, dkv, d_bias):
    grads = halves.backward(_with_block(x, block), facts, lse, d_out, delta,
                            into=base.Grads(dq, *dkv))
    d_bias = None if d_bias is None else jax.tree.map(jnp.add, d_bias, grads.d_bias)
    return grads.dq, (grads.dk, grads.dv), d_bias

  def hop(_, carry):
    block, dq, dkv, d_bias = carry
    dq, dkv, d_bias = step(block, dq, dkv, d_bias)
    return _pass_on(block, axis, n), dq, _pass_on(dkv, axis, n), d_bias

  dkv = (jnp.zeros(x.key.shape, jnp.float32), jnp.zeros(x.value.shape, jnp.float32))
  d_bias = None if x.bias is None else jax.tree.map(jnp.zeros_like, x.bias)
  init = (_block(x), jnp.zeros(x.query.shape, jnp.float32), dkv, d_bias)
  block, dq, dkv, d_bias = jax.lax.fori_loop(0, n - 1, hop, init)
  dq, dkv, d_bias = step(block, dq, dkv, d_bias)
  dk, dv = _pass_on(dkv, axis, n)  # the last hop home: block i's gradients back to device i
  return base.Grads(dq.astype(x.query.dtype), dk.astype(x.key.dtype), dv.astype(x.value.dtype),
                    base.sink_grads(x.sinks, lse, delta), d_bias)
