"""Result, decision and kernel-boundary types (no logic beyond derived shapes)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple, Sequence

import jax

from splash_hk import mask_objects
from splash_hk.config import AttentionConfig


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
  """

  backend: str
  reason: str
  fallback: bool = False
  ring: bool = False
  ulysses: bool = False


class AttentionOutput(NamedTuple):
  """What `attention` returns (a pytree, so it can leave jit/shard_map).

  Attributes:
    attention_outputs: [B, T, Hq, Dv].
    attention_weights: [B, Hq, T, S] softmax weights, only on the reference
      path when asked for (`return_weights=True`), else None.
  """

  attention_outputs: jax.Array
  attention_weights: jax.Array | None = None


class Extras(NamedTuple):
  """The optional per-call arrays of `attention`, as the caller passed them (see there)."""

  q_segment_ids: Any = None
  kv_segment_ids: Any = None
  q_positions: Any = None
  kv_positions: Any = None
  mask: Any = None
  softmax_aux: Any = None


class KernelInputs(NamedTuple):
  """One call's (or one shard's) arrays in normal form. A pytree; None fields are absent.

  The layout stays the public BTHD one: a backend transposes what it computes
  on, so nothing proportional to S is copied before it decides what it reads.
  """

  query: jax.Array  # [B, T, Hq, D]
  key: jax.Array  # [B, S, Hkv, D]
  value: jax.Array  # [B, S, Hkv, Dv]
  q_positions: jax.Array  # [B, T] int32
  kv_positions: jax.Array  # [B, S] int32
  q_segment_ids: jax.Array | None = None  # [B, T] int32, negative = padding
  kv_segment_ids: jax.Array | None = None  # [B, S] int32, negative = padding
  rule: Any = None  # a `splash_hk.masks.Mask` (arrays [B, T], [B, S], [B|1, 1|Hq, T, S]) or None
  sinks: jax.Array | None = None  # [Hq, n] float32


class KernelOutput(NamedTuple):
  """What a backend returns for one call or shard. A pytree; None fields are absent."""

  out: jax.Array  # [B, T, Hq, Dv]
  lse: jax.Array | None = None  # [B, T, Hq] float32, `splash_hk.backends.base`'s lse convention
  weights: jax.Array | None = None  # [B, Hq, T, S] float32 (reference, when asked for)


@dataclasses.dataclass(frozen=True)
class Facts:
  """What is known of a call at trace time: hashable, so backends may cache on it.

  Built once per call by `splash_hk.inputs` from the public arguments; every
  layer below reads it instead of re-deriving shapes, scale or rules.
  """

  config: AttentionConfig
  query_shape: tuple[int, int, int, int]  # [B, T, Hq, D] of the whole call
  key_shape: tuple[int, int, int, int]  # [B, S, Hkv, D]
  value_dim: int
  mode: Mode
  default_positions: bool  # positions are the end-aligned defaults: masks follow from indices
  mask_shape: tuple[int, ...] | None = None  # the dense mask's shape, if one is given
  return_weights: bool = False
  sequence_shards: int = 1  # the query sequence is split over this many devices
  load_balanced: bool = False  # the sequence is in dual-chunk (load-balanced) order
  sequence_strategy: str = "all_gather"  # asked for (see Decision.ring, Decision.ulysses)
  head_shards: int = 1  # the query heads are split over this many devices (the head axis)
  whole_sequence: bool = False  # a sharded sequence, but the kernel sees all of it (Ulysses)
  rule: Any = None  # the position rule's skeleton (`mask_objects.skeleton`): static, hashable

  @classmethod
  def from_shapes(cls, config: AttentionConfig, query_shape: Sequence[int],
                  key_shape: Sequence[int], value_dim: int | None = None, *,
                  default_positions: bool = True, mask_shape: Sequence[int] | None = None,
                  **sharding: Any) -> Facts:
    """Facts of a call from its (already validated) shapes; `sharding`: the fields below.

    `rule` (in `sharding`): a mask object given as `mask`; by default the config's
    rules, ANDed with a dense mask of `mask_shape` when one is given.
    """
    rule = sharding.pop("rule", None)
    if rule is None:
      rule = mask_objects.from_rules(**config.rules)
      if mask_shape is not None:
        dense = mask_objects.Dense(jax.ShapeDtypeStruct(tuple(mask_shape), bool))
        rule = dense if rule is None else rule & dense
    return cls(config=config, query_shape=tuple(query_shape), key_shape=tuple(key_shape),
               value_dim=query_shape[-1] if value_dim is None else value_dim,
               mode=Mode.of(query_shape[1], key_shape[1]), default_positions=default_positions,
               mask_shape=None if mask_shape is None else tuple(mask_shape),
               rule=mask_objects.skeleton(rule), **sharding)

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
  def static_rules(self) -> dict | None:
    """The rule as config keywords (causal, window, chunk_size) when it is an AND of
    at most one Causal, SlidingWindow and Chunked (what a static kernel builds), else None."""
    return mask_objects.as_rules(self.rule)
