"""Checks at the edge: every bad input becomes a ValueError naming the argument.

All checks read only `.shape` and `.dtype`, so they run at trace time (and on
`jax.ShapeDtypeStruct`s, for `explain`).
"""

from __future__ import annotations

from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp

from splash_hk.masks import _objects
from splash_hk.config import AttentionConfig
from splash_hk.sharding.axes import MeshAxes, dropped_names
from splash_hk.types import Extras, as_score

Shaped = Any  # anything with .shape and .dtype


def fail(message: str):
  raise ValueError(message)


def array(x: Any, name: str, layout: str) -> None:
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    fail(f"`{name}` must be an array {layout} (a jax.Array or np.ndarray), got "
          f"{type(x).__name__}; wrap it with jnp.asarray.")


def _chex(check: Callable[[], None], message: str) -> None:
  """Runs a chex assertion; a failure is a ValueError that starts with `message` (chex's after)."""
  try:
    check()
  except AssertionError as e:
    raise ValueError(f"{message} ({e})") from None


def rank(x: Shaped, rank: int, name: str, layout: str) -> None:
  array(x, name, layout)
  _chex(lambda: chex.assert_rank(x, rank),
        f"`{name}` must be {layout}, got shape {tuple(x.shape)}.")


def integer(x: Shaped, name: str) -> None:
  if not jnp.issubdtype(x.dtype, jnp.integer):
    fail(f"`{name}` must have an integer dtype, got {x.dtype}; pass it as "
          f"{name}.astype(jnp.int32).")


def validate_qkv(query: Shaped, key: Shaped, value: Shaped, config: AttentionConfig) -> None:
  """query [B, T, Hq, D], key [B, S, Hkv, D], value [B, S, Hkv, Dv]."""
  if not isinstance(config, AttentionConfig):
    fail(f"`config` must be a splash_hk.AttentionConfig, got {type(config).__name__}.")
  rank(query, 4, "query", "[batch, query_len, num_heads, head_dim]")
  rank(key, 4, "key", "[batch, kv_len, num_kv_heads, head_dim]")
  rank(value, 4, "value", "[batch, kv_len, num_kv_heads, value_head_dim]")
  batch, _, num_heads, head_dim = query.shape
  num_kv_heads, key_dim = key.shape[2:]
  if min(query.shape) < 1 or min(key.shape) < 1 or min(value.shape) < 1:
    fail(f"`query`, `key` and `value` must have no empty axis, got query {tuple(query.shape)}, "
          f"key {tuple(key.shape)}, value {tuple(value.shape)}.")
  if key.shape[0] != batch or value.shape[0] != batch:
    fail(f"`key` and `value` must have the batch size of `query` ({batch}), got key "
          f"{tuple(key.shape)}, value {tuple(value.shape)}.")
  if key_dim != head_dim:
    fail(f"`key` head_dim must equal `query` head_dim ({head_dim}), got key "
          f"{tuple(key.shape)}, query {tuple(query.shape)}.")
  if value.shape[1:3] != key.shape[1:3]:
    fail(f"`value` must have the kv_len and num_kv_heads of `key` {tuple(key.shape[1:3])}, got "
          f"value {tuple(value.shape)}.")
  if num_heads % num_kv_heads:
    fail(f"`query` num_heads ({num_heads}) must be a multiple of `key` num_kv_heads "
          f"({num_kv_heads}) for GQA/MQA.")
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      fail(f"`{name}` must have a floating dtype, got {x.dtype}.")
  if config.runtime_dtype is None and not query.dtype == key.dtype == value.dtype:
    fail(f"`query`, `key` and `value` must share a dtype, got {query.dtype}, {key.dtype}, "
          f"{value.dtype}; cast them or set AttentionConfig(runtime_dtype=...).")


def validate_extras(query: Shaped, key: Shaped, extras: Extras) -> None:
  """Segment ids, positions, dense mask and sinks against query/key."""
  batch, query_len = query.shape[:2]
  kv_len = key.shape[1]
  for name, length, axis in (("q_segment_ids", query_len, "query_len"),
                             ("kv_segment_ids", kv_len, "kv_len"),
                             ("q_positions", query_len, "query_len"),
                             ("kv_positions", kv_len, "kv_len")):
    x = getattr(extras, name)
    if x is not None:
      _validate_rows(x, name, batch, length, axis)
  if query_len != kv_len and (extras.q_segment_ids is None) != (extras.kv_segment_ids is None):
    missing = "kv_segment_ids" if extras.kv_segment_ids is None else "q_segment_ids"
    fail(f"`{missing}` is required when query_len ({query_len}) != kv_len ({kv_len}) and "
          "the other segment ids are given: ids of one length cannot default to the other.")
  if extras.mask is not None and not isinstance(extras.mask, _objects.Mask):
    _validate_mask(extras.mask, batch, query.shape[2], query_len, kv_len)
  if extras.softmax_aux is not None:
    validate_sinks(extras.softmax_aux, query.shape[2], key.shape[2])
  score = as_score(extras.bias)
  for part in () if score is None else score.parts():  # each term checks itself, naming `bias`
    part.check(batch, query.shape[2], query_len, kv_len)


