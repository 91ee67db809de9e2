"""Lists of key blocks for query rows: what a paged call reads, as one value.

A sequence's page-table row, the pages a selection chose for it (Quest) and a cascade group's
shared prefix are the same thing (DESIGN's "One kernel for lists of blocks"): for some query
rows, the pages to read and where their keys sit. `pages.BlockLists` holds such lists, one per
owner (a sequence, or a group), with the rows that read each. `plan` reads a step's batch once
into its rows and its lists (`pages.StepLists`); every backend reads those, never the batch, and
decides how to tile them.

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


def key_bounds(layout: pages.Layout, rules: dict | None) -> tuple[jax.Array, jax.Array]:
  """[N] first and last key slot each row may see in its sequence (last < first: none): its
  length after the call, and the rule when config terms say it (`rules`). In a tree batch the
  rule speaks of positions by depth (`Layout.at`): a new key's slot is at or past its position,
  so where the rule reaches the new keys the bound is the row's own slot (its ancestors are
  before it) and the element mask decides."""
  pos = layout.at  # [N]
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
  if layout.tree is not None:
    own = jnp.minimum(layout.kv_len_after[layout.seq] - 1, layout.pos)
    hi = jnp.where(hi < layout.tree.first_new, hi, own)
  return lo, jnp.where(layout.row_live, hi, -1)


def _clip_pages(table: jax.Array, num_pages: int) -> jax.Array:
  return jnp.clip(table.astype(jnp.int32), 0, num_pages - 1)


def _rows(batch: pages.RaggedBatch, layout: pages.Layout) -> jax.Array:
  """[max_seqs] live rows of each sequence (0 for padding and misusing sequences)."""
  n = layout.pos.shape[0]
  cu = batch.cu_q_lens[:batch.max_seqs + 1].astype(jnp.int32)
  live = (jnp.arange(batch.max_seqs) < jnp.reshape(batch.num_seqs, (-1,))[0]) & ~layout.misuse.any()
  return jnp.where(live, jnp.clip(cu[1:] - cu[:-1], 0, n), 0)


def table_lists(batch: pages.RaggedBatch, layout: pages.Layout, lo: jax.Array, hi: jax.Array,
                num_pages: int, page_size: int) -> pages.BlockLists:
  """Each sequence's page-table row (every kv head alike), read by its live rows within
  [lo, hi] [N]."""
  covered = jnp.minimum(-(-layout.kv_len_after // page_size), batch.pages_per_seq)  # [max_seqs]
  table = batch.page_table[:, None, :]  # [max_seqs, 1, pages_per_seq]
  first_key = jnp.arange(batch.pages_per_seq, dtype=jnp.int32) * page_size
  return pages.BlockLists(_clip_pages(table, num_pages), jnp.broadcast_to(first_key, table.shape),
                          covered[:, None].astype(jnp.int32),
                          jnp.arange(layout.pos.shape[0], dtype=jnp.int32),
                          batch.cu_q_lens[:-1].astype(jnp.int32), _rows(batch, layout), lo, hi)


def chosen_lists(batch: pages.RaggedBatch, table: pages.BlockLists,
                 page_size: int) -> pages.BlockLists | None:
  """Each sequence's chosen pages (a list per kv head), read as `table`'s rows; None without a
  selection."""
  if batch.selection is None:
    return None
  chosen = batch.selection.pages.astype(jnp.int32)  # [max_seqs, Hkv, Ks] logical pages
  logical = jnp.clip(chosen, 0, batch.pages_per_seq - 1)
  blocks = jnp.take_along_axis(jnp.broadcast_to(table.blocks, (*chosen.shape[:2],
                                                               table.blocks.shape[2])),
                               logical, axis=2)
  count = jnp.clip(batch.selection.counts.astype(jnp.int32), 0, chosen.shape[2])
  return dataclasses.replace(table, blocks=blocks, first_key=logical * page_size, count=count,
                             positional=False)


def prefix_of(batch: pages.RaggedBatch, seq: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(group [..] int32, -1 for none; prefix tokens [..] int32, 0 for none) of sequences `seq`."""
  if batch.prefix is None:
    return jnp.full(seq.shape, -1, jnp.int32), jnp.zeros(seq.shape, jnp.int32)
  p = batch.prefix
  group = p.group.astype(jnp.int32)[seq]
  inside = (group >= 0) & (group < p.num_groups)
  lens = jnp.where(inside, p.lens.astype(jnp.int32)[jnp.clip(group, 0, p.num_groups - 1)], 0)
  return jnp.where(inside, group, -1), lens


def cascade_groups(batch: pages.RaggedBatch, layout: pages.Layout) -> tuple[jax.Array, jax.Array]:
  """([N] each row's cascade group, -1 for none; [N] its prefix tokens, 0 for none): groups
  with fewer than two live member sequences do not count (a prefix read once for one sequence
  saves nothing: its rows read it with their own pages)."""
  prefix = batch.prefix
  assert prefix is not None, "only a cascade has groups"
  group, plen = prefix_of(batch, layout.seq)  # [N]
  num_groups = prefix.num_groups
  first = jnp.zeros_like(layout.row_in).at[batch.cu_q_lens[:-1]].set(True, mode="drop")
  starts = first & layout.row_live & (group >= 0)  # one row per live member sequence
  members = jnp.zeros((num_groups,), jnp.int32).at[jnp.where(starts, group, num_groups)].add(
      1, mode="drop")  # [G]
  shared = (group >= 0) & (members[jnp.clip(group, 0, num_groups - 1)] > 1)
  return jnp.where(shared, group, -1), jnp.where(shared, plen, 0)


def plan(batch: pages.RaggedBatch, num_tokens: int, num_pages: int, page_size: int,
         rules: dict | None) -> tuple[pages.Layout, pages.StepLists]:
  """A step's batch read once: its rows (`ragged.layout`: positions, writes, misuse) and its
  lists of pages (the table, a selection's choice, a cascade's prefixes). `rules`: the call's
  rule in config terms (bounds each row's keys), or None."""
  layout = ragged.layout(batch, num_tokens, num_pages, page_size)
  lo, hi = key_bounds(layout, rules)  # [N]
  zero = jnp.zeros_like(lo)
  if batch.prefix is None or batch.selection is not None:  # a selection chooses prefix pages too
    table = table_lists(batch, layout, lo, hi, num_pages, page_size)
    return layout, pages.StepLists(table, chosen_lists(batch, table, page_size), None, zero)
  group, plen = cascade_groups(batch, layout)  # [N]
  prefix = prefix_lists(batch, group, plen, lo, hi, num_pages, page_size)
  table = table_lists(batch, layout, jnp.maximum(lo, plen), hi, num_pages, page_size)
  return layout, pages.StepLists(table, None, prefix, plen)


def prefix_lists(batch: pages.RaggedBatch, group: jax.Array, plen: jax.Array, lo: jax.Array,
                 hi: jax.Array, num_pages: int, page_size: int) -> pages.BlockLists:
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
  return pages.BlockLists(_clip_pages(table, num_pages),
                          jnp.broadcast_to(first_key, table.shape), count, order, offset, rows,
                          jnp.where(member, lo, 0),
                          jnp.where(member, jnp.minimum(hi, plen - 1), -1))
