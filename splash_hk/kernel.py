"""The kernel call: run one backend on per-shard BHTD arrays.

Knows nothing of meshes: `attention` (or its shard_map wrapper) hands each
call the arrays of one shard in `KernelInputs` form.
"""

from __future__ import annotations

import functools
import importlib
import os
import tempfile

import jax
import jax.numpy as jnp

from splash_hk import masks
from splash_hk.config import AttentionConfig
from splash_hk.fallback import reference
from splash_hk.inputs import KernelInputs


@functools.lru_cache(maxsize=None)
def _ejkernel():
  """Imports ejkernel's block-sparse op with its caches kept out of the home directory."""
  cache = os.path.join(tempfile.gettempdir(), "splash_hk-ejkernel")
  os.environ.setdefault("EJKERNEL_PERSISTENT_CACHE_DIR", cache)
  os.environ.setdefault("COMPILE_FUNC_DIR", os.path.join(cache, "compiled"))
  os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
  op = importlib.import_module("ejkernel.modules.operations.blocksparse_attention")
  from ejkernel.modules.operations.configs import BlockSparseAttentionConfig  # pylint: disable=g-import-not-at-top
  from ejkernel.ops import BwdParams, FwdParams  # pylint: disable=g-import-not-at-top
  return op.BlockSparseAttention(), BlockSparseAttentionConfig, FwdParams, BwdParams


def ejkernel_config(config: AttentionConfig, platform: str):
  """An explicit ejkernel config (never autotuned) from our block sizes."""
  _, config_cls, fwd_cls, bwd_cls = _ejkernel()
  fwd_q, fwd_kv = config.block_sizes.block_q, config.block_sizes.block_kv
  bwd_q, bwd_kv = config.block_sizes.backward
  return config_cls(
      fwd_params=fwd_cls(q_blocksize=fwd_q, kv_blocksize=fwd_kv, num_warps=None, num_stages=None),
      bwd_params=bwd_cls(q_blocksize=bwd_q, kv_blocksize=bwd_kv, num_warps=None, num_stages=None),
      platform=platform,
      backend="any" if platform == "xla" else "gpu",
  )


def sink_logsumexp(sinks: jax.Array) -> jax.Array:
  """[Hq, n] -> [Hq]: n sinks of a head act exactly as one sink of their logsumexp."""
  return jax.nn.logsumexp(sinks, axis=-1)


def run_ejkernel_xla(x: KernelInputs, config: AttentionConfig) -> jax.Array:
  """ejkernel's XLA block-sparse attention, adapted to our semantics.

  ejkernel's XLA path aligns causal masks top-left (its dense core applies
  `tril` whatever the positions) and ignores `chunk_size`. So the adapter hands
  it the whole mask, built by `masks.full_mask` from end-aligned positions,
  with `causal=False`; sinks go in as one logsumexp sink per query head. It
  reads only head 0 of a dense mask, so the selector never sends per-head masks.
  """
  op, *_ = _ejkernel()
  mask = masks.full_mask(
      q_positions=x.q_positions, kv_positions=x.kv_positions, causal=config.causal,
      window=config.window, chunk_size=config.chunk_size, q_segment_ids=x.q_segment_ids,
      kv_segment_ids=x.kv_segment_ids, mask=x.mask)  # [B|1, 1, T, S]
  batch = x.query.shape[0]
  mask = jnp.broadcast_to(mask, (batch, *mask.shape[1:]))  # [B, 1, T, S]
  out = op.run(
      query=x.query,
      key=x.key,
      value=x.value,
      softmax_aux=None if x.sinks is None else sink_logsumexp(x.sinks).astype(x.query.dtype),
      attention_mask=mask,
      logits_soft_cap=config.logits_soft_cap,
      softmax_scale=config.softmax_scale or x.query.shape[-1]**-0.5,
      causal=False,
      fused_backward=config.fused_backward,
      platform="xla",
      cfg=ejkernel_config(config, "xla"),
  )  # [B, Hq, T, Dv]
  return out.astype(x.query.dtype)


def run_reference(x: KernelInputs, config: AttentionConfig) -> jax.Array:
  return reference.reference_bhtd(x, config)[0]


KERNELS = {
    "xla": run_ejkernel_xla,
    "reference": run_reference,
}


def run(backend: str, x: KernelInputs, config: AttentionConfig) -> jax.Array:
  """Runs `backend` on one shard: KernelInputs -> output [B, Hq, T, Dv]."""
  return KERNELS[backend](x, config)
