"""The xla backend's paged attention: work that follows each sequence's length.

Each live query row needs the pages that hold keys it may see: from its sequence's page 0 (or
the first page of its window or chunk, when the rule says so in config terms) to the page of its
last visible key (its own position under a causal rule, else its sequence's last token). Those
(row, page) pairs, counted per row and numbered by a running sum, are the work; a
`lax.while_loop` takes them `ITEMS` at a time (each row found by a binary search over the
running sum), gathers the rows' queries and the pages' keys and values, and folds each chunk
into every row's online softmax (a row's items in one chunk meet in a scatter-max and
scatter-adds, in a fixed order: the same bits every run). Nothing scales with `pages_per_seq`.

A cascade (`RaggedBatch.prefix`) first attends each group's shared prefix once for all rows:
the group's pages are gathered once and every row's logits against them are one dense
matmul (rows of other groups masked out, groups without a live member skipped); the rows'
own pages then start after the prefix, folded into the same softmax state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from splash_hk import pages
from splash_hk import quant
from splash_hk.backends import base

ITEMS = 256  # (row, page) pairs per loop step
_HIGHEST = jax.lax.Precision.HIGHEST


def key_bounds(x: pages.PagedInputs, facts: pages.PagedFacts) -> tuple[jax.Array, jax.Array]:
  """[N] first and last key position each row may see (last < first: none)."""
  layout = x.layout
  pos = layout.pos  # [N]
  lo = jnp.zeros_like(pos)
  hi = layout.kv_len_after[layout.seq] - 1
  rules = facts.static_rules or {}
  if rules.get("causal"):
    hi = jnp.minimum(hi, pos)
  if rules.get("window"):
    left, right = rules["window"]
    lo, hi = jnp.maximum(lo, pos - left), jnp.minimum(hi, pos + right)
  if rules.get("chunk_size"):
    first = pos // rules["chunk_size"] * rules["chunk_size"]
    lo, hi = jnp.maximum(lo, first), jnp.minimum(hi, first + rules["chunk_size"] - 1)
  return lo, jnp.where(layout.row_live, hi, -1)


def _fold(state, item: jax.Array, x: pages.PagedInputs, facts: pages.PagedFacts, rows):
  """One loop step: items `item` [ITEMS] folded into the softmax state (m, l, acc)."""
  m, l, acc = state  # [N, Hkv, G], [N, Hkv, G], [N, Hkv, G, Dv]
  lo, hi, first_page, starts, ends, total = rows
  num_tokens, num_kv_heads, groups = m.shape
  page_size = facts.page_size
  valid = item < total  # [I]
  row = jnp.clip(jnp.searchsorted(ends, item, side="right"), 0, num_tokens - 1)  # [I]
  logical = first_page[row] + item - starts[row]  # [I]
  seq = x.layout.seq[row]
  table = x.batch.page_table[seq, jnp.clip(logical, 0, facts.pages_per_seq - 1)]
  physical = jnp.clip(table, 0, facts.num_pages - 1)  # [I]
  q_pos = x.layout.pos[row]  # [I]
  kv_pos = logical[:, None] * page_size + jnp.arange(page_size)  # [I, page]
  visible = valid[:, None] & (kv_pos >= lo[row][:, None]) & (kv_pos <= hi[row][:, None])
  if x.rule is not None:
    visible = visible & x.rule.visible(q_pos[:, None], kv_pos)  # [I, page]
  query = x.query[row].reshape(-1, num_kv_heads, groups, facts.head_dim)  # [I, Hkv, G, D]
  key, key_scale = quant.pages(x.cache.key, physical)  # [I, page, Hkv, D]; garbage is masked
  value, value_scale = quant.pages(x.cache.value, physical)  # [I, page, Hkv, Dv]
  value = jnp.where(visible[:, :, None, None], value, 0)
  logits = jnp.einsum("ikgd,iskd->ikgs", query, key.astype(query.dtype), precision=_HIGHEST,
                      preferred_element_type=jnp.float32) * facts.scale  # [I, Hkv, G, page]
  if key_scale is not None:  # per (token, head): a column of the logits
    logits = logits * _column(key_scale)
  bias = None
  if x.bias is not None:
    bias = base.bias_block(x.bias, q_pos[:, None], kv_pos, x.heads, groups)[..., 0, :]
    bias = jnp.where(visible[:, None, None, :], bias, 0.0)  # [I, Hkv, G, page]
    logits = logits + bias
    visible = visible[:, None, None, :] & (bias != -jnp.inf)
  else:
    visible = visible[:, None, None, :]  # [I, 1, 1, page]
  logits = jnp.where(visible, base.soft_cap(logits, facts.config.logits_soft_cap, bias), -jnp.inf)
  chunk_max = jnp.full(m.shape, -jnp.inf).at[row].max(jnp.max(logits, axis=-1))  # [N, Hkv, G]
  new_m = jnp.maximum(m, chunk_max)
  alpha = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - new_m))  # [N, Hkv, G]
  shift = new_m[row][..., None]  # [I, Hkv, G, 1]
  p = jnp.where(visible & (logits > -jnp.inf), jnp.exp(logits - shift), 0.0)  # [I, Hkv, G, page]
  l = l * alpha + jnp.zeros_like(l).at[row].add(jnp.sum(p, axis=-1))
  if value_scale is not None:  # per (token, head): a column of the probabilities
    p = p * jnp.where(visible, _column(value_scale), 0.0)
  pv = jnp.einsum("ikgs,iskd->ikgd", p, value.astype(jnp.float32), precision=_HIGHEST)
  acc = acc * alpha[..., None] + jnp.zeros_like(acc).at[row].add(pv)
  return new_m, l, acc


def _column(scale: jax.Array) -> jax.Array:
  """Per-token scales [I, page, Hkv, 1] as a column of the logits: [I, Hkv, 1, page]."""
  return jnp.moveaxis(scale, 1, 3)


def cascade_groups(x: pages.PagedInputs) -> tuple[jax.Array, jax.Array]:
  """([N] each row's cascade group, -1 for none; [N] its prefix tokens, 0 for none): groups
  with fewer than two live member sequences do not count (a prefix read once for one sequence
  saves nothing: its rows read it with their own pages)."""
  layout, prefix = x.layout, x.batch.prefix
  assert prefix is not None, "only a cascade has groups"
  group, plen = pages.prefix_of(x.batch, layout.seq)  # [N]
  num_groups = prefix.num_groups
  first = jnp.zeros_like(layout.row_in).at[x.batch.cu_q_lens[:-1]].set(True, mode="drop")
  starts = first & layout.row_live & (group >= 0)  # one row per live member sequence
  members = jnp.zeros((num_groups,), jnp.int32).at[jnp.where(starts, group, num_groups)].add(
      1, mode="drop")  # [groups]
  shared = (group >= 0) & (members[jnp.clip(group, 0, num_groups - 1)] > 1)
  return jnp.where(shared, group, -1), jnp.where(shared, plen, 0)


def _prefix(x: pages.PagedInputs, facts: pages.PagedFacts, lo: jax.Array, hi: jax.Array,
            group: jax.Array, plen: jax.Array, state):
  """The softmax state after each cascade group's prefix: every row against its group's prefix
  keys [0, plen) within its bounds [lo, hi], one dense block per group with live members
  (`group`, `plen` [N]: `cascade_groups`)."""
  prefix, layout = x.batch.prefix, x.layout
  assert prefix is not None, "only a cascade has prefixes"
  num_kv_heads, heads_per_kv = facts.num_kv_heads, facts.num_heads // facts.num_kv_heads
  width = prefix.pages.shape[1] * facts.page_size
  kv_pos = jnp.arange(width, dtype=jnp.int32)  # [L]
  query = jnp.swapaxes(x.query.reshape(-1, num_kv_heads, heads_per_kv * facts.head_dim), 0, 1)
  query = query.reshape(num_kv_heads, -1, facts.head_dim)  # [Hkv, N * G, D]

  def one(g, state):
    pool = jnp.clip(prefix.pages[g], 0, facts.num_pages - 1)  # [prefix_pages]
    whole = lambda a: quant.tile(quant.cut(a, 0, lambda t: t[pool].reshape(
        width, num_kv_heads, -1)), jnp.float32)  # the group's block, dequantized as a tile
    key, value = whole(x.cache.key), whole(x.cache.value)  # [L, Hkv, D], [L, Hkv, Dv]
    visible = ((group == g)[:, None] & (kv_pos[None, :] < plen[:, None])
               & (kv_pos[None, :] >= lo[:, None]) & (kv_pos[None, :] <= hi[:, None]))  # [N, L]
    if x.rule is not None:
      visible = visible & x.rule.visible(layout.pos[:, None], kv_pos[None, :])
    logits = jnp.einsum("kmd,kld->kml", query, jnp.swapaxes(key, 0, 1), precision=_HIGHEST,
                        preferred_element_type=jnp.float32) * facts.scale  # [Hkv, N * G, L]
    logits = jnp.moveaxis(logits.reshape(num_kv_heads, -1, heads_per_kv, width), 0, 1)
    bias = None
    if x.bias is not None:
      bias = base.bias_block(x.bias, layout.pos[:, None],
                             jnp.broadcast_to(kv_pos, (layout.pos.shape[0], width)), x.heads,
                             heads_per_kv)[..., 0, :]
      bias = jnp.where(visible[:, None, None, :], bias, 0.0)
      logits = logits + bias
    seen = visible[:, None, None, :] & (True if bias is None else bias != -jnp.inf)
    logits = jnp.where(seen, base.soft_cap(logits, facts.config.logits_soft_cap, bias), -jnp.inf)
    return _merge_block(state, logits, seen, value, jnp.any(visible, axis=0))

  live = lambda g: jnp.any((group == g) & layout.row_live)
  return jax.lax.fori_loop(0, prefix.num_groups, lambda g, state: jax.lax.cond(
      live(g), lambda s: one(g, s), lambda s: s, state), state)


def _merge_block(state, logits, seen, value, used):
  """The state (m, l, acc) with a dense block of every row's logits [N, Hkv, G, L] folded in
  (values [L, Hkv, Dv]; `used` [L]: keys some row sees; a non-finite value a row sees makes
  that row's column NaN, one it does not see changes nothing)."""
  m, l, acc = state
  block_max = jnp.max(logits, axis=-1)  # [N, Hkv, G]
  new_m = jnp.maximum(m, block_max)
  safe = jnp.where(new_m == -jnp.inf, 0.0, new_m)
  alpha = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - safe))
  p = jnp.where(seen, jnp.exp(logits - safe[..., None]), 0.0)  # [N, Hkv, G, L]
  bad = ~jnp.isfinite(value) & used[:, None, None]  # [L, Hkv, Dv]
  clean = jnp.swapaxes(jnp.where(used[:, None, None] & ~bad, value, 0), 0, 1)  # [Hkv, L, Dv]
  n, num_kv_heads, groups, width = p.shape
  by_head = jnp.moveaxis(p, 1, 0).reshape(num_kv_heads, n * groups, width)  # [Hkv, N * G, L]
  pv = jnp.einsum("kml,kld->kmd", by_head, clean.astype(jnp.float32), precision=_HIGHEST)
  pv = jnp.moveaxis(pv.reshape(num_kv_heads, n, groups, -1), 0, 1)  # [N, Hkv, G, Dv]

  def poison(pv):  # rows that see a non-finite value: NaN in its column
    hits = jnp.einsum("nkgl,lkd->nkgd", seen.astype(jnp.float32), bad.astype(jnp.float32))
    return jnp.where(hits > 0, jnp.nan, pv)

  pv = jax.lax.cond(jnp.any(bad), poison, lambda pv: pv, pv)
  return new_m, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv


def attend(x: pages.PagedInputs, facts: pages.PagedFacts) -> tuple[jax.Array, jax.Array]:
  """out [N, Hq, Dv] of every live row over its sequence's pages (other rows: 0), and its lse
  [N, Hq] (base's convention)."""
  num_tokens, num_heads = facts.num_tokens, facts.num_heads
  num_kv_heads = facts.num_kv_heads
  groups = num_heads // num_kv_heads
  lo, hi = key_bounds(x, facts)  # [N]
  shape = (num_tokens, num_kv_heads, groups)
  state = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, facts.value_dim)))
  if x.batch.prefix is not None:  # a cascade: prefixes once, then each row's own pages after
    group, plen = cascade_groups(x)  # [N]
    state = _prefix(x, facts, lo, hi, group, plen, state)
    lo = jnp.maximum(lo, plen)
  first_page = jnp.maximum(lo, 0) // facts.page_size
  count = jnp.where(hi >= lo, hi // facts.page_size - first_page + 1, 0)  # [N] pages per row
  ends = jnp.cumsum(count)  # [N]
  rows = (lo, hi, first_page, ends - count, ends, ends[-1])

  def body(carry):
    step, state = carry
    item = step * ITEMS + jnp.arange(ITEMS, dtype=jnp.int32)
    return step + 1, _fold(state, item, x, facts, rows)

  _, (m, l, acc) = jax.lax.while_loop(lambda c: c[0] * ITEMS < ends[-1], body, (0, state))
  if x.sinks is not None:  # [Hq, n] join every row's denominator
    sinks = x.sinks.reshape(num_kv_heads, groups, -1)  # [Hkv, G, n]
    top = jnp.maximum(m, jnp.max(sinks, axis=-1))  # [N, Hkv, G]
    keep = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - top))
    l = l * keep + jnp.sum(jnp.exp(sinks - top[..., None]), axis=-1)
    acc = acc * keep[..., None]
    m = top
  out = jnp.where(l[..., None] == 0, 0.0, acc / l[..., None])  # NaN stays NaN
  lse = jnp.where(l == 0, -jnp.inf, jnp.where(l == 0, 0.0, m) + jnp.log(jnp.where(l == 0, 1.0, l)))
  return (out.reshape(num_tokens, num_heads, -1).astype(x.query.dtype),  # [N, Hq, Dv]
          lse.reshape(num_tokens, num_heads))  # [N, Hq]
