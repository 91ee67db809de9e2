"""Plain ("vanilla") dense attention with the whole semantics: the fallback of every kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from splash_hk import inputs as inputs_lib
from splash_hk import masks
from splash_hk import validation
from splash_hk.config import AttentionConfig
from splash_hk.types import AttentionOutput

_HIGHEST = jax.lax.Precision.HIGHEST


def logits_and_mask(x: inputs_lib.KernelInputs, config: AttentionConfig) -> tuple[jax.Array, jax.Array]:
  """Scaled, soft-capped float32 logits [B, Hkv, G, T, S] and their mask [B, 1|Hkv, 1|G, T, S]."""
  batch, num_heads, query_len, head_dim = x.query.shape
  num_kv_heads = x.key.shape[1]
  groups = num_heads // num_kv_heads
  scale = config.softmax_scale or head_dim**-0.5
  q = x.query.reshape(batch, num_kv_heads, groups, query_len, head_dim)  # [B, Hkv, G, T, D]
  logits = jnp.einsum("bkgtd,bksd->bkgts", q, x.key, precision=_HIGHEST,
                      preferred_element_type=jnp.float32) * scale  # [B, Hkv, G, T, S]
  if config.logits_soft_cap is not None:
    cap = config.logits_soft_cap
    logits = cap * jnp.tanh(logits / cap)
  mask = masks.full_mask(
      q_positions=x.q_positions, kv_positions=x.kv_positions, causal=config.causal,
      window=config.window, chunk_size=config.chunk_size, q_segment_ids=x.q_segment_ids,
      kv_segment_ids=x.kv_segment_ids, mask=x.mask)  # [B, 1|Hq, T, S]
  mask = mask.reshape(mask.shape[0], -1, groups if mask.shape[1] > 1 else 1, *mask.shape[2:])
  return logits, mask


def reference_bhtd(
    x: inputs_lib.KernelInputs,
    config: AttentionConfig,
    return_weights: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
  """Dense attention on kernel-layout inputs.

  GQA groups query heads over their kv head instead of repeating keys/values.

  Returns:
    output [B, Hq, T, Dv] in the query dtype, and weights [B, Hq, T, S] float32
    when asked for (None otherwise).
  """
  batch, num_heads, query_len, _ = x.query.shape
  num_kv_heads, kv_len = x.key.shape[1], x.key.shape[2]
  groups = num_heads // num_kv_heads
  logits, mask = logits_and_mask(x, config)  # [B, Hkv, G, T, S]
  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)  # [B, Hkv, G, T, 1]
  if x.sinks is not None:
    sinks = x.sinks.reshape(num_kv_heads, groups, 1, -1)  # [Hkv, G, 1, n]
    row_max = jnp.maximum(row_max, jnp.max(sinks, axis=-1, keepdims=True))
  visible = jnp.any(mask, axis=-1, keepdims=True)  # [B, 1|Hkv, 1|G, T, 1]
  # Rows that see nothing get a finite shift and exact zeros (never NaN).
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  unnormalized = jnp.exp(logits - row_max)  # [B, Hkv, G, T, S]
  denominator = jnp.sum(unnormalized, axis=-1, keepdims=True)
  if x.sinks is not None:
    denominator = denominator + jnp.sum(jnp.exp(sinks - row_max), axis=-1, keepdims=True)
  weights = jnp.where(visible, unnormalized / jnp.where(visible, denominator, 1.0), 0.0)
  out = jnp.einsum("bkgts,bksd->bkgtd", weights, x.value.astype(jnp.float32),
                   precision=_HIGHEST)  # [B, Hkv, G, T, Dv]
  out = out.reshape(batch, num_heads, query_len, -1).astype(x.query.dtype)  # [B, Hq, T, Dv]
  if not return_weights:
    return out, None
  return out, weights.reshape(batch, num_heads, query_len, kv_len)  # [B, Hq, T, S]


def reference_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    config: AttentionConfig | None = None,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    mask: jax.Array | None = None,
    softmax_aux: jax.Array | None = None,
    return_weights: bool = False,
    **config_overrides,
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
    q_segment_ids, kv_segment_ids, q_positions, kv_positions, mask, softmax_aux:
      as in `splash_hk.attention`.
    return_weights: also return the softmax weights [B, Hq, T, S].
    **config_overrides: AttentionConfig fields to replace, e.g. `causal=False`.

  Returns:
    AttentionOutput(attention_outputs [B, T, Hq, Dv], attention_weights or None).
  """
  config = AttentionConfig() if config is None else config
  if config_overrides:
    config = config.replace(**config_overrides)
  validation.validate_qkv(query, key, value, config)
  extras = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                q_positions=q_positions, kv_positions=kv_positions, mask=mask,
                softmax_aux=softmax_aux)
  validation.validate_extras(query, key, **extras)
  x = inputs_lib.prepare(query, key, value, config=config, **extras)
  out, weights = reference_bhtd(x, config, return_weights)
  return AttentionOutput(jnp.swapaxes(out, 1, 2), weights)  # [B, T, Hq, Dv]
