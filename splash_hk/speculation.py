"""`accept_drafts`: after a paged step verified draft trees, each sequence's accepted rows moved
to the slots right after its length before the step (DESIGN's "Draft trees").

The step wrote row r of sequence s at slot `kv_lens[s] + r` (row order); the accepted path
`path[s, :path_lens[s]]` (root to leaf, in s's row numbering) becomes slots `kv_lens[s] + 0,
1, ...`, and the caller adds `path_lens` to `kv_lens`. A path that is not one of the batch's
tree paths (a chain's: 0, 1, ...), or a length or row outside the step's rows, is the paged
misuse rule: a ValueError naming the argument when concrete, else that sequence moves nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk import drafts
from splash_hk import quant
from splash_hk.config import known_now
from splash_hk.pages import PagedKVCache, RaggedBatch
from splash_hk.validation import fail, integer, rank

__all__ = ("accept_drafts",)


def _checked(cache: PagedKVCache, batch: RaggedBatch, path: jax.Array,
             path_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Shapes and dtypes of `accept_drafts`' arguments; (path, path_lens) as int32 arrays."""
  if not isinstance(cache, PagedKVCache):
    fail(f"`cache` must be a splash_hk.PagedKVCache, got {type(cache).__name__}.")
  if not isinstance(batch, RaggedBatch):
    fail(f"`batch` must be the splash_hk.RaggedBatch of the step that verified the drafts, got "
         f"{type(batch).__name__}.")
  path, path_lens = jnp.asarray(path), jnp.asarray(path_lens)
  max_seqs = batch.max_seqs
  rank(path, 2, "path", f"[max_seqs, L] = [{max_seqs}, L] (each sequence's accepted rows)")
  rank(path_lens, 1, "path_lens", f"[max_seqs] = [{max_seqs}]")
  if path.shape[0] != max_seqs or path_lens.shape[0] != max_seqs:
    fail(f"`path` must be [max_seqs, L] and `path_lens` [max_seqs] with max_seqs = {max_seqs} "
         f"(the batch's), got {tuple(path.shape)} and {tuple(path_lens.shape)}.")
  integer(path, "path")
  integer(path_lens, "path_lens")
  return path.astype(jnp.int32), path_lens.astype(jnp.int32)


