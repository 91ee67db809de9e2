"""A ragged batch read as rows and pages: who owns each query row, where it writes, which
sequences misuse the cache (one jnp function, for eager errors and under `jit`), and the write
of a step's new tokens at their positions.

The layout is DESIGN's "Paged KV cache and ragged batches": sequence s owns query rows
`cu_q_lens[s]:cu_q_lens[s+1]`, has `kv_lens[s]` tokens in the cache before the call, and its
logical page p is physical page `page_table[s, p]`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk import drafts
from splash_hk import pool
from splash_hk.pool import COMPARE_LIMIT, search
from splash_hk.pages import Layout, Misuse, PagedKVCache, RaggedBatch


def _cdiv(a: jax.Array, b: int) -> jax.Array:
  return (a + b - 1) // b


def _shared_writes(batch: RaggedBatch, listed: jax.Array, written: jax.Array, num_pages: int,
                   span: int) -> jax.Array:
  """[max_seqs] bool: sequences listing (below their length) a page some sequence writes here
  that is listed more than once. `span`: the most pages one sequence writes (its written entries
  are a run). A scatter over every listing (a sort on a TPU: 0.4 ms of a decode step there) where
  comparing each written page with each listing would be more work than `COMPARE_LIMIT`."""
  table = batch.page_table.astype(jnp.int32)  # [max_seqs, pages_per_seq]
  inside = (table >= 0) & (table < num_pages)
  max_seqs, width = table.shape
  if max_seqs * span * table.size > COMPARE_LIMIT:
    at = lambda where: jnp.where(where & inside, table, num_pages)  # num_pages: dropped
    listings = jnp.zeros((num_pages,), jnp.int32).at[at(listed)].add(1, mode="drop")  # [P]
    is_written = jnp.zeros((num_pages,), jnp.bool_).at[at(written)].set(True, mode="drop")
    conflict = is_written & (listings > 1)  # [P]
    return jnp.any(listed & inside & conflict[jnp.clip(table, 0, num_pages - 1)], axis=1)
  first = jnp.argmax(written, axis=1)[:, None] + jnp.arange(span)[None, :]  # [max_seqs, span]
  entry = jnp.clip(first, 0, width - 1)
  writes = jnp.take_along_axis(written & inside, entry, axis=1) & (first < width)
  pages = jnp.where(writes, jnp.take_along_axis(table, entry, axis=1), -1).reshape(-1)  # [W]
  listing = jnp.where(listed & inside, table, -2).reshape(-1)  # [max_seqs * pages_per_seq]
  count = jnp.sum(listing[None, :] == pages[:, None], axis=1)  # [W]: listings of each write
  conflict = jnp.where(count > 1, pages, -3)  # [W]
  hits = jnp.any(listing[:, None] == conflict[None, :], axis=1)  # [max_seqs * pages_per_seq]
  return jnp.any(hits.reshape(max_seqs, width), axis=1)


def _prefix_misuse(batch: RaggedBatch, page_size: int) -> jax.Array:
  """[max_seqs] bool: members whose group is out of range, whose prefix is not whole cached
  pages, or whose page table does not start with the group's pages."""
  p = batch.prefix
  if p is None:
    return jnp.zeros((batch.max_seqs,), jnp.bool_)
  group = p.group.astype(jnp.int32)
  member = group >= 0
  g = jnp.clip(group, 0, p.num_groups - 1)
  lens = p.lens.astype(jnp.int32)[g]  # [max_seqs]
  width = min(p.pages.shape[1], batch.pages_per_seq)
  bad = ((group >= p.num_groups) | (lens < 0) | (lens % page_size != 0) | (lens > width * page_size)
         | (lens > batch.kv_lens.astype(jnp.int32)))
  covered = jnp.arange(width)[None, :] < (lens // page_size)[:, None]  # [max_seqs, width]
  differs = batch.page_table[:, :width].astype(jnp.int32) != p.pages.astype(jnp.int32)[g, :width]
  return member & (bad | jnp.any(covered & differs, axis=1))


def _selection_misuse(batch: RaggedBatch) -> jax.Array:
  """[max_seqs] bool: sequences whose selection has a count outside [0, K], a chosen page
  outside [0, pages_per_seq), or a page chosen twice for one kv head."""
  chosen = batch.selection
  if chosen is None:
    return jnp.zeros((batch.max_seqs,), jnp.bool_)
  most = chosen.most
  counts = chosen.counts.astype(jnp.int32)  # [max_seqs, Hkv]
  listed = jnp.arange(most)[None, None, :] < counts[..., None]  # [max_seqs, Hkv, K]
  page = chosen.pages.astype(jnp.int32)
  outside = listed & ((page < 0) | (page >= batch.pages_per_seq))
  ordered = jnp.sort(jnp.where(listed, page, jnp.iinfo(jnp.int32).max), axis=-1)
  twice = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] < jnp.iinfo(jnp.int32).max)
  bad_count = (counts < 0) | (counts > most)
  return jnp.any(bad_count, axis=1) | jnp.any(outside, axis=(1, 2)) | jnp.any(twice, axis=(1, 2))


