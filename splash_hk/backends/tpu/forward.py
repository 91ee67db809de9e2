"""The dense TPU kernel's forward for calls that are not differentiated: tokamax's experimental TPU
splash kernel where it is installed (the `[tpu]` extra), else None (JAX's serves them too).

tokamax's kernel is JAX's splash kernel with base-2 exponentials and the reciprocal fused into
the kernel: on the lent v5e its forward measured 3-5% faster than JAX's at the same tiles, its
forward+backward slower (the TPU bench). So a call's primal (inference, prefill, any forward
not under `jax.grad`) runs tokamax's kernel and a differentiated call JAX's forward and
backward (`backend._run`'s custom VJP): each the faster. It takes the same inputs (scaled q
[H, T, D] or an MQA group's, segment ids with disjoint padding, one sink logit per head), the
call's rule as its mask (`_ComputableMask` over the same positions) and the forward tiles.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable

import jax

from splash_hk.backends.tpu import tiles as tiles_lib
from splash_hk.config import AttentionConfig
from splash_hk.masks import _objects


@functools.cache
def available() -> bool:
  """Whether tokamax (the `[tpu]` extra) is importable."""
  return importlib.util.find_spec("tokamax") is not None


@functools.lru_cache(maxsize=64)
def kernel(*, padded: tuple[int, int], is_mqa: bool, config: AttentionConfig,
           tiles: tiles_lib.Tiles, mask: Any) -> Callable[..., Any] | None:
  """tokamax's forward kernel for one static shape (cached: built once), or None without
  tokamax. `mask`: the rule over padded indices (a hashable object whose `mask_function(q_ids,
  kv_ids)` says it: `backend.PositionMask`), None for every pair.

  The kernel takes q [H, Tp, D] (or [G, Tp, D] with k, v [Sp, D] when `is_mqa`), k, v,
  `segment_ids` (`segment_ids(q, kv)`) and `sinks` [H] (or None)."""
  if not available():
    return None
  from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as tsk  # pylint: disable=g-import-not-at-top
  from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as tsm  # pylint: disable=g-import-not-at-top
  mask = tsm.FullMask(padded) if mask is None else _rule_mask()(padded, mask)
  cfg = tsk.SplashConfig(block_q=tiles.block_q, block_kv=tiles.block_kv,
                         block_kv_compute=tiles.block_kv_compute,
                         attn_logits_soft_cap=config.logits_soft_cap, interpret=config.interpret)
  with jax.ensure_compile_time_eval():  # its MaskInfo: constants, not tracers of the caller
    return tsk._make_splash_attention(mask, config=cfg, is_mqa=is_mqa, q_seq_shards=1)  # pylint: disable=protected-access


def segment_ids(q: Any, kv: Any) -> Any:
  """tokamax's `SegmentIds(q, kv)`."""
  from tokamax._src.ops.experimental.tpu.splash_attention import base as tbase  # pylint: disable=g-import-not-at-top
  return tbase.SegmentIds(q, kv)


def serves(rule: _objects.Mask | None) -> bool:
  """Whether the rule is one tokamax's forward computes (a position rule known at trace time)."""
  return rule is None or rule.is_static()


@functools.cache
def _rule_mask() -> type:
  """tokamax's computable mask over a rule (`backend.PositionMask`: hashable, its
  `mask_function` the rule over padded indices), compared by that rule."""
  from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as tsm  # pylint: disable=g-import-not-at-top

  class RuleMask(tsm._ComputableMask):  # pylint: disable=protected-access
    def __init__(self, shape: tuple[int, int], rule: Any):
      self.rule = rule
      super().__init__(shape, rule.mask_function)

    def __eq__(self, other: object) -> bool:
      return isinstance(other, RuleMask) and (self.shape, self.rule) == (other.shape, other.rule)

    def __hash__(self) -> int:
      return hash((self.shape, self.rule))

  return RuleMask


def apart(primal: Callable[..., jax.Array],
          differentiated: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """`primal` where the call is not differentiated, `differentiated` (its forward and its
  backward) where it is."""

  @jax.custom_vjp
  def run(q, k, v, sinks, seg):
    return primal(q, k, v, sinks, seg)

  def run_fwd(q, k, v, sinks, seg):
    out, pull = jax.vjp(lambda q, k, v, s: differentiated(q, k, v, s, seg), q, k, v, sinks)
    return out, (pull, seg)

  def run_bwd(saved, cotangent):
    pull, seg = saved
    return (*pull(cotangent), jax.tree.map(lambda _: None, seg))

  run.defvjp(run_fwd, run_bwd)
  return run
