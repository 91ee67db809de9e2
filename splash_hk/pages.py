"""The paged cache and the ragged batch as data: `PagedKVCache`, `RaggedBatch`, what a paged
call knows statically (`PagedFacts`) and hands a backend (`PagedInputs`), and the batch read as
rows and pages: who owns each query row, where it writes, which sequences misuse the cache (one
jnp function, for eager errors and under `jit`).

The layout is DESIGN's "Paged KV cache and ragged batches": sequence s owns query rows
`cu_q_lens[s]:cu_q_lens[s+1]`, has `kv_lens[s]` tokens in the cache before the call, and its
logical page p is physical page `page_table[s, p]`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Generic, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk import owners
from splash_hk import quant
from splash_hk.config import AttentionConfig
from splash_hk.masks import _objects
from splash_hk.scores import Score
from splash_hk.types import Leaf


@functools.partial(owners.register, data_fields=("key", "value"))
@dataclasses.dataclass(frozen=True, eq=False)
class PagedKVCache:
  """Keys and values in fixed-size pages from one pool (a pytree); sequences own pages through
  a `RaggedBatch`'s page table.

  Attributes:
    key: [P, page_size, Hkv, D]; slots no sequence has written may hold anything.
    value: [P, page_size, Hkv, Dv].
    owner: the layer that first wrote this pool (a module's name, or the `owner` given to
      `paged_attention`), or None for a pool no layer has written yet. Static metadata, as
      `KVCache.owner`: any other layer given this pool raises a ValueError naming both.
  """

  key: jax.Array
  value: jax.Array
  owner: str | None = None

  @classmethod
  def zeros(cls, num_pages: int, page_size: int, num_kv_heads: int, key_size: int,
            value_size: int | None = None, dtype: Any = jnp.float32,
            owner: str | None = None) -> PagedKVCache:
    """A pool of zeroed pages (a quantized `dtype` stores `Quantized`, as `KVCache.zeros`;
    `owner` as there)."""
    shape = (num_pages, page_size, num_kv_heads)
    return cls(key=quant.zeros((*shape, key_size), dtype),
               value=quant.zeros((*shape, value_size or key_size), dtype),
               owner=owners.checked(owner))

  @property
  def num_pages(self) -> int:
    return self.key.shape[0]

  @property
  def page_size(self) -> int:
    return self.key.shape[1]

  def replace(self, **changes: Any) -> PagedKVCache:
    """This cache with the given fields replaced."""
    return dataclasses.replace(self, **changes)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("pages", "lens", "group"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class SharedPrefix:
  """Groups of sequences that start with the same cached pages (a pytree): a cascade.

  Attributes:
    pages: [G, prefix_pages] int32; group g's prefix is `pages[g, :lens[g] // page_size]`.
    lens: [G] int32, group g's prefix tokens: whole pages, all cached before the call.
    group: [max_seqs] int32, each sequence's group (-1: none). A member's page table lists its
      group's pages first and it holds at least `lens[g]` tokens (else the misuse rule).
  """

  pages: jax.Array
  lens: jax.Array
  group: jax.Array

  @property
  def num_groups(self) -> int:
    return self.pages.shape[0]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("cu_q_lens", "kv_lens", "page_table", "num_seqs", "prefix"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class RaggedBatch:
  """One step's sequences over a flat batch of new tokens (a pytree).

  Attributes:
    cu_q_lens: [max_seqs + 1] int32; sequence s owns query rows
      `cu_q_lens[s]:cu_q_lens[s+1]`; only the first `num_seqs + 1` entries are read.
    kv_lens: [max_seqs] int32, tokens of s in the cache before this call.
    page_table: [max_seqs, pages_per_seq] int32; s's logical page p is physical page
      `page_table[s, p]`; entries past s's length after the call are not read.
    num_seqs: int32 `[]` or `[1]`; sequences from it on (and their rows) are padding.
    prefix: a `SharedPrefix` (cascade: each group's prefix is attended once for all its
      members' rows, then merged with their own pages), or None.
  """

  cu_q_lens: jax.Array
  kv_lens: jax.Array
  page_table: jax.Array
  num_seqs: jax.Array
  prefix: SharedPrefix | None = None

  @property
  def max_seqs(self) -> int:
    return self.kv_lens.shape[0]

  @property
  def pages_per_seq(self) -> int:
    return self.page_table.shape[1]


@dataclasses.dataclass(frozen=True)
class PagedFacts:
  """What is known of a paged call at trace time (hashable: backends may cache on it)."""

  config: AttentionConfig
  query_shape: tuple[int, ...]  # [N, Hq, D]
  cache_shape: tuple[int, ...]  # [P, page_size, Hkv, D]
  value_dim: int
  max_seqs: int
  pages_per_seq: int
  rule: _objects.Mask | None = None  # the position rule's skeleton
  bias: Score | None = None  # the bias's skeleton
  quantized: bool = False  # the pool's keys or values are quantized
  cascade: bool = False  # the batch has a shared prefix (`RaggedBatch.prefix`)

  @property
  def num_tokens(self) -> int:
    return self.query_shape[0]

  @property
  def num_heads(self) -> int:
    return self.query_shape[1]

  @property
  def head_dim(self) -> int:
    return self.query_shape[2]

  @property
  def num_pages(self) -> int:
    return self.cache_shape[0]

  @property
  def page_size(self) -> int:
    return self.cache_shape[1]

  @property
  def num_kv_heads(self) -> int:
    return self.cache_shape[2]

  @property
  def scale(self) -> float:
    return self.config.scale(self.head_dim)

  @property
  def static_rules(self) -> dict[str, Any] | None:
    """The rule as config keywords when the config can say it, else None."""
    return _objects.as_rules(self.rule)


class Misuse(NamedTuple):
  """[max_seqs] bool per misuse kind: the sequences it involves (all False: a valid batch)."""

  rows: jax.Array  # cu_q_lens decreasing, negative or past the flat batch (all sequences)
  num_seqs: jax.Array  # num_seqs outside [0, max_seqs] (all sequences)
  kv_lens: jax.Array  # a negative length
  capacity: jax.Array  # length after the call past pages_per_seq * page_size
  page_range: jax.Array  # a page read or written outside [0, num_pages)
  shared_write: jax.Array  # a page written here that another listing (or the same) also reads
  prefix: jax.Array  # a member whose table or length disagrees with its group's prefix

  def any(self) -> jax.Array:
    """[max_seqs] bool: the sequences that write nothing and output NaN."""
    return functools.reduce(jnp.logical_or, self)


class Layout(NamedTuple):
  """A ragged batch as rows ([N]) and sequences ([max_seqs])."""

  seq: jax.Array  # [N] int32: the sequence each row belongs to (clipped; see row_in)
  pos: jax.Array  # [N] int32: its position (where it is written, what it sees up to)
  row_in: jax.Array  # [N] bool: the row belongs to a sequence (not padding)
  row_live: jax.Array  # [N] bool: ... and that sequence is valid (it writes and attends)
  row_bad: jax.Array  # [N] bool: ... and that sequence misuses the cache (outputs NaN)
  kv_len_after: jax.Array  # [max_seqs] int32: each sequence's length after the call
  misuse: Misuse


def _cdiv(a: jax.Array, b: int) -> jax.Array:
  return (a + b - 1) // b


def _shared_writes(batch: RaggedBatch, listed: jax.Array, written: jax.Array,
                   num_pages: int) -> jax.Array:
  """[max_seqs] bool: sequences listing (below their length) a page some sequence writes here
  that is listed more than once."""
  table = batch.page_table.astype(jnp.int32)  # [max_seqs, pages_per_seq]
  inside = (table >= 0) & (table < num_pages)
  at = lambda where: jnp.where(where & inside, table, num_pages)  # num_pages: dropped
  listings = jnp.zeros((num_pages,), jnp.int32).at[at(listed)].add(1, mode="drop")  # [P]
  is_written = jnp.zeros((num_pages,), jnp.bool_).at[at(written)].set(True, mode="drop")  # [P]
  conflict = is_written & (listings > 1)  # [P]
  return jnp.any(listed & inside & conflict[jnp.clip(table, 0, num_pages - 1)], axis=1)


def prefix_of(batch: RaggedBatch, seq: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(group [..] int32, -1 for none; prefix tokens [..] int32, 0 for none) of sequences `seq`."""
  if batch.prefix is None:
    return jnp.full(seq.shape, -1, jnp.int32), jnp.zeros(seq.shape, jnp.int32)
  p = batch.prefix
  group = p.group.astype(jnp.int32)[seq]
  inside = (group >= 0) & (group < p.num_groups)
  lens = jnp.where(inside, p.lens.astype(jnp.int32)[jnp.clip(group, 0, p.num_groups - 1)], 0)
  return jnp.where(inside, group, -1), lens


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
  misuse = Misuse(
      rows=in_use & bad_rows, num_seqs=jnp.broadcast_to(bad_count, (max_seqs,)),
      kv_lens=in_use & (kv < 0), capacity=in_use & too_long, page_range=out_of_range,
      shared_write=_shared_writes(batch, listed, written, num_pages),
      prefix=in_use & _prefix_misuse(batch, page_size))
  bad = misuse.any()  # [max_seqs]
  rows = jnp.arange(num_tokens, dtype=jnp.int32)  # [N]
  ends = jnp.where(in_use, end, jnp.iinfo(jnp.int32).max)  # [max_seqs], non-decreasing if valid
  seq = jnp.clip(jnp.searchsorted(ends, rows, side="right"), 0, max_seqs - 1).astype(jnp.int32)
  row_in = (rows >= cu[0]) & (rows < cu[count])
  row_bad = (row_in & bad[seq]) | bad_count
  return Layout(seq=seq, pos=kv[seq] + rows - start[seq], row_in=row_in,
                row_live=row_in & ~row_bad, row_bad=row_bad, kv_len_after=after, misuse=misuse)


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
}


