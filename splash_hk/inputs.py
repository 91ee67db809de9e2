"""The one normal form: validated public arguments -> KernelInputs + the call's static Facts.

`attention`, `explain` and `reference_attention` all enter here. `facts`
reads only shapes and dtypes (so `explain` works on ShapeDtypeStructs);
`normalise` also builds the arrays: explicit positions (end-aligned defaults;
with T == S one side given serves both, as segment ids do),
segment ids for both sides or neither, sinks as [Hq, n] float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from splash_hk import quant
from splash_hk import validation
from splash_hk.dropout import Dropout, key_words
from splash_hk.config import AttentionConfig
from splash_hk.sharding import specs
from splash_hk.sharding.axes import MeshAxes
from splash_hk.masks import _objects
from splash_hk.masks import _rules
from splash_hk.masks._chosen import CallIndex
from splash_hk.nodes import skeleton
from splash_hk.scores import Dense, Score
from splash_hk.types import Extras, Facts, KernelInputs, Shaped, as_score

__all__ = ("Extras", "facts", "normalise", "sinks")
QKV = ("query", "key", "value")


def compute_dtype(query: Shaped, key: Shaped, value: Shaped, config: AttentionConfig) -> Any:
  """The dtype a call computes in: the runtime dtype, else that of its first floating (not
  quantized) input, else float32 (quantized inputs dequantize to it, block by block)."""
  if config.runtime_dtype is not None:
    return jnp.dtype(config.runtime_dtype)
  plain = [a.dtype for a in (query, key, value) if not quant.is_quantized(a)]
  return jnp.dtype(plain[0]) if plain else jnp.dtype(jnp.float32)


def as_shapes(query: Shaped, key: Shaped, value: Shaped,
              config: AttentionConfig) -> tuple[Shaped, Shaped, Shaped]:
  """q, k, v with each quantized one (checked, naming it) as the shape and compute dtype it
  stands for: what the shape and dtype checks read."""
  if not any(quant.is_quantized(a) for a in (query, key, value)):
    return query, key, value
  dtype = compute_dtype(query, key, value, config)
  return tuple(quant.shaped(a, name, dtype) for a, name in zip((query, key, value), QKV))


def facts(query: Shaped, key: Shaped, value: Shaped, *, config: AttentionConfig, extras: Extras,
          mesh: jax.sharding.Mesh | None = None, axes: MeshAxes = MeshAxes(),
          return_weights: bool = False, return_residuals: bool = False,
          need_key: bool = True) -> Facts:
  """Validates the public arguments (shapes and dtypes only); returns the call's Facts.

  `need_key=False`: the call is only planned (`explain`), so dropout needs no key."""
  quantized = tuple(name for name, a in zip(QKV, (query, key, value)) if quant.is_quantized(a))
  storage = (quant.storage(key), quant.storage(value))
  given = (query, key, value)
  query, key, value = as_shapes(query, key, value, config)
  validation.validate_qkv(query, key, value, config)
  dtype = str(compute_dtype(*given, config))
  validation.validate_extras(query, key, extras)
  validation.validate_dropout(query, key, extras, config, need_key)
  # The facts keep the bias's skeleton: broadcast its shapes, not its arrays.
  extras = extras._replace(bias=full_bias(skeleton(as_score(extras.bias)), query.shape[1],
                                          key.shape[1]))
  if isinstance(extras.mask, _objects.Mask):
    validation.validate_rule(extras.mask, query, key, config)
  sequence_shards = head_shards = 1
  dropped: tuple[str, ...] = ()
  if mesh is not None:
    dropped = validation.validate_mesh(mesh, axes)
    sequence_shards = specs.query_sequence_shards(query.shape, mesh, axes)
    head_shards = specs.query_head_shards(query.shape, mesh, axes)
  if axes.load_balanced:
    specs.check_load_balanced(query.shape[1], key.shape[1], mesh, axes, sequence_shards)
  return Facts.from_shapes(
      config, query.shape, key.shape, value.shape[-1],
      explicit_dropout=config.dropout_rate > 0 and extras.dropout_mask is not None,
      default_positions=extras.q_positions is None and extras.kv_positions is None,
      mask=extras.mask, bias=extras.bias, return_weights=return_weights,
      return_residuals=return_residuals,
      sequence_shards=sequence_shards,
      load_balanced=axes.load_balanced, sequence_strategy=axes.sequence_strategy,
      head_shards=head_shards, quantized=quantized, storage=storage, dropped_axes=dropped,
      dtype=dtype, segments=extras.q_segment_ids is not None or extras.kv_segment_ids is not None)


def _rule(extras: Extras, config: AttentionConfig, call: Facts) -> _objects.Mask | None:
  """The call's position rule in normal form (`Mask.normal`, `Mask.for_call`): arrays bool for a
  dense mask or a map, else int32."""
  rule = _rules.call_rule(**config.rules, mask=extras.mask)
  if rule is None:
    return None
  index = CallIndex(call.query_shape[0], call.query_len, call.kv_len, call.num_heads,
                    call.num_kv_heads, *_token_indices(call))
  keeps_bool = lambda side, a: side == "qk" or (side in ("free", "head") and a.dtype == jnp.bool_)
  as_normal = lambda side, a, **_: jnp.asarray(
      a, jnp.bool_ if keeps_bool(side, jnp.asarray(a)) else jnp.int32)
  return rule.map_parts(lambda part: part.normal().for_call(index)).map_arrays(as_normal)


def _token_indices(call: Facts) -> tuple[jax.Array, jax.Array]:
  """Each query's and key's index in the call ([B, T], [B, S] int32): end-aligned order, or the
  tokens' original indices when they come load-balanced."""
  batch, query_len, kv_len = call.query_shape[0], call.query_len, call.kv_len
  kv_index = jnp.arange(kv_len, dtype=jnp.int32)
  if call.load_balanced:  # tokens in dual-chunk order: each keeps its original index (T == S)
    kv_index = jnp.asarray(_rules.load_balanced_order(kv_len, call.sequence_shards), jnp.int32)
    q_index = kv_index
  else:
    q_index = jnp.arange(query_len, dtype=jnp.int32)
  return (jnp.broadcast_to(q_index, (batch, query_len)),
          jnp.broadcast_to(kv_index, (batch, kv_len)))


