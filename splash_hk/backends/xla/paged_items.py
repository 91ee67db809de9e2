"""Work items of the xla backend's paged tiles (`xla_paged`): (a tile, a run of its entries).

A tile's entries are read in two loops: the runs visible whole (`Tiles.full_start` to
`full_stop`, whole runs inside every row's bounds) without a mask, and the rest (before and
after them) with the element mask: the rows' bounds, the rule, entries past a list's count.
Each loop numbers its items by a running sum over the tiles that have some (tiles with none are
moved behind the others, so a step's items lie in a window of consecutive tiles) and takes
`per_step` of them a `lax.while_loop` step: their pages gathered once ([I, Hkv, S', D]), the
logits of each tile's rows and group heads as one dot per kv head, folded into the window's
softmax states with a scatter-max and scatter-adds (a fixed order: the same bits every run).

Masked items keep invisible garbage out: values no row of the item sees count as 0, and a
non-finite value a row sees makes exactly that row's column NaN (`0 * NaN` would spread it).

Glossary: T tiles, w rows a tile, I items a step, C entries a run, S' = C * page_size keys,
Hkv kv heads, G query heads per kv head, Hl list heads (1 or Hkv), D / Dv key / value size.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from splash_hk import drafts
from splash_hk import pages
from splash_hk import quant
from splash_hk.backends import base

KEYS_PER_RUN = (512, 128)  # keys a run reads at most: tiles of 32 rows or more, narrower ones
LOGITS_PER_STEP = (2**21, 2**17)  # logits a loop step computes at most: wide tiles, narrow
GATHERED_PER_STEP = 2**20  # key and value elements a loop step gathers at most
MAX_ITEMS = 32
FULL_RUNS_FROM = 32  # tiles of this many rows or more run their runs visible whole unmasked


class Tiles(NamedTuple):
  """The tiles of one width, with the entries each reads."""

  rows: jax.Array  # [T, w] int32: the tile's rows (N: none)
  owner: jax.Array  # [T] int32: the list it reads
  lo: jax.Array  # [T, w] int32: first key position each row may see
  hi: jax.Array  # [T, w] int32: last one (below lo: none)
  start: jax.Array  # [T] int32: its first entry
  stop: jax.Array  # [T, Hl] int32: one past its last, per list head
  full_start: jax.Array  # [T] int32: the first entry of its runs visible whole
  full_stop: jax.Array  # [T] int32: one past their last (whole runs)


def run_length(width: int, page_size: int, entries: int) -> int:
  """Entries (pages) a run of a tile of `width` rows reads, of lists of `entries`."""
  return max(1, min(KEYS_PER_RUN[width < 32] // page_size, entries))


def per_step(width: int, run: int, facts: pages.PagedFacts, most: int) -> int:
  """Items a loop step takes: its logits and gathered keys and values within the budgets, and
  no more than the `most` items the loop can have (a small step computes no empty items)."""
  keys = run * facts.page_size
  by_logits = LOGITS_PER_STEP[width < 32] // (keys * width * facts.num_heads)
  by_gather = GATHERED_PER_STEP // (keys * facts.num_kv_heads * (facts.head_dim + facts.value_dim))
  return max(1, min(by_logits, by_gather, MAX_ITEMS, most))


class Segments(NamedTuple):
  """The entries one loop reads of each tile: [start1, stop1), then [start2, stop2[h])."""

  start1: jax.Array  # [T]
  stop1: jax.Array  # [T]
  start2: jax.Array  # [T]
  stop2: jax.Array  # [T, Hl]

  def runs(self, run: int) -> tuple[jax.Array, jax.Array]:
    """([T] runs of the first segment, [T] of both)."""
    cdiv = lambda a: jnp.maximum(a + run - 1, 0) // run
    first = cdiv(self.stop1 - self.start1)
    return first, first + cdiv(jnp.max(self.stop2, axis=1) - self.start2)


def segments(t: Tiles, full: bool) -> Segments:
  """The full loop's entries (whole runs visible to every row) or the masked loop's (the rest)."""
  if full:
    return Segments(t.full_start, t.full_stop, t.full_stop, jnp.zeros_like(t.stop))
  return Segments(t.start, t.full_start, t.full_stop, t.stop)


class Item(NamedTuple):
  """A loop step's items: which window tile each folds into and what they read."""

  tile: jax.Array  # [I] int32: its tile within the step's window
  rows: jax.Array  # [I, w] int32 (clipped)
  lo: jax.Array  # [I, w] int32
  hi: jax.Array  # [I, w] int32
  kv_pos: jax.Array  # [I, Hl, S'] int32: its keys' positions
  ok: jax.Array  # [I, Hl, S'] bool: the key is an entry in use (and the item is real)
  blocks: jax.Array  # [I, Hl, C] int32: the pages it reads


