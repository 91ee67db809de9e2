"""The implementations the bench compares splash_hk against (not part of the library).

- `jax_nn`: `jax.nn.dot_product_attention(implementation="xla")`, dense.
- `float64_rows`: NumPy float64 attention of a few query rows, the bench's
  measure of every implementation's error.
- `ejkernel_xla`: ejkernel's XLA block-sparse attention, adapted to our
  semantics. Its dense core aligns causal masks top-left whatever the
  positions and ignores `chunk_size`, so it gets the whole mask, built by
  `splash_hk.backends.base.full_mask` from end-aligned positions, with `causal=False`;
  sinks go in as one logsumexp sink per query head. It reads only head 0 of a
  dense mask, so per-head masks are refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import splash_hk as sh
from splash_hk import inputs
from splash_hk.backends.gpu import ejkernel as _ejkernel
from splash_hk.backends import base
from splash_hk.types import Extras


def ejkernel_xla(q: jax.Array, k: jax.Array, v: jax.Array, config: sh.AttentionConfig,
                 **extras) -> jax.Array:
  """ejkernel's XLA block-sparse path: q [B, T, Hq, D], k, v -> [B, T, Hq, Dv]."""
  x, facts = inputs.normalise(q, k, v, config=config, extras=Extras(**extras))
  mask = base.full_mask(x)  # [B|1, 1|Hq, T, S]
  if mask.shape[1] > 1:
    raise ValueError("ejkernel's XLA block-sparse path reads only head 0 of a dense mask.")
  mask = jnp.broadcast_to(mask, (q.shape[0], *mask.shape[1:]))  # [B, 1, T, S]
  out = _ejkernel.blocksparse_op().run(
      query=base.to_bhtd(x.query),
      key=base.to_bhtd(x.key),
      value=base.to_bhtd(x.value),
      softmax_aux=None if x.sinks is None else base.sink_logsumexp(x.sinks).astype(q.dtype),
      attention_mask=mask,
      logits_soft_cap=config.logits_soft_cap,
      softmax_scale=facts.scale,
      causal=False,
      fused_backward=bool(config.fused_backward),
      platform="xla",
      cfg=_ejkernel.blocksparse_config(config, "xla"),
  )  # [B, Hq, T, Dv]
  return base.to_bhtd(out).astype(q.dtype)


def jax_nn(q: jax.Array, k: jax.Array, v: jax.Array, nn_kwargs: dict,
           implementation: str | None = "xla") -> jax.Array:
  """jax.nn.dot_product_attention with `nn_kwargs` (`bench_workloads.jax_nn_kwargs`)."""
  kwargs = dict(nn_kwargs)
  if k.shape[2] != q.shape[2]:  # jax.nn's GQA takes repeated kv heads
    k, v = (jnp.repeat(a, q.shape[2] // k.shape[2], axis=2) for a in (k, v))
  return jax.nn.dot_product_attention(q, k, v, implementation=implementation, **kwargs)


def float64_rows(q, k, v, mask: np.ndarray, *, scale: float, soft_cap: float | None,
                 bias: np.ndarray | None = None) -> np.ndarray:
  """Plain float64 NumPy attention of the given query rows (no sinks).

  q [B, R, Hq, D] (the chosen rows), k [B, S, Hkv, D], v [B, S, Hkv, Dv], mask [B, 1, R, S],
  bias [1|B, 1|Hq, R, S] or None -> [B, R, Hq, Dv]; a row that sees no key is 0.
  """
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  groups = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
  logits = np.einsum("brhd,bshd->bhrs", q, k) * scale  # [B, Hq, R, S]
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  if soft_cap is not None:
    logits = soft_cap * np.tanh(logits / soft_cap)
  logits = np.where(mask, logits, -np.inf)
  top = np.max(logits, axis=-1, keepdims=True)
  weights = np.where(mask, np.exp(logits - np.where(np.isfinite(top), top, 0)), 0.0)
  total = weights.sum(-1, keepdims=True)
  weights = weights / np.where(total > 0, total, 1.0)
  return np.einsum("bhrs,bshd->brhd", weights, v)
