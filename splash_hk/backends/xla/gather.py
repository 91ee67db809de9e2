"""The xla backend's gathered tiles: attention over key blocks chosen by the data (`masks.Blocks`).

A work item is R consecutive choice rows (query blocks of bq rows) of every batch row and list
head (a kv head when the choice is shared by its GQA group, else a query head): each row's
listed key blocks are gathered once, as one dense tile of K * bk keys, and attended with one
softmax (the whole list is one run). Slots past a row's count are a zero block at index nk,
masked. The position rule beside the choice (`Blocks & Causal()`), segments, padding, sinks,
the soft cap, GQA and Dv != D apply inside the tile. A custom VJP recomputes each tile from
the saved log-sum-exp and scatters dK, dV back to the listed blocks, so nothing of size T x S
is built and the cost grows with K * bk per query, not with S.

Glossary: B batch, T queries (this shard's), S keys, Hq / Hkv heads, L list heads (Hkv or Hq),
Gl = Hq / L query heads per list head, nq = ceil(T / bq) choice rows, nk = ceil(S / bk) key
blocks, K the longest list, R choice rows per work item.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from splash_hk.backends import base
from splash_hk.backends.xla import tile_extras as extras
from splash_hk.backends.xla.lists import Layout, Tables, choice_of, layout, tables
from splash_hk.masks._mask import Mask
from splash_hk.scores import Score
from splash_hk.types import Facts, KernelInputs, KernelOutput


class Item(NamedTuple):
  """One work item's gathered tile and what its mask reads."""

  q: jax.Array  # [B, L, R, Gl * bq, D], scaled
  k: jax.Array  # [B, L, R, K * bk, D]
  v: jax.Array  # [B, L, R, K * bk, Dv]
  mask: jax.Array  # [B, L|1, R, Gl * bq, K * bk] bool
  at: jax.Array  # [B, L, R, K] int32: the listed blocks (nk past each count)
  q_pos: jax.Array  # [B, R, bq] int32: the tile's rows' positions
  kv_pos: jax.Array  # [B, L, R, K * bk] int32: its gathered keys' positions
  drop: jax.Array | None = None  # [B, L, R, Gl * bq, K * bk] f32 keep / (1 - rate), or None
  bias: jax.Array | None = None  # [B, L, R, Gl * bq, K * bk] f32 (0 where invisible), or None


def _heads_rows(a: jax.Array, lay: Layout) -> jax.Array:
  """[B, R * bq, Hq, X] -> [B, L, R, Gl * bq, X]."""
  a = a.reshape(lay.batch, lay.per_item, lay.block_q, lay.list_heads, lay.group, a.shape[-1])
  return jnp.transpose(a, (0, 3, 1, 4, 2, 5)).reshape(
      lay.batch, lay.list_heads, lay.per_item, lay.group * lay.block_q, a.shape[-1])


def _rows_heads(a: jax.Array, lay: Layout) -> jax.Array:
  """[B, L, R, Gl * bq, X] -> [B, R * bq, Hq, X] (the inverse of `_heads_rows`)."""
  a = a.reshape(lay.batch, lay.list_heads, lay.per_item, lay.group, lay.block_q, a.shape[-1])
  return jnp.transpose(a, (0, 2, 4, 1, 3, 5)).reshape(
      lay.batch, lay.per_item * lay.block_q, lay.num_heads, a.shape[-1])


class Keys(NamedTuple):
  """K/V and their per-key facts as blocks [B, Hkv | -, nk + 1, bk, ...] (block nk: empty)."""

  k: jax.Array  # [B, Hkv, nk + 1, bk, D]
  v: jax.Array  # [B, Hkv, nk + 1, bk, Dv]
  pos: jax.Array  # [B, nk + 1, bk] int32
  seg: jax.Array  # [B, nk + 1, bk] int32: -1 outside S (and for padding keys)
  drop_index: jax.Array | None  # [B, nk + 1, bk] int32: the keys' dropout indices, or None


def keys(x: KernelInputs, lay: Layout) -> Keys:
  size = (lay.kv_blocks + 1) * lay.block_kv
  as_blocks = lambda a, fill: base.pad_axis(a, 1, size, fill).reshape(
      lay.batch, lay.kv_blocks + 1, lay.block_kv, *a.shape[2:])
  heads = lambda a: jnp.moveaxis(as_blocks(a, 0), 3, 1)  # [B, Hkv, nk + 1, bk, X]
  seg = base.segment_ids(x)[1]
  index = None if x.dropout is None else as_blocks(x.dropout.kv_index, 0)
  return Keys(heads(x.key), heads(x.value), as_blocks(x.kv_positions, 0), as_blocks(seg, -1),
              index)


