"""Lists of key blocks for query rows: what a paged call reads, as one value.

A sequence's page-table row, the pages a selection chose for it (Quest) and a cascade group's
shared prefix are the same thing (DESIGN's "One kernel for lists of blocks"): for some query
rows, the pages to read and where their keys sit. `BlockLists` holds such lists, one per owner
(a sequence, or a group), with the rows that read each; `page_lists` builds a step's own lists
(its page table, or its selection) and `prefix_lists` a cascade's. Every backend reads them the
same way; each decides how to tile them.

Glossary: N rows of the step, O owners, Hl list heads (1: every kv head reads the same pages;
Hkv: a list per kv head, as a selection), K entries per list, page_size keys per page.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from splash_hk import pages
from splash_hk import ragged


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("blocks", "first_key", "count", "order", "offset", "rows", "lo",
                                "hi"),
                   meta_fields=("positional",))
@dataclasses.dataclass(frozen=True)
class BlockLists:
  """Each owner's list of pages and the rows that read it (a pytree).

  Attributes:
    blocks: [O, Hl, K] int32, the physical page of each entry (inside the pool).
    first_key: [O, Hl, K] int32, the position of the entry's first key (slot 0).
    count: [O, Hl] int32, the entries in use (those past it are never read).
    order: [N] int32, the step's rows sorted by owner (rows no list serves: last).
    offset: [O] int32, where owner o's rows start in `order`.
    rows: [O] int32, how many rows owner o has (0 for owners nothing reads).
    lo: [N] int32, the first key position each row may see through these lists.
    hi: [N] int32, the last one (below `lo`: the row sees nothing here).
    positional: entry e of every list holds keys [e * page_size, (e + 1) * page_size) (a page
      table, a prefix): a tile's entries are a range its rows' bounds cut, and a run of entries
      inside every row's bounds is visible whole. Else (a selection) any order.
  """

  blocks: jax.Array
  first_key: jax.Array
  count: jax.Array
  order: jax.Array
  offset: jax.Array
  rows: jax.Array
  lo: jax.Array
  hi: jax.Array
  positional: bool = True

  @property
  def list_heads(self) -> int:
    return self.blocks.shape[1]

  @property
  def num_owners(self) -> int:
    return self.blocks.shape[0]


def key_bounds(layout: pages.Layout, rules: dict | None) -> tuple[jax.Array, jax.Array]:
  """[N] first and last key position each row may see in its sequence (last < first: none):
  its length after the call, and the rule when config terms say it (`rules`)."""
  pos = layout.pos  # [N]
  lo = jnp.zeros_like(pos)
  hi = layout.kv_len_after[layout.seq] - 1
  rules = rules or {}
  if rules.get("causal"):
    hi = jnp.minimum(hi, pos)
  if rules.get("window"):
    left, right = rules["window"]
    lo, hi = jnp.maximum(lo, pos - left), jnp.minimum(hi, pos + right)
  if rules.get("chunk_size"):
    first = pos // rules["chunk_size"] * rules["chunk_size"]
    lo, hi = jnp.maximum(lo, first), jnp.minimum(hi, first + rules["chunk_size"] - 1)
  return lo, jnp.where(layout.row_live, hi, -1)


def _clip_pages(table: jax.Array, num_pages: int) -> jax.Array:
  return jnp.clip(table.astype(jnp.int32), 0, num_pages - 1)


def page_lists(batch: pages.RaggedBatch, layout: pages.Layout, lo: jax.Array, hi: jax.Array,
               num_pages: int, page_size: int) -> BlockLists:
  """Each sequence's own list: its page-table row (every kv head alike), or the pages its
  selection chose (a list per kv head), read by its live rows within [lo, hi] [N]."""
  n = layout.pos.shape[0]
  cu = batch.cu_q_lens[:batch.max_seqs + 1].astype(jnp.int32)
  live = (jnp.arange(batch.max_seqs) < jnp.reshape(batch.num_seqs, (-1,))[0]) & ~layout.misuse.any()
  rows = jnp.where(live, jnp.clip(cu[1:] - cu[:-1], 0, n), 0)  # [max_seqs]
  covered = -(-layout.kv_len_after // page_size)  # [max_seqs] pages holding the sequence
  order = jnp.arange(n, dtype=jnp.int32)
  if batch.selection is None:
    table = batch.page_table[:, None, :]  # [max_seqs, 1, pages_per_seq]
    first_key = jnp.arange(batch.pages_per_seq, dtype=jnp.int32) * page_size
    count = jnp.minimum(covered, batch.pages_per_seq)[:, None]
    return BlockLists(_clip_pages(table, num_pages), jnp.broadcast_to(first_key, table.shape),
                      count.astype(jnp.int32), order, cu[:-1], rows, lo, hi)
  chosen = batch.selection.pages.astype(jnp.int32)  # [max_seqs, Hkv, Ks] logical pages
  logical = jnp.clip(chosen, 0, batch.pages_per_seq - 1)
  table = jnp.take_along_axis(batch.page_table[:, None, :].astype(jnp.int32), logical, axis=2)
  count = jnp.clip(batch.selection.counts.astype(jnp.int32), 0, chosen.shape[2])
  return BlockLists(_clip_pages(table, num_pages), logical * page_size, count, order, cu[:-1],
                    rows, lo, hi, positional=False)


def cascade_groups(batch: pages.RaggedBatch, layout: pages.Layout) -> tuple[jax.Array, jax.Array]:
  """([N] each row's cascade group, -1 for none; [N] its prefix tokens, 0 for none): groups
  with fewer than two live member sequences do not count (a prefix read once for one sequence
  saves nothing: its rows read it with their own pages)."""
  prefix = batch.prefix
  assert prefix is not None, "only a cascade has groups"
  group, plen = ragged.prefix_of(batch, layout.seq)  # [N]
  num_groups = prefix.num_groups
  first = jnp.zeros_like(layout.row_in).at[batch.cu_q_lens[:-1]].set(True, mode="drop")
  starts = first & layout.row_live & (group >= 0)  # one row per live member sequence
  members = jnp.zeros((num_groups,), jnp.int32).at[jnp.where(starts, group, num_groups)].add(
      1, mode="drop")  # [G]
  shared = (group >= 0) & (members[jnp.clip(group, 0, num_groups - 1)] > 1)
  return jnp.where(shared, group, -1), jnp.where(shared, plen, 0)


def step_lists(batch: pages.RaggedBatch, layout: pages.Layout, rules: dict | None,
               num_pages: int, page_size: int) -> tuple[BlockLists | None, BlockLists]:
  """A step's lists: (each cascade group's prefix, or None; each sequence's own pages after
  it). A selection reads its chosen pages alone (no cascade: the prefix's pages are chosen or
  not like any other)."""
  lo, hi = key_bounds(layout, rules)  # [N]
  if batch.prefix is None or batch.selection is not None:
    return None, page_lists(batch, layout, lo, hi, num_pages, page_size)
  group, plen = cascade_groups(batch, layout)  # [N]
  prefix = prefix_lists(batch, group, plen, lo, hi, num_pages, page_size)
  own = page_lists(batch, layout, jnp.maximum(lo, plen), hi, num_pages, page_size)
  return prefix, own


def prefix_lists(batch: pages.RaggedBatch, group: jax.Array, plen: jax.Array, lo: jax.Array,
                 hi: jax.Array, num_pages: int, page_size: int) -> BlockLists:
  """Each cascade group's prefix pages, read by its members' rows (`group` [N], -1: none) up to
  their prefix length `plen` [N], within [lo, hi]."""
  prefix = batch.prefix
  assert prefix is not None, "only a cascade has prefixes"
  num_groups, width = prefix.pages.shape
  member = group >= 0
  order = jnp.argsort(jnp.where(member, group, num_groups), stable=True).astype(jnp.int32)
  rows = jnp.zeros((num_groups,), jnp.int32).at[jnp.where(member, group, num_groups)].add(
      1, mode="drop")  # [G]
  offset = (jnp.cumsum(rows) - rows).astype(jnp.int32)
  count = jnp.clip(prefix.lens.astype(jnp.int32) // page_size, 0, width)[:, None]  # [G, 1]
  first_key = jnp.arange(width, dtype=jnp.int32) * page_size
  table = prefix.pages[:, None, :]
  return BlockLists(_clip_pages(table, num_pages), jnp.broadcast_to(first_key, table.shape),
                    count, order, offset, rows, jnp.where(member, lo, 0),
                    jnp.where(member, jnp.minimum(hi, plen - 1), -1))
