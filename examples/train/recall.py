"""Associative recall: a synthetic task only attention can solve, generated in-process.

A sequence lists `num_pairs` (key, value) pairs, then asks `num_pairs` queries:
a key seen above, whose next token must be its value.

  k1 v1 k2 v2 ... kN vN | q1 a1 q2 a2 ... qN aN

Keys and values are disjoint token ranges; keys are distinct within a sequence.
The model reads tokens[:-1] and predicts tokens[1:]; only answer positions are
scored. Batches are a pure function of (seed, step), so a resumed run sees the
same data as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class RecallTask:
  num_pairs: int
  num_keys: int = 32
  num_values: int = 32
  length: int | None = None  # model input length; past 4 * num_pairs - 1 tokens: padding

  @classmethod
  def for_seq_len(cls, seq_len: int) -> "RecallTask":
    """The task whose model input is `seq_len` tokens (the last ones padding if needed)."""
    if seq_len < 3:
      raise ValueError(f"--seq_len must be >= 3 (one pair and its query), got {seq_len}.")
    return cls(num_pairs=(seq_len + 1) // 4, length=seq_len)

  @property
  def vocab_size(self) -> int:
    return self.num_keys + self.num_values

  @property
  def seq_len(self) -> int:
    """Length of the model input: 4 * num_pairs tokens less the last, or `length`."""
    return self.length or 4 * self.num_pairs - 1

  def prompt_len(self) -> int:
    """Tokens before the first answer (pairs and the first query)."""
    return 2 * self.num_pairs + 1

  def batch(self, seed: int, step: int, batch_size: int,
            rows: slice | None = None) -> dict[str, np.ndarray]:
    """{"inputs" [B, T], "targets" [B, T], "weights" [B, T] (1 on answers)}.

    Each row is drawn from its own generator seeded by (seed, step, row), so
    `rows` (a slice of the batch, e.g. one process's share) is built alone and
    equals the same rows of the whole batch.
    """
    n = self.num_pairs
    indices = range(batch_size)[rows or slice(None)]
    tokens = np.empty((len(indices), 4 * n), np.int32)
    for out, row in enumerate(indices):
      rng = np.random.default_rng([seed, step, row])
      keys = rng.permutation(self.num_keys)[:n]  # distinct
      values = self.num_keys + rng.integers(0, self.num_values, size=n)
      order = rng.permutation(n)
      tokens[out, 0:2 * n:2], tokens[out, 1:2 * n:2] = keys, values
      tokens[out, 2 * n::2], tokens[out, 2 * n + 1::2] = keys[order], values[order]
    weights = np.zeros((len(indices), 4 * n - 1), np.float32)
    weights[:, 2 * n::2] = 1.0  # input is a query, target its answer
    pad = [(0, 0), (0, self.seq_len - (4 * n - 1))]  # trailing padding: token 0, weight 0
    return {"inputs": np.pad(tokens[:, :-1], pad), "targets": np.pad(tokens[:, 1:], pad),
            "weights": np.pad(weights, pad)}
