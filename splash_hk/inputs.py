"""Defaults and normal forms of the optional inputs, shared by every path.

`prepare` turns the public BTHD arguments into `KernelInputs`: BHTD arrays,
explicit positions (end-aligned defaults), segment ids given for both sides or
neither, sinks as [Hq, n] float32. Kernels see only this normal form.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from splash_hk import masks
from splash_hk.config import AttentionConfig


class KernelInputs(NamedTuple):
  """Per-call (or per-shard) arrays in kernel layout. A pytree; None fields are absent."""

  query: jax.Array  # [B, Hq, T, D]
  key: jax.Array  # [B, Hkv, S, D]
  value: jax.Array  # [B, Hkv, S, Dv]
  q_positions: jax.Array  # [B, T] int32
  kv_positions: jax.Array  # [B, S] int32
  q_segment_ids: jax.Array | None = None  # [B, T] int32
  kv_segment_ids: jax.Array | None = None  # [B, S] int32
  mask: jax.Array | None = None  # [B or 1, 1 or Hq, T, S] bool
  sinks: jax.Array | None = None  # [Hq, n] float32


def sinks_per_query_head(softmax_aux: jax.Array, num_heads: int) -> jax.Array:
  """[Hq], [Hq, n] or [Hkv, n] -> [Hq, n] float32 (kv-head sinks shared by their group)."""
  aux = jnp.asarray(softmax_aux, jnp.float32)
  if aux.ndim == 1:
    return aux[:, None]  # [Hq, 1]
  return jnp.repeat(aux, num_heads // aux.shape[0], axis=0)  # [Hq, n]


def prepare(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    config: AttentionConfig,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    mask: jax.Array | None = None,
    softmax_aux: jax.Array | None = None,
) -> KernelInputs:
  """Validated BTHD inputs -> KernelInputs (BHTD, defaults filled in)."""
  batch, query_len, num_heads, _ = query.shape
  kv_len = key.shape[1]
  if config.runtime_dtype is not None:
    query, key, value = (x.astype(config.runtime_dtype) for x in (query, key, value))
  default_q, default_kv = masks.default_positions(batch, query_len, kv_len)
  q_positions = default_q if q_positions is None else q_positions.astype(jnp.int32)
  kv_positions = default_kv if kv_positions is None else kv_positions.astype(jnp.int32)
  if q_segment_ids is None and kv_segment_ids is not None:
    q_segment_ids = kv_segment_ids  # validation allowed this only when T == S
  if kv_segment_ids is None and q_segment_ids is not None:
    kv_segment_ids = q_segment_ids
  if q_segment_ids is not None:
    q_segment_ids = q_segment_ids.astype(jnp.int32)
    kv_segment_ids = kv_segment_ids.astype(jnp.int32)
  return KernelInputs(
      query=jnp.swapaxes(query, 1, 2),  # [B, Hq, T, D]
      key=jnp.swapaxes(key, 1, 2),  # [B, Hkv, S, D]
      value=jnp.swapaxes(value, 1, 2),  # [B, Hkv, S, Dv]
      q_positions=q_positions,
      kv_positions=kv_positions,
      q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids,
      mask=mask,
      sinks=None if softmax_aux is None else sinks_per_query_head(softmax_aux, num_heads),
  )
