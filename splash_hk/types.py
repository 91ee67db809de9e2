"""The values that cross layers: a call's arrays (`Extras`), its static facts (`Facts`), the
kernel boundary (`KernelInputs`, `KernelOutput`) and what `attention` / `explain` return."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Generic, NamedTuple, Sequence

import jax
import numpy as np
from typing_extensions import TypeVar

from splash_hk.config import AttentionConfig
from splash_hk.masks import _mask
from splash_hk.masks import _objects
from splash_hk.masks import _rules
from splash_hk.nodes import skeleton
from splash_hk.scores import Dense, Score

Array = jax.Array | np.ndarray  # what the public functions take as an array
Shaped = _mask.Shaped  # an array, or its shape and dtype (for `explain`)
# The leaves of a kernel-boundary pytree: arrays, or (for `sharding.attention_specs`) their specs.
Leaf = TypeVar("Leaf", default=jax.Array)


class Mode(enum.Enum):
  """What a call does, from its query and key lengths (see `detect_mode`)."""

  TRAIN = "train"  # T == S: a whole sequence at once.
  PREFILL = "prefill"  # 1 < T < S: a chunk of queries against a longer KV cache.
  DECODE = "decode"  # T == 1: one new token against the KV cache.

  @classmethod
  def of(cls, query_len: int, kv_len: int) -> Mode:
    """DECODE for one query token, PREFILL for fewer queries than keys, else TRAIN."""
    if query_len == 1:
      return cls.DECODE
    return cls.PREFILL if query_len < kv_len else cls.TRAIN


@dataclasses.dataclass(frozen=True)
class Decision:
  """Which backend runs a call, and why.

  Attributes:
    backend: "splash", "triton", "xla" or "reference".
    reason: why this backend; for a fallback, what the preferred one could not do.
    fallback: True when the backend (or sequence strategy) is not the one asked for.
    ring: True when the call runs as a context-parallel ring over the sequence axis.
    ulysses: True when the call runs Ulysses-style: an all-to-all turns the sharded
      sequence into sharded heads, and the backend attends the whole sequence.
    dropped_axes: the mesh axis names of `axes` that the call's mesh lacks (dropped: their
      dimensions are not sharded over them).
  """

  backend: str
  reason: str
  fallback: bool = False
  ring: bool = False
  ulysses: bool = False
  dropped_axes: tuple[str, ...] = ()


class AttentionOutput(NamedTuple):
  """What `attention` returns (a pytree, so it can leave jit/shard_map).

  Attributes:
    attention_outputs: [B, T, Hq, Dv].
    attention_weights: [B, Hq, T, S] softmax weights, only on the reference
      path when asked for (`return_weights=True`), else None.
    lse: [B, T, Hq] float32, when asked for (`return_residuals=True`), else None: the
      log-sum-exp of each row's visible logits (after scale, bias and soft cap) and its
      sinks, -inf where the row sees nothing; differentiable. `splash_hk.merge_attention`
      combines outputs over disjoint keys by it.
  """

  attention_outputs: jax.Array
  attention_weights: jax.Array | None = None
  lse: jax.Array | None = None


def as_score(bias: Any) -> Score | None:
  """The call's `bias` argument as a score object: an array (or its shape) is `Dense(bias)`."""
  return bias if bias is None or isinstance(bias, Score) else Dense(bias)


class Extras(NamedTuple):
  """The optional per-call arrays of `attention` (see there), as the caller passed them.

  The one per-call structure below the public signatures: `attention`, `explain`,
  `reference_attention`, the modules and the KV cache build it (by keyword) and
  pass it on whole; `splash_hk.inputs` turns it into `KernelInputs`. A new
  per-call input is a field here.
  """

  q_segment_ids: Shaped | None = None  # [B, T] int, negative = padding
  kv_segment_ids: Shaped | None = None  # [B, S] int
  q_positions: Shaped | None = None  # [B, T] int
  kv_positions: Shaped | None = None  # [B, S] int
  mask: Shaped | _objects.Mask | None = None  # [B|1, 1|Hq, T, S] bool, or a mask object
  bias: Shaped | Score | None = None  # [B|1, Hq|1, T, S] float, or a score object
  softmax_aux: Shaped | None = None  # sinks: [Hq], [Hq, n] or [Hkv, n]
  dropout_rng: Any = None  # a jax.random key (with AttentionConfig.dropout_rate > 0)
  dropout_mask: Shaped | None = None  # [B|1, Hq|1, T, S] bool, True = keep: overrides the hash
  dropout_q_index: Shaped | None = None  # [B, T] int: the queries' indices (a cache: their slots)
  dropout_broadcast: bool = False  # one dropout mask for every batch row and head (Flax's)