def full_bias(bias: Shaped | Score | None, query_len: int, kv_len: int) -> Score | None:
  """A validated `bias` as a score object whose dense parts span [.., T, S] (axes of size 1
  broadcast: `Dense.filled`)."""
  score = as_score(bias)
  fill = lambda part: part.filled(query_len, kv_len) if isinstance(part, Dense) else part
  return None if score is None else score.map_parts(fill)


def _bias(extras: Extras, query_len: int, kv_len: int) -> Score | None:
  """The call's bias as a score object with jnp arrays (a dense array is `Dense(bias)`)."""
  score = full_bias(extras.bias, query_len, kv_len)
  return None if score is None else score.map_arrays(lambda side, a, **_: jnp.asarray(a))


def _dropout(extras: Extras, call: Facts) -> Dropout | None:
  """The call's dropout in kernel form (None at rate 0: the program of a call without it)."""
  if call.config.dropout_rate == 0:
    return None
  batch, query_len, kv_len = call.query_shape[0], call.query_len, call.kv_len
  token_q_index, kv_index = _token_indices(call)  # [B, T], [B, S]
  q_index = extras.dropout_q_index
  if q_index is None and call.load_balanced:  # T == S: each query keeps its token's index
    q_index = token_q_index
  elif q_index is None:  # end-aligned: query t has S - T + t (negative when T > S)
    q_index = jnp.broadcast_to(kv_len - query_len + jnp.arange(query_len, dtype=jnp.int32),
                               (batch, query_len))
  shared = extras.dropout_broadcast  # Flax's broadcast_dropout: one mask for every row and head
  index = lambda n: jnp.zeros(n, jnp.int32) if shared else jnp.arange(n, dtype=jnp.int32)
  mask = extras.dropout_mask
  return Dropout(
      key=None if mask is not None else key_words(extras.dropout_rng),  # [2] uint32
      rows=index(batch),  # [B]
      heads=index(call.num_heads),  # [Hq]
      q_index=jnp.asarray(q_index, jnp.int32),  # [B, T]
      kv_index=kv_index,  # [B, S]
      mask=None if mask is None else jnp.asarray(mask, jnp.bool_))  # [B|1, Hq|1, T, S]


