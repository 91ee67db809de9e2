"""The words of Flax's `nnx.MultiHeadAttention` that `splash_hk.flax.MultiHeadAttention` does not
serve, and how it answers each: accepted at the values that change nothing here (Flax's
defaults, dropout's words without dropout), else a ValueError naming the word and what to use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

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
    "dropout_rate": (lambda v: v == 0, "attention dropout needs the attention weights, which "
                     "splash attention never builds; drop out the layer's output instead"),
    "broadcast_dropout": (lambda v: isinstance(v, bool), "it only shapes dropout, which this "
                          "module does not apply"),
    "deterministic": (lambda v: v is None or isinstance(v, bool), "it only switches dropout, "
                      "which this module does not apply"),
    "decode": (lambda v: not v, "pass kv_cache=mha.init_cache(batch, max_len) (and `lengths`) "
               f"to the call, or {_OWN_ATTENTION}"),
    "normalize_qk": (lambda v: not v, f"normalise q and k in your model, or {_OWN_ATTENTION}"),
    "attention_fn": (lambda v: v is None or v is nnx.dot_product_attention or _is_ours(v),
                     "this module's attention is splash attention; to plug in another function "
                     "use nnx.MultiHeadAttention itself"),
    "keep_rngs": (lambda v: isinstance(v, bool), "it keeps dropout's rngs"),
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
    "deterministic": CONSTRUCTOR["deterministic"],
    "rngs": (lambda v: True, "it feeds dropout, which this module does not apply"),
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
