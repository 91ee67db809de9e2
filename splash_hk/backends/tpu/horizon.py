"""Splash serving `Causal() | Bidirectional(ids)` (prefix-LM, images, any span) with traced ids.

Splash's masks are static, but its mask function reads each query row's entry
of the MaskInfo's `q_sequence`, a kernel input that may be traced like q. At
default positions that rule leaves query i (at key index p_i) the keys
[0, h_i]: its causal past, extended to the end of the run of equal ids that
holds p_i when query i shares that id (its "horizon"). So the kernel computes
the mask `kv_index <= q_sequence[i]` with q_sequence = h, and each example's
block plan comes from its query blocks' least and greatest h, in O(blocks), as
MaskInfo that is not shrunk (a traced plan cannot choose its own grid width).

The rewrite is exact when no key after h_i holds query i's id (each id's keys
from p_i on are one run): `horizon` says at run time whether it is, and the
caller runs another path where it is not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info_lib

from splash_hk.masks import _objects
from splash_hk.backends.tpu import plan as splash_plan


def serves(rule: _objects.Mask | None) -> bool:
  """Whether `rule` (an object or its skeleton) is `Causal() | Bidirectional(...)`, either order."""
  return _objects.causal_or_spans(rule) is not None


def horizon(rule: _objects.Mask | None, query_len: int,
            kv_len: int) -> tuple[jax.Array, jax.Array]:
  """(h [B, T] int32: the last key index each query sees, exact: whether keys [0, h] are all
  the keys the rule (`Causal() | Bidirectional(ids)`) lets each query see) at default
  (end-aligned) positions."""
  spans = _objects.causal_or_spans(rule)
  assert spans is not None, "the selector sends only Causal() | Bidirectional(ids) here"
  q_ids, kv_ids = spans.ids  # [B, T], [B, S]
  batch = q_ids.shape[0]
  place = kv_len - query_len + jnp.arange(query_len)  # [T]: each query's key index
  keys = jnp.arange(kv_len)
  ends = jnp.concatenate([kv_ids[:, 1:] != kv_ids[:, :-1], jnp.ones((batch, 1), bool)], axis=1)
  run_end = jax.lax.cummin(jnp.where(ends, keys, kv_len), axis=1, reverse=True)  # [B, S]
  in_span = (q_ids >= 0) & (kv_ids[:, place] == q_ids)  # [B, T]
  h = jnp.where(in_span, run_end[:, place], place)  # [B, T]
  order = jnp.argsort(kv_ids, axis=1, stable=True)  # equal ids in key order
  sorted_ids = jnp.take_along_axis(kv_ids, order, axis=1)  # [B, S]
  last = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side="right"))(sorted_ids, q_ids) - 1
  last = jnp.maximum(last, 0)  # [B, T]: where each query's id occurs last (if at all)
  found = jnp.take_along_axis(sorted_ids, last, axis=1) == q_ids
  beyond = found & (jnp.take_along_axis(order, last, axis=1) > h)
  return h.astype(jnp.int32), ~jnp.any((q_ids >= 0) & beyond)


def mask_infos(h: jax.Array, padded: tuple[int, int], blocks: tuple[int, int, int, int],
               fused: bool) -> tuple[info_lib.MaskInfo, info_lib.MaskInfo | None, info_lib.MaskInfo]:
  """Per-example (forward, dq, dK/dV) MaskInfo [B, 1, nq, nk] of the mask `kv <= h[q]`.

  Args:
    h: [B, Tp] int32, the horizon of every padded query row.
    padded: (Tp, Sp); blocks: (block_q, block_kv, block_q_bwd, block_kv_bwd).
    fused: the backward is fused (no dq grid).
  """
  bq, bkv, bq_bwd, bkv_bwd = blocks
  info = lambda shape, is_dkv: _info(h, padded[1], shape, is_dkv)
  return (info((bq, bkv), False), None if fused else info((bq_bwd, bkv_bwd), False),
          info((bq_bwd, bkv_bwd), True))


def within_horizon(q_ids: jax.Array, kv_ids: jax.Array) -> jax.Array:
  """The kernel's mask function: `q_ids` are the rows' horizons (`q_sequence`)."""
  return kv_ids <= q_ids


def _info(h: jax.Array, kv_len: int, block_shape: tuple[int, int], is_dkv: bool) -> info_lib.MaskInfo:
  batch, query_len = h.shape
  bq, bk = block_shape
  rows = h.reshape(batch, query_len // bq, bq)  # [B, nq, bq]
  first_key = jnp.arange(kv_len // bk) * bk  # [nk]
  full = first_key + bk - 1 <= rows.min(axis=-1)[..., None]  # [B, nq, nk]
  may = first_key <= rows.max(axis=-1)[..., None]
  values = may.astype(jnp.int8) + full.astype(jnp.int8)
  fetched = values.shape[1 if is_dkv else 2]
  data_next = splash_plan.next_nonzero(values, is_dkv, jnp).astype(splash_plan.small_dtype(fetched - 1))
  # JAX annotates MaskInfo's fields as NumPy arrays; its kernel takes traced ones (a pytree).
  return info_lib.MaskInfo._make((data_next[:, None], None, values[:, None], None, h, None))
