"""`reference_attention`: the plain dense path (`splash_hk.backends.reference`) from public arguments."""

from __future__ import annotations

from typing import Any


from splash_hk import inputs
from splash_hk.masks import Mask
from splash_hk.scores import Score
from splash_hk.backends import reference
from splash_hk.config import AttentionConfig
from splash_hk.types import Array, AttentionOutput, Extras


def reference_attention(
    query: Array,
    key: Array,
    value: Array,
    config: AttentionConfig | None = None,
    *,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    mask: Array | Mask | None = None,
    bias: Array | Score | None = None,
    softmax_aux: Array | None = None,
    return_weights: bool = False,
    **config_overrides: Any,
) -> AttentionOutput:
  """Plain dense attention with the semantics of `splash_hk.attention`.

  Glossary of shapes:
  - B: batch size; T: query length; S: key/value length.
  - Hq, Hkv: query and key/value heads (Hq % Hkv == 0).
  - D: query/key head dim; Dv: value head dim.

  Args:
    query: [B, T, Hq, D].
    key: [B, S, Hkv, D].
    value: [B, S, Hkv, Dv].
    config: the semantic fields (causal, sliding_window, chunk_size,
      logits_soft_cap, softmax_scale, runtime_dtype) are used; default
      `AttentionConfig()`.
    q_segment_ids, kv_segment_ids, q_positions, kv_positions, mask, bias, softmax_aux:
      as in `splash_hk.attention`.
    return_weights: also return the softmax weights [B, Hq, T, S].
    **config_overrides: AttentionConfig fields to replace, e.g. `causal=False`.

  Returns:
    AttentionOutput(attention_outputs [B, T, Hq, Dv], attention_weights or None).
  """
  config = AttentionConfig() if config is None else config
  if config_overrides:
    config = config.replace(**config_overrides)
  extras = Extras(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                  q_positions=q_positions, kv_positions=kv_positions, mask=mask, bias=bias,
                  softmax_aux=softmax_aux)
  x, facts = inputs.normalise(query, key, value, config=config, extras=extras,
                              return_weights=return_weights)
  result = reference.attend(x, facts)
  return AttentionOutput(result.out, result.weights)
