"""Draft trees (speculative decoding) as arrays: each row's depth and its place in the tree's
depth-first order, so "key row a is an ancestor of query row r" is two comparisons.

A forest of N rows is given by parents [N] (-1: a root; a parent always comes earlier). Its
depth-first walk, children in row order and roots in row order, enters row r at `enter[r]` and
leaves it at `leave[r]`; a is r or an ancestor of r exactly when
`enter[a] <= enter[r] < leave[a]` (`is_ancestor`). Both come from one Euler tour ranked by
pointer jumping (O(N log N), no loop over the rows), as the depths do.

DESIGN's "Draft trees (speculative decoding)" is the contract: a row's position is its
sequence's length before the call plus its depth; keys are written in row order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Walk(NamedTuple):
  """A forest's rows in depth-first order: [N] int32 each."""

  depth: jax.Array  # ancestors among the rows (a root: 0)
  enter: jax.Array  # when the walk enters the row
  leave: jax.Array  # when it leaves it (after its whole subtree)


def _rounds(n: int) -> int:
  """Pointer-jumping rounds that cover a list of `n` links."""
  return max(1, (max(n, 1) - 1).bit_length())


def depths(parents: jax.Array) -> jax.Array:
  """[N] int32: each row's ancestors (`parents` [N], -1 a root, each parent earlier)."""
  up = parents.astype(jnp.int32)  # [N]
  depth = (up >= 0).astype(jnp.int32)
  for _ in range(_rounds(up.shape[0])):
    at = jnp.clip(up, 0, None)
    depth = depth + jnp.where(up >= 0, depth[at], 0)
    up = jnp.where(up >= 0, up[at], -1)
  return depth


def walk(parents: jax.Array) -> Walk:
  """The depth-first walk of the forest `parents` [N] (-1: a root; each parent earlier)."""
  n = parents.shape[0]
  parent = jnp.where(parents >= 0, parents, n).astype(jnp.int32)  # roots: children of row n
  rows = jnp.arange(n, dtype=jnp.int32)
  order = jnp.argsort(parent, stable=True).astype(jnp.int32)  # children by parent, in row order
  follows = jnp.append(parent[order][1:] == parent[order][:-1], False)  # a sibling after it
  sibling = jnp.full((n,), -1, jnp.int32).at[order].set(
      jnp.where(follows, jnp.append(order[1:], 0), -1))  # [N]: the next child of its parent
  first = jnp.full((n + 1,), n, jnp.int32).at[parent].min(rows)  # [N + 1]: first child (n: none)
  # The tour's 2N steps: entering row r is step r, leaving it step N + r.
  into = lambda r: r
  out_of = lambda r: n + r
  after_enter = jnp.where(first[:n] < n, into(first[:n]), out_of(rows))
  after_leave = jnp.where(sibling >= 0, into(jnp.clip(sibling, 0, None)),  # roots: the next
                          jnp.where(parent < n, out_of(jnp.clip(parent, 0, n - 1)), 2 * n))
  succ = jnp.concatenate([after_enter, after_leave])  # [2N] (2N: the end)
  left = (succ < 2 * n).astype(jnp.int32)  # steps after each one, by pointer jumping
  for _ in range(_rounds(2 * n + 1)):
    ahead = jnp.clip(succ, 0, 2 * n - 1)
    left = left + jnp.where(succ < 2 * n, left[ahead], 0)
    succ = jnp.where(succ < 2 * n, succ[ahead], 2 * n)
  place = 2 * n - 1 - left  # [2N]: each step's place in the tour
  return Walk(depth=depths(parents), enter=place[:n], leave=place[n:])


def is_ancestor(enter_a: jax.Array, leave_a: jax.Array, enter_r: jax.Array) -> jax.Array:
  """Whether row a (its `enter_a`, `leave_a`) is row r (its `enter_r`) or an ancestor of it."""
  return (enter_a <= enter_r) & (enter_r < leave_a)


class TreeRows(NamedTuple):
  """A tree batch's rows ([N] int32 each): where each one's sequence starts, and its walk."""

  first_new: jax.Array  # the slot of its sequence's first new key (the length before the call)
  first_row: jax.Array  # its sequence's first row
  enter: jax.Array  # `Walk.enter` over the whole batch (sequences are disjoint trees)
  leave: jax.Array  # `Walk.leave`


def keys_seen(tree: TreeRows, at: jax.Array, rows: jax.Array,
              kv_pos: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(positions, seen) of keys at slots `kv_pos` of the sequence of query rows `rows`
  (broadcast together): a new key's position is its row's `at` [N], and a query row sees, of
  its sequence's new keys, its own and its ancestors' (cached keys: all)."""
  first_new = tree.first_new[rows]
  new = kv_pos >= first_new
  a = jnp.clip(tree.first_row[rows] + kv_pos - first_new, 0, at.shape[0] - 1)  # the key's row
  seen = ~new | is_ancestor(tree.enter[a], tree.leave[a], tree.enter[rows])
  return jnp.where(new, at[a], kv_pos), seen


def bad_paths(path: jax.Array, path_lens: jax.Array, rows: jax.Array,
              parent: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Which accepted paths are not paths of their tree: the one check of `sh.accept_drafts` and
  `KVCache.accept`.

  Args:
    path: [R, L] int32, each sequence's kept rows (indices among its rows), root to leaf.
    path_lens: [R] int32, how many of them it keeps.
    rows: [R] int32, the rows the sequence has in the call.
    parent: [R, L] int32, the parent of each path entry among the sequence's rows (-1: a root;
      any value where the entry is out of range).

  Returns:
    (bad_len, outside, off_tree), [R] bool each: a length outside [0, min(L, rows)]; a kept row
    outside [0, rows); a kept row whose parent is not the entry before it (-1 for the first).
  """
  width = path.shape[1]
  bad_len = (path_lens < 0) | (path_lens > jnp.minimum(width, rows))
  used = jnp.arange(width)[None, :] < path_lens[:, None]  # [R, L]
  inside = (path >= 0) & (path < rows[:, None])
  before = jnp.concatenate([jnp.full((path.shape[0], 1), -1, jnp.int32), path[:, :-1]], axis=1)
  return (bad_len, jnp.any(used & ~inside, axis=1),
          jnp.any(used & inside & (parent != before), axis=1))
