"""Haiku modules: thin compositions over `splash_hk.attention`."""

from __future__ import annotations

import math
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from splash_hk import kv_cache as kv_cache_lib
from splash_hk.attention import attend
from splash_hk.config import AttentionConfig, require_int
from splash_hk.kv_cache import KVCache, row_lengths
from splash_hk.masks import Mask
from splash_hk.scores import Score
from splash_hk.sharding.axes import MeshAxes
from splash_hk.types import Array, Extras


class SplashAttention(hk.Module):
  """Attention over already-projected heads, with optional learnable sinks.

  Glossary of shapes:
  - B: batch; T: query length; S: key/value length.
  - Hq, Hkv: query and key/value heads; D: key size; Dv: value size.
  """

  def __init__(
      self,
      config: AttentionConfig = AttentionConfig(),
      mesh: jax.sharding.Mesh | None = None,
      axes: MeshAxes = MeshAxes(),
      num_sinks: int = 0,
      name: str | None = None,
  ):
    """Initialises the module.

    Args:
      config: the attention config (mask rules, scale, platform, ...).
      mesh: if given, attention runs under shard_map over this mesh.
      axes: which mesh axes carry batch, heads and query sequence.
      num_sinks: learnable attention sinks per query head; > 0 creates a
        `sinks [Hq, num_sinks]` parameter (zeros init).
      name: module name.
    """
    super().__init__(name=name)
    if not isinstance(config, AttentionConfig):
      raise ValueError(f"`config` must be a splash_hk.AttentionConfig, got {type(config).__name__}.")
    require_int("num_sinks", num_sinks, minimum=0)
    self.config = config
    self.mesh = mesh
    self.axes = axes
    self.num_sinks = num_sinks

  def __call__(
      self,
      query: jax.Array,
      key: jax.Array,
      value: jax.Array,
      *,
      mask: Array | Mask | None = None,
      bias: Array | Score | None = None,
      q_segment_ids: Array | None = None,
      kv_segment_ids: Array | None = None,
      q_positions: Array | None = None,
      kv_positions: Array | None = None,
  ) -> jax.Array:
    """query [B, T, Hq, D], key [B, S, Hkv, D], value [B, S, Hkv, Dv] -> [B, T, Hq, Dv].

    The arrays are those of `splash_hk.attention`; the sinks are this module's.
    """
    extras = Extras(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                    q_positions=q_positions, kv_positions=kv_positions, mask=mask, bias=bias)
    return self.attend(query, key, value, extras)

  def attend(self, query: jax.Array, key: jax.Array, value: jax.Array,
             extras: Extras) -> jax.Array:
    """As `__call__`, with the call's arrays as one `Extras` (its sinks are this module's)."""
    if self.num_sinks:
      sinks = hk.get_parameter("sinks", (query.shape[-2], self.num_sinks), jnp.float32,
                               init=jnp.zeros)  # [Hq, n]
      extras = extras._replace(softmax_aux=sinks)
    return attend(query, key, value, extras, config=self.config, mesh=self.mesh,
                  axes=self.axes).attention_outputs  # [B, T, Hq, Dv]


