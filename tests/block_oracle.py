"""A float64 NumPy oracle of attention over blocks chosen per query tile (`sh.masks.Blocks` &
causal), computed over each tile's chosen keys only: a dense [T, S] oracle does not fit at
T = 16384. Values and the gradients of sum(out * cot) for q, k and v, by the softmax's own
formulas (independent of the library: no JAX)."""

from __future__ import annotations

import numpy as np


def _keys(chosen: np.ndarray, bk: int, length: int) -> np.ndarray:
  """The key positions of the chosen key blocks, ascending."""
  return np.concatenate([np.arange(c * bk, min((c + 1) * bk, length)) for c in sorted(chosen)]
                        or [np.zeros((0,), np.int64)])


def _tile(q, k, v, do, visible, sink):
  """One query tile of one head over its chosen keys (q pre-scaled): out [bq, Dv], d(q scaled)
  [bq, D], dk [n, D], dv [n, Dv] (float64; `sink` a logit joining the denominator, or None)."""
  s = np.where(visible, q @ k.T, -np.inf)  # [bq, n], q pre-scaled
  top = s.max(axis=1, initial=-np.inf)
  top = top if sink is None else np.maximum(top, sink)
  top = np.where(np.isfinite(top), top, 0.0)[:, None]
  p = np.exp(s - top)
  norm = p.sum(axis=1, keepdims=True) + (0.0 if sink is None else np.exp(sink - top))
  p = np.where(norm > 0, p / np.where(norm > 0, norm, 1.0), 0.0)  # a row seeing nothing: 0
  out = p @ v
  ds = p * (do @ v.T - np.sum(do * out, axis=1, keepdims=True))
  return out, ds @ k, ds.T @ q, p.T @ do


def chosen_attention(q, k, v, cot, lists, counts, block, sinks=None, segments=None):
  """q [B, T, Hq, D], k / v [B, T, Hkv, D|Dv] (causal self-attention), lists [B, L, nq, K] and
  counts [B, L, nq] (L list heads, each serving Hq // L query heads), block (bq, bk), sinks
  [Hq] (one logit a head) or None, segments [B, T] ids (a key is seen only in its query's
  segment; negative: padding, seen by nothing) or None -> out [B, T, Hq, Dv] and (dq, dk, dv),
  float64, with the scale 1 / sqrt(D)."""
  q, k, v, cot = (np.asarray(a, np.float64) for a in (q, k, v, cot))
  batch, length, heads, dim = q.shape
  group, list_group = heads // k.shape[2], heads // lists.shape[1]
  bq, bk = block
  scale = dim ** -0.5
  out = np.zeros((*q.shape[:3], v.shape[-1]))
  dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
  seg = np.zeros((batch, length), np.int64) if segments is None else np.asarray(segments)
  for b in range(batch):
    for h in range(heads):
      hk, hl = h // group, h // list_group
      for r in range(lists.shape[2]):
        rows = np.arange(r * bq, min((r + 1) * bq, length))
        keys = _keys(lists[b, hl, r, :counts[b, hl, r]], bk, length)
        visible = ((keys[None] <= rows[:, None]) & (seg[b, rows][:, None] == seg[b, keys][None])
                   & (seg[b, rows][:, None] >= 0))
        got = _tile(q[b, rows, h] * scale, k[b, keys, hk], v[b, keys, hk], cot[b, rows, h],
                    visible, None if sinks is None else float(sinks[h]))
        out[b, rows, h] = got[0]
        dq[b, rows, h] = got[1] * scale
        dk[b, keys, hk] += got[2]
        dv[b, keys, hk] += got[3]
  return out, (dq, dk, dv)
