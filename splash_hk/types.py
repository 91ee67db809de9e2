"""Result and decision types."""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax


class Mode(enum.Enum):
  """What a call does, from its query and key lengths (see `detect_mode`)."""

  TRAIN = "train"  # T == S: a whole sequence at once.
  PREFILL = "prefill"  # 1 < T < S: a chunk of queries against a longer KV cache.
  DECODE = "decode"  # T == 1: one new token against the KV cache.


@dataclasses.dataclass(frozen=True)
class Decision:
  """Which backend runs a call, and why.

  Attributes:
    backend: "splash", "triton", "xla" or "reference".
    reason: why this backend; for a fallback, what the preferred one could not do.
    fallback: True when the backend is not the one the platform asked for.
  """

  backend: str
  reason: str
  fallback: bool = False


class AttentionOutput(NamedTuple):
  """What `attention` returns (a pytree, so it can leave jit/shard_map).

  Attributes:
    attention_outputs: [B, T, Hq, Dv].
    attention_weights: [B, Hq, T, S] softmax weights, only on the reference
      path when asked for (`return_weights=True`), else None.
  """

  attention_outputs: jax.Array
  attention_weights: jax.Array | None = None