class MultiHeadAttention(hk.Module):
  """A drop-in for `hk.MultiHeadAttention` on splash attention, with GQA and a KV cache.

  With `num_kv_heads == num_heads` its parameters are exactly those of
  `hk.MultiHeadAttention` (`query`, `key`, `value`, `linear`, each `w` and
  `b`), so its checkpoints load unchanged. Unlike Haiku's, the default config
  is causal (pass `AttentionConfig(causal=False)` for Haiku's behaviour), and a
  query row that may attend to nothing outputs 0 rather than mean(v).

  Glossary of shapes:
  - T: query length; S: key/value length (S_max with a cache).
  - D: embedding size; H: query heads; Hkv: key/value heads.
  - K: key size; V: value size; D': model size.
  """

  def __init__(
      self,
      num_heads: int,
      key_size: int,
      *,
      num_kv_heads: int | None = None,
      value_size: int | None = None,
      model_size: int | None = None,
      w_init: hk.initializers.Initializer | None = None,
      with_bias: bool = True,
      b_init: hk.initializers.Initializer | None = None,
      config: AttentionConfig = AttentionConfig(),
      mesh: jax.sharding.Mesh | None = None,
      axes: MeshAxes = MeshAxes(),
      num_sinks: int = 0,
      name: str | None = None,
  ):
    """Initialises the module.

    Args:
      num_heads: query heads (H).
      key_size: size of each query/key head (K).
      num_kv_heads: key/value heads (Hkv, GQA/MQA); must divide `num_heads`;
        default `num_heads`.
      value_size: size of each value head (V); default `key_size`.
      model_size: output size (D'); default `key_size * num_heads`.
      w_init: initialiser of the projection weights (required, as in Haiku).
      with_bias: whether the projections have biases.
      b_init: initialiser of the biases; default zeros.
      config: the attention config.
      mesh: if given, attention runs under shard_map over this mesh.
      axes: which mesh axes carry batch, heads and query sequence.
      num_sinks: learnable attention sinks per head (see `SplashAttention`).
      name: module name.
    """
    super().__init__(name=name)
    require_int("num_heads", num_heads)
    require_int("key_size", key_size)
    for name, value in (("num_kv_heads", num_kv_heads), ("value_size", value_size),
                        ("model_size", model_size)):
      require_int(name, value, allow_none=True)
    num_kv_heads = num_kv_heads or num_heads
    if num_heads % num_kv_heads:
      raise ValueError(f"`num_heads` ({num_heads}) must be a multiple of `num_kv_heads` "
                       f"({num_kv_heads}).")
    if w_init is None:
      raise ValueError("Please provide a weight initializer: `w_init`, e.g. "
                       "hk.initializers.VarianceScaling(1.0) (required, as in hk.MultiHeadAttention).")
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.key_size = key_size
    self.value_size = value_size or key_size
    self.model_size = model_size or key_size * num_heads
    self.w_init = w_init
    self.with_bias = with_bias
    self.b_init = b_init
    self.splash = SplashAttention(config=config, mesh=mesh, axes=axes, num_sinks=num_sinks,
                                  name="splash_attention")

  def init_cache(self, batch: int, max_len: int, dtype: Any = jnp.float32) -> KVCache:
    """An empty KV cache for this layer."""
    return KVCache.zeros(batch, max_len, self.num_kv_heads, self.key_size, self.value_size, dtype)

  def __call__(
      self,
      query: jax.Array,
      key: jax.Array | None = None,
      value: jax.Array | None = None,
      mask: ArrayLike | Mask | None = None,
      *,
      bias: Array | Score | None = None,
      q_segment_ids: Array | None = None,
      kv_segment_ids: Array | None = None,
      q_positions: Array | None = None,
      kv_positions: Array | None = None,
      kv_cache: kv_cache_lib.Cache | None = None,
      lengths: ArrayLike | None = None,
  ) -> jax.Array | tuple[jax.Array, KVCache]:
    """Attends `query` to `key`/`value` (default: self-attention).

    Args:
      query: [..., T, D_q]; any number of leading batch dims.
      key: [..., S, D_k]; default `query`.
      value: [..., S, D_v]; default `key`.
      mask: anything broadcastable to [..., H, T, S] (any dtype, nonzero =
        attend), as Haiku's; or a mask object (`splash_hk.masks`), the whole
        position rule, its arrays [..., T] / [..., S]. With `kv_cache`, a
        `Bidirectional(q_ids)` spans the new tokens (cached ones have no id).
      bias: added to the scaled logits: [B|1, H|1, T, S] float (B: the leading dims
        flattened; with `kv_cache`, S is the cache's slots) or a score object
        (`splash_hk.scores`), as in `splash_hk.attention`.
      q_segment_ids, kv_segment_ids, q_positions, kv_positions: [..., T] and
        [..., S] ints, as in `splash_hk.attention`.
      kv_cache: if given, row b's new keys/values are written at
        `kv_cache.length[b]` and its queries attend to the row's filled slots
        (positions and padding derived from the cache); returns
        `(output, new_cache)`. T == 1 is decoding. A cache of another batch
        or layer, or a row that would write past `max_len`, is a ValueError
        naming `kv_cache`; under `jit`, where lengths are not known until run
        time, such a row writes nothing, keeps its length and outputs NaN.
      lengths: with `kv_cache`, [...] ints in [0, T]: row b appends only its
        first `lengths[b]` tokens (its other query rows are padding and output
        0); default T for every row. `lengths=0` leaves a finished row
        unchanged. Outside [0, T]: a ValueError, or under `jit` a NaN row.

    Returns:
      [..., T, D'], or ([..., T, D'], KVCache) with `kv_cache`.
    """
    key = query if key is None else key
    value = key if value is None else value
    *lead, query_len, _ = query.shape
    kv_len = key.shape[-2]
    flat = lambda x: x.reshape(-1, *x.shape[len(lead):])  # [..., X] -> [B, X]
    q = self._projection(flat(query), self.num_heads, self.key_size, "query")  # [B, T, H, K]
    k = self._projection(flat(key), self.num_kv_heads, self.key_size, "key")  # [B, S, Hkv, K]
    v = self._projection(flat(value), self.num_kv_heads, self.value_size, "value")  # [B, S, Hkv, V]
    rows = lambda x: None if x is None else flat(jnp.broadcast_to(x, (*lead, x.shape[-1])))
    extras = Extras(q_segment_ids=rows(q_segment_ids), kv_segment_ids=rows(kv_segment_ids),
                    q_positions=rows(q_positions), kv_positions=rows(kv_positions))
    step = None
    if kv_cache is not None:
      if any(x is not None for x in extras):
        raise ValueError("`kv_cache` derives positions and padding itself: do not pass "
                         "q_segment_ids, kv_segment_ids, q_positions or kv_positions with it.")
      step = kv_cache_lib.append_to(kv_cache, k, v, row_lengths(lengths, tuple(lead), query_len),
                                    self.module_name)
      k, v, extras, kv_len = step.key, step.value, step.extras, step.key.shape[1]
    elif lengths is not None:
      raise ValueError("`lengths` says how many tokens each row appends to `kv_cache`; pass "
                       "it with a kv_cache (or use q_segment_ids to mark padding).")
    if isinstance(mask, Mask):
      mask = _flat_mask_object(mask, lead, self.num_heads, query_len, kv_len, step)
    elif mask is not None:
      mask = _haiku_mask(mask, lead, self.num_heads, query_len, kv_len)  # [B, 1|H, T, S]
    out = self.splash.attend(q, k, v, extras._replace(mask=mask, bias=bias))  # [B, T, H, V]
    if step is not None:  # a row that could not append says so: NaN, never a finite wrong answer
      out = jnp.where(step.failed[:, None, None, None], jnp.nan, out)  # [B, T, H, V]
    out = out.reshape(*lead, query_len, self.num_heads * self.value_size)  # [..., T, H*V]
    out = hk.Linear(self.model_size, w_init=self.w_init, with_bias=self.with_bias,
                    b_init=self.b_init, name="linear")(out)  # [..., T, D']
    return out if step is None else (out, step.cache)

  @hk.transparent
  def _projection(self, x: jax.Array, heads: int, head_size: int, name: str) -> jax.Array:
    y = hk.Linear(heads * head_size, w_init=self.w_init, with_bias=self.with_bias,
                  b_init=self.b_init, name=name)(x)  # [B, T, heads * head_size]
    return y.reshape(*x.shape[:-1], heads, head_size)  # [B, T, heads, head_size]


