"""Flax NNX: `MultiHeadAttention` and `attention_fn`, thin over `splash_hk.layer`.

The `[flax]` extra: flax is imported here only. `MultiHeadAttention` takes
`nnx.MultiHeadAttention`'s words (flax 0.12) plus ours, and calls the same layer as
the Haiku module (masks, bias, sinks, the `KVCache`, meshes); `attention_fn` serves
Flax's own `nnx.MultiHeadAttention(attention_fn=...)` with Flax's mask meaning.

Glossary of shapes:
- ...: leading batch dims; T: query length; S: key/value length.
- H, Hkv: query and key/value heads; D: head size (`qkv_features // num_heads`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
try:
  from flax import nnx
  from flax.nnx.nn import initializers
except ImportError as e:  # the wheel does not require flax
  raise ImportError("splash_hk.flax needs Flax NNX: pip install 'splash_hk[flax]' (flax>=0.12.8)."
                    ) from e
from jax.typing import ArrayLike

from splash_hk import flax_words
from splash_hk import layer
from splash_hk.config import AttentionConfig, require_int
from splash_hk.kv_cache import KVCache
from splash_hk.masks import Causal, Mask
from splash_hk.pages import PagedKVCache, RaggedBatch
from splash_hk.scores import Score
from splash_hk.sharding.axes import MeshAxes
from splash_hk.types import Array

__all__ = ("MultiHeadAttention", "attention_fn", "from_haiku", "to_haiku")

_NO_METADATA: Mapping[str, Any] = MappingProxyType({})

# Layers without a `name=` are named in the order they are built, as Haiku names modules.
_UNNAMED = itertools.count()


class MultiHeadAttention(nnx.Module):
  """`nnx.MultiHeadAttention` on splash attention: GQA, mask objects, bias, sinks, a KV cache.

  Causal by default like `splash_hk.MultiHeadAttention` (pass
  `config=AttentionConfig(causal=False)` for Flax's unmasked default); a query row that sees
  nothing outputs 0. Projections are `nnx.LinearGeneral` attributes named as Flax names them:
  `query` (kernel [in, H, D]), `key`, `value` ([in_kv, Hkv, D]) and `out` ([H, D, out]);
  `sinks` is an `nnx.Param` [H, num_sinks] (zeros) when `num_sinks > 0`.
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      qkv_features: int | None = None,
      out_features: int | None = None,
      num_kv_heads: int | None = None,
      in_kv_features: int | None = None,
      *,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      broadcast_dropout: bool = True,
      dropout_rate: float = 0.0,
      deterministic: bool | None = None,
      precision: Any = None,
      kernel_init: Any = initializers.lecun_normal(),
      out_kernel_init: Any = None,
      bias_init: Any = initializers.zeros_init(),
      out_bias_init: Any = None,
      use_bias: bool = True,
      rngs: nnx.Rngs,
      keep_rngs: bool = True,
      config: AttentionConfig = AttentionConfig(),
      mesh: jax.sharding.Mesh | None = None,
      axes: MeshAxes = MeshAxes(),
      num_sinks: int = 0,
      kernel_metadata: Mapping[str, Any] = _NO_METADATA,
      out_kernel_metadata: Mapping[str, Any] = _NO_METADATA,
      bias_metadata: Mapping[str, Any] = _NO_METADATA,
      out_bias_metadata: Mapping[str, Any] = _NO_METADATA,
      name: str | None = None,
      **words: Any,
  ):
    """Initialises the module (`nnx.MultiHeadAttention`'s words, then ours: `config`, `mesh`,
    `axes`, `num_sinks` as in `splash_hk.MultiHeadAttention`, and `name`: how errors name this
    layer, e.g. as the owner of a KV cache; default `multi_head_attention_<n>`, n counting
    the layers built in this process).

    Dropout as Flax's: `dropout_rate` on the attention probabilities (the library's hash,
    `splash_hk.dropout_mask`; or the config's `dropout_rate`, not both at different rates),
    `broadcast_dropout` (one mask for every batch row and head, as Flax's), `deterministic`
    (here or at the call; required when `dropout_rate > 0`), keys from `rngs.dropout` (kept
    when `keep_rngs`) or the call's `rngs`. Flax's words this module does not serve
    (`decode`, `normalize_qk`, custom matmuls, ...) are accepted at values that change
    nothing here, else a ValueError names the word and what to use instead.
    """
    flax_words.refuse(words, flax_words.CONSTRUCTOR, "")
    require_int("num_heads", num_heads)
    require_int("in_features", in_features)
    for word, size in (("qkv_features", qkv_features), ("out_features", out_features),
                       ("num_kv_heads", num_kv_heads), ("in_kv_features", in_kv_features)):
      require_int(word, size, allow_none=True)
    require_int("num_sinks", num_sinks, minimum=0)
    if not isinstance(config, AttentionConfig):
      raise ValueError(f"`config` must be a splash_hk.AttentionConfig, got {type(config).__name__}.")
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads or num_heads
    self.qkv_features = qkv_features or in_features
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"`num_heads` ({num_heads}) must be a multiple of `num_kv_heads` "
                       f"({self.num_kv_heads}): pass num_kv_heads dividing {num_heads}.")
    if self.qkv_features % self.num_heads:
      raise ValueError(f"`qkv_features` ({self.qkv_features}) must be a multiple of `num_heads` "
                       f"({num_heads}): each head gets qkv_features // num_heads features; pass "
                       f"e.g. qkv_features={num_heads * max(1, self.qkv_features // num_heads)}.")
    if name is not None and not isinstance(name, str):
      raise ValueError(f"`name` must be a str (how errors name this layer), got {name!r}.")
    self.head_dim = self.qkv_features // num_heads
    self.in_features, self.out_features = in_features, out_features or in_features
    self.in_kv_features = in_kv_features or in_features
    linear = lambda features, heads, **kw: nnx.LinearGeneral(
        features, (heads, self.head_dim), dtype=dtype, param_dtype=param_dtype,
        kernel_init=kernel_init, bias_init=bias_init, use_bias=use_bias, precision=precision,
        rngs=rngs, kernel_metadata=kernel_metadata, bias_metadata=bias_metadata, **kw)
    self.query = linear(in_features, num_heads)
    self.key = linear(self.in_kv_features, self.num_kv_heads)
    self.value = linear(self.in_kv_features, self.num_kv_heads)
    self.out = nnx.LinearGeneral(
        (num_heads, self.head_dim), self.out_features, axis=(-2, -1), dtype=dtype,
        param_dtype=param_dtype, kernel_init=out_kernel_init or kernel_init,
        bias_init=out_bias_init or bias_init, use_bias=use_bias, precision=precision, rngs=rngs,
        kernel_metadata=out_kernel_metadata or kernel_metadata,
        bias_metadata=out_bias_metadata or bias_metadata)
    self.sinks = (nnx.Param(jnp.zeros((num_heads, num_sinks), jnp.float32)) if num_sinks
                  else nnx.data(None))
    # A cache remembers the layer that wrote it; NNX modules have no names, so each gets one.
    self.name = name or f"multi_head_attention_{next(_UNNAMED)}"
    self.settings = layer.Settings(config, mesh, axes, self.name)
    self.dropout_rate = layer.dropout_rate(config, dropout_rate)
    self.broadcast_dropout, self.deterministic = bool(broadcast_dropout), deterministic
    self.rngs = rngs.dropout.fork() if keep_rngs and self.dropout_rate > 0 else nnx.data(None)

  def init_cache(self, batch: int, max_len: int, dtype: Any = jnp.float32,
                 owner: str | None = None) -> KVCache:
    """An empty KV cache for this layer (the Haiku module's `KVCache`; `owner=self.name`:
    owned already, as a `lax.scan` carry must enter)."""
    return KVCache.zeros(batch, max_len, self.num_kv_heads, self.head_dim, self.head_dim, dtype,
                         owner)

  def __call__(
      self,
      inputs_q: jax.Array,
      inputs_k: jax.Array | None = None,
      inputs_v: jax.Array | None = None,
      *,
      mask: ArrayLike | Mask | None = None,
      bias: Array | Score | None = None,
      q_segment_ids: Array | None = None,
      kv_segment_ids: Array | None = None,
      q_positions: Array | None = None,
      kv_positions: Array | None = None,
      kv_cache: KVCache | PagedKVCache | None = None,
      lengths: ArrayLike | None = None,
      batch: RaggedBatch | None = None,
      page_top_k: int | None = None,
      deterministic: bool | None = None,
      rngs: nnx.Rngs | nnx.RngStream | None = None,
      **words: Any,
  ) -> jax.Array | tuple[jax.Array, KVCache | PagedKVCache]:
    """inputs_q [..., T, in], inputs_k / inputs_v [..., S, in_kv] (default: self-attention)
    -> [..., T, out], or ([..., T, out], KVCache) with `kv_cache`; with a `PagedKVCache` and
    `batch` (a serving step: inputs [N, in], the step's tokens flat), ([N, out], PagedKVCache).

    The arguments after `inputs_v` are those of `splash_hk.MultiHeadAttention.__call__`;
    `deterministic` and `rngs` as Flax's (dropout). `nnx.MultiHeadAttention.__call__`'s other
    words (`sow_weights`, `decode`, shardings) are accepted where they change nothing here,
    else refused with what to use; causality is the config's (`AttentionConfig(causal=...)`),
    not `is_causal`.
    """
    flax_words.refuse(words, flax_words.CALL, ".__call__")
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError("`inputs_k` cannot be None when `inputs_v` is given: pass the same "
                         "array as `inputs_k` and leave `inputs_v` None.")
      inputs_k = inputs_q
    inputs_v = inputs_k if inputs_v is None else inputs_v
    q = self.query(inputs_q)  # [..., T, H, D]
    k = self.key(inputs_k)  # [..., S, Hkv, D]
    v = self.value(inputs_v)  # [..., S, Hkv, D]
    key = flax_words.dropout_key(self.dropout_rate, self.deterministic, deterministic,
                                 self.rngs, rngs)
    call = layer.Call(mask=mask, bias=bias, q_segment_ids=q_segment_ids,
                      kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                      kv_positions=kv_positions, kv_cache=kv_cache, lengths=lengths,
                      batch=batch, page_top_k=page_top_k, dropout_rng=key,
                      dropout_broadcast=self.broadcast_dropout)
    settings = self.settings._replace(config=self.settings.config.replace(
        dropout_rate=0.0 if key is None else self.dropout_rate))
    sinks = None if self.sinks is None else self.sinks[...]  # [H, n]
    out, cache = layer.attend(q, k, v, call, settings, sinks)  # [..., T, H, D]
    y = self.out(out)  # [..., T, out]
    return y if cache is None else (y, cache)


