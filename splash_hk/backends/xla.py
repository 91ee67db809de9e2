"""Block-sparse attention in pure JAX: the portable ("xla") backend, on any hardware.

The static part of the mask (causal, window, chunk over the default
end-aligned positions) decides at trace time which (query block, key block)
pairs can see anything; only those pairs are computed, one per iteration of a
`fori_loop`, with an online (flash) softmax carried across a query block's key
blocks. A `jax.custom_vjp` backward recomputes the probabilities from the
saved log-sum-exp instead of storing them, so memory stays linear in T.
Dynamic parts (explicit positions, segments, padding, a dense mask) are applied
inside the blocks; statically full blocks skip masking. GQA groups query heads
over their kv head; keys and values are never repeated.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk import masks
from splash_hk.backends import base
from splash_hk.config import AttentionConfig
from splash_hk.types import Facts, KernelInputs, KernelOutput


@dataclasses.dataclass(frozen=True, eq=False)  # identity: it holds arrays
class Plan:
  """The static block structure of a call: which block pairs to compute, in order."""

  block_q: int
  block_kv: int
  padded_q: int
  padded_kv: int
  default_positions: bool  # block skipping from indices (else every pair is computed and masked)
  q_block: np.ndarray  # [P] query block of each pair, grouped by query block
  kv_block: np.ndarray  # [P] key block of each pair
  masked: np.ndarray  # [P] whether the pair needs an element mask
  first: np.ndarray  # [P] first pair of its query block
  last: np.ndarray  # [P] last pair of its query block


@functools.lru_cache(maxsize=256)
def make_plan(query_len: int, kv_len: int, *, causal: bool, window: tuple[int, int] | None,
              chunk_size: int | None, default_positions: bool, block_q: int, block_kv: int) -> Plan:
  """Which (query block, key block) pairs can see a key (cached per static shape and config)."""
  block_q, block_kv = min(block_q, query_len), min(block_kv, kv_len)
  padded_q, padded_kv = base.round_up(query_len, block_q), base.round_up(kv_len, block_kv)
  if default_positions:
    lo, hi = masks.visible_interval(np.arange(query_len) + (kv_len - query_len), kv_len,
                                    causal=causal, window=window, chunk_size=chunk_size)
  else:
    lo, hi = np.zeros(query_len, np.int64), np.full(query_len, kv_len - 1, np.int64)
  pairs = []
  for i in range(padded_q // block_q):
    rows = slice(i * block_q, min((i + 1) * block_q, query_len))
    row_lo, row_hi = lo[rows], hi[rows]
    for j in range(padded_kv // block_kv):
      col_lo, col_hi = j * block_kv, (j + 1) * block_kv - 1
      sees = np.maximum(row_lo, col_lo) <= np.minimum(row_hi, col_hi)
      if not sees.any():
        continue
      full = (rows.stop - rows.start == block_q and col_hi < kv_len and default_positions
              and bool(np.all((row_lo <= col_lo) & (row_hi >= col_hi))))
      pairs.append((i, j, not full))
  q_block = np.array([p[0] for p in pairs], np.int32)
  first = np.ones(len(pairs), bool)
  first[1:] = q_block[1:] != q_block[:-1]
  last = np.ones(len(pairs), bool)
  last[:-1] = q_block[1:] != q_block[:-1]
  return Plan(block_q, block_kv, padded_q, padded_kv, default_positions, q_block,
              np.array([p[1] for p in pairs], np.int32), np.array([p[2] for p in pairs], bool),
              first, last)


class _Blocks:
  """Block views of one call's inputs (padded, kernel layout, GQA-grouped)."""

  def __init__(self, x: KernelInputs, config: AttentionConfig, plan: Plan):
    """`x` in BHTD layout (query [B, Hq, T, D], key [B, Hkv, S, D], value [B, Hkv, S, Dv])."""
    batch, num_heads, query_len, head_dim = x.query.shape
    self.num_kv_heads, self.kv_len = x.key.shape[1], x.key.shape[2]
    self.groups = num_heads // self.num_kv_heads
    self.query_len, self.plan, self.config, self.x = query_len, plan, config, x
    self.scale = config.scale(head_dim)
    pad = lambda a, axis, n: base.pad_axis(a, axis, n)
    q = (x.query * jnp.asarray(self.scale, x.query.dtype)).reshape(
        batch, self.num_kv_heads, self.groups, query_len, head_dim)
    self.q = pad(q, 3, plan.padded_q)  # [B, Hkv, G, Tp, D]
    self.k = pad(x.key, 2, plan.padded_kv)  # [B, Hkv, Sp, D]
    self.v = pad(x.value, 2, plan.padded_kv)  # [B, Hkv, Sp, Dv]
    self.sinks = None if x.sinks is None else x.sinks.reshape(self.num_kv_heads, self.groups, 1, -1)
    rows = lambda a, n: None if a is None else pad(a, 1, n)
    self.q_pos, self.kv_pos = rows(x.q_positions, plan.padded_q), rows(x.kv_positions, plan.padded_kv)
    self.q_seg = rows(x.q_segment_ids, plan.padded_q)
    self.kv_seg = rows(x.kv_segment_ids, plan.padded_kv)
    self.mask = None
    if x.mask is not None:
      m = pad(pad(x.mask, 2, plan.padded_q), 3, plan.padded_kv)  # [B|1, 1|Hq, Tp, Sp]
      self.mask = m.reshape(m.shape[0], self.num_kv_heads if m.shape[1] > 1 else 1, -1,
                            *m.shape[2:])  # [B|1, 1|Hkv, 1|G, Tp, Sp]

  def q_block(self, a, i, axis=3):
    return jax.lax.dynamic_slice_in_dim(a, i * self.plan.block_q, self.plan.block_q, axis)

  def kv_block(self, a, j, axis=2):
    return jax.lax.dynamic_slice_in_dim(a, j * self.plan.block_kv, self.plan.block_kv, axis)

  def logits(self, q, k):
    """f32 logits [B, Hkv, G, bq, bk] and tanh(s / cap) (None without soft cap)."""
    s = jnp.einsum("bkgqd,bksd->bkgqs", q, k, preferred_element_type=jnp.float32)
    cap = self.config.logits_soft_cap
    if cap is None:
      return s, None
    t = jnp.tanh(s / cap)
    return cap * t, t

  def element_mask(self, i, j):
    """Visibility inside block pair (i, j): broadcastable to [B, Hkv, G, bq, bk]."""
    config, plan = self.config, self.plan
    rules = dict(causal=config.causal, window=config.window, chunk_size=config.chunk_size)
    q_idx = i * plan.block_q + jnp.arange(plan.block_q, dtype=jnp.int32)  # [bq]
    k_idx = j * plan.block_kv + jnp.arange(plan.block_kv, dtype=jnp.int32)  # [bk]
    mask = (q_idx[:, None] < self.query_len) & (k_idx[None, :] < self.kv_len)  # padding
    mask = mask[None, None, None]  # [1, 1, 1, bq, bk]
    if plan.default_positions:
      pos = masks.position_rules(q_idx[:, None] + (self.kv_len - self.query_len), k_idx[None, :],
                                 **rules)
      if pos is not None:
        mask = mask & pos[None, None, None]
    else:
      pos = masks.position_mask(self.q_block(self.q_pos, i, 1), self.kv_block(self.kv_pos, j, 1),
                                **rules)
      if pos is not None:
        mask = mask & pos[:, None, None]  # [B, 1, 1, bq, bk]
    if self.q_seg is not None:
      seg = masks.segment_mask(self.q_block(self.q_seg, i, 1), self.kv_block(self.kv_seg, j, 1))
      mask = mask & seg[:, None, None]
    if self.mask is not None:
      mask = mask & self.kv_block(self.q_block(self.mask, i, 3), j, 4)
    return mask

  def masked_logits(self, q, k, i, j, needs_mask):
    """Logits with invisible entries at -inf; statically full blocks of a call without
    dynamic masks (segments, dense mask) skip the element mask."""
    s, t = self.logits(q, k)
    apply = lambda s: jnp.where(self.element_mask(i, j), s, -jnp.inf)
    if self.q_seg is not None or self.mask is not None or not self.plan.default_positions:
      return apply(s), t
    return jax.lax.cond(needs_mask, apply, lambda s: s, s), t