class Window(NamedTuple):
  """A loop's tiles in its order (tiles with items first), what its items read of them."""

  info: jax.Array  # [T, 5] int32: owner, first segment's runs, start1, stop1, start2
  stop2: jax.Array  # [T, Hl] int32
  bounds: jax.Array  # [T, 3, w] int32: rows (clipped), lo, hi
  ends: jax.Array  # [T] int32: the running sum of their items
  counts: jax.Array  # [T] int32: their items


def _item(number: jax.Array, w: Window, entries: jax.Array, run: int, page_size: int,
          start) -> Item:
  """Items `number` [I] of a loop (past its last: nothing); `entries` [O, Hl, K, 2]: each
  list entry's page and first key position."""
  total = w.ends[-1]
  c = jnp.clip(jnp.searchsorted(w.ends, number, side="right", method="compare_all"), 0,
               w.ends.shape[0] - 1)  # the item's tile, in the loop's order
  k = number - (w.ends[c] - w.counts[c])  # the item's run within its tile
  owner, first_runs, start1, stop1, start2 = (w.info[c, i] for i in range(5))
  in_first = k < first_runs
  e0 = jnp.where(in_first, start1 + k * run, start2 + (k - first_runs) * run)  # [I]
  e_end = jnp.where(in_first[:, None], stop1[:, None], w.stop2[c])  # [I, Hl]
  entry = e0[:, None] + jnp.arange(run, dtype=jnp.int32)  # [I, C]
  ok = (number < total)[:, None, None] & (entry[:, None, :] < e_end[:, :, None])  # [I, Hl, C]
  got = entries[owner[:, None, None], jnp.arange(entries.shape[1])[None, :, None],
                jnp.clip(entry, 0, entries.shape[2] - 1)[:, None, :]]  # [I, Hl, C, 2]
  kv_pos = got[..., 1:] + jnp.arange(page_size, dtype=jnp.int32)  # [I, Hl, C, page]
  flat = lambda a: a.reshape(*a.shape[:2], -1)
  bounds = w.bounds[c]  # [I, 3, w]
  return Item(tile=c - start, rows=bounds[:, 0], lo=bounds[:, 1], hi=bounds[:, 2],
              kv_pos=flat(kv_pos), ok=flat(jnp.broadcast_to(ok[..., None], kv_pos.shape)),
              blocks=got[..., 0])


def gather(pool, blocks: jax.Array, kv_heads: int) -> tuple[jax.Array, jax.Array | None]:
  """Pages `blocks` [I, Hl, C] of a pool ([P, Hkv, page, X], `pool.POOL_AXES`) for each kv
  head, each a contiguous [page, X] block: values [I, Hkv, C * page, X] as stored, and a
  quantized pool's scales [I, Hkv, C * page]."""
  index = blocks * kv_heads + jnp.arange(kv_heads, dtype=jnp.int32)[None, :, None]  # [I, Hkv, C]

  def one(a):
    flat = a.reshape(-1, *a.shape[2:])  # [P * Hkv, page, X]
    got = flat[index]  # [I, Hkv, C, page, X]
    return got.reshape(*index.shape[:2], -1, a.shape[-1])

  if isinstance(pool, quant.Quantized):
    return one(pool.values), one(pool.scale)[..., 0]
  return one(pool), None


def _logits(q: jax.Array, key: jax.Array, key_scale: jax.Array | None, groups: int) -> jax.Array:
  """f32 logits [I, Hkv, G, w, S'] of the items' rows q [I, Hkv, G * w, D] (scaled)."""
  s = jnp.einsum("ikrd,iksd->ikrs", q, key.astype(q.dtype), preferred_element_type=jnp.float32)
  if key_scale is not None:  # per (token, head): a column of the logits
    s = s * key_scale[:, :, None, :]
  return s.reshape(s.shape[0], s.shape[1], groups, -1, s.shape[-1])