def attention_fn(query: jax.Array, key: jax.Array, value: jax.Array,
                 bias: Array | Score | None = None, mask: ArrayLike | Mask | None = None, *,
                 is_causal: bool = False, dropout_rate: float = 0.0,
                 deterministic: bool | None = None, dtype: Any = None, module: Any = None,
                 config: AttentionConfig | None = None, mesh: jax.sharding.Mesh | None = None,
                 axes: MeshAxes = MeshAxes(), dropout_rng: Any = None,
                 broadcast_dropout: bool = True, **flax_args: Any) -> jax.Array:
  """Flax's `dot_product_attention` contract on splash attention, for
  `nnx.MultiHeadAttention(attention_fn=...)`.

  query [..., T, H, D], key [..., S, Hkv, D], value [..., S, Hkv, Dv] -> [..., T, H, Dv], with
  Flax's meaning: no rule beyond `mask` (nonzero = attend, broadcastable to [..., H, T, S]) and
  `is_causal` (top-left: query i sees keys j <= i, as Flax's own cache path assumes). A mask
  object as `mask` is the whole rule; `functools.partial(attention_fn, config=cfg)` adds cfg's
  rules as `splash_hk.attention` reads them. `bias`: broadcastable to [..., H, T, S], or a score
  object. A row that sees nothing outputs 0 (Flax: mean(v)). Dropout as Flax's
  (`dropout_rate` or the config's, `dropout_rng`, `deterministic` honoured whichever states
  the rate, `broadcast_dropout`: one mask for every batch row and head), drawn by the
  library's hash. Flax's other arguments (`precision`, `promote_dtype`) are accepted: the
  kernels accumulate in float32.
  """
  del flax_args
  rate = layer.dropout_rate(AttentionConfig() if config is None else config, dropout_rate)
  dropout = rate > 0 and not deterministic
  if dropout and dropout_rng is None:
    raise ValueError(f"`dropout_rate={rate}` without deterministic=True needs a key: "
                     "pass dropout_rng (nnx.MultiHeadAttention passes its rngs' dropout key).")
  if module is not None:
    raise ValueError("`sow_weights=True` asks for the attention weights, which "
                     "splash_hk.flax.attention_fn never builds: call without sow_weights.")
  if dtype is not None:
    query, key, value = (jnp.asarray(a, dtype) for a in (query, key, value))
  *lead, query_len, num_heads, _ = query.shape
  kv_len = key.shape[-3]
  call = layer.Call(mask=mask, bias=_flat_bias(bias, lead))
  if isinstance(mask, Mask):
    config = AttentionConfig() if config is None else config
    call = call._replace(mask=mask & Causal() if is_causal else mask)
  elif config is None:
    config = AttentionConfig(causal=is_causal)
  elif is_causal:
    config = config.replace(causal=True)
  if is_causal and query_len != kv_len:  # Flax aligns causal top-left; ours end-aligns by default
    call = call._replace(q_positions=jnp.arange(query_len, dtype=jnp.int32),
                         kv_positions=jnp.arange(kv_len, dtype=jnp.int32))
  config = config.replace(dropout_rate=rate if dropout else 0.0)  # deterministic: none
  if dropout:
    call = call._replace(dropout_rng=dropout_rng, dropout_broadcast=bool(broadcast_dropout))
  out, _ = layer.attend(query, key, value, call,
                        layer.Settings(config, mesh, axes, "attention_fn"))  # [..., T, H, Dv]
  return out