def _misuse(batch: RaggedBatch, path: jax.Array, path_lens: jax.Array,
            num_pages: int, page_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """[max_seqs] bool each: a length outside [0, min(L, rows)], a path that is not a root-to-leaf
  path of the sequence's tree (its rows in range), a page it touches outside the pool."""
  max_seqs, width = path.shape
  cu = batch.cu_q_lens.astype(jnp.int32)
  rows = jnp.maximum(cu[1:] - cu[:-1], 0)  # [max_seqs]
  live = jnp.arange(max_seqs) < jnp.reshape(batch.num_seqs, (-1,))[0]
  used = jnp.arange(width)[None, :] < path_lens[:, None]  # [max_seqs, L]
  if batch.tree is None:
    parent = path - 1  # a chain: row i's parent is row i - 1
  else:
    n = batch.tree.shape[0]
    parent = batch.tree.astype(jnp.int32)[jnp.clip(cu[:-1, None] + path, 0, n - 1)]
  bad_len, outside, off_tree = drafts.bad_paths(path, path_lens, rows, parent)
  bad_len, bad_path = live & bad_len, live & (outside | off_tree)
  kv = batch.kv_lens.astype(jnp.int32)[:, None]
  last = (kv + jnp.max(jnp.where(used, path, 0), axis=1, keepdims=True)) // page_size  # [., 1]
  logical = jnp.arange(batch.pages_per_seq)[None, :]
  touched = (logical >= kv // page_size) & (logical <= last)  # [max_seqs, pages_per_seq]
  table = batch.page_table.astype(jnp.int32)
  outside = jnp.any(touched & ((table < 0) | (table >= num_pages)), axis=1)
  bad_page = live & jnp.any(used, axis=1) & (outside | (last[:, 0] >= batch.pages_per_seq))
  return bad_len, bad_path, bad_page


_WORDS = (("path_lens", "is outside [0, min(L, the sequence's rows in the step)]"),
          ("path", "is not a root-to-leaf path of the sequence's tree (a chain's: 0, 1, ...) "
                   "within its rows"),
          ("batch.page_table", "lists a page outside the pool where the path moves keys"))


def _raise(flags: tuple[jax.Array, ...]) -> None:
  """The first misuse of concrete arguments as a ValueError naming the argument."""
  for (name, wrong), flag in zip(_WORDS, flags):
    known = known_now(flag)
    seqs = [] if known is None else np.flatnonzero(known).tolist()
    if seqs:
      raise ValueError(f"`{name}` {wrong} (sequences {seqs}); pass for each sequence the rows "
                       "it keeps, root first, each the parent of the next, and their count.")


def accept_drafts(cache: PagedKVCache, batch: RaggedBatch, path: jax.Array,
                  path_lens: jax.Array) -> PagedKVCache:
  """Keeps each sequence's accepted rows of a step that verified draft trees.

  Glossary: max_seqs sequences (the batch's), L the longest path, P pages of page_size slots.

  Args:
    cache: the pool the step returned (`paged_attention`'s second output).
    batch: that step's `RaggedBatch` (its `tree`, or None for chains).
    path: [max_seqs, L] int: sequence s keeps its rows `path[s, :path_lens[s]]`, root to leaf
      in s's row numbering (each row's parent the one before it; the first a root).
    path_lens: [max_seqs] int, the rows each sequence keeps (0: none).

  Returns:
    The pool with those rows' keys and values (and page key bounds) at slots `kv_lens[s] + 0,
    1, ...` of each sequence; the caller adds `path_lens` to `kv_lens`. Slots past them are
    garbage, never read once lengths say so. Misuse (see the module): a ValueError when
    concrete; under `jit` that sequence moves nothing.
  """
  path, path_lens = _checked(cache, batch, path, path_lens)
  flags = _misuse(batch, path, path_lens, cache.num_pages, cache.page_size)
  _raise(flags)
  bad = flags[0] | flags[1] | flags[2]  # [max_seqs]
  ps, table = cache.page_size, batch.page_table.astype(jnp.int32)
  kv = batch.kv_lens.astype(jnp.int32)[:, None]  # [max_seqs, 1]
  keep = jnp.arange(path.shape[1])[None, :]  # [1, L]
  moves = (keep < path_lens[:, None]) & (path != keep) & ~bad[:, None]  # [max_seqs, L]
  src, dst = kv + jnp.clip(path, 0, None), kv + keep  # [max_seqs, L] slots
  page_of = lambda slot: jnp.take_along_axis(
      table, jnp.clip(slot // ps, 0, batch.pages_per_seq - 1), axis=1)
  src_page = jnp.clip(page_of(src), 0, cache.num_pages - 1).reshape(-1)
  dst_page = jnp.where(moves, page_of(dst), cache.num_pages).reshape(-1)  # past the pool: none
  src_slot, dst_slot = (src % ps).reshape(-1), (dst % ps).reshape(-1)
  move = lambda a: a.at[dst_page, :, dst_slot].set(a[src_page, :, src_slot], mode="drop")
  moved = cache.replace(key=jax.tree.map(move, cache.key), value=jax.tree.map(move, cache.value))
  if cache.key_min is None or cache.key_max is None:
    return moved
  stored = quant.cut(cache.key, 0, lambda a: a[src_page, :, src_slot])  # [M, Hkv, D]
  stored = jnp.asarray(quant.tile(stored, jnp.float32), jnp.float32)
  return moved.replace(key_min=cache.key_min.at[dst_page].min(stored, mode="drop"),
                       key_max=cache.key_max.at[dst_page].max(stored, mode="drop"))
