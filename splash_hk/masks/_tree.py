"""Draft trees over a call's new tokens (speculative decoding with a fixed cache): `Tree`.

`Tree(parents)`: parents [B, T] int, each query's parent among the call's tokens (its index in
the row), or -1 when its parent is what came before the call (a root). Query i sees, of the
call's tokens, itself and its ancestors; with a `KVCache` it also sees every cached key (under
the config's rule), and the layer gives the call positions by depth (`positions`): query i at
the cache's length plus its depth, and its key there too, though it is written at slot length
+ i. Without a cache the last T keys are the call's tokens (end-aligned, at the default
positions) and every earlier key is seen by every row. Ancestry is two comparisons of the
depth-first walk's times (`splash_hk.drafts`). A parent not earlier in its row is a ValueError
naming `mask` when concrete; under `jit` that batch row outputs NaN.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk import drafts
from splash_hk.masks._blocks import ArrayLike, Blocks, blocks, ranges
from splash_hk.masks._mask import Mask, Shaped, array_field

__all__ = ("Tree", "misused", "positions")

_CACHED = -1  # a cached key's walk entry: before every query's
_ALWAYS = 2**30  # and its exit: after every query's


def misused(tree: Tree) -> jax.Array:
  """[B] bool: rows of the call with a parent not earlier (under `jit`: they output NaN;
  concrete parents are refused by `Tree.check`)."""
  p = jnp.asarray(tree.parents, jnp.int32)
  return jnp.any((p < -1) | (p >= jnp.arange(p.shape[1])[None, :]), axis=1)


def _walk(parents: jax.Array) -> drafts.Walk:
  """The walk of each row's forest: parents [B, T] -> Walk of [B, T] arrays."""
  batch, length = parents.shape
  p = jnp.asarray(parents, jnp.int32)
  index = jnp.arange(length, dtype=jnp.int32)[None, :]
  linked = (p >= 0) & (p < index)  # a parent not earlier: a root (its batch row: NaN)
  offset = jnp.arange(batch, dtype=jnp.int32)[:, None] * length
  w = drafts.walk(jnp.where(linked, p + offset, -1).reshape(-1))
  return drafts.Walk(*(a.reshape(batch, length) for a in w))


def _xp_side(a: ArrayLike, block: int, xp) -> ArrayLike:
  return blocks(a, block, _CACHED, xp)


@dataclasses.dataclass(frozen=True)
class Tree(Mask):
  """Draft trees: `parents` [B, T] int (see the module docstring)."""

  parents: Shaped = array_field("q")  # [B, T] int
  enter: ArrayLike = array_field("q", None)  # normal form: each query's walk entry [B, T]
  depth: ArrayLike = array_field("q", None)  # and its depth [B, T]
  kv_enter: ArrayLike = array_field("kv", None)  # [B, S]: its key's row's entry (cached: -1)
  kv_leave: ArrayLike = array_field("kv", None)  # [B, S]: and exit (cached: after all)

  def check(self, batch: int, query_len: int, kv_len: int) -> None:
    p = self.parents
    if len(p.shape) != 2 or tuple(p.shape) != (batch, query_len):
      raise ValueError(f"`mask` Tree.parents must be [B, T] = [{batch}, {query_len}] (each "
                       f"query's parent among the call's tokens), got {tuple(p.shape)}.")
    if not jnp.issubdtype(p.dtype, jnp.integer):
      raise ValueError(f"`mask` Tree.parents must be integers, got {p.dtype}.")
    if self.kv_enter is None and query_len > kv_len:
      raise ValueError(f"`mask` Tree without a cache needs kv_len >= query_len (the last T keys "
                       f"are the call's own tokens), got {query_len} queries and {kv_len} keys.")
    if not isinstance(p, (jax.core.Tracer, jax.ShapeDtypeStruct)):
      known = np.asarray(p)
      bad = (known < -1) | (known >= np.arange(query_len)[None, :])
      if bad.any():
        b, i = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"`mask` Tree.parents[{b}, {i}] is {int(known[b, i])}: a parent must be "
                         f"an earlier token of the call (0..{i - 1}) or -1 (a root).")

  def for_call(self, call: Any) -> Mask:
    """Without a cache (`over_slots` not applied): the last T keys are the call's tokens, in
    order (end-aligned, as the default positions), the keys before them seen by every row."""
    if self.kv_enter is not None:
      return self
    slots = jnp.arange(call.kv_len - call.query_len, call.kv_len, dtype=jnp.int32)
    return self.over_slots(jnp.broadcast_to(slots, (call.batch, call.query_len)), call.kv_len)

  def over_slots(self, slots: ArrayLike, kv_len: int) -> Mask:
    """Over a cache of `kv_len` slots, the call's tokens written at `slots` [B, T]."""
    if tuple(jnp.shape(self.parents)) != tuple(slots.shape):
      raise ValueError(f"`mask` Tree.parents must be [B, T] = {tuple(slots.shape)} (each of the "
                       f"call's tokens' parent), got {tuple(jnp.shape(self.parents))}.")
    w = _walk(jnp.asarray(self.parents))
    rows = jnp.arange(slots.shape[0])[:, None]
    fill = lambda value, at: jnp.full((slots.shape[0], kv_len), value, jnp.int32).at[
        rows, slots].set(at, mode="drop")  # [B, S]
    return dataclasses.replace(self, enter=w.enter, depth=w.depth,
                               kv_enter=fill(_CACHED, w.enter), kv_leave=fill(_ALWAYS, w.leave))

  def visible(self, q_pos: ArrayLike, kv_pos: ArrayLike) -> ArrayLike:
    del q_pos, kv_pos  # ancestry is by index
    q = self.enter[:, None, :, None]  # [B, 1, T, 1]
    return drafts.is_ancestor(self.kv_enter[:, None, None, :], self.kv_leave[:, None, None, :], q)

  def classify(self, b: Blocks) -> tuple[ArrayLike, ArrayLike]:
    xp = b.xp
    q_in = blocks(b.q_valid, b.block_q, False, xp)
    kv_in = blocks(b.kv_valid, b.block_kv, False, xp)
    q_lo, q_hi = ranges(_xp_side(self.enter, b.block_q, xp), q_in, xp)  # [B, nq]
    enter_lo, enter_hi = ranges(_xp_side(self.kv_enter, b.block_kv, xp), kv_in, xp)  # [B, nk]
    _, leave_hi = ranges(_xp_side(self.kv_leave, b.block_kv, xp), kv_in, xp)
    may = (enter_lo[:, None, :] <= q_hi[:, :, None]) & (q_lo[:, :, None] < leave_hi[:, None, :])
    full = xp.broadcast_to((enter_hi == _CACHED)[:, None, :], may.shape)  # cached keys only
    return may, full


def positions(tree: Tree, slots: jax.Array, kv_len: int) -> tuple[jax.Array, jax.Array]:
  """Positions by depth over a cache: (queries [B, T], the cache's slots [B, S]): the call's
  token i (written at `slots[:, i]`) at the cache's length plus its depth, cached keys at
  their slots. `tree`: over the cache (`over_slots`: its walk made once)."""
  depth = tree.depth  # [B, T]
  q_pos = slots[:, :1] + depth
  rows = jnp.arange(slots.shape[0])[:, None]
  kv_pos = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (slots.shape[0], kv_len))
  return q_pos, kv_pos.at[rows, slots].set(q_pos, mode="drop")