def _forward(x: KernelInputs, config: AttentionConfig, plan: Plan):
  """-> out [B, Hkv, G, T, Dv] (query dtype), lse [B, Hkv, G, T] f32 (+inf where no key)."""
  blocks = _Blocks(x, config, plan)
  batch, num_kv_heads, groups, padded_q, _ = blocks.q.shape
  value_dim = blocks.v.shape[-1]
  row_shape = (batch, num_kv_heads, groups, plan.block_q)
  tables = [jnp.asarray(a) for a in (plan.q_block, plan.kv_block, plan.masked, plan.first, plan.last)]

  def body(p, carry):
    out, lse, m, l, acc = carry
    i, j, needs_mask, first, last = (t[p] for t in tables)
    m = jnp.where(first, -jnp.inf, m)
    l = jnp.where(first, 0.0, l)
    acc = jnp.where(first, 0.0, acc)
    s, _ = blocks.masked_logits(blocks.q_block(blocks.q, i), blocks.kv_block(blocks.k, j), i, j,
                                needs_mask)  # [B, Hkv, G, bq, bk]
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    probs = jnp.exp(s - m_safe[..., None])
    correction = jnp.exp(m - m_safe)
    l = l * correction + jnp.sum(probs, axis=-1)
    acc = acc * correction[..., None] + jnp.einsum(
        "bkgqs,bksd->bkgqd", probs.astype(blocks.v.dtype), blocks.kv_block(blocks.v, j),
        preferred_element_type=jnp.float32)
    m = m_new
    # The block's normalised result so far (final on the block's last pair), sinks included.
    m_all, l_all = m, l
    if blocks.sinks is not None:
      m_all = jnp.maximum(m, jnp.max(blocks.sinks, axis=-1))
      l_all = l * jnp.exp(m - m_all) + jnp.sum(jnp.exp(blocks.sinks - m_all[..., None]), axis=-1)
    has_key = l > 0
    o = jnp.where(has_key[..., None],
                  acc * (jnp.exp(m - m_all) / jnp.where(has_key, l_all, 1.0))[..., None], 0.0)
    lse_i = jnp.where(l_all > 0, m_all + jnp.log(jnp.where(l_all > 0, l_all, 1.0)), jnp.inf)
    start = i * plan.block_q
    out = jax.lax.cond(last, lambda out: jax.lax.dynamic_update_slice_in_dim(
        out, o.astype(out.dtype), start, 3), lambda out: out, out)
    lse = jax.lax.cond(last, lambda lse: jax.lax.dynamic_update_slice_in_dim(lse, lse_i, start, 3),
                       lambda lse: lse, lse)
    return out, lse, m, l, acc

  out = jnp.zeros((batch, num_kv_heads, groups, padded_q, value_dim), x.query.dtype)
  lse = jnp.full((batch, num_kv_heads, groups, padded_q), jnp.inf, jnp.float32)
  if blocks.sinks is not None:  # rows of query blocks with no pair: only the sinks
    lse = lse.at[:].set(jax.nn.logsumexp(blocks.sinks[..., 0, :], axis=-1)[None, :, :, None])
  init = (out, lse, jnp.full(row_shape, -jnp.inf, jnp.float32), jnp.zeros(row_shape, jnp.float32),
          jnp.zeros((*row_shape, value_dim), jnp.float32))
  out, lse, *_ = jax.lax.fori_loop(0, len(plan.q_block), body, init)
  return out[:, :, :, :blocks.query_len], lse[:, :, :, :blocks.query_len]


