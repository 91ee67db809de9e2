"""The base of every mask object (a `nodes.Node`: fields declared as arrays or parts), and `&` /
`|` (`And`, `Or`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from splash_hk.masks._blocks import ArrayLike, Blocks
from splash_hk.nodes import Node, Shaped, array_field, part_field, skeleton

__all__ = ("And", "Mask", "Or", "Shaped", "array_field", "part_field", "skeleton")


@dataclasses.dataclass(frozen=True)
class Mask(Node):
  """The base of every mask object: `&`, `|`, and what each object says of itself.

  A subclass is a frozen dataclass; its fields are static (the pytree's structure:
  hashable, compared by value) unless declared with `array_field` (leaves) or
  `part_field` (mask objects it combines); see `splash_hk.nodes`.
  """

  def __and__(self, other: Mask) -> Mask:
    return And(self, _as_mask(other, "&"))

  def __or__(self, other: Mask) -> Mask:
    return Or(self, _as_mask(other, "|"))

  def visible(self, q_pos: ArrayLike, kv_pos: ArrayLike) -> ArrayLike:
    """[B, 1|H, T, S] bool from positions q [B, 1, T, 1] and kv [B, 1, 1, S] (and own arrays)."""
    raise NotImplementedError

  def classify(self, blocks: Blocks) -> tuple[ArrayLike, ArrayLike]:
    """(may, full) [B|1, nq, nk] of every block pair (see the module docstring)."""
    raise NotImplementedError

  def is_static(self) -> bool:
    """Whether the rule is known at trace time: a function of positions alone (no arrays, no
    traced values), which NumPy can evaluate when a kernel or plan is built."""
    return not self.array_fields() and all(p.is_static() for p in self.children())

  @property
  def name(self) -> str:
    """How messages name this object."""
    return type(self).__name__

  def normal(self) -> Mask:
    """This object as kernels read it: every default filled in (itself, unless it has some)."""
    return self

  def evaluated_per_pair(self) -> bool:
    """Whether its blocks are classified by evaluating it on every (query, key) pair, once per
    call (O(T * S)), rather than from per-block ranges."""
    return False

  def check(self, batch: int, query_len: int, kv_len: int) -> None:
    """Raises ValueError when this object cannot serve a call of these shapes for reasons of its
    own (its arrays' shapes and dtypes, by side, are checked for every object at the edge)."""
    del batch, query_len, kv_len

  def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
    """Raises ValueError when this object's arrays cannot serve Hq = `num_heads` query heads over
    Hkv = `num_kv_heads` kv heads."""
    del num_heads, num_kv_heads

  def for_call(self, call: Any) -> Mask:
    """This object in the normal form kernels read for `call` (a `_chosen.CallIndex`: the call's
    shapes and token indices): itself, unless it derives arrays from them."""
    del call
    return self

  def over_slots(self, slots: Any, kv_len: int) -> Mask:
    """This object over a KV cache of `kv_len` slots, the new tokens written at `slots`
    [B, T]: what a query-side rule becomes when the keys are the cache (itself, unless it
    holds query-side arrays whose key side defaults to them)."""
    del slots, kv_len
    return self

  def config_rules(self) -> dict[str, Any] | None:
    """This object as AttentionConfig rule keywords ({"causal": True}, {"window": (l, r)},
    {"chunk_size": c}, merged over `&`), or None when the config cannot say it."""
    return None

def _as_mask(x: Any, op: str) -> Mask:
  if not isinstance(x, Mask):
    raise ValueError(f"`{op}` combines mask objects (splash_hk.masks.Causal(), ...), got "
                     f"{type(x).__name__}; wrap a dense bool array as splash_hk.masks.Dense(array).")
  return x


@dataclasses.dataclass(frozen=True)
class And(Mask):
  """Visible when both are: `a & b`."""

  a: Mask = part_field()
  b: Mask = part_field()

  def visible(self, q_pos: ArrayLike, kv_pos: ArrayLike) -> ArrayLike:
    return self.a.visible(q_pos, kv_pos) & self.b.visible(q_pos, kv_pos)

  def config_rules(self) -> dict[str, Any] | None:
    a, b = self.a.config_rules(), self.b.config_rules()
    return None if a is None or b is None or set(a) & set(b) else {**a, **b}

  def classify(self, blocks: Blocks) -> tuple[ArrayLike, ArrayLike]:
    (may_a, full_a), (may_b, full_b) = self.a.classify(blocks), self.b.classify(blocks)
    return may_a & may_b, full_a & full_b


@dataclasses.dataclass(frozen=True)
class Or(Mask):
  """Visible when either is: `a | b`."""

  a: Mask = part_field()
  b: Mask = part_field()

  def visible(self, q_pos: ArrayLike, kv_pos: ArrayLike) -> ArrayLike:
    return self.a.visible(q_pos, kv_pos) | self.b.visible(q_pos, kv_pos)

  def classify(self, blocks: Blocks) -> tuple[ArrayLike, ArrayLike]:
    (may_a, full_a), (may_b, full_b) = self.a.classify(blocks), self.b.classify(blocks)
    return may_a | may_b, full_a | full_b
