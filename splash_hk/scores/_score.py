"""The base of every score object (a `nodes.Node`: fields declared as arrays or parts), and `+`."""

from __future__ import annotations

import dataclasses
from typing import Any

from splash_hk.nodes import Node, part_field

ArrayLike = Any  # np.ndarray or jax.Array, or a tracer of one


@dataclasses.dataclass(frozen=True)
class Score(Node):
  """An additive bias on the scaled logits, per (query, key) pair and head.

  `scores(q_pos, kv_pos, head)` -> float32, broadcastable to [B, Hkv, G, T, S]: the bias
  of query heads `head` (global indices, [1, Hkv, G, 1, 1]; G query heads per kv head)
  at query positions [B, 1, 1, T, 1] and key positions [B, 1, 1, 1, S] (a kernel's
  block passes its block's rows and keys). Arrays on the "qk" side come cut to the same
  rows and keys; "head" arrays hold the heads `head` names, in order.
  """

  def __add__(self, other: Score) -> Score:
    if not isinstance(other, Score):
      raise ValueError(f"`+` adds score objects (splash_hk.scores.Alibi(slopes), ...), got "
                       f"{type(other).__name__}; wrap a dense float array as "
                       "splash_hk.scores.Dense(array).")
    return Sum(self, other)

  def scores(self, q_pos: ArrayLike, kv_pos: ArrayLike, head: ArrayLike) -> ArrayLike:
    raise NotImplementedError

  @property
  def name(self) -> str:
    """How messages name this object."""
    return type(self).__name__

  def check(self, batch: int, num_heads: int, query_len: int, kv_len: int) -> None:
    """Raises ValueError naming `bias` when this object cannot serve a call of these shapes."""
    del batch, num_heads, query_len, kv_len


@dataclasses.dataclass(frozen=True)
class Sum(Score):
  """Both terms added: `a + b`."""

  a: Score = part_field()
  b: Score = part_field()

  def scores(self, q_pos: ArrayLike, kv_pos: ArrayLike, head: ArrayLike) -> ArrayLike:
    return self.a.scores(q_pos, kv_pos, head) + self.b.scores(q_pos, kv_pos, head)