def _backward(x: KernelInputs, config: AttentionConfig, plan: Plan, out, lse, d_out, d_lse):
  """Gradients of q, k, v, sinks from saved out/lse (probabilities recomputed per block pair).

  `d_lse` is the cotangent of the log-sum-exp output: d lse_i / d s_ij = p_ij,
  so it enters exactly where `delta` does, with the opposite sign.
  """
  blocks = _Blocks(x, config, plan)
  pad_rows = lambda a, fill=0.0: jnp.pad(a, [(0, 0)] * 3 + [(0, plan.padded_q - a.shape[3])]
                                         + [(0, 0)] * (a.ndim - 4), constant_values=fill)
  d_out = d_out.astype(jnp.float32)  # [B, Hkv, G, T, Dv]
  delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1) - d_lse  # [B, Hkv, G, T]
  d_out_p, delta_p, lse_p = pad_rows(d_out), pad_rows(delta), pad_rows(lse, jnp.inf)
  tables = [jnp.asarray(a) for a in (plan.q_block, plan.kv_block, plan.masked)]

  def body(p, grads):
    dq, dk, dv = grads
    i, j, needs_mask = (t[p] for t in tables)
    q, k, v = blocks.q_block(blocks.q, i), blocks.kv_block(blocks.k, j), blocks.kv_block(blocks.v, j)
    do = blocks.q_block(d_out_p, i)  # [B, Hkv, G, bq, Dv]
    s, t = blocks.masked_logits(q, k, i, j, needs_mask)
    probs = jnp.exp(s - blocks.q_block(lse_p, i)[..., None])  # [B, Hkv, G, bq, bk]
    dv_j = jnp.einsum("bkgqs,bkgqd->bksd", probs, do)
    dp = jnp.einsum("bkgqd,bksd->bkgqs", do, v, preferred_element_type=jnp.float32)
    ds = probs * (dp - blocks.q_block(delta_p, i)[..., None])
    if t is not None:
      ds = ds * (1.0 - t * t)
    dq_i = jnp.einsum("bkgqs,bksd->bkgqd", ds, k, preferred_element_type=jnp.float32)
    dk_j = jnp.einsum("bkgqs,bkgqd->bksd", ds, q, preferred_element_type=jnp.float32)
    add = lambda buf, block, start, axis: jax.lax.dynamic_update_slice_in_dim(
        buf, jax.lax.dynamic_slice_in_dim(buf, start, block.shape[axis], axis) + block, start, axis)
    return (add(dq, dq_i, i * plan.block_q, 3), add(dk, dk_j, j * plan.block_kv, 2),
            add(dv, dv_j, j * plan.block_kv, 2))

  init = (jnp.zeros(blocks.q.shape, jnp.float32), jnp.zeros(blocks.k.shape, jnp.float32),
          jnp.zeros(blocks.v.shape, jnp.float32))
  dq, dk, dv = jax.lax.fori_loop(0, len(plan.q_block), body, init)
  dq = (dq[:, :, :, :blocks.query_len] * blocks.scale).reshape(x.query.shape)
  d_sinks = None
  if x.sinks is not None:
    weight = jnp.exp(blocks.sinks[None] - lse[..., None])  # [B, Hkv, G, T, n]
    d_sinks = -jnp.sum(weight * delta[..., None], axis=(0, 3)).reshape(x.sinks.shape)
  return (dq.astype(x.query.dtype), dk[:, :, :blocks.kv_len].astype(x.key.dtype),
          dv[:, :, :blocks.kv_len].astype(x.value.dtype), d_sinks)