def item(x: KernelInputs, facts: Facts, rest: Mask | None, lay: Layout, kb: Keys, t: Tables,
         q_pad, scale, i) -> Item:
  """Work item i: its queries, their lists' keys gathered, and the tile's element mask."""
  n = lay.per_item * lay.block_q
  q_rows = jax.lax.dynamic_slice_in_dim(q_pad, i * n, n, 1)  # [B, R * bq, Hq, D]
  rows = jax.lax.dynamic_slice_in_dim(t.rows, i * lay.per_item, lay.per_item, 1)  # [B, R]
  at = jnp.take_along_axis(t.lists, rows[:, None, :, None], axis=2)  # [B, L, R, K]
  b = jnp.arange(lay.batch)[:, None, None, None]
  kv_head = (jnp.arange(lay.list_heads) * lay.num_kv_heads // lay.list_heads)[None, :, None, None]
  flat = lambda a: a.reshape(*a.shape[:3], -1, *a.shape[5:])  # [B, L, R, K * bk, ...]
  k, v = flat(kb.k[b, kv_head, at]), flat(kb.v[b, kv_head, at])  # [B, L, R, K * bk, D]
  kv_pos, kv_seg = flat(kb.pos[b, at]), flat(kb.seg[b, at])  # [B, L, R, K * bk]
  q_pos, q_seg = (_query_side(a, i, lay) for a in (x.q_positions, base.segment_ids(x)[0]))
  q_real = _query_side(jnp.arange(lay.padded_q)[None] < lay.query_len, i, lay)
  mask = (q_real[..., None] & (kv_seg >= 0)[..., None, :]  # slots past a count: the empty block
          & (q_seg[..., None] == kv_seg[..., None, :]) & (q_seg >= 0)[..., None])
  if rest is not None:
    mask = mask & rest.visible(q_pos[..., None], kv_pos[..., None, :])
  drop = None
  if x.dropout is not None and kb.drop_index is not None:
    drop = extras.drop(x.dropout, facts.config.dropout_rate,
                       _query_side(x.dropout.q_index, i, lay), flat(kb.drop_index[b, at]), lay)
  rows_pos = jax.lax.dynamic_slice_in_dim(base.pad_axis(x.q_positions, 1, lay.padded_q), i * n, n,
                                          1).reshape(-1, lay.per_item, lay.block_q)
  return Item(_heads_rows(q_rows, lay) * scale, k, v, mask, at, rows_pos, kv_pos, drop)


def _with_bias(it: Item, score: Score | None, heads: jax.Array | None, lay: Layout) -> Item:
  """The item with its bias (from the call's score object), if the call has one."""
  if score is None or heads is None:
    return it
  return it._replace(bias=extras.bias(score, heads, it.q_pos, it.kv_pos, it.mask, lay))


def _query_side(a: jax.Array, i, lay: Layout) -> jax.Array:
  """Item i's rows of a [B|1, T] per-query array as [B|1, 1, R, Gl * bq] (every head alike)."""
  n = lay.per_item * lay.block_q
  a = jax.lax.dynamic_slice_in_dim(base.pad_axis(a, 1, lay.padded_q, a.dtype.type(0)), i * n, n, 1)
  a = a.reshape(a.shape[0], 1, lay.per_item, 1, lay.block_q)
  return jnp.broadcast_to(a, (*a.shape[:3], lay.group, lay.block_q)).reshape(
      a.shape[0], 1, lay.per_item, lay.group * lay.block_q)


def _logits(it: Item, cap: float | None) -> tuple[jax.Array, jax.Array | None]:
  """Masked f32 logits [B, L, R, Gl * bq, K * bk] of an item, and tanh(s / cap) (or None)."""
  s = jnp.einsum("blrqd,blrsd->blrqs", it.q, it.k, preferred_element_type=jnp.float32)
  if it.bias is not None:
    s = s + it.bias
  t = None
  if cap is not None:  # a -inf bias keeps its pair at -inf (`base.soft_cap`)
    t = jnp.tanh(s / cap)
    s = cap * t if it.bias is None else jnp.where(it.bias == -jnp.inf, -jnp.inf, cap * t)
  return jnp.where(it.mask, s, -jnp.inf), t


def _sink_rows(x: KernelInputs, lay: Layout) -> jax.Array | None:
  """Each head's sinks as one logit, laid out as an item's rows: [1, L, 1, Gl * bq]."""
  if x.sinks is None:
    return None
  sink = base.sink_logsumexp(x.sinks).reshape(1, lay.list_heads, 1, lay.group, 1)
  return jnp.broadcast_to(sink, (*sink.shape[:4], lay.block_q)).reshape(
      1, lay.list_heads, 1, lay.group * lay.block_q)


def _item_forward(it: Item, sink, cap) -> tuple[jax.Array, jax.Array]:
  """(out [B, L, R, Gl * bq, Dv] f32, lse [B, L, R, Gl * bq]) of one item, one softmax."""
  s, _ = _logits(it, cap)
  m = jnp.max(s, axis=-1)
  m_all = m if sink is None else jnp.maximum(m, sink)
  safe = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
  p = jnp.exp(s - safe[..., None])
  l = jnp.sum(p, axis=-1)
  l_all = l if sink is None else l + jnp.exp(sink - safe)
  kept = p if it.drop is None else p * it.drop  # dropout: on the normalised probabilities
  pv = jnp.einsum("blrqs,blrsd->blrqd", kept.astype(it.v.dtype), base.finite(it.v),
                  preferred_element_type=jnp.float32)
  pv = _visible_garbage(pv, it)
  # `!= 0`, not `> 0`: a visible NaN logit leaves NaN sums, which must show (not read as empty).
  has_key, has_mass = l != 0, l_all != 0
  out = jnp.where(has_key[..., None], pv / jnp.where(has_mass, l_all, 1.0)[..., None], 0.0)
  lse = jnp.where(has_mass, safe + jnp.log(jnp.where(has_mass, l_all, 1.0)), -jnp.inf)
  return out, lse


def _visible_garbage(pv: jax.Array, it: Item) -> jax.Array:
  """p @ v with NaN in the rows that see a non-finite value (zeroed in v so that rows which do
  not see it stay clean); one reduction decides whether to look."""
  def poison(pv):
    bad = (~jnp.isfinite(it.v)).astype(jnp.float32)  # [B, L, R, K * bk, Dv]
    seen = jnp.einsum("blrqs,blrsd->blrqd", it.mask.astype(jnp.float32), bad)
    return jnp.where(seen > 0, jnp.nan, pv)
  return jax.lax.cond(~jnp.isfinite(jnp.sum(it.v)), poison, lambda pv: pv, pv)


def _setup(x: KernelInputs) -> tuple[Mask | None, Layout, Tables, Keys]:
  """What the forward and the backward both read: the rule beside the choice, the layout, the
  lists and K/V in blocks (rebuilt in the backward: saved, they would be a second K/V)."""
  choice, rest = choice_of(x)
  lay = layout(x, choice)
  return rest, lay, tables(choice, lay), keys(x, lay)


def forward(x: KernelInputs, facts: Facts) -> tuple[jax.Array, jax.Array]:
  """out [B, T, Hq, Dv] (query dtype) and lse [B, T, Hq] f32 over the chosen blocks."""
  rest, lay, t, kb = _setup(x)
  q_pad = base.pad_axis(x.query, 1, lay.padded_q)  # [B, Tp, Hq, D]
  scale, cap, sink = jnp.asarray(facts.scale, x.query.dtype), facts.config.logits_soft_cap, \
      _sink_rows(x, lay)
  n = lay.per_item * lay.block_q

  def step(i, carry):
    out, lse = carry
    it = _with_bias(item(x, facts, rest, lay, kb, t, q_pad, scale, i), x.bias, x.heads, lay)
    o, l = _item_forward(it, sink, cap)
    at = (0, i * n, 0, 0)
    out = jax.lax.dynamic_update_slice(out, _rows_heads(o, lay).astype(out.dtype), at)
    return out, jax.lax.dynamic_update_slice(lse, _rows_heads(l[..., None], lay)[..., 0], at[:3])

  init = (jnp.zeros((lay.batch, lay.padded_q, lay.num_heads, x.value.shape[-1]), x.query.dtype),
          jnp.zeros((lay.batch, lay.padded_q, lay.num_heads), jnp.float32))
  out, lse = jax.lax.fori_loop(0, lay.items, step, init)
  return out[:, :lay.query_len], lse[:, :lay.query_len]


def backward(x: KernelInputs, facts: Facts, lse, d_out, delta) -> base.Grads:
  """dq, dk, dv (inputs' dtypes) and d_sinks, each tile recomputed from the saved lse."""
  rest, lay, t, kb = _setup(x)
  pad = lambda a, fill=0.0: base.pad_axis(a, 1, lay.padded_q, fill)
  q_pad, do_pad = pad(x.query), pad(d_out.astype(jnp.float32))
  rows = (pad(base.probability_lse(lse), jnp.inf), pad(delta))  # [B, Tp, Hq] each
  scale, cap, n = jnp.asarray(facts.scale, x.query.dtype), facts.config.logits_soft_cap, \
      lay.per_item * lay.block_q
  b = jnp.arange(lay.batch)[:, None, None, None]
  kv_head = (jnp.arange(lay.list_heads) * lay.num_kv_heads // lay.list_heads)[None, :, None, None]

  def step(i, carry):
    dq, dk, dv, d_bias = carry
    it = item(x, facts, rest, lay, kb, t, q_pad, scale, i)
    pull = None
    if x.bias is not None:  # the bias as a function of its leaves, to pull ds back through it
      b_tile, pull = jax.vjp(lambda score: extras.bias(score, x.heads, it.q_pos, it.kv_pos,
                                                       it.mask, lay), x.bias)
      it = it._replace(bias=b_tile)
    cut = lambda a: _heads_rows(jax.lax.dynamic_slice_in_dim(a, i * n, n, 1), lay)
    do = cut(do_pad)  # [B, L, R, Gl * bq, Dv]
    lse_i, delta_i = (cut(a[..., None])[..., 0] for a in rows)  # [B, L, R, Gl * bq]
    dq_i, dk_i, dv_i, ds = _item_grads(it, do, lse_i, delta_i, cap)
    dq = jax.lax.dynamic_update_slice(dq, _rows_heads(dq_i * facts.scale, lay), (0, i * n, 0, 0))
    blocks = lambda g: g.reshape(*g.shape[:3], lay.most, lay.block_kv, g.shape[-1])
    dk = dk.at[b, kv_head, it.at].add(blocks(dk_i))  # slots past a count land on block nk
    dv = dv.at[b, kv_head, it.at].add(blocks(dv_i))
    if pull is not None:
      d_bias = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), d_bias, pull(ds)[0])
    return dq, dk, dv, d_bias

  zeros = lambda a: jnp.zeros(a.shape, jnp.float32)
  d_bias = None if x.bias is None else jax.tree.map(zeros, x.bias)
  dq, dk, dv, d_bias = jax.lax.fori_loop(0, lay.items, step,
                                         (zeros(q_pad), zeros(kb.k), zeros(kb.v), d_bias))
  unblock = lambda g, like: jnp.moveaxis(g, 1, 3).reshape(lay.batch, -1, *like.shape[2:])[
      :, :lay.kv_len].astype(like.dtype)
  d_bias = None if d_bias is None else jax.tree.map(lambda g, a: g.astype(a.dtype), d_bias, x.bias)
  return base.Grads(dq[:, :lay.query_len].astype(x.query.dtype), unblock(dk, x.key),
                    unblock(dv, x.value), base.sink_grads(x.sinks, lse, delta), d_bias)