def _flat_bias(bias: Array | Score | None, lead: list[int]) -> Array | Score | None:
  """A Flax bias (broadcastable to [..., H, T, S]; axes of size 1 broadcast) as
  [B|1, H|1, T|1, S|1] over the flattened leading dims; a score object as it is."""
  if bias is None or isinstance(bias, Score):
    return bias
  bias = jnp.asarray(bias)
  if bias.ndim > len(lead) + 3:
    raise ValueError(f"`bias` of shape {tuple(bias.shape)} has more dims than [..., H, T, S] "
                     f"({len(lead) + 3}).")
  bias = bias.reshape((1,) * (len(lead) + 3 - bias.ndim) + bias.shape)  # [..., H|1, T|1, S|1]
  if all(n == 1 for n in bias.shape[:-3]):
    return bias.reshape(1, *bias.shape[-3:])  # [1, H|1, T|1, S|1]
  return jnp.broadcast_to(bias, (*lead, *bias.shape[-3:])).reshape(-1, *bias.shape[-3:])


_HAIKU_PARTS = ("query", "key", "value", "linear")


def from_haiku(params: Mapping[str, Mapping[str, Any]],
               module: MultiHeadAttention) -> MultiHeadAttention:
  """Loads one Haiku `splash_hk.MultiHeadAttention`'s params into `module` and returns it.

  `params`: the dict whose keys end in `query`, `key`, `value` and `linear` (each `{w, b}`),
  e.g. `{k: v for k, v in params.items() if k.startswith("model/~/layer_0/attn")}`; sinks
  from its `splash_attention`. Value heads must have the key size (Flax has one head size).
  """
  prefix = _haiku_prefix(params)
  for name, target in (("query", module.query), ("key", module.key), ("value", module.value),
                       ("linear", module.out)):
    got = params[prefix + name]
    _load(target.kernel, got["w"], f"{prefix}{name}/w")
    if (target.bias is None) != ("b" not in got):
      raise ValueError(f"`{prefix}{name}` {'has' if 'b' in got else 'lacks'} a bias `b` and the "
                       f"Flax module was built with use_bias={target.bias is not None}: build "
                       "both alike.")
    if target.bias is not None:
      _load(target.bias, got["b"], f"{prefix}{name}/b")
  sinks = params.get(prefix + "~/splash_attention", {}).get("sinks")
  count = lambda s: 0 if s is None else s.shape[-1]
  if count(sinks) != count(module.sinks):
    raise ValueError(f"the Haiku layer {prefix!r} has {count(sinks)} sinks and the Flax module "
                     f"{count(module.sinks)}: build both with the same num_sinks.")
  if module.sinks is not None:
    _load(module.sinks, sinks, f"{prefix}~/splash_attention/sinks")
  return module


