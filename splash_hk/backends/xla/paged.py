"""The xla backend's paged attention: tiles of query rows against runs of their listed pages.

A step's lists (`splash_hk.lists`: each sequence's page-table row or chosen pages, each cascade
group's prefix) are read in tiles: an owner's rows are cut into tiles of `WIDTHS[0]` rows, what
is left into tiles of the next width (a partial last tile where enough rows are left for it),
down to single rows, so a prefill's rows share every page read and a decode row is a tile of
one. A work item is (a tile, a run of up to C entries of its
list): its pages are gathered once for every kv head and attended by the tile's rows and each kv
head's group of query heads as one dense block, folded into the tile's online softmax. Items are
numbered by a running sum over the tiles, so the work follows each sequence's length (never
`pages_per_seq`), and a `lax.while_loop` takes a budget of them a step (`xla_paged_items`).

Runs inside every row's bounds (positional lists under config rules) are visible whole and run
in a loop of their own without a mask, as the block plan's full blocks do; the others apply the
element mask. A cascade's prefixes run first, and each row's own pages continue its softmax.

Glossary: N rows, T tiles of one width w, Hkv kv heads, G query heads per kv head, Hl list
heads (1 or Hkv), C entries per run.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from splash_hk import pages
from splash_hk.backends.xla import paged_items as items_lib
from splash_hk.backends.xla.paged_items import Tiles

# Tile rows, widest first, and the fewest rows a partial tile of each width takes: an owner's
# rows left over after its whole tiles go into one partial tile when there are at least that
# many (a page read once for all of them), else to the next width. A lone row is a tile of one.
# A width is tiled only in steps of at least `PASS_FROM` rows (each width is a loop to compile
# and run; a smaller step's rows go to narrower tiles).
WIDTHS = (256, 16, 1)
PARTIAL_FROM = (128, 2, 1)
PASS_FROM = (512, 32, 1)


def bounds(num_rows: int, max_owners: int) -> tuple[tuple[int, int, int], ...]:
  """(width, fewest rows of a partial tile, static bound on its tiles) per pass: at most one
  partial tile an owner (of `partial` rows or more) and whole tiles of the rows left, and no
  more than the fewer than the wider width's partial tile's rows an owner has left for it."""
  out, left = [], None  # the most rows an owner has left for a width
  for width, partial, least in zip(WIDTHS, PARTIAL_FROM, PASS_FROM):
    if num_rows < least:
      continue
    if partial <= num_rows:
      partials = min(max_owners, num_rows // partial)  # each of at least `partial` rows
      most = partials + (num_rows - partials * partial) // width
      if left is not None:
        most = min(most, max_owners * -(-left // width))
      out.append((width, partial, max(min(most, num_rows), 1)))
    left = partial - 1
  return tuple(out)


def tiles(bl: pages.BlockLists, width: int, partial: int, count: int, done: jax.Array,
          page_size: int, run: int, exact: bool) -> tuple[Tiles, jax.Array]:
  """The tiles of `width` rows (at most `count`; the last of an owner partial when at least
  `partial` rows are left for it) after each owner's first `done` [O] rows, and the rows done
  after them. `exact`: the rows' bounds are their whole rule (config rules)."""
  n = bl.order.shape[0]
  left = bl.rows - done  # [O]
  taken = jnp.where(left % width >= partial, left, left // width * width)  # [O] rows
  per_owner = -(-taken // width)  # [O] tiles
  ends = jnp.cumsum(per_owner)  # [O]
  tau = jnp.arange(count, dtype=jnp.int32)  # [T]
  owner = jnp.clip(jnp.searchsorted(ends, tau, side="right", method="compare_all"), 0,
                   bl.num_owners - 1)
  first = (tau - (ends[owner] - per_owner[owner])) * width  # [T]: its first row in the owner's
  row = first[:, None] + jnp.arange(width, dtype=jnp.int32)  # [T, w]
  used = (tau < ends[-1])[:, None] & (row < taken[owner][:, None])  # [T, w]
  slots = jnp.clip(bl.offset[owner][:, None] + done[owner][:, None] + row, 0, n - 1)
  rows = jnp.where(used, bl.order[slots], n)
  at = jnp.clip(rows, 0, n - 1)
  lo = jnp.where(used, bl.lo[at], 0)  # [T, w]
  hi = jnp.where(used, bl.hi[at], -1)
  return _entries(bl, rows, owner.astype(jnp.int32), lo, hi, used, page_size, run,
                  exact and width >= items_lib.FULL_RUNS_FROM), done + taken


def _entries(bl: pages.BlockLists, rows: jax.Array, owner: jax.Array, lo: jax.Array,
             hi: jax.Array, used: jax.Array, page_size: int, run: int, exact: bool) -> Tiles:
  """The tiles' entries: the range their rows' bounds cut from a positional list (else the
  whole list), and within it the whole runs every used row sees whole (with `exact`)."""
  count_h = bl.count[owner]  # [T, Hl]
  seen = hi >= lo  # [T, w]
  if bl.positional:
    start = jnp.min(jnp.where(seen, lo, jnp.iinfo(jnp.int32).max), axis=1) // page_size
    last = jnp.max(jnp.where(seen, hi, -1), axis=1) // page_size  # [T]
    stop = jnp.minimum(last + 1, count_h[:, 0])[:, None]  # [T, 1]
  else:
    start, stop = jnp.zeros(owner.shape, jnp.int32), count_h
  stop = jnp.where(jnp.any(seen, axis=1)[:, None], stop, 0)
  start = jnp.minimum(start, jnp.min(stop, axis=1))
  full_start, full_stop = start, start
  if bl.positional and exact:  # entries inside every used row's bounds
    big = jnp.iinfo(jnp.int32).max
    inner_lo = jnp.max(jnp.where(used, lo, 0), axis=1)  # [T]
    inner_hi = jnp.min(jnp.where(used, hi, big), axis=1)
    all_seen = jnp.all(seen | ~used, axis=1) & jnp.any(used, axis=1)
    first = jnp.clip(-(-inner_lo // page_size), start, stop[:, 0])
    most = jnp.clip((inner_hi + 1) // page_size, first, stop[:, 0])
    whole = jnp.where(all_seen, (most - first) // run * run, 0)
    full_start = jnp.where(all_seen, first, start)
    full_stop = full_start + whole
  return Tiles(rows=rows, owner=owner, lo=lo, hi=hi, start=start, stop=stop,
               full_start=full_start, full_stop=full_stop)


def _cached_whole(t: Tiles, first_new: jax.Array, page_size: int, run: int) -> Tiles:
  """A tree batch's tiles with their runs visible whole ending before their rows' new keys
  (`first_new` [N]: which of those a row sees is its ancestry, read in the masked loop)."""
  n = first_new.shape[0]
  cached = jnp.min(jnp.where(t.rows < n, first_new[jnp.clip(t.rows, 0, n - 1)],
                             jnp.iinfo(jnp.int32).max), axis=1) // page_size  # [T] whole pages
  stop = jnp.clip(cached, t.full_start, t.full_stop)
  return t._replace(full_stop=t.full_start + (stop - t.full_start) // run * run)


class State(NamedTuple):
  """Online-softmax state per row: m, l [N + 1, Hkv, G], acc [N + 1, Hkv, G, Dv] (row N: none)."""

  m: jax.Array
  l: jax.Array
  acc: jax.Array


def _empty(n: int, kv_heads: int, groups: int, value_dim: int) -> State:
  shape = (n + 1, kv_heads, groups)
  return State(jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, value_dim)))


def _pass(x: pages.PagedInputs, facts: pages.PagedFacts, bl: pages.BlockLists,
          state: State) -> State:
  """The rows' states after reading their lists `bl`, from `state`: a width's tiles, then the
  next's. A width no owner has rows for is skipped at run time (its static bound of tiles is
  sized for every split of the rows: a step of 16 sequences' chunks and decodes, D 128, took
  75 ms with its empty width's tiles gathered and scattered, 56 ms skipping them)."""
  done = jnp.zeros((bl.num_owners,), jnp.int32)  # each owner's rows in tiles so far
  for width, partial, count in bounds(facts.num_tokens, bl.num_owners):
    left = bl.rows - done  # [O]
    taken = jnp.where(left % width >= partial, left, left // width * width)  # [O] rows
    state = jax.lax.cond(jnp.any(taken > 0),
                         lambda s: _width(x, facts, bl, State(*s), done, width, partial, count),
                         lambda s: State(*s), state)
    done = done + taken
  return state


def _width(x: pages.PagedInputs, facts: pages.PagedFacts, bl: pages.BlockLists, state: State,
           done: jax.Array, width: int, partial: int, count: int) -> State:
  """The rows' states after the tiles of `width` rows (`tiles`' arguments)."""
  entries = bl.blocks.shape[2]
  run = items_lib.run_length(width, facts.page_size, entries)
  size = items_lib.per_step(width, run, facts, count * -(-entries // run))
  count = max(count, size)  # a step's window of tiles
  t, _ = tiles(bl, width, partial, count, done, facts.page_size, run,
               facts.static_rules is not None)
  if x.layout.tree is not None:
    t = _cached_whole(t, x.layout.tree.first_new, facts.page_size, run)
  tile_state = tuple(jnp.moveaxis(a[t.rows], 1, 3) for a in state)  # [T, Hkv, G, w, ...]
  tile_state = items_lib.attend_tiles(x, facts, bl, t, run, size, tile_state)
  back = jnp.where(t.rows < facts.num_tokens, t.rows, facts.num_tokens + 1)  # none: dropped
  return State(*(a.at[back].set(jnp.moveaxis(b, 3, 1), mode="drop")
                 for a, b in zip(state, tile_state)))


def _finish(state: State, sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """(out [.., Hkv, G, Dv], lse [.., Hkv, G]) of the states, the sinks [Hkv, G, n] (or None) in
  every row's denominator."""
  m, l, acc = state
  if sinks is not None:
    top = jnp.maximum(m, jnp.max(sinks, axis=-1))
    keep = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - top))
    l = l * keep + jnp.sum(jnp.exp(sinks - top[..., None]), axis=-1)
    acc, m = acc * keep[..., None], top
  out = jnp.where(l[..., None] == 0, 0.0, acc / l[..., None])  # NaN stays NaN
  lse = jnp.where(l == 0, -jnp.inf, jnp.where(l == 0, 0.0, m) + jnp.log(jnp.where(l == 0, 1.0, l)))
  return out, lse


def attend(x: pages.PagedInputs, facts: pages.PagedFacts) -> tuple[jax.Array, jax.Array]:
  """out [N, Hq, Dv] of every live row over its lists (other rows: 0), and its lse [N, Hq]
  (base's convention)."""
  n, heads, kv_heads = facts.num_tokens, facts.num_heads, facts.num_kv_heads
  groups = heads // kv_heads
  state = _empty(n, kv_heads, groups, facts.value_dim)
  for bl in (x.lists.prefix, x.lists.own):  # a cascade's prefixes first
    if bl is not None:
      state = _pass(x, facts, bl, state)
  sinks = None if x.sinks is None else x.sinks.reshape(kv_heads, groups, -1)
  out, lse = _finish(State(*(a[:n] for a in state)), sinks)  # [N, Hkv, G, Dv], [N, Hkv, G]
  return (out.reshape(n, heads, -1).astype(x.query.dtype), lse.reshape(n, heads))