def raise_misuse(misuse: Misuse, **sizes: int) -> None:
  """The first misuse of a concrete batch as a ValueError naming the argument and sequences."""
  for kind, flags in misuse._asdict().items():
    seqs = np.flatnonzero(np.asarray(flags))
    if seqs.size:
      argument, wrong, instead = MISUSE_WORDS[kind]
      raise ValueError(f"`{argument}` {wrong.format(**sizes)} (sequences {seqs.tolist()}); pass "
                       f"{instead.format(**sizes)}.")


class PagedCall(NamedTuple, Generic[Leaf]):
  """A paged call's arrays before its step (what travels into each shard of heads); with
  PartitionSpec leaves, their specs."""

  query: Leaf  # [N, Hq, D]
  key: Leaf  # [N, Hkv, D]
  value: Leaf  # [N, Hkv, Dv]
  cache: PagedKVCache
  batch: RaggedBatch
  rule: _objects.Mask | None
  bias: Score | None
  sinks: Leaf | None  # [Hq, n] float32
  heads: Leaf  # [Hq] int32, global indices


class PagedInputs(NamedTuple):
  """A paged call's arrays as a backend gets them: the new keys and values already written."""

  query: jax.Array  # [N, Hq, D]
  cache: PagedKVCache  # key [P, page, Hkv, D], value [P, page, Hkv, Dv]
  batch: RaggedBatch
  layout: Layout
  rule: _objects.Mask | None  # over positions; no per-token arrays
  bias: Score | None  # a position object; no per-token arrays
  sinks: jax.Array | None  # [Hq, n] float32
  heads: jax.Array  # [Hq] int32: the global indices of this shard's query heads