def _tree_rows(batch: RaggedBatch, seq: jax.Array, start: jax.Array, kv: jax.Array,
               row_in: jax.Array) -> tuple[jax.Array, jax.Array, drafts.TreeRows | None]:
  """([max_seqs] bool: sequences with a parent not earlier in their rows; [N] each row's depth
  (0 without a tree); the rows' `TreeRows`, or None without a tree)."""
  n, max_seqs = seq.shape[0], batch.max_seqs
  if batch.tree is None:
    return jnp.zeros((max_seqs,), jnp.bool_), jnp.zeros((n,), jnp.int32), None
  index = jnp.arange(n, dtype=jnp.int32) - start[seq]  # [N]: each row's index in its sequence
  parent = batch.tree.astype(jnp.int32)  # [N]
  bad = row_in & ((parent < -1) | (parent >= index))
  misuse = jnp.zeros((max_seqs,), jnp.bool_).at[seq].max(bad)  # [max_seqs]
  linked = row_in & ~bad & (parent >= 0)
  walk = drafts.walk(jnp.where(linked, start[seq] + parent, -1))  # [N] each
  return misuse, walk.depth, drafts.TreeRows(first_new=kv[seq], first_row=start[seq],
                                              enter=walk.enter, leave=walk.leave)


def sequences_of(batch: RaggedBatch, num_tokens: int) -> tuple[jax.Array, jax.Array]:
  """(seq [N] int32: each row's sequence, row_in [N] bool: whether a sequence from 0 to
  `num_seqs` holds it) of a flat batch of `num_tokens` rows (no misuse checks: `layout`'s)."""
  max_seqs = batch.max_seqs
  cu = batch.cu_q_lens.astype(jnp.int32)  # [max_seqs + 1]
  count = jnp.clip(jnp.reshape(batch.num_seqs, ()).astype(jnp.int32), 0, max_seqs)
  in_use = jnp.arange(max_seqs, dtype=jnp.int32) < count
  rows = jnp.arange(num_tokens, dtype=jnp.int32)  # [N]
  ends = jnp.where(in_use, cu[1:], jnp.iinfo(jnp.int32).max)  # non-decreasing if valid
  seq = jnp.clip(search(ends, rows), 0, max_seqs - 1).astype(jnp.int32)
  return seq, (rows >= cu[0]) & (rows < cu[count])


