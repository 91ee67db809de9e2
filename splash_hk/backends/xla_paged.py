"""The xla backend's paged attention: work that follows each sequence's length.

Each live query row needs the pages that hold keys it may see: from its sequence's page 0 (or
the first page of its window or chunk, when the rule says so in config terms) to the page of its
last visible key (its own position under a causal rule, else its sequence's last token). Those
(row, page) pairs, counted per row and numbered by a running sum, are the work; a
`lax.while_loop` takes them `ITEMS` at a time (each row found by a binary search over the
running sum), gathers the rows' queries and the pages' keys and values, and folds each chunk
into every row's online softmax (a row's items in one chunk meet in a scatter-max and
scatter-adds, in a fixed order: the same bits every run). Nothing scales with `pages_per_seq`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from splash_hk import pages
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
  key = x.cache.key[physical]  # [I, page, Hkv, D]; garbage's logits are masked below
  value = jnp.where(visible[:, :, None, None], x.cache.value[physical], 0)  # [I, page, Hkv, Dv]
  logits = jnp.einsum("ikgd,iskd->ikgs", query, key, precision=_HIGHEST,
                      preferred_element_type=jnp.float32) * facts.scale  # [I, Hkv, G, page]
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
  pv = jnp.einsum("ikgs,iskd->ikgd", p, value.astype(jnp.float32), precision=_HIGHEST)
  acc = acc * alpha[..., None] + jnp.zeros_like(acc).at[row].add(pv)
  return new_m, l, acc


def attend(x: pages.PagedInputs, facts: pages.PagedFacts) -> tuple[jax.Array, jax.Array]:
  """out [N, Hq, Dv] of every live row over its sequence's pages (other rows: 0), and its lse
  [N, Hq] (base's convention)."""
  num_tokens, num_heads = facts.num_tokens, facts.num_heads
  num_kv_heads = facts.num_kv_heads
  groups = num_heads // num_kv_heads
  lo, hi = key_bounds(x, facts)  # [N]
  first_page = jnp.maximum(lo, 0) // facts.page_size
  count = jnp.where(hi >= lo, hi // facts.page_size - first_page + 1, 0)  # [N] pages per row
  ends = jnp.cumsum(count)  # [N]
  rows = (lo, hi, first_page, ends - count, ends, ends[-1])
  shape = (num_tokens, num_kv_heads, groups)
  state = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, facts.value_dim)))

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
