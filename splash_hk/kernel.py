"""The kernel call: run one backend on per-shard BHTD arrays.

Knows nothing of meshes: `attention` (or its shard_map wrapper) hands each
call the arrays of one shard in `KernelInputs` form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from splash_hk import _ejkernel
from splash_hk import blocksparse_xla
from splash_hk import masks
from splash_hk import splash_tpu
from splash_hk.config import AttentionConfig
from splash_hk.fallback import reference
from splash_hk.inputs import KernelInputs


def sink_logsumexp(sinks: jax.Array) -> jax.Array:
  """[Hq, n] -> [Hq]: n sinks of a head act exactly as one sink of their logsumexp."""
  return jax.nn.logsumexp(sinks, axis=-1)


def run_ejkernel_xla(x: KernelInputs, config: AttentionConfig, default_positions: bool = True
                     ) -> jax.Array:
  """ejkernel's XLA block-sparse attention, adapted to our semantics (dense: the bench's baseline).

  ejkernel's XLA path aligns causal masks top-left (its dense core applies
  `tril` whatever the positions) and ignores `chunk_size`. So the adapter hands
  it the whole mask, built by `masks.full_mask` from end-aligned positions,
  with `causal=False`; sinks go in as one logsumexp sink per query head. It
  reads only head 0 of a dense mask, so per-head masks are refused.
  """
  del default_positions
  if x.mask is not None and x.mask.shape[1] > 1:
    raise ValueError("ejkernel's XLA block-sparse path reads only head 0 of a dense mask.")
  mask = masks.full_mask(
      q_positions=x.q_positions, kv_positions=x.kv_positions, causal=config.causal,
      window=config.window, chunk_size=config.chunk_size, q_segment_ids=x.q_segment_ids,
      kv_segment_ids=x.kv_segment_ids, mask=x.mask)  # [B|1, 1, T, S]
  batch = x.query.shape[0]
  mask = jnp.broadcast_to(mask, (batch, *mask.shape[1:]))  # [B, 1, T, S]
  out = _ejkernel.blocksparse_op().run(
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
      cfg=_ejkernel.blocksparse_config(config, "xla"),
  )  # [B, Hq, T, Dv]
  return out.astype(x.query.dtype)


def run_triton(x: KernelInputs, config: AttentionConfig, default_positions: bool = True
               ) -> jax.Array:
  """ejkernel's Triton block-sparse kernel (GPU).

  It masks from positions and segment ids, so it gets the explicit
  (end-aligned) positions and segment ids whose padding can never match; rows
  that are padding are zeroed afterwards. The selector keeps chunked masks,
  dense masks and head dims that are not multiples of 16 away from it.
  """
  batch, _, query_len, head_dim = x.query.shape
  kv_len = x.key.shape[2]
  q_seg = jnp.zeros((batch, query_len), jnp.int32) if x.q_segment_ids is None else x.q_segment_ids
  kv_seg = jnp.zeros((batch, kv_len), jnp.int32) if x.kv_segment_ids is None else x.kv_segment_ids
  q_seg, kv_seg = masks.disjoint_padding(q_seg, kv_seg)
  out = _ejkernel.blocksparse_op().run(
      query=x.query,
      key=x.key,
      value=x.value,
      q_segment_ids=q_seg,
      kv_segment_ids=kv_seg,
      q_positions=x.q_positions,
      kv_positions=x.kv_positions,
      softmax_aux=None if x.sinks is None else sink_logsumexp(x.sinks).astype(x.query.dtype),
      logits_soft_cap=config.logits_soft_cap,
      softmax_scale=config.softmax_scale or head_dim**-0.5,
      sliding_window=config.window,
      causal=config.causal,
      fused_backward=config.fused_backward,
      platform="triton",
      cfg=_ejkernel.blocksparse_config(config, "triton", num_warps=4, num_stages=2),
  )  # [B, Hq, T, Dv]
  return jnp.where((q_seg >= 0)[:, None, :, None], out, 0).astype(x.query.dtype)


def run_reference(x: KernelInputs, config: AttentionConfig, default_positions: bool = True
                  ) -> jax.Array:
  del default_positions
  return reference.reference_bhtd(x, config)[0]


def run_splash(x: KernelInputs, config: AttentionConfig, default_positions: bool = True,
               sequence_shards: int = 1) -> jax.Array:
  assert default_positions, "the selector sends splash default positions only"
  return splash_tpu.run_splash(x, config, sequence_shards)


KERNELS = {
    "splash": run_splash,
    "triton": run_triton,
    "xla": blocksparse_xla.run_blocksparse,
    "reference": run_reference,
}


def run(backend: str, x: KernelInputs, config: AttentionConfig, default_positions: bool,
        sequence_shards: int = 1) -> jax.Array:
  """Runs `backend` on one shard: KernelInputs -> output [B, Hq, T, Dv].

  Args:
    backend: a key of KERNELS.
    x: the arrays of one shard.
    config: the attention config.
    default_positions: the positions in `x` are the end-aligned defaults over
      the whole query, so static masks may be derived from indices.
    sequence_shards: `x` holds one of this many equal, consecutive slices of
      the query. Splash builds a static mask per slice; the other backends
      then mask from the positions in `x`.
  """
  if backend == "splash":
    return run_splash(x, config, default_positions, sequence_shards)
  return KERNELS[backend](x, config, default_positions and sequence_shards == 1)
