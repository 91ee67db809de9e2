"""Plain ("vanilla") dense attention with the whole semantics: the selector's last resort.

`BACKEND` serves every call (it is the only one that materialises weights);
`splash_hk.fallback.reference_attention` is the same computation from public arguments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from splash_hk import drafts
from splash_hk import dropout
from splash_hk import pages
from splash_hk import quant
from splash_hk.backends import base
from splash_hk.masks import Dense, Mask
from splash_hk.types import Facts, KernelInputs, KernelOutput

_HIGHEST = jax.lax.Precision.HIGHEST


def logits_and_mask(x: KernelInputs, facts: Facts) -> tuple[jax.Array, jax.Array]:
  """Scaled, biased, soft-capped float32 logits [B, Hkv, G, T, S] and their mask
  [B, 1|Hkv, 1|G, T, S].

  Queries and keys enter the product with non-finite entries zeroed, so garbage
  where the mask is False changes nothing, gradients included; a visible pair
  whose query or key holds NaN/Inf gets the plain product's logit instead (+-inf
  or NaN, as the float64 oracle computes it), without a gradient.
  """
  batch, query_len, num_heads, head_dim = x.query.shape
  num_kv_heads = x.key.shape[2]
  groups = num_heads // num_kv_heads
  finite = lambda a: jnp.where(jnp.isfinite(a), a, jnp.zeros((), a.dtype))
  bad = lambda a: jnp.any(~jnp.isfinite(a), axis=-1)
  product = lambda q, k: jnp.einsum(
      "btkgd,bskd->bkgts", q.reshape(batch, query_len, num_kv_heads, groups, head_dim), k,
      precision=_HIGHEST, preferred_element_type=jnp.float32) * facts.scale  # [B, Hkv, G, T, S]
  logits = product(finite(x.query), finite(x.key))
  mask = base.full_mask(x)  # [B, 1|Hq, T, S]
  mask = mask.reshape(mask.shape[0], -1, groups if mask.shape[1] > 1 else 1, *mask.shape[2:])
  bad_q = jnp.moveaxis(bad(x.query).reshape(batch, query_len, num_kv_heads, groups), 1, 3)
  bad_k = jnp.swapaxes(bad(x.key), 1, 2)[:, :, None, None, :]  # [B, Hkv, 1, 1, S]
  plain = lambda: jax.lax.stop_gradient(product(x.query, x.key))
  logits = jax.lax.cond(jnp.any(bad_q) | jnp.any(bad_k),
                        lambda s: jnp.where(mask & (bad_q[..., None] | bad_k), plain(), s),
                        lambda s: s, logits)
  bias = None
  if x.bias is not None:  # read where visible only: garbage elsewhere (NaN) changes nothing
    bias = jnp.where(mask, base.bias_block(x.bias, x.q_positions, x.kv_positions, x.heads,
                                           groups), 0.0)  # [B, Hkv, G, T, S]
    logits = logits + bias
    mask = mask & (bias != -jnp.inf)  # a -inf bias removes its pair
  return base.soft_cap(logits, facts.config.logits_soft_cap, bias), mask


def _keep_scale(x: KernelInputs, facts: Facts) -> jax.Array:
  """keep / (1 - rate) of every pair, [B, Hkv, G, T, S] (broadcast)."""
  d, num_kv_heads = x.dropout, x.key.shape[2]
  return dropout.scale(d.key, facts.config.dropout_rate, d.rows[:, None, None, None, None],
                       dropout.heads_by_kv(d.heads, num_kv_heads),
                       d.q_index[:, None, None, :, None], d.kv_index[:, None, None, None, :],
                       None if d.mask is None else dropout.mask_by_kv(d.mask, num_kv_heads))


def why_not(facts: Facts, hardware: str) -> str | None:
  """The reference serves every call."""
  del facts, hardware
  return None


def attend(x: KernelInputs, facts: Facts) -> KernelOutput:
  """Dense attention on one shard: out [B, T, Hq, Dv], lse [B, T, Hq], weights if asked for.

  GQA groups query heads over their kv head instead of repeating keys/values; quantized keys
  and values are dequantized whole (this path is dense anyway).
  """
  x = x._replace(key=quant.tile(x.key, x.query.dtype), value=quant.tile(x.value, x.query.dtype))
  batch, query_len, num_heads, _ = x.query.shape
  num_kv_heads, kv_len = x.key.shape[2], x.key.shape[1]
  groups = num_heads // num_kv_heads
  logits, mask = logits_and_mask(x, facts)  # [B, Hkv, G, T, S]
  logits = jnp.where(mask, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)  # [B, Hkv, G, T, 1]
  if x.sinks is not None:
    sinks = x.sinks.reshape(num_kv_heads, groups, 1, -1)  # [Hkv, G, 1, n]
    row_max = jnp.maximum(row_max, jnp.max(sinks, axis=-1, keepdims=True))
  visible = jnp.any(mask, axis=-1, keepdims=True)  # [B, 1|Hkv, 1|G, T, 1]
  # Rows that see nothing get a finite shift and exact zeros (never NaN).
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  unnormalized = jnp.exp(logits - row_max)  # [B, Hkv, G, T, S]
  denominator = jnp.sum(unnormalized, axis=-1, keepdims=True)
  if x.sinks is not None:
    denominator = denominator + jnp.sum(jnp.exp(sinks - row_max), axis=-1, keepdims=True)
  weights = jnp.where(visible, unnormalized / jnp.where(visible, denominator, 1.0), 0.0)
  # Zero already; the select keeps a masked pair's cotangent (dP may be inf where the
  # value is garbage near the float limit) out of the row's softmax gradient.
  weights = jnp.where(mask, weights, 0.0)
  bad_v = ~jnp.isfinite(x.value)  # [B, S, Hkv, Dv]: zeroed, then NaN where a row sees one
  value = jnp.where(bad_v, 0, x.value).astype(jnp.float32)
  dropped = weights if x.dropout is None else weights * _keep_scale(x, facts)  # [B, Hkv, G, T, S]
  out = jnp.einsum("bkgts,bskd->btkgd", dropped, value, precision=_HIGHEST)  # [B, T, Hkv, G, Dv]
  seen = lambda: jnp.einsum("bkgts,bskd->btkgd", jnp.broadcast_to(mask, weights.shape).astype(
      jnp.float32), bad_v.astype(jnp.float32))
  out = jax.lax.cond(jnp.any(bad_v), lambda o: jnp.where(seen() > 0, jnp.nan, o), lambda o: o, out)
  out = out.reshape(batch, query_len, num_heads, -1).astype(x.query.dtype)  # [B, T, Hq, Dv]
  has_mass = denominator != 0  # NaN stays NaN
  lse = jnp.where(has_mass, row_max + jnp.log(jnp.where(has_mass, denominator, 1.0)), -jnp.inf)
  lse = lse[..., 0].reshape(batch, num_heads, query_len)  # [B, Hq, T]
  asked = weights.reshape(batch, num_heads, query_len, kv_len) if facts.return_weights else None
  return KernelOutput(out, jnp.swapaxes(lse, 1, 2), asked)  # [B, T, Hq, Dv], [B, T, Hq]


def _with_selection(x: pages.PagedInputs, facts: pages.PagedFacts) -> Mask | None:
  """The call's rule, ANDed with a page selection's element rule (a key is visible only if its
  logical page is chosen for the row's sequence and kv head) as a dense [N, Hq, 1, S] mask."""
  chosen = x.lists.chosen
  if chosen is None:
    return x.rule
  counts = chosen.count[..., None]  # [max_seqs, Hkv, 1]
  listed = jnp.arange(chosen.blocks.shape[2])[None, None, :] < counts
  seqs, heads = (jnp.arange(n)[:, None, None] for n in counts.shape[:2])
  page = jnp.where(listed, chosen.first_key // facts.page_size, facts.pages_per_seq)
  table = jnp.zeros((*counts.shape[:2], facts.pages_per_seq), jnp.bool_).at[
      seqs, heads.reshape(1, -1, 1), page].set(True, mode="drop")  # [max_seqs, Hkv, pages]
  keys = jnp.repeat(table, facts.page_size, axis=2)[x.layout.seq]  # [N, Hkv, S]
  dense = Dense(jnp.repeat(keys, facts.num_heads // facts.num_kv_heads, axis=1)[:, :, None])
  return dense if x.rule is None else x.rule & dense


def paged_attend(x: pages.PagedInputs, facts: pages.PagedFacts) -> tuple[jax.Array, jax.Array]:
  """Dense gather: each row against its sequence's whole page table, as a one-query call of
  `attend` (keys past the sequence's length are padding). out [N, Hq, Dv], lse [N, Hq]."""
  layout, page_size = x.layout, facts.page_size
  num_tokens, kv_len = facts.num_tokens, facts.pages_per_seq * page_size
  table = x.lists.table.blocks[layout.seq, 0]  # [N, pages_per_seq], inside the pool
  gather = lambda pool: quant.cut(pool, 0, lambda t: jnp.swapaxes(t[table], 2, 3).reshape(
      num_tokens, kv_len, t.shape[1], t.shape[3]))  # [N, pages, Hkv, page, .] -> [N, S, Hkv, .]
  slots = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (num_tokens, kv_len))
  kv_positions, rule = slots, _with_selection(x, facts)
  if layout.tree is not None:  # positions by depth; of the new keys, a row's ancestors
    rows = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
    kv_positions, ancestors = drafts.keys_seen(layout.tree, layout.at, rows, slots)
    rule = Dense(ancestors[:, None, None, :]) if rule is None else rule & Dense(
        ancestors[:, None, None, :])  # [N, 1, 1, S]
  inputs = KernelInputs(
      query=x.query[:, None],  # [N, 1, Hq, D]
      key=gather(x.cache.key),  # [N, S, Hkv, D]
      value=gather(x.cache.value),  # [N, S, Hkv, Dv]
      q_positions=layout.at[:, None],  # [N, 1]
      kv_positions=kv_positions,  # [N, S]
      q_segment_ids=jnp.where(layout.row_live, 0, -1)[:, None],  # [N, 1]
      kv_segment_ids=jnp.where(slots < layout.kv_len_after[layout.seq][:, None], 0, -1),
      rule=rule, sinks=x.sinks, bias=x.bias, heads=x.heads)
  call = Facts.from_shapes(facts.config, inputs.query.shape, inputs.key.shape, facts.value_dim,
                           default_positions=False, mask=inputs.rule, bias=facts.bias)
  out, lse, _ = attend(inputs, call)
  assert lse is not None  # the reference always computes it
  return out[:, 0], lse[:, 0]  # [N, Hq, Dv], [N, Hq]


BACKEND = base.Backend(name="reference", why_not=why_not, attend=attend, rank=100,  # last resort
                       paged_why_not=lambda facts, hardware: None, paged_attend=paged_attend)
