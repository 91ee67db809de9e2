"""Attention dropout: one counter-based hash of the key and a pair's global coordinates.

Pair (b, h, i, j) (the global batch row, the global query head, the query's end-aligned index
`S - T + t` and the key's index along S) is kept when `bits(key, b, h, i, j) >= rate * 2**32`.
Nothing depends on the tile, the backend or the device layout, so every backend, block size and
mesh draws the same mask from the same key, and a decode step against a cache (its query at its
slot) draws the full forward's. The backward regenerates it; nothing of size T x S is stored.

The bits: murmur3's 32-bit finaliser (`_fmix`) folds the key words, b, h and i into one word
per query row, then once more with j per pair (a full avalanche per pair, one multiply-xorshift
finaliser of cost per element).
"""

from __future__ import annotations

from typing import Any, Generic, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk.types import Leaf

__all__ = ("Dropout", "dropout_mask", "heads_by_kv", "keep", "key_words", "mask_by_kv",
           "row_bits", "scale")

_ROW, _HEAD, _QUERY, _KEY = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F


class Dropout(NamedTuple, Generic[Leaf]):
  """What a kernel needs to draw the mask of its pairs (a pytree; sharded with what it indexes).

  Either `key` (the hash) or `mask` (an explicit keep mask, tokamax's `dropout_mask`) is set.
  """

  key: Leaf | None  # [2] uint32: the PRNG key's words
  rows: Leaf  # [B] int32: each batch row's global index
  heads: Leaf  # [Hq] int32: each query head's global index (all 0: one mask for all heads)
  q_index: Leaf  # [B, T] int32: each query's end-aligned global index (a cache: its slot)
  kv_index: Leaf  # [B, S] int32: each key's global index along S
  mask: Leaf | None = None  # [B|1, Hq|1, T, S] bool, True = keep: overrides the hash


def _fmix(x: jax.Array) -> jax.Array:
  """murmur3's 32-bit finaliser (uint32 in, uint32 out)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def key_words(key: Any) -> jax.Array:
  """A jax.random key (typed, or a legacy uint32 array) as [2] uint32 words, each a hash of
  every other word of the key's data (wider keys, e.g. rbg's 4 words, folded in)."""
  if _typed(key):
    data = jax.random.key_data(key)
  elif jnp.issubdtype(jnp.asarray(key).dtype, jnp.unsignedinteger):
    data = jnp.asarray(key)
  else:
    raise ValueError(f"`dropout_rng` must be a jax.random key (jax.random.key(0) or "
                     f"jax.random.PRNGKey(0)), got {jnp.asarray(key).dtype}{list(jnp.shape(key))}.")
  if data.ndim != 1 or data.shape[0] % 2:
    raise ValueError(f"`dropout_rng` must be one jax.random key (not a batch of keys), got key "
                     f"data of shape {tuple(data.shape)}.")
  words = data.astype(jnp.uint32).reshape(-1, 2)  # [n, 2]
  fold = [jnp.uint32(_ROW), jnp.uint32(_KEY)]
  for n in range(words.shape[0]):
    fold = [_fmix(fold[w] ^ words[n, w]) for w in range(2)]
  return jnp.stack(fold)  # [2]


def _typed(key: Any) -> bool:
  return jnp.issubdtype(getattr(key, "dtype", np.float32), jax.dtypes.prng_key)


def row_bits(key: jax.Array, rows: jax.Array, heads: jax.Array, q_index: jax.Array) -> jax.Array:
  """The per-query-row word of the hash, broadcast over `rows`, `heads` and `q_index` (uint32)."""
  u32 = lambda a: jnp.asarray(a).astype(jnp.uint32)
  x = _fmix(key[0] ^ (u32(rows) * jnp.uint32(_ROW)))
  x = _fmix(x ^ key[1] ^ (u32(heads) * jnp.uint32(_HEAD)))
  return _fmix(x ^ (u32(q_index) * jnp.uint32(_QUERY)))


def keep(row: jax.Array, kv_index: jax.Array, rate: float) -> jax.Array:
  """bool: pairs kept, from `row_bits` and the keys' indices (broadcast)."""
  bits = _fmix(row ^ (jnp.asarray(kv_index).astype(jnp.uint32) * jnp.uint32(_KEY)))
  return bits >= jnp.uint32(min(round(rate * 2.0**32), 2**32 - 1))


def scale(key: jax.Array | None, rate: float, rows: jax.Array, heads: jax.Array,
          q_index: jax.Array, kv_index: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """float32 keep / (1 - rate) of a block of pairs, broadcast over its arguments: `rows`,
  `heads`, `q_index`, `kv_index` already laid out along the block's axes (e.g. [r, 1, 1, 1, 1],
  [1, Hkv, G, 1, 1], [r, 1, 1, bq, 1], [r, 1, 1, 1, bk]); `mask` (explicit, True = keep)
  instead of the hash when given."""
  if mask is None:
    if key is None:
      raise ValueError("a Dropout needs its key or an explicit mask (a bug in the caller)")
    mask = keep(row_bits(key, rows, heads, q_index), kv_index, rate)
  return jnp.where(mask, jnp.float32(1.0 / (1.0 - rate)), jnp.float32(0.0))


def heads_by_kv(heads: jax.Array, num_kv_heads: int) -> jax.Array:
  """[Hq] head indices -> [1, Hkv, G, 1, 1] (a kv head's query heads along G)."""
  return heads.reshape(1, num_kv_heads, -1, 1, 1)


def mask_by_kv(mask: jax.Array, num_kv_heads: int) -> jax.Array:
  """[B|1, Hq|1, T, S] -> [B|1, Hkv|1, G|1, T, S]."""
  if mask.shape[1] == 1:
    return mask[:, :, None]
  return mask.reshape(mask.shape[0], num_kv_heads, -1, *mask.shape[2:])


def dropout_mask(key: Any, rate: float, *, batch: int, num_heads: int, query_len: int,
                 kv_len: int) -> jax.Array:
  """The keep mask [batch, num_heads, query_len, kv_len] (bool, True = kept) that `attention`
  draws from `key` at `dropout_rate=rate` for a call of these shapes (queries end-aligned: query
  t has index kv_len - query_len + t). For checks and tests: a call never builds it."""
  if not (isinstance(rate, (int, float)) and 0 <= rate < 1):
    raise ValueError(f"`rate` must be a number in [0, 1), got {rate!r}.")
  row = row_bits(key_words(key), jnp.arange(batch)[:, None, None, None],
                 jnp.arange(num_heads)[None, :, None, None],
                 (kv_len - query_len + jnp.arange(query_len))[None, None, :, None])
  return keep(row, jnp.arange(kv_len)[None, None, None, :], rate)