def _positions(it: Item, x: pages.PagedInputs) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """(the rows' positions [I, 1, w, 1], the keys' [I, Hl, w|1, S'], and in a tree batch
  which keys each row sees of its sequence's new ones [I, Hl, w, S'], else None)."""
  kv = it.kv_pos[:, :, None, :]  # [I, Hl, 1, S'] slots
  q_at = x.layout.at[it.rows][:, None, :, None]  # [I, 1, w, 1]
  if x.layout.tree is None:
    return q_at, kv, None
  kv_at, seen = drafts.keys_seen(x.layout.tree, x.layout.at, it.rows[:, None, :, None], kv)
  return q_at, kv_at, seen


def _visible(it: Item, x: pages.PagedInputs, positions) -> jax.Array:
  """[I, Hl, w, S'] bool: the element mask (bounds, rule, entries in use, a tree's ancestors);
  `positions`: `_positions(it, x)`."""
  kv = it.kv_pos[:, :, None, :]  # [I, Hl, 1, S']
  seen = (it.ok[:, :, None, :] & (kv >= it.lo[:, None, :, None]) & (kv <= it.hi[:, None, :, None]))
  q_at, kv_at, ancestors = positions
  if ancestors is not None:
    seen = seen & ancestors
  if x.rule is not None:
    seen = seen & x.rule.visible(q_at, kv_at)
  return seen


def _scores(it: Item, x: pages.PagedInputs, facts: pages.PagedFacts, logits: jax.Array,
            masked: bool) -> tuple[jax.Array, jax.Array | None]:
  """(capped logits with invisible pairs at -inf, the mask [I, Hkv|1, G|1, w, S'] or None)."""
  positions = _positions(it, x)  # read once, by the mask and the bias
  seen = _visible(it, x, positions)[:, :, None] if masked else None  # [I, Hl, 1, w, S']
  bias = None
  if x.bias is not None:
    groups = logits.shape[2]
    head = x.heads.reshape(1, -1, groups, 1, 1)
    q_at, kv_at, _ = positions
    bias = x.bias.scores(q_at[:, :, None], kv_at[:, :, None], head)  # [I, Hkv, G, w, S']
    if seen is not None:
      bias = jnp.where(seen, bias, 0.0)
      seen = seen & (bias != -jnp.inf)
    logits = logits + bias
  logits = base.soft_cap(logits, facts.config.logits_soft_cap, bias)
  if seen is not None:
    logits = jnp.where(seen, logits, -jnp.inf)
  return logits, seen


def _values(p: jax.Array, value: jax.Array, seen: jax.Array | None) -> jax.Array:
  """p [I, Hkv, G, w, S'] times values [I, Hkv, S', Dv]: [I, Hkv, G, w, Dv] f32. Masked
  (`seen`): keys no row sees count as 0, and a non-finite value a row sees makes that row's
  column NaN."""
  shape = p.shape
  merged = lambda a: a.reshape(shape[0], shape[1], -1, shape[-1])  # [I, Hkv, G * w, S']
  dot = lambda a, b: jnp.einsum("ikrs,iksd->ikrd", merged(a), b,
                                preferred_element_type=jnp.float32).reshape(*shape[:-1], -1)
  if seen is None:
    return dot(p.astype(value.dtype), value)
  used = jnp.any(seen, axis=(2, 3))[..., None]  # [I, Hl, S', 1]
  bad = used & ~jnp.isfinite(value)  # [I, Hkv, S', Dv]
  pv = dot(p.astype(value.dtype), jnp.where(used & ~bad, value, jnp.zeros((), value.dtype)))

  def poison(pv):
    rows = jnp.broadcast_to(seen, shape).astype(jnp.float32)
    return jnp.where(dot(rows, bad.astype(jnp.float32)) > 0, jnp.nan, pv)

  return jax.lax.cond(jnp.any(bad), poison, lambda pv: pv, pv)


