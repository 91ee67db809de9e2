"""splash_hk: block-sparse ("splash") attention for JAX and Haiku."""

from splash_hk import fallback
from splash_hk import masks
from splash_hk import scores
from splash_hk import sharding
from splash_hk import sparse
from splash_hk.attention import attention
from splash_hk.attention import explain
from splash_hk.config import AttentionConfig
from splash_hk.config import BlockSizes
from splash_hk.dropout import dropout_mask
from splash_hk.mode import detect_mode
from splash_hk.kv_cache import KVCache
from splash_hk.merge import merge_attention
from splash_hk.module import MultiHeadAttention
from splash_hk.module import SplashAttention
from splash_hk.paged import PageSelection
from splash_hk.paged import PagedKVCache
from splash_hk.paged import RaggedBatch
from splash_hk.paged import SharedPrefix
from splash_hk.paged import explain_paged
from splash_hk.paged import paged_attention
from splash_hk.quant import Quantized
from splash_hk.quant import quantize
from splash_hk.sharding import MeshAxes
from splash_hk.speculation import accept_drafts
from splash_hk.types import AttentionOutput
from splash_hk.types import Decision
from splash_hk.types import Mode

__version__ = "0.1.0"

__all__ = (
    "AttentionConfig",
    "AttentionOutput",
    "BlockSizes",
    "Decision",
    "KVCache",
    "MeshAxes",
    "Mode",
    "MultiHeadAttention",
    "PageSelection",
    "PagedKVCache",
    "Quantized",
    "RaggedBatch",
    "SharedPrefix",
    "SplashAttention",
    "accept_drafts",
    "attention",
    "detect_mode",
    "dropout_mask",
    "explain",
    "explain_paged",
    "fallback",
    "masks",
    "merge_attention",
    "paged_attention",
    "quantize",
    "scores",
    "sharding",
    "sparse",
)
