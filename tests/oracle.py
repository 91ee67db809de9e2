"""An independent float64 oracle for attention, written from DESIGN.md's semantics.

Shares no code with splash_hk. `xp` is NumPy for values, or jax.numpy under
`jax.enable_x64(True)` for float64 gradients. Row i's output sums only over
the keys row i sees, so garbage (NaN, Inf) elsewhere never reaches it, and a
NaN that row i sees (in q_i, or a visible key or value) makes it NaN.
"""

import math

import numpy as np


def attention(q, k, v, *, causal=True, window=None, chunk=None, soft_cap=None, scale=None,
              q_seg=None, kv_seg=None, q_pos=None, kv_pos=None, mask=None, sinks=None,
              bias=None, xp=np, with_lse=False, dropout=None):
  """q [B,T,Hq,D], k [B,S,Hkv,D], v [B,S,Hkv,Dv] -> (out [B,T,Hq,Dv], weights [B,Hq,T,S]),
  and with `with_lse` the log-sum-exp [B,T,Hq] of each row's visible logits and sinks (-inf
  where it has neither).

  bias: [B|1, Hq|1, T, S] added to the scaled logits before the soft cap, read only where a
  pair is visible; a -inf there removes the pair, soft cap or not.
  dropout: (keep [B|1, Hq|1, T, S] bool, rate): the normalised weights times keep / (1 - rate)
  before they meet the values (the returned weights and lse are before dropout).
  """
  f64 = xp.float64
  q, k, v = (xp.asarray(a, dtype=f64) for a in (q, k, v))
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  k = xp.repeat(k, g, axis=2)
  v = xp.repeat(v, g, axis=2)
  scale = d ** -0.5 if scale is None else scale
  logits = xp.einsum("bthd,bshd->bhts", q, k) * scale
  allowed = visible(b, t, s, hq, causal=causal, window=window, chunk=chunk, q_seg=q_seg,
                    kv_seg=kv_seg, q_pos=q_pos, kv_pos=kv_pos, mask=mask)
  if bias is not None:
    bias = xp.where(allowed, xp.asarray(bias, dtype=f64), 0.0)  # nobody reads an invisible one
    logits = logits + bias
    allowed = allowed & (bias != -np.inf)  # a -inf bias removes its pair
  if soft_cap is not None:
    logits = soft_cap * xp.tanh(logits / soft_cap)

  if sinks is None:
    sink_logits = np.zeros((hq, 0))
  else:
    sinks_arr = xp.asarray(sinks, dtype=f64)
    if sinks_arr.ndim == 1:
      sink_logits = sinks_arr[:, None]
    elif sinks_arr.shape[0] == hq:
      sink_logits = sinks_arr
    else:
      sink_logits = xp.repeat(sinks_arr, g, axis=0)
  sink_logits = xp.asarray(sink_logits, dtype=f64)

  masked = xp.where(allowed, logits, -1e300)
  m = xp.max(masked, axis=-1, keepdims=True)
  if sink_logits.shape[1]:
    m = xp.maximum(m, xp.max(sink_logits, axis=-1)[None, :, None, None])
  e = xp.where(allowed, xp.exp(masked - m), 0.0)
  denom = xp.sum(e, axis=-1, keepdims=True)
  if sink_logits.shape[1]:
    denom = denom + xp.sum(xp.exp(sink_logits[None, :, None, :] - m), axis=-1, keepdims=True)
  any_visible = allowed.any(axis=-1, keepdims=True)
  w = xp.where(any_visible, e / xp.where(any_visible, denom, 1.0), 0.0)
  weights = w
  if dropout is not None:
    keep, rate = dropout
    w = w * xp.asarray(keep, dtype=f64) / (1.0 - rate)
  if xp is np and not np.isfinite(v).all():
    # Only the keys a row sees contribute: a non-finite value must not reach rows with w == 0
    # (as w @ v would spread it there). The slow path, for inputs that hold garbage.
    with np.errstate(invalid="ignore"):  # 0 * inf where a row does not look: discarded below
      terms = w[..., None] * np.transpose(v, (0, 2, 1, 3))[:, :, None]  # [B, H, T, S, Dv]
    out = np.transpose(np.where(allowed[..., None], terms, 0.0).sum(axis=3), (0, 2, 1, 3))
  else:
    out = xp.einsum("bhts,bshd->bthd", w, v)
  if not with_lse:
    return out, weights
  has = any_visible | (sink_logits.shape[1] > 0)
  lse = xp.where(has, m + xp.log(xp.where(has, denom, 1.0)), -np.inf)[..., 0]  # [B, Hq, T]
  return out, weights, xp.swapaxes(lse, 1, 2)


def visible(b, t, s, hq, *, causal=True, window=None, chunk=None, q_seg=None, kv_seg=None,
            q_pos=None, kv_pos=None, mask=None):
  """[B, Hq, T, S] bool: may query i attend to key j."""
  qp = np.arange(t)[None, :] + (s - t) if q_pos is None else np.asarray(q_pos)
  kp = np.arange(s)[None, :] if kv_pos is None else np.asarray(kv_pos)
  qp = np.broadcast_to(qp, (b, t))[:, None, :, None]
  kp = np.broadcast_to(kp, (b, s))[:, None, None, :]
  allowed = np.ones((b, 1, t, s), bool)
  if causal:
    allowed &= kp <= qp
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    allowed &= (qp - left <= kp) & (kp <= qp + right)
  if chunk is not None:
    allowed &= np.floor_divide(qp, chunk) == np.floor_divide(kp, chunk)
  if q_seg is not None or kv_seg is not None:
    qs = np.asarray(q_seg if q_seg is not None else kv_seg)[:, None, :, None]
    ks = np.asarray(kv_seg if kv_seg is not None else q_seg)[:, None, None, :]
    allowed &= (qs == ks) & (qs >= 0) & (ks >= 0)
  if mask is not None:
    allowed = allowed & np.asarray(mask, bool)
  return np.broadcast_to(allowed, (b, hq, t, s))


