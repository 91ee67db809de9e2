"""Haiku modules: thin compositions over `splash_hk.attention` and `splash_hk.layer`."""

from __future__ import annotations

from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from splash_hk import kv_cache as kv_cache_lib
from splash_hk import layer as layer_lib
from splash_hk.attention import attend
from splash_hk.config import AttentionConfig, require_int
from splash_hk.kv_cache import KVCache
from splash_hk.masks import Mask
from splash_hk.pages import PagedKVCache, RaggedBatch
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
    extras = extras._replace(softmax_aux=self.sinks(query.shape[-2]))
    return attend(query, key, value, extras, config=self.config, mesh=self.mesh,
                  axes=self.axes).attention_outputs  # [B, T, Hq, Dv]

  def sinks(self, num_heads: int) -> jax.Array | None:
    """This module's sinks parameter [Hq, num_sinks] (zeros init), or None without sinks."""
    if not self.num_sinks:
      return None
    return hk.get_parameter("sinks", (num_heads, self.num_sinks), jnp.float32, init=jnp.zeros)

  def settings(self, layer: str) -> layer_lib.Settings:
    """What `splash_hk.layer` needs of this module, for the layer named `layer`."""
    return layer_lib.Settings(self.config, self.mesh, self.axes, layer)


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
      dropout_rate: float = 0.0,
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
      dropout_rate: attention dropout (on the normalised probabilities) applied when called
        with `is_training=True`, its key drawn with `hk.next_rng_key()`; default: the
        config's `dropout_rate` (both set to different rates: a ValueError naming both).
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
    self.dropout_rate = layer_lib.dropout_rate(config, dropout_rate)

  def init_cache(self, batch: int, max_len: int, dtype: Any = jnp.float32,
                 owner: str | None = None) -> KVCache:
    """An empty KV cache for this layer (`owner=self.module_name`: owned already, as a
    `lax.scan` carry must enter; see `KVCache.zeros`)."""
    return KVCache.zeros(batch, max_len, self.num_kv_heads, self.key_size, self.value_size, dtype,
                         owner)

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
      kv_cache: kv_cache_lib.Cache | PagedKVCache | None = None,
      lengths: ArrayLike | None = None,
      batch: RaggedBatch | None = None,
      page_top_k: int | None = None,
      is_training: bool = False,
  ) -> jax.Array | tuple[jax.Array, KVCache | PagedKVCache]:
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
      batch: with a `PagedKVCache` as `kv_cache`, the serving step's sequences
        (`splash_hk.RaggedBatch`); `query` is then the step's tokens flat,
        [N, D_q], and the call is `splash_hk.paged_attention` between the
        projections: returns ([N, D'], new PagedKVCache). `mask` and `bias`
        are then objects over positions.
      page_top_k: with `batch`, each sequence reads only the pages this layer's queries
        choose (Quest: `splash_hk.sparse.top_k_pages` with `top_k=page_top_k`, on a pool
        built with `page_summaries=True`), its last page and every page the step writes (a
        prefill chunk sees its own tokens); None reads every page.
      is_training: apply the module's `dropout_rate` (a key from `hk.next_rng_key()`, so
        the transform needs an rng); False (the default) computes without dropout.

    Returns:
      [..., T, D'], or ([..., T, D'], KVCache) with `kv_cache`.
    """
    key = query if key is None else key
    value = key if value is None else value
    q = self._projection(query, self.num_heads, self.key_size, "query")  # [..., T, H, K]
    k = self._projection(key, self.num_kv_heads, self.key_size, "key")  # [..., S, Hkv, K]
    v = self._projection(value, self.num_kv_heads, self.value_size, "value")  # [..., S, Hkv, V]
    dropout = self.dropout_rate if is_training else 0.0
    call = layer_lib.Call(mask=mask, bias=bias, q_segment_ids=q_segment_ids,
                          kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                          kv_positions=kv_positions, kv_cache=kv_cache, lengths=lengths,
                          batch=batch, page_top_k=page_top_k,
                          dropout_rng=hk.next_rng_key() if dropout else None)
    settings = self.splash.settings(self.module_name)
    settings = settings._replace(config=settings.config.replace(dropout_rate=dropout))
    out, cache = layer_lib.attend(q, k, v, call, settings,
                                  self.splash.sinks(self.num_heads))  # [..., T, H, V]
    out = out.reshape(*out.shape[:-2], self.num_heads * self.value_size)  # [..., T, H*V]
    out = hk.Linear(self.model_size, w_init=self.w_init, with_bias=self.with_bias,
                    b_init=self.b_init, name="linear")(out)  # [..., T, D']
    return out if cache is None else (out, cache)

  @hk.transparent
  def _projection(self, x: jax.Array, heads: int, head_size: int, name: str) -> jax.Array:
    y = hk.Linear(heads * head_size, w_init=self.w_init, with_bias=self.with_bias,
                  b_init=self.b_init, name=name)(x)  # [..., T, heads * head_size]
    return y.reshape(*x.shape[:-1], heads, head_size)  # [..., T, heads, head_size]