def _arrays(query: Shaped, key: Shaped, value: Shaped, config: AttentionConfig,
            spread: bool) -> tuple[jax.Array, Any, Any]:
  """q, k, v as kernels take them: floats in the compute dtype, a quantized query dequantized,
  quantized keys and values kept (`quant.Quantized`, refusing gradients; with `spread`, their
  scales broadcast over batch, sequence and heads so they shard like their values)."""
  dtype = compute_dtype(query, key, value, config)
  arrays: list[Any] = []
  for name, given in zip(QKV, (query, key, value)):
    a = quant.checked(given, name)
    if isinstance(a, quant.Quantized) and name == "query":
      arrays.append(a.dequantize(dtype))  # [B, T, Hq, D]
    elif isinstance(a, quant.Quantized):
      arrays.append(quant.spread(a, (0, 1, 2)) if spread else a)
    else:
      arrays.append(jnp.asarray(a, dtype))
  return arrays[0], arrays[1], arrays[2]


def sinks(softmax_aux: Shaped | None, num_heads: int) -> jax.Array | None:
  """Sinks [Hq], [Hq, n] or [Hkv, n] (kv-head sinks serve their group) as [Hq, n] float32."""
  if softmax_aux is None:
    return None
  aux = jnp.asarray(softmax_aux, jnp.float32)
  aux = aux.reshape(aux.shape[0], -1)  # [Hq or Hkv, n]
  return jnp.repeat(aux, num_heads // aux.shape[0], axis=0)  # [Hq, n]


def normalise(query: Shaped, key: Shaped, value: Shaped, *, config: AttentionConfig, extras: Extras,
              mesh: jax.sharding.Mesh | None = None, axes: MeshAxes = MeshAxes(),
              return_weights: bool = False,
              return_residuals: bool = False) -> tuple[KernelInputs, Facts]:
  """Validated public arguments -> (KernelInputs with defaults filled in, Facts)."""
  call = facts(query, key, value, config=config, extras=extras, mesh=mesh, axes=axes,
               return_weights=return_weights, return_residuals=return_residuals)
  query, key, value = _arrays(query, key, value, config, spread=mesh is not None)
  batch = call.query_shape[0]
  q_pos, kv_pos = _rules.end_aligned_positions(batch, call.query_len, call.kv_len)
  if call.load_balanced:  # default positions are the tokens' original ones
    order = jnp.asarray(_rules.load_balanced_order(call.query_len, call.sequence_shards),
                        jnp.int32)
    q_pos = kv_pos = jnp.broadcast_to(order, (batch, call.query_len))
  as_int = lambda a, default=None: default if a is None else jnp.asarray(a, jnp.int32)
  q_seg = as_int(extras.q_segment_ids, as_int(extras.kv_segment_ids))  # only when T == S
  kv_seg = as_int(extras.kv_segment_ids, q_seg)
  if call.query_len == call.kv_len:  # positions mirror segment ids: one given serves both sides
    q_pos = kv_pos = as_int(extras.q_positions, as_int(extras.kv_positions, q_pos))
  x = KernelInputs(
      query=query,  # [B, T, Hq, D]
      key=key,  # [B, S, Hkv, D]
      value=value,  # [B, S, Hkv, Dv]
      q_positions=as_int(extras.q_positions, q_pos),  # [B, T]
      kv_positions=as_int(extras.kv_positions, kv_pos),  # [B, S]
      q_segment_ids=q_seg,  # [B, T] or None
      kv_segment_ids=kv_seg,  # [B, S] or None
      rule=_rule(extras, config, call),
      sinks=sinks(extras.softmax_aux, call.num_heads),  # [Hq, n] or None
      bias=_bias(extras, call.query_len, call.kv_len),  # a score object or None
      heads=None if extras.bias is None else jnp.arange(call.num_heads, dtype=jnp.int32),  # [Hq]
      dropout=_dropout(extras, call),
  )
  return x, call
