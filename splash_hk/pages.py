"""The ragged batch as data: `RaggedBatch` (with its `SharedPrefix` and `PageSelection`), what a
paged call knows statically (`PagedFacts`), the batch read as rows (`Layout`, `Misuse`: computed
by `splash_hk.ragged`) and what a backend gets (`PagedInputs`). The pool is `splash_hk.pool`'s
(`PagedKVCache`, re-exported here).

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

from splash_hk.drafts import TreeRows
from splash_hk.pool import PagedKVCache
from splash_hk.config import AttentionConfig
from splash_hk.masks import _objects
from splash_hk.scores import Score
from splash_hk.types import Leaf


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
                   data_fields=("pages", "counts"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class PageSelection:
  """The pages each sequence reads, per kv head (a pytree): Quest's choice (`top_k_pages`).

  Attributes:
    pages: [max_seqs, Hkv, K] int32 logical page indices of the sequence (any order); entries
      past a count are never read.
    counts: [max_seqs, Hkv] int32, the pages chosen, in [0, K].
  """

  pages: jax.Array
  counts: jax.Array

  @property
  def most(self) -> int:
    return self.pages.shape[2]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("cu_q_lens", "kv_lens", "page_table", "num_seqs", "prefix",
                                "selection", "tree"),
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
    selection: a `PageSelection`: each sequence's rows read only its chosen pages (per kv
      head), or None (every page).
    tree: [N] int32 draft trees (speculative decoding), or None (each sequence's rows a
      chain). Row r of sequence s: the index within s's rows of its parent, or -1 when its
      parent is s's last cached token. A row sees s's cached keys under the rule and, of s's
      new rows, itself and its ancestors; its position (rules, position scores) is
      `kv_lens[s]` plus its depth, and its key is still written at slot `kv_lens[s]` plus its
      index. A parent not earlier in its sequence is the misuse rule.
  """

  cu_q_lens: jax.Array
  kv_lens: jax.Array
  page_table: jax.Array
  num_seqs: jax.Array
  prefix: SharedPrefix | None = None
  selection: PageSelection | None = None
  tree: jax.Array | None = None

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
  cache_shape: tuple[int, ...]  # [P, Hkv, page_size, D] (`POOL_AXES`)
  value_dim: int
  max_seqs: int
  pages_per_seq: int
  rule: _objects.Mask | None = None  # the position rule's skeleton
  bias: Score | None = None  # the bias's skeleton
  quantized: bool = False  # the pool's keys or values are quantized
  storage: tuple[str, ...] = ()  # how the pool's keys and values are stored (`quant.storage`)
  cascade: bool = False  # the batch has a shared prefix (`RaggedBatch.prefix`)
  selected: bool = False  # the batch has a page selection (`RaggedBatch.selection`)
  tree: bool = False  # the batch has draft trees (`RaggedBatch.tree`)
  residuals: bool = False  # the caller asked for each row's lse (`return_residuals`)

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
    return self.cache_shape[2]

  @property
  def num_kv_heads(self) -> int:
    return self.cache_shape[1]

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
  selection: jax.Array  # a count outside [0, K], a chosen page outside the table, or twice
  tree: jax.Array  # a draft tree's parent not earlier in its sequence

  def any(self) -> jax.Array:
    """[max_seqs] bool: the sequences that write nothing and output NaN."""
    return functools.reduce(jnp.logical_or, self)


class Layout(NamedTuple):
  """A ragged batch as rows ([N]) and sequences ([max_seqs])."""

  seq: jax.Array  # [N] int32: the sequence each row belongs to (clipped; see row_in)
  pos: jax.Array  # [N] int32: its slot position (where it is written)
  row_in: jax.Array  # [N] bool: the row belongs to a sequence (not padding)
  row_live: jax.Array  # [N] bool: ... and that sequence is valid (it writes and attends)
  row_bad: jax.Array  # [N] bool: ... and that sequence misuses the cache (outputs NaN)
  kv_len_after: jax.Array  # [max_seqs] int32: each sequence's length after the call
  page: jax.Array  # [N] int32: the physical page a live row is written to (others: P, none)
  slot: jax.Array  # [N] int32: its slot there
  misuse: Misuse
  at: jax.Array  # [N] int32: its position for rules and scores (`pos`, or by depth in a tree)
  tree: TreeRows | None = None  # a tree batch's rows (`RaggedBatch.tree`), else None


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


class StepLists(NamedTuple):
  """A step's lists of pages, built once (`splash_hk.lists.plan`) and read by every backend."""

  table: BlockLists  # each sequence's page-table row (every kv head), read by its live rows
  chosen: BlockLists | None  # each sequence's chosen pages per kv head (a selection), or None
  prefix: BlockLists | None  # each cascade group's prefix, read by its members' rows, or None
  prefix_len: jax.Array  # [N] int32: the prefix tokens a row reads through `prefix` (0: none)

  @property
  def own(self) -> BlockLists:
    """Each sequence's own lists, read after a cascade's prefix (the chosen ones, else the
    table)."""
    return self.table if self.chosen is None else self.chosen


class PagedCall(NamedTuple, Generic[Leaf]):
  """A paged call's arrays before its step (what travels into each shard of heads); with
  PartitionSpec leaves, their specs."""

  query: Leaf  # [N, Hq, D]
  key: Leaf  # [N, Hkv, D]
  value: Leaf  # [N, Hkv, Dv]
  cache: PagedKVCache
  layout: Layout  # the batch read as rows (`lists.plan`)
  lists: StepLists  # and as lists of pages
  rule: _objects.Mask | None
  bias: Score | None
  sinks: Leaf | None  # [Hq, n] float32
  heads: Leaf  # [Hq] int32, global indices


class PagedInputs(NamedTuple):
  """A paged call's arrays as a backend gets them: the new keys and values already written."""

  query: jax.Array  # [N, Hq, D]
  cache: PagedKVCache  # key [P, Hkv, page, D], value [P, Hkv, page, Dv]
  layout: Layout
  lists: StepLists
  rule: _objects.Mask | None  # over positions; no per-token arrays
  bias: Score | None  # a position object; no per-token arrays
  sinks: jax.Array | None  # [Hq, n] float32
  heads: jax.Array  # [Hq] int32: the global indices of this shard's query heads
  new_key: Any = None  # [N, Hkv, D]: the new rows as the pool holds them (`quant.as_held`)
  new_value: Any = None  # [N, Hkv, Dv]
