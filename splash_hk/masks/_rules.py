"""What always applies, whatever the rule: positions (end-aligned defaults, the load-balanced
order), segments, and the call's position rule from the config and a mask argument.

Written with operators only, so they work on NumPy arrays (static, at trace time)
and on traced jnp arrays (inside kernels) alike.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from splash_hk.masks._objects import Dense, Mask, from_rules

ArrayLike = Any  # np.ndarray or jax.Array


def end_aligned_positions(batch: int, query_len: int, kv_len: int,
                          xp: Any = jnp) -> tuple[ArrayLike, ArrayLike]:
  """End-aligned default positions (FlashAttention-2 convention), in `xp` (jnp or NumPy).

  Returns:
    q_positions [B, T] = arange(T) + (S - T), kv_positions [B, S] = arange(S), int32.
  """
  kv_pos = xp.arange(kv_len, dtype=xp.int32)  # [S]
  q_pos = xp.arange(query_len, dtype=xp.int32) + (kv_len - query_len)  # [T]
  return (xp.broadcast_to(q_pos, (batch, query_len)),
          xp.broadcast_to(kv_pos, (batch, kv_len)))


def load_balanced_order(length: int, shards: int) -> np.ndarray:
  """The dual-chunk swap: entry p of the balanced sequence is entry order[p] of the original.

  The sequence is cut into 2n chunks; shard i holds chunks i and 2n - 1 - i, in
  that order, so every shard gets as much causal work as any other.
  """
  if shards < 1 or length % (2 * shards):
    raise ValueError(f"a sequence of length {length} does not split into 2 * {shards} equal "
                     f"chunks; pad it to a multiple of {2 * max(shards, 1)}.")
  chunk = length // (2 * shards)
  chunks = np.array([c for i in range(shards) for c in (i, 2 * shards - 1 - i)])
  return (chunks[:, None] * chunk + np.arange(chunk)).reshape(-1)


def load_balanced_position(index: ArrayLike, length: int, shards: int) -> ArrayLike:
  """`load_balanced_order(length, shards)[index]`, in arithmetic (works on traced indices)."""
  chunk = length // (2 * shards)
  slot, within = index // chunk, index % chunk
  shard, second = slot // 2, slot % 2
  return (shard + second * (2 * shards - 1 - 2 * shard)) * chunk + within


def segment_mask(q_segment_ids: ArrayLike, kv_segment_ids: ArrayLike) -> ArrayLike:
  """Visibility from segments: [..., T], [..., S] -> [..., T, S]; negative ids are padding."""
  q = q_segment_ids[..., :, None]  # [..., T, 1]
  k = kv_segment_ids[..., None, :]  # [..., 1, S]
  return (q == k) & (q >= 0) & (k >= 0)


def call_rule(causal: bool, window: tuple[int, int] | None, chunk_size: int | None,
              mask: Any = None) -> Mask | None:
  """A call's position rule: `mask` when it is a mask object (the whole rule), else the config's
  rules (causal, window, chunk_size), ANDed with a dense `mask` array when one is given."""
  if isinstance(mask, Mask):
    return mask
  rule = from_rules(causal, window, chunk_size)
  if mask is None:
    return rule
  return Dense(mask) if rule is None else rule & Dense(mask)
