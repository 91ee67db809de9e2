"""The words of Flax's `nnx.MultiHeadAttention` and how `splash_hk.flax.MultiHeadAttention`
answers them: dropout's as Flax does (`dropout_key`); those it does not serve are accepted at
the values that change nothing here (Flax's defaults), else a ValueError naming the word and
what to use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import jax
from flax import nnx
from flax.nnx.nn import dtypes as flax_dtypes


def _is_ours(fn: Any) -> bool:
  """Whether `fn` is `splash_hk.flax.attention_fn` (what this module computes anyway)."""
  return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) == (
      "splash_hk.flax", "attention_fn")


_OWN_ATTENTION = "use nnx.MultiHeadAttention(..., attention_fn=splash_hk.flax.attention_fn)"
# Words of nnx.MultiHeadAttention's constructor this module does not serve: word -> (the values
# that change nothing here, so are accepted; what to do instead).
CONSTRUCTOR: dict[str, tuple[Callable[[Any], bool], str]] = {
    "decode": (lambda v: not v, "pass kv_cache=mha.init_cache(batch, max_len) (and `lengths`) "
               f"to the call, or {_OWN_ATTENTION}"),
    "normalize_qk": (lambda v: not v, f"normalise q and k in your model, or {_OWN_ATTENTION}"),
    "attention_fn": (lambda v: v is None or v is nnx.dot_product_attention or _is_ours(v),
                     "this module's attention is splash attention; to plug in another function "
                     "use nnx.MultiHeadAttention itself"),
    "qkv_dot_general": (lambda v: v is None, f"{_OWN_ATTENTION} for custom matmuls"),
    "out_dot_general": (lambda v: v is None, f"{_OWN_ATTENTION} for custom matmuls"),
    "qkv_dot_general_cls": (lambda v: v is None, f"{_OWN_ATTENTION} for custom matmuls"),
    "out_dot_general_cls": (lambda v: v is None, f"{_OWN_ATTENTION} for custom matmuls"),
    "qkv_promote_dtype": (lambda v: v is flax_dtypes.promote_dtype,
                          "set `dtype` for the computation's dtype"),
    "out_promote_dtype": (lambda v: v is flax_dtypes.promote_dtype,
                          "set `dtype` for the computation's dtype"),
    "ln_promote_dtype": (lambda v: v is flax_dtypes.promote_dtype,
                         "normalize_qk is not served"),
    "query_ln_scale_metadata": (lambda v: not v, "normalize_qk is not served"),
    "key_ln_scale_metadata": (lambda v: not v, "normalize_qk is not served"),
}
# Words of nnx.MultiHeadAttention.__call__ this module does not serve, as above.
CALL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "sow_weights": (lambda v: not v, "splash attention never builds the attention weights; "
                    "use splash_hk.attention(..., return_weights=True, config=AttentionConfig("
                    "platform='reference')) to inspect them"),
    "decode": CONSTRUCTOR["decode"],
    "out_sharding": (lambda v: v is None, "build the module with mesh= and axes="),
    "qkv_sharding": (lambda v: v is None, "build the module with mesh= and axes="),
}


def refuse(words: dict[str, Any], known: Mapping[str, tuple[Callable[[Any], bool], str]],
            where: str) -> None:
  """Flax's words this module does not serve: accepted at values that change nothing here,
  else a ValueError naming the word and what to use; other words are a TypeError (a typo)."""
  for name, value in words.items():
    if name == "is_causal" and where:
      raise ValueError(f"`is_causal={value!r}`: splash_hk.flax.MultiHeadAttention takes its rule "
                       "from its config (causal by default): build it with "
                       "config=AttentionConfig(causal=...) or pass a mask object as `mask`.")
    if name not in known:
      raise TypeError(f"splash_hk.flax.MultiHeadAttention{where} got an unexpected keyword "
                      f"`{name}`: it is not a word of nnx.MultiHeadAttention{where} nor of this "
                      "module.")
    accepted, instead = known[name]
    if not accepted(value):
      raise ValueError(f"`{name}={value!r}` is not served by splash_hk.flax.MultiHeadAttention"
                       f"{where}: {instead}.")


def dropout_key(rate: float, built: bool | None, called: bool | None, kept: Any,
                rngs: Any) -> jax.Array | None:
  """A call's dropout key (None: no dropout), as nnx.MultiHeadAttention draws it: `called`
  (the call's `deterministic`) over `built` (the constructor's), one of them required when
  `rate > 0`; the key from the call's `rngs` (an nnx.Rngs or RngStream), else the module's
  `kept` stream."""
  if rate == 0:
    return None
  deterministic = built if called is None else called
  if deterministic is None:
    raise ValueError(f"dropout_rate={rate}: pass `deterministic` (True: no dropout, False: "
                     "dropout) to the call or the constructor, as Flax asks.")
  if deterministic:
    return None
  stream = kept if rngs is None else (rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs)
  if stream is None:
    raise ValueError("`rngs` must be passed to the call when the module was built with "
                     "keep_rngs=False and dropout_rate > 0 (its dropout keys come from there).")
  return stream()
