"""The bench's workloads: inputs, config and useful work of each, from a short spec.

  MASK@T            self-attention over T tokens; MASK is causal, full, window:W
                    (causal, W keys back), chunk:C (causal chunks) or packed:N
                    (N causal documents of T/N tokens, as segment ids)
  decode:L/C        one new token after L tokens, in a KV cache of C slots
  prefill:N/C       N new tokens into an empty KV cache of C slots

Useful work counts only the (query, key) pairs the mask lets through.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

import splash_hk as sh
from splash_hk import masks


@dataclasses.dataclass(frozen=True)
class Workload:
  """One attention call to measure: shapes, config, extra inputs and useful pairs."""

  name: str
  query_len: int
  kv_len: int
  config: sh.AttentionConfig
  useful_pairs: int  # visible (query, key) pairs per batch row and head
  kind: str = "mask"  # "mask", "packed", "decode" or "prefill"
  documents: int = 1
  filled: int = 0  # cache slots holding tokens before the call

  def extras(self, batch: int) -> dict[str, np.ndarray]:
    """The keyword arrays of `sh.attention` for this workload."""
    if self.kind == "packed":
      ids = np.repeat(np.arange(self.documents, dtype=np.int32), self.query_len // self.documents)
      return {"q_segment_ids": np.tile(ids, (batch, 1))}
    if self.kind in ("decode", "prefill"):
      slots = np.arange(self.kv_len, dtype=np.int32)
      q_pos = self.filled + np.arange(self.query_len, dtype=np.int32)
      return {"q_positions": np.tile(q_pos, (batch, 1)),
              "kv_positions": np.tile(slots, (batch, 1)),
              "q_segment_ids": np.zeros((batch, self.query_len), np.int32),
              "kv_segment_ids": np.tile(np.where(slots < self.filled + self.query_len, 0, -1),
                                        (batch, 1)).astype(np.int32)}
    return {}

  def positions(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(q_positions [B, T], kv_positions [B, S]): the explicit ones, else the defaults."""
    q_pos, kv_pos = masks.end_aligned_positions(batch, self.query_len, self.kv_len, np)
    e = self.extras(batch)
    return e.get("q_positions", q_pos), e.get("kv_positions", kv_pos)

  def dense_mask(self, batch: int) -> np.ndarray:
    """The same visibility as a dense [B, 1, T, S] mask (for implementations without segments)."""
    return self.mask_rows(batch, np.arange(self.query_len))

  def mask_rows(self, batch: int, rows: np.ndarray) -> np.ndarray:
    """The visibility of query rows `rows` only: [B, 1, len(rows), S] bool."""
    e = self.extras(batch)
    q_pos, kv_pos = self.positions(batch)
    mask = masks.position_mask(q_pos[:, rows], kv_pos, **self.config.rules)
    mask = np.ones((batch, len(rows), self.kv_len), bool) if mask is None else mask
    if "q_segment_ids" in e:
      mask = mask & masks.segment_mask(e["q_segment_ids"][:, rows],
                                       e.get("kv_segment_ids", e["q_segment_ids"]))
    return mask[:, None]


def parse(spec: str) -> Workload:
  """A workload from its spec (see the module docstring); ValueError naming the spec."""
  try:
    if "@" in spec:
      return _mask_workload(*spec.split("@"))
    kind, _, sizes = spec.partition(":")
    first, _, capacity = sizes.partition("/")
    first, capacity = int(first), int(capacity)
    if kind == "decode" and 0 < first < capacity:
      return Workload(spec, 1, capacity, sh.AttentionConfig(), first + 1, "decode", filled=first)
    if kind == "prefill" and 0 < first <= capacity:
      return Workload(spec, first, capacity, sh.AttentionConfig(), first * (first + 1) // 2,
                      "prefill")
  except (TypeError, ValueError):
    pass
  raise ValueError(f"unknown workload {spec!r}: use MASK@T (MASK: causal, full, window:W, "
                   "chunk:C, packed:N), decode:L/C or prefill:N/C.")


def _mask_workload(mask: str, length: str) -> Workload:
  kind, _, size = mask.partition(":")
  length = int(length)
  n = int(size) if size else 0
  config = {"causal": sh.AttentionConfig(), "full": sh.AttentionConfig(causal=False),
            "packed": sh.AttentionConfig(), "window": sh.AttentionConfig(sliding_window=(n, 0)),
            "chunk": sh.AttentionConfig(chunk_size=n) if n else None}.get(kind)
  if config is None or (kind in ("window", "chunk", "packed") and n < 1) or length < 1:
    raise ValueError(mask)
  if kind == "packed":
    if length % n:
      raise ValueError(mask)
    doc = length // n
    return Workload(f"{mask}@{length}", length, length, config, n * doc * (doc + 1) // 2,
                    "packed", documents=n)
  pairs = masks.visible_pairs(length, length, **config.rules)
  return Workload(f"{mask}@{length}", length, length, config, pairs)


def jax_nn_kwargs(workload: Workload, batch: int) -> dict[str, Any]:
  """Keywords of jax.nn.dot_product_attention giving the same visibility."""
  config = workload.config
  if workload.kind == "mask" and config.chunk_size is None:
    kwargs = {"is_causal": config.causal}
    if config.window is not None:
      kwargs["local_window_size"] = config.window
    return kwargs
  return {"mask": workload.dense_mask(batch)}