def to_haiku(module: MultiHeadAttention,
             name: str = "multi_head_attention") -> dict[str, dict[str, jax.Array]]:
  """`module`'s weights as the params of a Haiku `splash_hk.MultiHeadAttention` named `name`
  (built with the same heads, sizes, `with_bias` and `num_sinks`)."""
  params = {}
  for part, source in (("query", module.query), ("key", module.key), ("value", module.value),
                       ("linear", module.out)):
    w = source.kernel[...]
    w = w.reshape(w.shape[0], -1) if part != "linear" else w.reshape(-1, w.shape[-1])
    params[f"{name}/{part}"] = {"w": w}
    if source.bias is not None:
      params[f"{name}/{part}"]["b"] = source.bias[...].reshape(-1)
  if module.sinks is not None:
    params[f"{name}/~/splash_attention"] = {"sinks": module.sinks[...]}
  return params


def _haiku_prefix(params: Mapping[str, Any]) -> str:
  """The module name ending in "/" (or "") under which `params` holds one Haiku layer."""
  prefixes = {k[:-len(part)] for k in params for part in _HAIKU_PARTS
              if k == part or k.endswith("/" + part)}
  whole = [p for p in prefixes if all(p + part in params for part in _HAIKU_PARTS)]
  if len(whole) != 1:
    raise ValueError(f"`params` must hold one Haiku MultiHeadAttention (keys ending in "
                     f"{', '.join(_HAIKU_PARTS)}); found {len(whole)} ({sorted(whole)}): pass "
                     "the one layer's entries, e.g. filtered by its name prefix.")
  return whole[0]


def _load(target: nnx.Variable, array: Any, name: str) -> None:
  """target[...] = array reshaped to target's shape (Haiku merges heads into one axis)."""
  array = jnp.asarray(array)
  if array.size != target.size:
    raise ValueError(f"`{name}` has shape {tuple(array.shape)} and the Flax module expects "
                     f"{tuple(target.shape)} (heads x head size): build both with the same "
                     "heads and sizes.")
  target[...] = array.reshape(target.shape).astype(target.dtype)
