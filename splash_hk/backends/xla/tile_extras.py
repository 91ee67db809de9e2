"""A gathered tile's bias and dropout (`xla_gather`): position scores and the dropout hash over
the tile's own rows and gathered keys, in its [B, L, R, Gl * bq, K * bk] layout.

A score object reads positions and heads in the layout [.., Hkv, G, bq, bk] (its per-head
arrays reshaped to `head`'s axes 1 and 2), so the tile's bias is evaluated as [B, R, L, Gl, bq,
K * bk] and moved to the tile's layout. Dense bias arrays and explicit dropout masks are not read
here (their calls run on the block plan). Glossary as in `xla_gather`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from splash_hk import dropout as dropout_lib
from splash_hk.backends.xla.lists import Layout
from splash_hk.dropout import Dropout
from splash_hk.scores import Score


def merged_heads(heads: jax.Array, lay: Layout) -> jax.Array:
  """[Hq] per-head values -> [1, L, 1, Gl * bq, 1]: each of a tile's merged rows' value."""
  rows = jnp.repeat(heads.reshape(lay.list_heads, lay.group), lay.block_q, axis=1)
  return rows[None, :, None, :, None]


def bias(score: Score, heads: jax.Array, q_pos: jax.Array, kv_pos: jax.Array,
         mask: jax.Array, lay: Layout) -> jax.Array:
  """f32 [B, L, R, Gl * bq, K * bk]: the bias of a tile's visible pairs (0 elsewhere).

  q_pos [B, R, bq] (the tile's rows), kv_pos [B, L, R, K * bk] (its gathered keys), heads
  [Hq] (global indices)."""
  q = q_pos[:, :, None, None, :, None]  # [B, R, 1, 1, bq, 1]
  kv = jnp.swapaxes(kv_pos, 1, 2)[:, :, :, None, None, :]  # [B, R, L, 1, 1, K * bk]
  head = heads.reshape(1, lay.list_heads, lay.group, 1, 1)  # [1, L, Gl, 1, 1]
  full = (lay.batch, lay.per_item, lay.list_heads, lay.group, lay.block_q, kv.shape[-1])
  b = jnp.broadcast_to(score.scores(q, kv, head).astype(jnp.float32), full)
  b = jnp.transpose(b, (0, 2, 1, 3, 4, 5)).reshape(
      lay.batch, lay.list_heads, lay.per_item, lay.group * lay.block_q, kv.shape[-1])
  return jnp.where(mask, b, 0.0)


def drop(d: Dropout, rate: float, q_index: jax.Array, kv_index: jax.Array,
         lay: Layout) -> jax.Array:
  """f32 keep / (1 - rate) [B, L, R, Gl * bq, K * bk] of a tile: the library's dropout hash of
  each pair's global coordinates (q_index [B, 1, R, Gl * bq], kv_index [B, L, R, K * bk])."""
  rows = d.rows[:, None, None, None, None]  # [B, 1, 1, 1, 1]
  return dropout_lib.scale(d.key, rate, rows, merged_heads(d.heads, lay), q_index[..., None],
                           kv_index[..., None, :])