def validate_dropout(query: Shaped, key: Shaped, extras: Extras, config: AttentionConfig,
                     need_key: bool = True) -> None:
  """A call with dropout has a key (or an explicit keep mask; `need_key=False`: a plan, as
  `explain` makes, needs none); a keep mask needs a rate."""
  rate = config.dropout_rate
  if extras.dropout_mask is not None:
    if rate == 0:
      fail("`dropout_mask` was given with dropout_rate=0: kept probabilities are scaled by "
            "1 / (1 - dropout_rate); set AttentionConfig(dropout_rate=...) to the rate the mask "
            "was drawn at.")
    _validate_mask(extras.dropout_mask, query.shape[0], query.shape[2], query.shape[1],
                   key.shape[1], "dropout_mask")
  elif rate > 0 and extras.dropout_rng is None and need_key:
    fail(f"AttentionConfig(dropout_rate={rate}) needs a key: pass "
          "dropout_rng=jax.random.key(...) (a fresh one each step, e.g. hk.next_rng_key()), an "
          "explicit dropout_mask, or dropout_rate=0 to evaluate.")
  if extras.dropout_q_index is not None:
    _validate_rows(extras.dropout_q_index, "dropout_q_index", query.shape[0], query.shape[1],
                   "query_len")


def _validate_mask(mask: Shaped, batch: int, num_heads: int, query_len: int, kv_len: int,
                   name: str = "mask") -> None:
  rank(mask, 4, name, "[batch, 1 or num_heads, query_len, kv_len]")
  if (mask.shape[0] not in (1, batch) or mask.shape[1] not in (1, num_heads)
      or tuple(mask.shape[2:]) != (query_len, kv_len)):
    fail(f"`{name}` must be [batch or 1, 1 or num_heads, query_len, kv_len] = "
          f"[{batch}, 1 or {num_heads}, {query_len}, {kv_len}], got {tuple(mask.shape)}.")
  if mask.dtype != jnp.bool_:
    fail(f"`{name}` must be bool (True = may attend), got {mask.dtype}; pass {name} != 0.")


def validate_sinks(softmax_aux: Shaped, num_heads: int, num_kv_heads: int) -> None:
  array(softmax_aux, "softmax_aux", "[num_heads] or [num_heads or num_kv_heads, n]")
  shape = tuple(softmax_aux.shape)
  if not ((len(shape) == 1 and shape[0] == num_heads)
          or (len(shape) == 2 and shape[0] in (num_heads, num_kv_heads) and shape[1] >= 1)):
    fail(f"`softmax_aux` (sinks) must be [num_heads] = [{num_heads}], [num_heads, n] or "
          f"[num_kv_heads, n] = [{num_kv_heads}, n], got {shape}.")
  if not jnp.issubdtype(softmax_aux.dtype, jnp.floating):
    fail(f"`softmax_aux` must have a floating dtype, got {softmax_aux.dtype}.")


def validate_mesh(mesh: Any, axes: MeshAxes) -> tuple[str, ...]:
  """`mesh` is a jax.sharding.Mesh and `axes` a MeshAxes sharing a name with it; returns the
  names of `axes` the mesh lacks (dropped, logged once: `axes.dropped_names`)."""
  if not isinstance(mesh, jax.sharding.Mesh):
    fail(f"`mesh` must be a jax.sharding.Mesh (e.g. from jax.make_mesh), got {type(mesh).__name__}.")
  if not isinstance(axes, MeshAxes):
    fail(f"`axes` must be a splash_hk.sharding.MeshAxes, got {type(axes).__name__}.")
  return dropped_names(axes, mesh)


def one_rule_place(rule: _objects.Mask, config: AttentionConfig) -> None:
  """A mask object is the whole rule: the config states none beside it."""
  stated = [f"{name}={value!r}" for name, value, default in (
      ("causal", config.causal, None if config.causal_stated else True),
      ("sliding_window", config.sliding_window, None),
      ("chunk_size", config.chunk_size, None)) if value != default]
  if stated:
    fail(f"`mask` is a mask object ({type(rule).__name__}), the whole position rule, and "
          f"AttentionConfig also states {', '.join(stated)}: state the rule in one place "
          "(combine Causal(), SlidingWindow(w), Chunked(c) into the object, or pass no object).")


def validate_rule(rule: _objects.Mask, query: Shaped, key: Shaped,
                  config: AttentionConfig) -> None:
  """A mask object given as `mask`: the whole position rule, with arrays of the call's shapes
  (by their side) and each object's own rules (`Mask.check`)."""
  batch, query_len, num_heads = query.shape[:3]
  kv_len = key.shape[1]
  one_rule_place(rule, config)
  for part in rule.parts():
    for field, side, array in part.array_fields():
      name = f"{part.name}.{field}"
      if side in ("free", "head"):  # no layout by side: the object checks them itself
        continue
      if side == "qk":
        _validate_mask(array, batch, num_heads, query_len, kv_len, name)
      else:
        length, axis = (query_len, "query_len") if side == "q" else (kv_len, "kv_len")
        _validate_rows(array, name, batch, length, axis)
    part.check(batch, query_len, kv_len)
    part.check_heads(num_heads, key.shape[2])


def _validate_rows(x: Shaped, name: str, batch: int, length: int, axis: str) -> None:
  """An int array with one entry per token of one side: [batch, length]."""
  layout = f"[batch, {axis}] = {(batch, length)}"
  rank(x, 2, name, layout)
  _chex(lambda: chex.assert_shape(x, (batch, length)), f"`{name}` must be {layout}, got "
        f"{tuple(x.shape)}.")
  integer(x, name)