class KernelInputs(NamedTuple, Generic[Leaf]):
  """One call's (or one shard's) arrays in normal form. A pytree; None fields are absent.

  The layout stays the public BTHD one: a backend transposes what it computes
  on, so nothing proportional to S is copied before it decides what it reads.
  """

  query: Leaf  # [B, T, Hq, D]
  key: Leaf | Any  # [B, S, Hkv, D], or a `splash_hk.quant.Quantized` of that shape
  value: Leaf | Any  # [B, S, Hkv, Dv], or a `Quantized`
  q_positions: Leaf  # [B, T] int32
  kv_positions: Leaf  # [B, S] int32
  q_segment_ids: Leaf | None = None  # [B, T] int32, negative = padding
  kv_segment_ids: Leaf | None = None  # [B, S] int32, negative = padding
  rule: _objects.Mask | None = None  # arrays [B, T], [B, S] and [B|1, 1|Hq, T, S]; None: all visible
  sinks: Leaf | None = None  # [Hq, n] float32
  bias: Score | None = None  # additive scores (arrays [B|1, Hq|1, T, S], per head, free); None: 0
  heads: Leaf | None = None  # [Hq] int32: each query head's global index (with a bias)
  dropout: Any = None  # a `splash_hk.dropout.Dropout` (with dropout_rate > 0), or None


class KernelOutput(NamedTuple, Generic[Leaf]):
  """What a backend returns for one call or shard. A pytree; None fields are absent."""

  out: Leaf  # [B, T, Hq, Dv]
  lse: Leaf | None = None  # [B, T, Hq] float32, `splash_hk.backends.base`'s lse convention
  weights: Leaf | None = None  # [B, Hq, T, S] float32 (reference, when asked for)


@dataclasses.dataclass(frozen=True)
class Facts:
  """What is known of a call at trace time: hashable, so backends may cache on it.

  Built once per call by `splash_hk.inputs` from the public arguments; every
  layer below reads it instead of re-deriving shapes, scale or rules.
  """

  config: AttentionConfig
  query_shape: tuple[int, ...]  # [B, T, Hq, D] of the whole call
  key_shape: tuple[int, ...]  # [B, S, Hkv, D]
  value_dim: int
  mode: Mode
  default_positions: bool  # positions are the end-aligned defaults: masks follow from indices
  return_weights: bool = False
  return_residuals: bool = False  # the caller wants the log-sum-exp (AttentionOutput.lse)
  sequence_shards: int = 1  # the query sequence is split over this many devices
  load_balanced: bool = False  # the sequence is in dual-chunk (load-balanced) order
  sequence_strategy: str = "all_gather"  # asked for (see Decision.ring, Decision.ulysses)
  head_shards: int = 1  # the query heads are split over this many devices (the head axis)
  whole_sequence: bool = False  # a sharded sequence, but the kernel sees all of it (Ulysses)
  rule: _objects.Mask | None = None  # the position rule's skeleton: static, hashable
  bias: Score | None = None  # the bias's skeleton (None: no bias): static, hashable
  explicit_dropout: bool = False  # a dense dropout_mask was given (not the hash)
  quantized: tuple[str, ...] = ()  # the arguments given quantized ("query", "key", "value")
  storage: tuple[str, ...] = ()  # how key and value are stored (`quant.storage`); () unknown
  dropped_axes: tuple[str, ...] = ()  # names of `axes` the mesh lacks (dropped, said by explain)
  dtype: str = ""  # the dtype the call computes in ("bfloat16"; "" where not known)
  segments: bool = False  # segment ids were given (packed documents, padding)

  @classmethod
  def from_shapes(cls, config: AttentionConfig, query_shape: Sequence[int],
                  key_shape: Sequence[int], value_dim: int | None = None, *,
                  default_positions: bool = True, mask: Any = None, bias: Any = None,
                  **sharding: Any) -> Facts:
    """Facts of a call from its (already validated) shapes; `sharding`: the fields below.

    `mask`: the call's `mask` argument, an array (or its shape and dtype) or a mask object:
    with the config's rules it makes the position rule (`masks._rules.call_rule`).
    `bias`: the call's `bias` argument, an array (or its shape) or a score object.
    """
    rule = _rules.call_rule(**config.rules, mask=mask)
    return cls(config=config, query_shape=tuple(query_shape), key_shape=tuple(key_shape),
               value_dim=query_shape[-1] if value_dim is None else value_dim,
               mode=Mode.of(query_shape[1], key_shape[1]), default_positions=default_positions,
               rule=_objects.skeleton(rule), bias=skeleton(as_score(bias)), **sharding)

  def on_whole_sequence(self) -> Facts:
    """These facts as a Ulysses kernel sees them: the whole sequence, a share of the heads."""
    return dataclasses.replace(self, whole_sequence=True)

  @property
  def query_slices(self) -> int:
    """Into how many slices the kernel's query is cut (1 when it sees the whole sequence)."""
    return 1 if self.whole_sequence else self.sequence_shards

  @property
  def query_len(self) -> int:
    return self.query_shape[1]

  @property
  def kv_len(self) -> int:
    return self.key_shape[1]

  @property
  def num_heads(self) -> int:
    return self.query_shape[2]

  @property
  def num_kv_heads(self) -> int:
    return self.key_shape[2]

  @property
  def head_dim(self) -> int:
    return self.query_shape[3]

  @property
  def scale(self) -> float:
    return self.config.scale(self.head_dim)

  @property
  def static_rules(self) -> dict[str, Any] | None:
    """The rule as config keywords (causal, window, chunk_size) when the config can say it
    (what a static kernel builds), else None."""
    return _objects.as_rules(self.rule)