def out_and_vjp(q, k, v, cot, *, sinks=None, bias=None, bias_params=None, **rules):
  """float64 output and the gradients of sum(out * cot) for q, k, v (and sinks, and the bias,
  when given).

  `bias`: an array, or with `bias_params` a function of them (jnp, float64) giving the dense
  bias; the gradient is then the params' (a pytree like them).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  with jax.enable_x64(True):
    f64 = lambda a: None if a is None else jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), a)
    to_bias = (lambda p: p) if bias_params is None else bias
    params = bias if bias_params is None else bias_params
    out, vjp = jax.vjp(
        lambda q, k, v, s, p: attention(q, k, v, sinks=s, bias=None if p is None else to_bias(p),
                                        xp=jnp, **rules)[0],
        f64(q), f64(k), f64(v), f64(sinks), f64(params))
    grads = vjp(f64(cot))
  as_np = lambda g: jax.tree.map(np.asarray, g)
  return np.asarray(out), tuple(as_np(g) for g in grads if g is not None)


def mha(params, x, *, num_heads, num_kv_heads, key_size, value_size, causal=True,
        mask=None, window=None, sinks=None, bias=None, name="multi_head_attention"):
  """float64 NumPy MHA from a parameter dict: projections + oracle attention + output."""
  p = {k: {n: np.asarray(a, np.float64) for n, a in v.items()} for k, v in params.items()}
  lin = lambda x, m: x @ p[f"{name}/{m}"]["w"] + p[f"{name}/{m}"]["b"]
  b, t, _ = x.shape
  q = lin(x, "query").reshape(b, t, num_heads, key_size)
  k = lin(x, "key").reshape(b, t, num_kv_heads, key_size)
  v = lin(x, "value").reshape(b, t, num_kv_heads, value_size)
  out, _ = attention(q, k, v, causal=causal, mask=mask, window=window, sinks=sinks, bias=bias)
  return lin(out.reshape(b, t, -1), "linear")


def t5_bucket(relative, num_buckets, max_distance, bidirectional, xp):
  """T5's `_relative_position_bucket` (memory - context position), written after T5's code."""
  ret = 0
  n = -relative
  if bidirectional:
    num_buckets //= 2
    ret = ret + (n < 0).astype(np.int32) * num_buckets
    n = xp.abs(n)
  else:
    n = xp.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  safe = xp.maximum(n, 1).astype(np.float32)
  large = max_exact + (xp.log(safe / max_exact) / math.log(max_distance / max_exact)
                       * (num_buckets - max_exact)).astype(np.int32)
  large = xp.minimum(large, num_buckets - 1)
  return ret + xp.where(is_small, n, large)


def chosen_blocks(kv_blocks, counts, block_size, b, hq, t, s):
  """[B, Hq, T, S] bool of DESIGN's `Blocks` rule: key j is visible to query i when j // bk is
  one of kv_blocks[b, h, i // bq, :counts[b, h, i // bq]] (H of 1, Hkv or Hq: head h reads list
  head h * H // Hq)."""
  kv_blocks, counts = np.asarray(kv_blocks), np.asarray(counts)
  bq, bk = block_size
  heads = kv_blocks.shape[1]
  out = np.zeros((b, hq, t, s), bool)
  for row in range(b):
    for h in range(hq):
      lh = h * heads // hq
      lb = row if kv_blocks.shape[0] > 1 else 0
      for i in range(t):
        r = i // bq
        for c in kv_blocks[lb, lh, r, :counts[lb, lh, r]]:
          out[row, h, i, c * bk:(c + 1) * bk] = True
  return out


def moba_choice(q, k, top_k, block_size, causal=True, local=1, kv_valid=None, q_pos=None):
  """DESIGN's `top_k_blocks` in NumPy loops: sets of chosen blocks [B][Hkv][nq].

  kv_valid [B, S] bool (False: a padding key, left out of the means and never a candidate) and
  q_pos [B, T] (default end-aligned); keys sit at their index. A query block's local blocks end
  at the last block holding a valid key at or before its last position."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  b, t, hq, _ = q.shape
  s, hkv = k.shape[1], k.shape[2]
  bq, bk = block_size
  nq, nk = -(-t // bq), -(-s // bk)
  g = hq // hkv
  kv_valid = np.ones((b, s), bool) if kv_valid is None else np.asarray(kv_valid)
  q_pos = np.broadcast_to(np.arange(s - t, s) if q_pos is None else q_pos, (b, t))
  chosen = [[[None] * nq for _ in range(hkv)] for _ in range(b)]
  for row, h, r in np.ndindex(b, hkv, nq):
    qm = q[row, r * bq:(r + 1) * bq, h * g:(h + 1) * g].mean(axis=(0, 1))
    last_pos = q_pos[row, r * bq:(r + 1) * bq].max()
    keys = [np.flatnonzero(kv_valid[row, c * bk:(c + 1) * bk]) + c * bk for c in range(nk)]
    reach = [c for c in range(nk) if len(keys[c]) and keys[c].min() <= last_pos]
    last = max(reach, default=-1)
    own = [c for c in range(last - local + 1, last + 1) if 0 <= c < nk]
    scored = []
    for c in range(nk):
      if c in own or not len(keys[c]) or (causal and c not in reach):
        continue
      scored.append((-(qm @ k[row, keys[c], h].mean(axis=0)), c))
    chosen[row][h][r] = set(own) | {c for _, c in sorted(scored)[:top_k]}
  return chosen