def default_tiles(config: AttentionConfig) -> tuple[int, int, int, int]:
  """Tiles measured fastest on CPU: (block_q, block_kv, block_q_bwd, block_kv_bwd).

  Large forward tiles suit causal/full masks; a sliding window wants tiles of
  about half its span, so few keys outside it are computed (measured at
  T=8192, window 512: 256-tiles 0.108 s, 128-tiles 0.155 s, 512-tiles 0.129 s).
  """
  fwd_q, fwd_kv, bwd_q, bwd_kv = 512, 512, 512, 128
  if config.window is not None:
    span = config.window[0] + config.window[1] + 1
    fwd_q = fwd_kv = bwd_q = max(128, min(512, 1 << max(0, (span // 2).bit_length() - 1)))
  return fwd_q, fwd_kv, bwd_q, bwd_kv


def why_not(facts: Facts, hardware: str) -> str | None:
  """The xla path serves every call except one that asks for the weights."""
  del hardware
  return base.WEIGHTS_REFUSAL if facts.return_weights else None


def attend(x: KernelInputs, facts: Facts) -> KernelOutput:
  """Block-sparse attention on one shard: KernelInputs -> out [B, T, Hq, Dv], lse [B, T, Hq].

  Tiles: `config.block_sizes` where set, else `default_tiles(config)`. The
  log-sum-exp (-inf for a row with nothing to attend to) is differentiable.
  """
  config = facts.config
  batch, query_len, num_heads, _ = x.query.shape
  tiles = config.block_sizes.resolve(*default_tiles(config))
  plan_for = functools.partial(
      make_plan, query_len, x.key.shape[1], **facts.rules,
      default_positions=facts.default_positions and facts.sequence_shards == 1)
  plan, backward_plan = plan_for(block_q=tiles[0], block_kv=tiles[1]), plan_for(
      block_q=tiles[2], block_kv=tiles[3])

  # Everything goes in as arguments (no closure over tracers, so remat/jit nest safely);
  # integer and boolean inputs get no cotangent (None).
  @jax.custom_vjp
  def run(y):
    return _public_lse(*_forward(y, config, plan))

  def run_fwd(y):
    out, lse = _forward(y, config, plan)
    return _public_lse(out, lse), (y, out, lse)

  def run_bwd(residuals, cotangents):
    y, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv, d_sinks = _backward(y, config, backward_plan, out, lse, d_out, d_lse)
    zeros = jax.tree.map(lambda _: None, y)
    return (zeros._replace(query=dq, key=dk, value=dv, sinks=d_sinks),)

  run.defvjp(run_fwd, run_bwd)
  out, lse = run(x._replace(query=base.to_bhtd(x.query), key=base.to_bhtd(x.key),
                            value=base.to_bhtd(x.value)))  # [B, Hkv, G, T, Dv], [B, Hkv, G, T]
  out = out.reshape(batch, num_heads, query_len, -1)  # [B, Hq, T, Dv]
  lse = lse.reshape(batch, num_heads, query_len)  # [B, Hq, T]
  return KernelOutput(base.to_bhtd(out), jnp.swapaxes(lse, 1, 2))


def _public_lse(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The forward's lse marks a row with nothing to attend to +inf (so its probabilities
  recompute to 0); its true log-sum-exp is -inf."""
  return out, jnp.where(lse == jnp.inf, -jnp.inf, lse)


BACKEND = base.Backend(name="xla", why_not=why_not, attend=attend)