def _item_grads(it: Item, do, lse, delta, cap) -> tuple[jax.Array, ...]:
  """(dq unscaled [B, L, R, Gl * bq, D], dk, dv [B, L, R, K * bk, ...], ds: the logits'
  cotangent before the soft cap, the bias's) of one item, f32."""
  s, t = _logits(it, cap)
  # [B, L, R, Gl * bq, K * bk]; masked pairs 0 even in a row whose lse is NaN (it sees a NaN)
  p = jnp.where(it.mask, jnp.exp(s - lse[..., None]), 0.0)
  kept = p if it.drop is None else p * it.drop  # what the forward multiplied v by
  dv = jnp.einsum("blrqs,blrqd->blrsd", kept, do)
  dp = jnp.einsum("blrqd,blrsd->blrqs", do, base.finite(it.v).astype(jnp.float32))
  ds = p * ((dp if it.drop is None else dp * it.drop) - delta[..., None])
  if t is not None:
    ds = ds * (1.0 - t * t)
  ds = jnp.where(it.mask, ds, 0.0)
  dq = jnp.einsum("blrqs,blrsd->blrqd", ds, base.finite(it.k).astype(jnp.float32))
  dk = jnp.einsum("blrqs,blrqd->blrsd", ds, base.finite(it.q).astype(jnp.float32))
  return dq, dk, dv, ds


def attend(x: KernelInputs, facts: Facts) -> KernelOutput:
  """Attention over the chosen blocks: out [B, T, Hq, Dv] and a differentiable lse [B, T, Hq]."""

  @jax.custom_vjp
  def run(y):
    return forward(y, facts)

  def run_fwd(y):
    out, lse = forward(y, facts)
    return (out, lse), (y, out, lse)

  def run_bwd(residuals, cotangents):
    y, out, lse = residuals
    d_out, d_lse = cotangents
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    grads = backward(y, facts, lse, d_out, delta)
    none = jax.tree.map(lambda _: None, y)  # integer and boolean inputs get no cotangent
    return (none._replace(query=grads.dq, key=grads.dk, value=grads.dv, sinks=grads.d_sinks,
                          bias=grads.d_bias),)

  run.defvjp(run_fwd, run_bwd)
  return KernelOutput(*run(x))
