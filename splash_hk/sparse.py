"""Gates that choose key blocks from the data: MoBA's top-k by mean-pooled keys, Quest's pages.

`top_k_blocks` returns a `masks.Blocks`: pass it as `mask=` (`& masks.Causal()` keeps
causality inside the diagonal block), and attention computes the chosen blocks only.
`top_k_pages` returns a `PageSelection` for `RaggedBatch(selection=...)`: a paged step then
reads only the chosen pages of each sequence (a decode's cost follows the choice).

Glossary of shapes: B batch, T queries, S keys, Hq query heads, Hkv kv heads (Gq = Hq / Hkv
per group), D head dim, (bq, bk) the block size, nq = ceil(T / bq), nk = ceil(S / bk), K the
most blocks a query block lists (local + top_k).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk import lowering
from splash_hk import ragged
from splash_hk.backends.native import backend as native
from splash_hk.backends.native import build as native_build
from splash_hk.masks._chosen import Blocks
from splash_hk.pages import PagedKVCache, PageSelection, RaggedBatch

__all__ = ("top_k_blocks", "top_k_pages")

ROWS_PER_STEP = 16  # query rows whose page bounds `top_k_pages` scores in one loop step


def _block_means(x: jax.Array, valid: jax.Array, block: int) -> jax.Array:
  """x [B, L, H, D] -> [B, H, n, D] f32: each block's mean over its `valid` [B, L] rows."""
  batch, length, heads, dim = x.shape
  n = -(-length // block)
  pad = n * block - length
  x = jnp.pad(x.astype(jnp.float32) * valid[..., None, None], [(0, 0), (0, pad), (0, 0), (0, 0)])
  rows = jnp.pad(valid.astype(jnp.float32), [(0, 0), (0, pad)]).reshape(batch, n, block)
  sums = x.reshape(batch, n, block, heads, dim).sum(axis=2)  # [B, n, H, D]
  means = sums / jnp.maximum(rows.sum(axis=-1), 1.0)[..., None, None]
  return jnp.swapaxes(means, 1, 2)  # [B, H, n, D]


def _segment_ranges(ids: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """Per block (min, max) [B, n] of its non-negative segment ids (empty: (big, -big))."""
  return _block_range(ids, ids >= 0, block)


def _block_range(a: jax.Array, valid: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """Per block (min, max) [B, n] of int32 `a` [B, L] over its `valid` entries (none: (big,
  -big))."""
  batch, length = a.shape
  n = -(-length // block)
  pad = lambda x, fill: jnp.pad(x, [(0, 0), (0, n * block - length)],
                                constant_values=fill).reshape(batch, n, block)
  a, valid = pad(a.astype(jnp.int32), 0), pad(valid, False)
  far = jnp.iinfo(jnp.int32).max
  return (jnp.min(jnp.where(valid, a, far), axis=-1), jnp.max(jnp.where(valid, a, -far), axis=-1))


class _Sides(NamedTuple):
  """What the gate reads of each side's tokens: [B, T] / [B, S] each (`seg` None: one document)."""

  q_pos: jax.Array
  kv_pos: jax.Array
  q_valid: jax.Array
  kv_valid: jax.Array
  q_seg: jax.Array | None
  kv_seg: jax.Array | None


def _sides(batch: int, query_len: int, kv_len: int, q_segment_ids, kv_segment_ids, q_positions,
           kv_positions) -> _Sides:
  """Segment ids and positions with `attention`'s defaults: kv ids default to the queries' (T ==
  S), positions end-aligned (`S - T + i` and `j`), or one side given alone serving both (T == S)."""
  as_int = lambda a: None if a is None else jnp.asarray(a, jnp.int32)
  q_seg, kv_seg = as_int(q_segment_ids), as_int(kv_segment_ids)
  kv_seg = q_seg if kv_seg is None else kv_seg
  q_pos, kv_pos = as_int(q_positions), as_int(kv_positions)
  if query_len == kv_len:
    q_pos, kv_pos = (q_pos if q_pos is not None else kv_pos), (kv_pos if kv_pos is not None
                                                                 else q_pos)
  if q_pos is None:
    q_pos = jnp.arange(kv_len - query_len, kv_len, dtype=jnp.int32)
  if kv_pos is None:
    kv_pos = jnp.arange(kv_len, dtype=jnp.int32)
  valid = lambda seg, n: jnp.ones((batch, n), jnp.bool_) if seg is None else seg >= 0
  return _Sides(jnp.broadcast_to(q_pos, (batch, query_len)),
                jnp.broadcast_to(kv_pos, (batch, kv_len)), valid(q_seg, query_len),
                valid(kv_seg, kv_len), q_seg, kv_seg)


def _candidates(sides: _Sides, block_size: tuple[int, int],
                causal: bool) -> tuple[jax.Array, jax.Array]:
  """(candidate [B, nq, nk] bool, anchor [B, nq] int32): the key blocks a query block may choose
  (they hold a key it can see: not padding, its documents, under `causal` at or before one of
  its positions), and the last key block holding a key at or before its last position that it
  can see otherwise (-1: none): where its local blocks end."""
  bq, bk = block_size
  _, q_last = _block_range(sides.q_pos, sides.q_valid, bq)  # [B, nq]
  kv_first, _ = _block_range(sides.kv_pos, sides.kv_valid, bk)  # [B, nk]
  seen = (kv_first < jnp.iinfo(jnp.int32).max)[:, None, :]  # [B, 1, nk]: a key not padding
  if sides.q_seg is not None and sides.kv_seg is not None:  # documents meet the query block's
    (q_lo, q_hi), (kv_lo, kv_hi) = (_segment_ranges(sides.q_seg, bq),
                                    _segment_ranges(sides.kv_seg, bk))
    seen = seen & ((kv_lo[:, None, :] <= q_hi[:, :, None]) & (q_lo[:, :, None] <= kv_hi[:, None, :]))
  before = kv_first[:, None, :] <= q_last[:, :, None]  # [B, nq, nk]
  candidate = seen & before if causal else jnp.broadcast_to(seen, before.shape)
  blocks = jnp.arange(kv_first.shape[1], dtype=jnp.int32)
  anchor = jnp.max(jnp.where(seen & before, blocks, -1), axis=-1)  # [B, nq]
  return candidate, anchor


def top_k_blocks(q: jax.Array, k: jax.Array, top_k: int, block_size: tuple[int, int], *,
                 causal: bool = True, local: int = 1, q_segment_ids: jax.Array | None = None,
                 kv_segment_ids: jax.Array | None = None, q_positions: jax.Array | None = None,
                 kv_positions: jax.Array | None = None) -> Blocks:
  """MoBA's gate: for each query block and kv head, its `local` own blocks and the `top_k` key
  blocks scoring highest, as a `masks.Blocks` with H = Hkv (one choice per GQA group).

  The score of key block c for query block r is `mean(q[r's rows, the group's heads]) .
  mean(k[c's rows])` (padding rows, segment id < 0, left out of the means). The candidates are
  the key blocks holding a key r can see: not padding, of a document r's rows are in, and under
  `causal` at or before one of r's positions. The `local` blocks ending at the last key block
  holding such a key at or before r's last position are always chosen (a decode row over a
  partly filled cache: the block of its newest key, not the end of the key axis). Then the
  `top_k` highest other candidates, ties to the lower index; a row's count is what it chose
  (fewer when fewer candidates). No gradient flows through the choice. Segment ids and positions
  have `attention`'s meaning and defaults (end-aligned positions): pass the call's own.

  Args:
    q: [B, T, Hq, D]; k: [B, S, Hkv, D].
    top_k: key blocks chosen beyond the local ones (>= 0).
    block_size: (bq, bk).
    causal: choose under the causal rule; the choice then holds it (`Blocks.causal`: a query
      never sees a later key of its own block).
    local: the query block's own blocks always chosen (>= 0).
    q_segment_ids, kv_segment_ids: [B, T], [B, S] ints (negative: padding).
    q_positions, kv_positions: [B, T], [B, S] ints.

  Returns:
    Blocks(kv_blocks [B, Hkv, nq, local + top_k] int32 (-1 past each count), counts [B, Hkv, nq],
    causal=causal).
  """
  _check(q, k, top_k, block_size, local, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
  top_k, local = int(top_k), int(local)
  block_size = (int(block_size[0]), int(block_size[1]))
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  batch, query_len, num_heads, dim = q.shape
  kv_len, num_kv = k.shape[1], k.shape[2]
  sides = _sides(batch, query_len, kv_len, q_segment_ids, kv_segment_ids, q_positions,
                 kv_positions)
  grouped = q.reshape(batch, query_len, num_kv, num_heads // num_kv, dim).mean(axis=3)
  q_means = _block_means(grouped, sides.q_valid, block_size[0])  # [B, Hkv, nq, D]
  k_means = _block_means(k, sides.kv_valid, block_size[1])  # [B, Hkv, nk, D]
  scores = jnp.einsum("bhrd,bhcd->bhrc", q_means, k_means)  # [B, Hkv, nq, nk]
  candidate, anchor = _candidates(sides, block_size, causal)  # [B, nq, nk], [B, nq]
  listed, counts = _choose(scores, candidate, anchor, top_k, local)
  return Blocks(listed, counts, block_size, causal=causal)


def _choose(scores: jax.Array, candidate: jax.Array, anchor: jax.Array, top_k: int,
            local: int) -> tuple[jax.Array, jax.Array]:
  """(lists [B, Hkv, nq, K] int32, -1 past each count; counts [B, Hkv, nq]): the `local` blocks
  ending at `anchor` [B, nq], then the `top_k` best other candidates [B, nq, nk]."""
  nk = scores.shape[-1]
  own = anchor[..., None] - jnp.arange(local)  # [B, nq, local]: newest first
  is_own = jnp.any((jnp.arange(nk) == own[..., None]) & (own[..., None] >= 0), axis=-2)
  others = jnp.where((candidate & ~is_own)[:, None], scores, -jnp.inf)  # [B, Hkv, nq, nk]
  values, top = jax.lax.top_k(others, min(top_k, nk))  # [B, Hkv, nq, k'], ties to the lower index
  n_own = jnp.clip(anchor + 1, 0, local)[:, None]  # [B, 1, nq]
  n_top = jnp.sum(values > -jnp.inf, axis=-1, dtype=jnp.int32)  # [B, Hkv, nq]
  width = local + top_k
  slot = jnp.arange(width)  # [K]
  top = jnp.pad(top, [(0, 0)] * 3 + [(0, width - top.shape[-1])], constant_values=-1)
  from_top = jnp.take_along_axis(top, jnp.clip(slot - n_own[..., None], 0, width - 1), axis=-1)
  own = jnp.pad(own, [(0, 0), (0, 0), (0, top_k)])[:, None]  # [B, 1, nq, K]
  listed = jnp.where(slot < n_own[..., None], own, from_top)  # [B, Hkv, nq, K]
  counts = n_own + n_top  # [B, Hkv, nq]
  listed = jnp.where(slot < counts[..., None], listed, -1).astype(jnp.int32)
  return listed, counts.astype(jnp.int32)


def _check(q, k, top_k, block_size, local, q_segment_ids, kv_segment_ids, q_positions,
           kv_positions) -> None:
  """Arguments of `top_k_blocks`, each refusal naming its argument."""
  if q.ndim != 4 or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise ValueError(f"`q` must be [B, T, Hq, D] and `k` [B, S, Hkv, D] with the same B and D, "
                     f"got {tuple(q.shape)} and {tuple(k.shape)}.")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"`q`'s {q.shape[2]} heads must be a multiple of `k`'s {k.shape[2]}.")
  for name, n in (("top_k", top_k), ("local", local)):
    count(name, n)
  if top_k + local < 1:
    raise ValueError("`top_k` + `local` must be at least 1: a choice of no block sees nothing.")
  if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
      or not all(_is_count(b) and b >= 1 for b in block_size)):
    raise ValueError(f"`block_size` must be (bq, bk), two ints >= 1 (a query block's rows and a "
                     f"key block's keys), got {block_size!r}; for square blocks of n pass (n, n).")
  if q_segment_ids is None and kv_segment_ids is not None:
    raise ValueError("`kv_segment_ids` needs `q_segment_ids` (the queries' documents) too.")
  if kv_segment_ids is None and q_segment_ids is not None and q.shape[1] != k.shape[1]:
    raise ValueError("`kv_segment_ids` is required when T != S and `q_segment_ids` is given.")
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  for name, a, n, axis in (("q_segment_ids", q_segment_ids, t, "T"),
                           ("kv_segment_ids", kv_segment_ids, s, "S"),
                           ("q_positions", q_positions, t, "T"),
                           ("kv_positions", kv_positions, s, "S")):
    if a is not None and (jnp.ndim(a) != 2 or tuple(jnp.shape(a)) not in ((b, n), (1, n))
                          or not jnp.issubdtype(jnp.asarray(a).dtype, jnp.integer)):
      raise ValueError(f"`{name}` must be ints [B, {axis}] = [{b}, {n}], got "
                       f"{jnp.asarray(a).dtype}{list(jnp.shape(a))}.")


def _is_count(n: Any) -> bool:  # an int (Python's or a NumPy integer scalar), not a bool
  return isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_))


def count(name: str, n: Any) -> None:
  """A static count >= 0 (`top_k`, `local`): an int or a NumPy integer; a traced or other value
  is a ValueError naming it and saying what to pass."""
  if isinstance(n, jax.core.Tracer):
    raise ValueError(f"`{name}` must be a static int >= 0 (it sets the choice's shape), got a "
                     f"traced value ({n.aval}): pass a Python int, e.g. through "
                     "jax.jit(..., static_argnames=...).")
  if not _is_count(n) or n < 0:
    raise ValueError(f"`{name}` must be an int >= 0, got {n!r}.")


def top_k_pages(q: jax.Array, cache: PagedKVCache, batch: RaggedBatch, top_k: int, *,
                local: int = 1) -> PageSelection:
  """Quest's page choice: for each sequence and kv head, its `local` last pages and the `top_k`
  cached pages whose keys can score highest, as a `PageSelection` for `RaggedBatch(selection=)`.

  A page's bound for a query is `sum_d max(q_d * key_min_d, q_d * key_max_d)` over the page's
  key summaries (`PagedKVCache.zeros(..., page_summaries=True)`), an upper bound of every
  logit the page holds; a page's score for a sequence and kv head is its bound's max over the
  sequence's rows and the kv head's group of query heads. Every page this step writes (the
  rows' own keys: a prefill chunk's, a draft tree's) and the `local` last pages of the length
  after the step are always chosen; the candidates are the other pages holding cached tokens
  (`kv_lens`). Then the `top_k` highest candidates, ties to the lower index; count = what was
  chosen. No gradient.

  Args:
    q: [N, Hq, D], the step's query rows (`paged_attention`'s `query`).
    cache: the pool, with page summaries.
    batch: the step's `RaggedBatch` (its lengths before the step, as `paged_attention` reads).
    top_k: pages chosen beyond the local ones (>= 0).
    local: the last pages always chosen (>= 0).

  Returns:
    PageSelection(pages [max_seqs, Hkv, top_k' + own'] int32 logical pages (-1 past each
    count), counts [max_seqs, Hkv]), top_k' = min(top_k, pages_per_seq) and own' = the larger
    of `local` and the most pages one sequence's rows of this step can write.
  """
  _check_pages(q, cache, batch, top_k, local)
  top_k, local = int(top_k), int(local)
  q = jax.lax.stop_gradient(jnp.asarray(q))
  n, page_size = q.shape[0], cache.page_size
  seq, row_in = ragged.sequences_of(batch, n)  # [N] each (misused rows: NaN in the step)
  score = _page_scores(q, cache, batch, seq, row_in)  # [max_seqs, Hkv, pps]
  kv = batch.kv_lens.astype(jnp.int32)[:, None, None]  # [max_seqs, 1, 1]
  cu = batch.cu_q_lens.astype(jnp.int32)
  after = -(-(kv + jnp.maximum(cu[1:] - cu[:-1], 0)[:, None, None]) // page_size)  # pages after
  written = jnp.where(after * page_size > kv, kv // page_size, after)  # first page it writes
  first = jnp.minimum(after - local, written)  # [max_seqs, 1, 1]: the first page always chosen
  logical = jnp.arange(batch.pages_per_seq, dtype=jnp.int32)
  own = (logical >= first) & (logical < after)  # [max_seqs, 1, pps]
  candidate = (logical < -(-kv // page_size)) & ~own
  values, top = jax.lax.top_k(jnp.where(candidate, score, -jnp.inf),
                              min(top_k, batch.pages_per_seq))  # ties to the lower index
  chosen_top = jnp.take_along_axis(jnp.broadcast_to(candidate, score.shape), top, axis=-1)
  most = max(local, min(batch.pages_per_seq, -(-(n - 1) // page_size) + 1))  # static
  firsts = first + jnp.arange(most, dtype=jnp.int32)  # [max_seqs, 1, own']
  firsts = jnp.where(firsts < after, firsts, -1)
  firsts = jnp.broadcast_to(firsts, (*score.shape[:2], most))
  listed = jnp.concatenate([firsts, top.astype(jnp.int32)], axis=-1)  # [max_seqs, Hkv, K]
  valid = jnp.concatenate([(firsts >= 0) & (firsts < batch.pages_per_seq), chosen_top], axis=-1)
  live = jnp.arange(batch.max_seqs) < jnp.reshape(batch.num_seqs, (-1,))[0]
  valid = valid & live[:, None, None]
  order = jnp.argsort(~valid, axis=-1, stable=True)  # chosen first, in their order
  listed = jnp.where(jnp.take_along_axis(valid, order, -1),
                     jnp.take_along_axis(listed, order, -1), -1)
  return PageSelection(listed, jnp.sum(valid, axis=-1, dtype=jnp.int32))


def _page_scores(q: jax.Array, cache: PagedKVCache, batch: RaggedBatch, seq: jax.Array,
                 row_in: jax.Array) -> jax.Array:
  """[max_seqs, Hkv, pps] f32: each page's Quest bound, maxed over its sequence's live rows
  and each kv head's group (-inf: no row): on CPU the native kernel's (one read of each
  sequence's summaries for all its rows) where it is built, else XLA's."""
  table = jnp.clip(batch.page_table.astype(jnp.int32), 0, cache.num_pages - 1)  # [S, pps]
  args, portable = (q.astype(jnp.float32), cache.key_min, cache.key_max, table, seq, row_in), (
      lambda a: _xla_page_scores(*a))
  if native_build.unavailable() is not None:
    return portable(args)
  return lowering.per_platform({"cpu": lambda a: native.page_bounds(*a), "gpu": portable,
                                "tpu": portable}, args)


def _xla_page_scores(q: jax.Array, key_min: jax.Array, key_max: jax.Array, table: jax.Array,
                     seq: jax.Array, live: jax.Array) -> jax.Array:
  """`_page_scores` in XLA: `ROWS_PER_STEP` rows a loop step, each gathering its sequence's
  summaries."""
  (n, num_heads, dim), kv_heads = q.shape, key_min.shape[1]
  size = min(ROWS_PER_STEP, n)
  steps = -(-n // size)
  pad = lambda a, fill: jnp.pad(a, [(0, steps * size - n)] + [(0, 0)] * (a.ndim - 1),
                                constant_values=fill)
  grouped = pad(q, 0).reshape(-1, kv_heads, num_heads // kv_heads, dim)
  seq, live = pad(seq, 0), pad(live, False)
  best = jnp.full((table.shape[0], kv_heads, table.shape[1]), -jnp.inf)

  flat = lambda a: a.reshape(a.shape[0], -1)  # [P, Hkv * D]: a page's summaries one row

  def step(i, best):
    rows = jax.lax.dynamic_slice_in_dim(grouped, i * size, size)  # [R, Hkv, G, D]
    seqs = jax.lax.dynamic_slice_in_dim(seq, i * size, size)  # [R]
    pages_of = table[seqs]  # [R, pps], inside the pool (clipped)
    lo, hi = (flat(a).at[pages_of].get(mode="promise_in_bounds").reshape(
        *pages_of.shape, kv_heads, dim) for a in (key_min, key_max))  # [R, pps, Hkv, D]
    bound = None  # sum_d max(q_d lo_d, q_d hi_d) = max(q, 0) . hi + min(q, 0) . lo, max over G
    for g in range(num_heads // kv_heads):  # a head at a time: no [R, pps, Hkv, G, D] product
      q_g = rows[:, None, :, g]  # [R, 1, Hkv, D]
      b = jnp.sum(jnp.maximum(q_g, 0.0) * hi + jnp.minimum(q_g, 0.0) * lo, axis=-1)
      bound = b if bound is None else jnp.maximum(bound, b)  # [R, pps, Hkv]
    ok = jax.lax.dynamic_slice_in_dim(live, i * size, size)
    at = jnp.where(ok, seqs, table.shape[0])  # dead rows: dropped
    return best.at[at].max(jnp.swapaxes(bound, 1, 2), mode="drop")  # [R, Hkv, pps] in

  return jax.lax.fori_loop(0, steps, step, best)


def _check_pages(q, cache, batch, top_k, local) -> None:
  """Arguments of `top_k_pages`, each refusal naming its argument."""
  if not isinstance(cache, PagedKVCache) or cache.key_min is None:
    raise ValueError("`cache` must be a PagedKVCache that keeps page summaries: build it with "
                     "PagedKVCache.zeros(..., page_summaries=True).")
  if not isinstance(batch, RaggedBatch):
    raise ValueError(f"`batch` must be a splash_hk.RaggedBatch, got {type(batch).__name__}.")
  if (jnp.ndim(q) != 3 or q.shape[2] != cache.key_min.shape[-1]
      or q.shape[1] % cache.num_kv_heads):
    raise ValueError(f"`q` must be [N, Hq, D] with D = {cache.key_min.shape[-1]} and Hq a "
                     f"multiple of the cache's {cache.num_kv_heads} kv heads, got "
                     f"{tuple(jnp.shape(q))}.")
  for name, n in (("top_k", top_k), ("local", local)):
    count(name, n)
  if top_k + local < 1:
    raise ValueError("`top_k` + `local` must be at least 1: a choice of no page sees nothing.")