def _flat_mask_object(mask: Mask, lead: list[int], num_heads: int, query_len: int,
                      kv_len: int, step: kv_cache_lib.Append | None) -> Mask:
  """A mask object's arrays with the leading dims flattened ([..., T] -> [B, T]); with a cache,
  over its slots (`Mask.over_slots`: where the new tokens are written)."""
  def flat(side: str, a: jax.Array) -> jax.Array:
    if side == "qk":
      return _haiku_mask(a, lead, num_heads, query_len, kv_len)  # [B, 1|H, T, S]
    a = jnp.asarray(a)
    return jnp.broadcast_to(a, (*lead, a.shape[-1])).reshape(-1, a.shape[-1])  # [B, T|S]

  mask = mask.map_arrays(flat)
  if step is None:
    return mask
  slots = step.extras.q_positions  # [B, T]: where each new token is written
  return mask.map_parts(lambda part: part.over_slots(slots, kv_len))


def _haiku_mask(mask: ArrayLike, lead: list[int], num_heads: int, query_len: int,
                kv_len: int) -> jax.Array:
  """A Haiku-style mask (any dtype, nonzero = attend, broadcastable to [..., H, T, S])
  -> bool [B, 1 or H, T, S] with the leading dims flattened into B."""
  mask = jnp.asarray(mask)
  given = tuple(mask.shape)  # errors report what the caller passed
  full = (*lead, num_heads, query_len, kv_len)
  if mask.ndim > len(full):
    raise ValueError(f"`mask` of shape {given} has more dims than [..., H, T, S] = {full}.")
  mask = mask.reshape((1,) * (len(full) - mask.ndim) + mask.shape)
  heads = 1 if mask.shape[-3] == 1 else num_heads
  try:
    mask = jnp.broadcast_to(mask != 0, (*lead, heads, query_len, kv_len))
  except ValueError as e:
    raise ValueError(f"`mask` of shape {given} does not broadcast to [..., H, T, S] = "
                     f"{full}.") from e
  return mask.reshape(math.prod(lead), heads, query_len, kv_len)
