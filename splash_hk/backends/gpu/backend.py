"""The triton backend: ejkernel's Triton block-sparse kernel (GPU), adapted to our semantics.

It masks from positions and segment ids, so it gets the explicit (end-aligned)
positions and segment ids whose padding can never match; rows that are padding
are zeroed afterwards. Its limits: a GPU, masks the config can state without a
chunk (it ignores `chunk_size` and would turn a dense mask into segment ids),
query blocks of 16 or more rows (no decode) and head dims that are multiples of 16.
"""

from __future__ import annotations

import jax.numpy as jnp

from splash_hk.masks import _objects
from splash_hk.backends.gpu import ejkernel as _ejkernel
from splash_hk.backends import base
from splash_hk.backends import guard
from splash_hk.backends.xla import backend as xla
from splash_hk.types import Facts, KernelInputs, KernelOutput, Mode


def why_not(facts: Facts, hardware: str) -> str | None:
  """Why ejkernel's Triton kernel cannot serve this call, or None."""
  refusal = base.plain_kernel_refusal(facts)
  if refusal is not None:
    return refusal
  if hardware != "gpu":
    return f"ejkernel's Triton kernel needs a GPU (this is {hardware})"
  if not _ejkernel.available():
    return _ejkernel.MISSING
  if facts.bias is not None:
    return "a `bias` was given, and ejkernel's Triton block-sparse kernel takes none from us"
  if facts.mode is Mode.DECODE:
    return "decode (T == 1): ejkernel's Triton kernel tiles queries in blocks of 16 or more"
  if facts.head_dim % 16 or facts.value_dim % 16:
    return (f"head dims {facts.head_dim} / {facts.value_dim} are not multiples of 16, which "
            "ejkernel's Triton kernel needs")
  return base.rule_refusal(facts, "ejkernel's Triton kernel", _builds, BUILDS)


# What ejkernel's Triton kernel masks with, in words: positions and segment ids only, so a dense
# mask would become segment ids (a traced mask cannot be proven one), and it ignores chunk_size.
BUILDS = ("Causal and SlidingWindow, ANDed (as AttentionConfig states them); no Chunked: it "
          "ignores chunk_size; no Dense mask: it would turn one into segment ids")


def _builds(mask: _objects.Mask) -> bool:
  rules = mask.config_rules()
  return rules is not None and "chunk_size" not in rules


def attend(x: KernelInputs, facts: Facts) -> KernelOutput:
  """ejkernel's Triton kernel on one shard: KernelInputs -> out [B, T, Hq, Dv]."""
  config, rules = facts.config, facts.static_rules
  assert rules is not None, "the selector sends only rules the config can say here"
  q_seg, kv_seg = base.disjoint_padding(*base.segment_ids(x))
  out = _ejkernel.blocksparse_op().run(
      query=base.to_bhtd(x.query),  # [B, Hq, T, D]
      key=base.to_bhtd(x.key),  # [B, Hkv, S, D]
      value=base.to_bhtd(x.value),  # [B, Hkv, S, Dv]
      q_segment_ids=q_seg,
      kv_segment_ids=kv_seg,
      q_positions=x.q_positions,
      kv_positions=x.kv_positions,
      softmax_aux=None if x.sinks is None else base.sink_logsumexp(x.sinks).astype(x.query.dtype),
      logits_soft_cap=config.logits_soft_cap,
      softmax_scale=facts.scale,
      sliding_window=rules["window"],
      causal=rules["causal"],
      fused_backward=bool(config.fused_backward),
      platform="triton",
      cfg=_ejkernel.blocksparse_config(config, "triton", num_warps=4, num_stages=2),
  )  # [B, Hq, T, Dv]
  out = jnp.where((q_seg >= 0)[:, :, None, None], base.to_bhtd(out), 0)  # [B, T, Hq, Dv]
  return KernelOutput(out.astype(x.query.dtype))


BACKEND = base.Backend(name="triton", why_not=why_not,
                       attend=guard.guard_garbage(attend, xla.attend), hardware=("gpu",), rank=0,
                       traces_off_host=False,
                       paged_why_not=lambda facts, hardware: "no GPU paged kernel is served yet")