def _fold(state, it: Item, q: jax.Array, x: pages.PagedInputs, facts: pages.PagedFacts,
          masked: bool):
  """The window's states (m, l [I, Hkv, G, w], acc [I, Hkv, G, w, Dv]) with the items folded
  in; q [I, Hkv, G * w, D]: the window's tiles' rows, scaled."""
  m, l, acc = state
  groups = m.shape[2]
  key, key_scale = gather(x.cache.key, it.blocks, facts.num_kv_heads)  # [I, Hkv, S', D]
  value, value_scale = gather(x.cache.value, it.blocks, facts.num_kv_heads)
  if value_scale is not None:  # codes (int8, fp8) enter the product as f32, the scale apart
    value = value.astype(jnp.float32)
  logits = _logits(q[it.tile], key, key_scale, groups)  # [I, Hkv, G, w, S']
  if not masked:  # the loop's last step may hold items past its total: nothing of them counts
    logits = jnp.where(jnp.any(it.ok, axis=(1, 2))[:, None, None, None, None], logits, -jnp.inf)
  logits, seen = _scores(it, x, facts, logits, masked)
  item_max = jnp.max(logits, axis=-1)  # [I, Hkv, G, w]
  new_m = jnp.maximum(m, jnp.full(m.shape, -jnp.inf).at[it.tile].max(item_max))
  safe = jnp.where(new_m == -jnp.inf, 0.0, new_m)
  alpha = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - safe))
  p = jnp.exp(logits - safe[it.tile][..., None])  # 0 where -inf; NaN stays NaN
  l = l * alpha + jnp.zeros_like(l).at[it.tile].add(jnp.sum(p, axis=-1))
  if value_scale is not None:  # per (token, head): a column of the probabilities
    column = value_scale[:, :, None, None, :]
    p = p * (column if seen is None else jnp.where(seen, column, 0.0))  # free slots: garbage
  pv = _values(p, value, seen)  # [I, Hkv, G, w, Dv]
  return new_m, l, acc * alpha[..., None] + jnp.zeros_like(acc).at[it.tile].add(pv)


def _window(t: Tiles, seg: Segments, run: int, num_rows: int) -> tuple[Window, jax.Array]:
  """The loop's tiles in its order, and that order [T] (tiles with items first)."""
  first_runs, counts = seg.runs(run)  # [T]
  order = jnp.argsort(counts == 0, stable=True).astype(jnp.int32)
  info = jnp.stack([t.owner, first_runs, seg.start1, seg.stop1, seg.start2], axis=1)
  bounds = jnp.stack([jnp.clip(t.rows, 0, num_rows - 1), t.lo, t.hi], axis=1)  # [T, 3, w]
  counts = counts[order]
  return Window(info[order], seg.stop2[order], bounds[order],
                jnp.cumsum(counts).astype(jnp.int32), counts), order


def _loop(state, x: pages.PagedInputs, facts: pages.PagedFacts, entries: jax.Array, t: Tiles,
          q: jax.Array, run: int, size: int, full: bool):
  """The tiles' states (m, l [T, Hkv, G, w], acc) after one loop's items, `size` a step: a
  step reads its window of tiles through the loop's order and writes them back (no copy of the
  other tiles' states)."""
  w, order = _window(t, segments(t, full), run, facts.num_tokens)
  num_tiles = t.rows.shape[0]

  def body(carry):
    step, state = carry
    number = step * size + jnp.arange(size, dtype=jnp.int32)
    start = jnp.clip(jnp.searchsorted(w.ends, number[0], side="right", method="compare_all"),
                     0, num_tiles - size)
    it = _item(number, w, entries, run, facts.page_size, start)
    at = jax.lax.dynamic_slice_in_dim(order, start, size)  # [size]: the window's tiles
    new = _fold(tuple(a[at] for a in state), it, q[at], x, facts, not full)
    return step + 1, tuple(a.at[at].set(b, unique_indices=True) for a, b in zip(state, new))

  _, state = jax.lax.while_loop(lambda c: c[0] * size < w.ends[-1], body, (0, tuple(state)))
  return state


def attend_tiles(x: pages.PagedInputs, facts: pages.PagedFacts, bl: pages.BlockLists,
                 t: Tiles, run: int, size: int, state):
  """The tiles' states after their lists (runs of `run` entries, `size` items a loop step):
  the whole runs without a mask, then the rest."""
  count, width = t.rows.shape
  kv_heads, groups = facts.num_kv_heads, facts.num_heads // facts.num_kv_heads
  q = x.query[jnp.clip(t.rows, 0, facts.num_tokens - 1)]  # [T, w, Hq, D]
  q = q.reshape(count, width, kv_heads, groups, facts.head_dim).transpose(0, 2, 3, 1, 4)
  q = q.reshape(count, kv_heads, groups * width, facts.head_dim) * jnp.asarray(
      facts.scale, q.dtype)  # [T, Hkv, G * w, D]
  entries = jnp.stack([bl.blocks, bl.first_key], axis=-1)  # [O, Hl, K, 2]
  for full in ((True, False) if width >= FULL_RUNS_FROM else (False,)):
    state = _loop(state, x, facts, entries, t, q, run, size, full)
  return state
