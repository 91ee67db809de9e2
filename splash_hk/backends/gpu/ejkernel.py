"""ejkernel (the `splash_hk[gpu]` extra), imported only when a path needs it, caches out of $HOME."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import tempfile

from splash_hk.config import AttentionConfig

MISSING = ("ejkernel is not installed; it comes with the GPU extra: pip install 'splash_hk[gpu]'")


def available() -> bool:
  """Whether ejkernel can be imported (checked without importing it)."""
  return importlib.util.find_spec("ejkernel") is not None


@functools.lru_cache(maxsize=None)
def _modules():
  if not available():
    raise ImportError(MISSING)
  cache = os.path.join(tempfile.gettempdir(), "splash_hk-ejkernel")
  os.environ.setdefault("EJKERNEL_PERSISTENT_CACHE_DIR", cache)
  os.environ.setdefault("COMPILE_FUNC_DIR", os.path.join(cache, "compiled"))
  os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
  op = importlib.import_module("ejkernel.modules.operations.blocksparse_attention")
  configs = importlib.import_module("ejkernel.modules.operations.configs")
  ops = importlib.import_module("ejkernel.ops")
  return op.BlockSparseAttention(), configs.BlockSparseAttentionConfig, ops.FwdParams, ops.BwdParams


def blocksparse_op():
  """ejkernel's BlockSparseAttention kernel object; we call its `run` with an explicit config."""
  return _modules()[0]


def blocksparse_config(config: AttentionConfig, platform: str, num_warps: int | None = None,
                       num_stages: int | None = None):
  """An explicit ejkernel BlockSparseAttentionConfig (never autotuned) from our block sizes."""
  _, config_cls, fwd_cls, bwd_cls = _modules()
  defaults = (128, 128, 128, 128) if platform == "xla" else (64, 64, 32, 32)  # ejkernel's own
  fwd_q, fwd_kv, bwd_q, bwd_kv = config.block_sizes.resolve(*defaults)
  return config_cls(
      fwd_params=fwd_cls(q_blocksize=fwd_q, kv_blocksize=fwd_kv, num_warps=num_warps,
                         num_stages=num_stages),
      bwd_params=bwd_cls(q_blocksize=bwd_q, kv_blocksize=bwd_kv, num_warps=num_warps,
                         num_stages=num_stages),
      platform=platform,
      backend="any" if platform == "xla" else "gpu",
  )
