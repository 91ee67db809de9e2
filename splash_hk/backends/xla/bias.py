"""The xla backend's bias: each block pair's bias, and its gradients accumulated over the pairs.

The bias of a block pair comes from its positions and heads (`Score.scores`), with the
call's dense arrays cut to the pair (`Views.pair`), so no [T, S] array is built for a
position object. A masked block reads the bias where a pair is visible only (garbage
elsewhere changes nothing). Gradients: the cotangent of a pair's bias is its ds (before
the soft cap's scale), pulled back through the object by `jax.vjp` and summed pair after
pair in the loop's fixed order (deterministic); dense arrays get theirs at the pair's place.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from splash_hk.backends import base
from splash_hk.backends.xla.blocks import Pair, Views
from splash_hk.scores import Score
from splash_hk.types import KernelInputs


def block(views: Views, pair: Pair, mask: jax.Array | None) -> jax.Array | None:
  """f32 bias of the pair, broadcastable to [r, Hkv, Gq, bq, bk] (0 where `mask` is False), or
  None without a bias."""
  if pair.bias is None:
    return None
  b = _of(pair.bias, views, pair)
  return b if mask is None else jnp.where(mask, b, 0.0)


def _of(score: Score, views: Views, pair: Pair) -> jax.Array:
  return base.bias_block(score, pair.mask.q_pos, pair.mask.kv_pos, views.x.heads,
                         views.heads_per_kv)


def pair_grads(views: Views, pair: Pair, ds: jax.Array) -> Score | None:
  """The pair's bias leaves' cotangents (its cut arrays', and the objects' own), from ds
  [r, Hkv, Gq, bq, bk] (the logits' cotangent before the soft cap: d bias = ds)."""
  if pair.bias is None:
    return None
  out, pull_back = jax.vjp(lambda score: _of(score, views, pair), pair.bias)
  extra = tuple(i for i, (n, m) in enumerate(zip(ds.shape, out.shape)) if n != m)
  return pull_back(jnp.sum(ds, axis=extra, keepdims=True).astype(out.dtype))[0]


def zeros(views: Views) -> Score | None:
  """f32 accumulators of the bias leaves' gradients (dense arrays padded as `views` pads them)."""
  if views.bias is None:
    return None
  return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), views.bias)


def add(views: Views, acc: Score | None, grads: Score | None, group: Any, i: Any,
        j: Any) -> Score | None:
  """acc + one pair's grads: dense arrays at the pair's place, the others whole."""
  if views.bias is None or acc is None or grads is None:
    return acc
  sides = views.bias.map_arrays(lambda side, a, **_: side)  # the same tree, sides as leaves

  def one(side: str, a: jax.Array, g: jax.Array) -> jax.Array:
    g = g.astype(jnp.float32)
    return views.add_pair(a, g, group, i, j) if side == "qk" else a + g

  return jax.tree.map(one, sides, acc, grads)


def finish(x: KernelInputs, acc: Score | None, query_len: int) -> Score | None:
  """The accumulated gradients in the bias leaves' dtypes, dense arrays unpadded to T."""
  if acc is None or x.bias is None:
    return None
  trim = acc.map_arrays(lambda side, g, **_: g[:, :, :query_len] if side == "qk" else g)
  return jax.tree.map(lambda g, a: g.astype(a.dtype), trim, x.bias)
