"""The one mask semantics every backend shares.

Key j is visible to query i when all of these hold:
  causal:          kv_pos[j] <= q_pos[i]
  sliding window:  q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right
  chunk:           q_pos[i] // chunk_size == kv_pos[j] // chunk_size
  segments:        q_seg[i] == kv_seg[j], and both >= 0 (negative = padding)
  dense mask:      mask[b, h, i, j]

The position and segment rules are written with operators only, so they work
on NumPy arrays (static block structure, at trace time) and on traced jnp
arrays (inside kernels) alike.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk.types import KernelInputs

ArrayLike = Any  # np.ndarray or jax.Array


def end_aligned_positions(batch: int, query_len: int, kv_len: int) -> tuple[jax.Array, jax.Array]:
  """End-aligned default positions (FlashAttention-2 convention).

  Returns:
    q_positions [B, T] = arange(T) + (S - T), kv_positions [B, S] = arange(S).
  """
  kv_pos = jnp.arange(kv_len, dtype=jnp.int32)  # [S]
  q_pos = jnp.arange(query_len, dtype=jnp.int32) + (kv_len - query_len)  # [T]
  return (jnp.broadcast_to(q_pos, (batch, query_len)),
          jnp.broadcast_to(kv_pos, (batch, kv_len)))


def position_rules(
    q: ArrayLike,
    k: ArrayLike,
    *,
    causal: bool,
    window: tuple[int, int] | None,
    chunk_size: int | None,
) -> ArrayLike | None:
  """Visibility of keys at positions `k` to queries at positions `q` (broadcast elementwise).

  Returns None when no positional rule applies (everything visible).
  """
  mask = None

  def conj(a, b):
    return b if a is None else a & b

  if causal:
    mask = conj(mask, k <= q)
  if window is not None:
    left, right = window
    mask = conj(mask, (k >= q - left) & (k <= q + right))
  if chunk_size is not None:
    mask = conj(mask, (q // chunk_size) == (k // chunk_size))
  return mask


def position_mask(
    q_pos: ArrayLike,
    kv_pos: ArrayLike,
    *,
    causal: bool,
    window: tuple[int, int] | None,
    chunk_size: int | None,
) -> ArrayLike | None:
  """Visibility from positions: q_pos [..., T], kv_pos [..., S] -> [..., T, S] (or None)."""
  return position_rules(q_pos[..., :, None], kv_pos[..., None, :], causal=causal, window=window,
                        chunk_size=chunk_size)


def visible_interval(q_pos: np.ndarray, kv_len: int, *, causal: bool,
                     window: tuple[int, int] | None, chunk_size: int | None
                     ) -> tuple[np.ndarray, np.ndarray]:
  """The keys each query may see when `kv_positions = arange(kv_len)` (static, NumPy).

  The position rules leave every row one interval of key positions; this is
  that interval clipped to the keys. Segments and dense masks only narrow it.

  Returns:
    (lo, hi) [T] int64, inclusive; a row with no visible key has lo > hi.
  """
  q_pos = np.asarray(q_pos, np.int64)
  lo = np.zeros_like(q_pos)
  hi = np.full_like(q_pos, kv_len - 1)
  if causal:
    hi = np.minimum(hi, q_pos)
  if window is not None:
    lo, hi = np.maximum(lo, q_pos - window[0]), np.minimum(hi, q_pos + window[1])
  if chunk_size is not None:
    first = (q_pos // chunk_size) * chunk_size
    lo, hi = np.maximum(lo, first), np.minimum(hi, first + chunk_size - 1)
  return lo, hi


def visible_pairs(query_len: int, kv_len: int, **rules) -> int:
  """How many (query, key) pairs the position rules let through at default positions."""
  q_pos = np.arange(query_len) + (kv_len - query_len)
  lo, hi = visible_interval(q_pos, kv_len, **rules)
  return int(np.maximum(hi - lo + 1, 0).sum())


def segment_mask(q_segment_ids: ArrayLike, kv_segment_ids: ArrayLike) -> ArrayLike:
  """Visibility from segments: [..., T], [..., S] -> [..., T, S]; negative ids are padding."""
  q = q_segment_ids[..., :, None]  # [..., T, 1]
  k = kv_segment_ids[..., None, :]  # [..., 1, S]
  return (q == k) & (q >= 0) & (k >= 0)


def disjoint_padding(q_segment_ids: jax.Array, kv_segment_ids: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
  """Segment ids for kernels that only test equality: padding (-1 on the query
  side, -2 on the key side) can then never match anything."""
  return (jnp.where(q_segment_ids < 0, -1, q_segment_ids),
          jnp.where(kv_segment_ids < 0, -2, kv_segment_ids))


def full_mask(x: KernelInputs, *, causal: bool, window: tuple[int, int] | None,
              chunk_size: int | None) -> jax.Array:
  """Every rule at once over a call's positions, segments and dense mask, materialised.

  Returns:
    [B, 1 or H, T, S] bool (H when `x.mask` has heads).
  """
  batch, query_len = x.q_positions.shape
  kv_len = x.kv_positions.shape[-1]
  out = jnp.ones((batch, 1, query_len, kv_len), jnp.bool_)  # [B, 1, T, S]
  pos = position_mask(x.q_positions, x.kv_positions, causal=causal, window=window,
                      chunk_size=chunk_size)
  if pos is not None:
    out = out & pos[:, None]
  if x.q_segment_ids is not None:
    out = out & segment_mask(x.q_segment_ids, x.kv_segment_ids)[:, None]
  if x.mask is not None:
    out = out & x.mask
  return out