def layout(batch: RaggedBatch, num_tokens: int, num_pages: int, page_size: int) -> Layout:
  """The rows and sequences of `batch` over a flat batch of `num_tokens` new tokens."""
  max_seqs, pages_per_seq = batch.max_seqs, batch.pages_per_seq
  cu = batch.cu_q_lens.astype(jnp.int32)  # [max_seqs + 1]
  kv = batch.kv_lens.astype(jnp.int32)  # [max_seqs]
  given = jnp.reshape(batch.num_seqs, ()).astype(jnp.int32)
  bad_count = (given < 0) | (given > max_seqs)  # then every row is bad
  count = jnp.clip(given, 0, max_seqs)
  seqs = jnp.arange(max_seqs, dtype=jnp.int32)
  in_use = seqs < count  # [max_seqs]
  start, end = cu[:-1], cu[1:]  # [max_seqs]
  read = jnp.arange(max_seqs + 1) <= count  # the cu entries read
  cu_read = jnp.where(read, cu, jnp.iinfo(jnp.int32).max)
  bad_rows = (jnp.any(read[1:] & (cu_read[1:] < cu_read[:-1])) | (cu[0] < 0)
              | (jnp.max(jnp.where(read, cu, 0)) > num_tokens))
  q_len = jnp.maximum(end - start, 0)
  after = kv + q_len  # [max_seqs]
  too_long = after > pages_per_seq * page_size
  logical = jnp.arange(pages_per_seq, dtype=jnp.int32)[None, :]  # [1, pages_per_seq]
  covered = jnp.minimum(_cdiv(after, page_size), pages_per_seq)  # [max_seqs] pages read
  listed = in_use[:, None] & (logical < covered[:, None])
  written = listed & (q_len > 0)[:, None] & (logical >= (kv // page_size)[:, None])
  table = batch.page_table.astype(jnp.int32)
  out_of_range = jnp.any(listed & ((table < 0) | (table >= num_pages)), axis=1)
  rows = jnp.arange(num_tokens, dtype=jnp.int32)  # [N]
  seq, row_in = sequences_of(batch, num_tokens)
  bad_tree, depth, tree = _tree_rows(batch, seq, start, kv, row_in)
  misuse = Misuse(
      rows=in_use & bad_rows, num_seqs=jnp.broadcast_to(bad_count, (max_seqs,)),
      kv_lens=in_use & (kv < 0), capacity=in_use & too_long, page_range=out_of_range,
      shared_write=_shared_writes(batch, listed, written, num_pages,
                                  min(pages_per_seq, -(-num_tokens // page_size) + 1)),
      prefix=in_use & _prefix_misuse(batch, page_size),
      selection=in_use & _selection_misuse(batch), tree=in_use & bad_tree)
  bad = misuse.any()  # [max_seqs]
  row_bad = (row_in & pool.take(bad, seq)) | bad_count
  kv_before = pool.take(kv, seq)  # [N] its sequence's keys before the call
  pos = kv_before + rows - pool.take(start, seq)  # [N]
  live = row_in & ~row_bad
  entry = seq * pages_per_seq + jnp.clip(pos // page_size, 0, pages_per_seq - 1)  # [N]
  page = pool.take(table.reshape(-1), entry)  # [N]
  return Layout(seq=seq, pos=pos, row_in=row_in, row_live=live, row_bad=row_bad,
                kv_len_after=after, page=jnp.where(live, page, num_pages), slot=pos % page_size,
                misuse=misuse, at=pos if tree is None else kv_before + depth, tree=tree)


def write(cache: PagedKVCache, key: Any, value: Any, layout: Layout) -> PagedKVCache:
  """Each live row's key [N, Hkv, D] / value at its position in its sequence's pages; others
  write nothing (`pool.write`: a sequence's rows are one run of slots, and no page is written by
  two: the misuse rule `shared_write` leaves such sequences' rows unwritten)."""
  return pool.write(cache, key, value, layout.page, layout.slot,
                    runs=layout.kv_len_after.shape[0], disjoint=True)


MISUSE_WORDS = {  # Misuse field -> (argument, what is wrong, what to pass instead)
    "rows": ("batch.cu_q_lens", "decreases, is negative or passes the flat batch's {n} rows",
             "non-decreasing row offsets from 0 to at most {n}"),
    "num_seqs": ("batch.num_seqs", "is outside [0, {max_seqs}]", "at most max_seqs sequences"),
    "kv_lens": ("batch.kv_lens", "is negative", "the tokens each sequence has in the cache"),
    "capacity": ("batch.page_table", "has too few pages: the sequence grows past pages_per_seq * "
                 "page_size = {capacity} tokens", "a wider page table (or end the sequence)"),
    "page_range": ("batch.page_table", "lists a page outside [0, {num_pages})",
                   "physical page indices of this cache"),
    "shared_write": ("batch.page_table", "lists a page this call writes that is also listed "
                     "elsewhere (another sequence, or twice)",
                     "a page of its own for every page a sequence writes (copy a shared page "
                     "first)"),
    "prefix": ("batch.prefix", "disagrees with a member: its group is out of range, its length "
               "is not whole pages all cached before the call, or the member's page table does "
               "not start with the group's pages", "each member's own first pages and a length "
               "of whole pages up to its kv_lens"),
    "selection": ("batch.selection", "has a count outside [0, K], a chosen page outside "
                  "[0, pages_per_seq) or a page chosen twice for one kv head",
                  "each sequence's distinct logical pages (sh.sparse.top_k_pages gives them)"),
    "tree": ("batch.tree", "gives a row a parent that is not an earlier row of its sequence",
             "for each row the index within its sequence's rows of an earlier row, or -1"),
}


def raise_misuse(misuse: Misuse, **sizes: int) -> None:
  """The first misuse of a concrete batch as a ValueError naming the argument and sequences."""
  for kind, flags in misuse._asdict().items():
    seqs = np.flatnonzero(np.asarray(flags))
    if seqs.size:
      argument, wrong, instead = MISUSE_WORDS[kind]
      raise ValueError(f"`{argument}` {wrong.format(**sizes)} (sequences {seqs.tolist()}); pass "
                       f"{instead.format(**sizes)}.")
