"""The base of every mask object: fields declared as arrays or parts, pytree registration, the
walks over arrays and parts, and `&` / `|` (`And`, `Or`).

A mask object is a frozen dataclass. Its fields are static (part of the pytree's
structure: hashable, compared by value) unless declared with `array_field` (an array
leaf, with the side it lies on) or `part_field` (a mask object it combines), so a
field added anywhere in a class keeps the pytree right.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator

import jax
import numpy as np

from splash_hk.masks._blocks import ArrayLike, Blocks

Shaped = jax.Array | np.ndarray | jax.ShapeDtypeStruct  # an array, or its shape (for `explain`)


def array_field(side: str, default: Any = dataclasses.MISSING) -> Any:
  """A mask object's array field, a pytree leaf of `side`: "q" ([B, T], with the queries),
  "kv" ([B, S], with the keys) or "qk" ([B|1, 1|Hq, T, S], with both)."""
  return dataclasses.field(default=default, metadata={"side": side})


def part_field() -> Any:
  """A field holding another mask object (of `&` and `|`): a pytree child."""
  return dataclasses.field(metadata={"part": True})


@dataclasses.dataclass(frozen=True)
class Mask:
  """The base of every mask object: `&`, `|`, and the walks over array leaves and parts.

  A subclass is a frozen dataclass; its fields are static (the pytree's structure:
  hashable, compared by value) unless declared with `array_field` (leaves) or
  `part_field` (mask objects it combines). Subclasses register as pytrees themselves.
  """

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    jax.tree_util.register_pytree_node(cls, _flatten, functools.partial(_unflatten, cls))

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
    return not _fields(self, "side") and all(p.is_static() for p in self._children())

  @property
  def name(self) -> str:
    """How messages name this object."""
    return type(self).__name__

  def array_fields(self) -> list[tuple[str, str, Any]]:
    """(field name, side, array) of this object's own arrays (not its parts'), as given."""
    return [(f.name, f.metadata["side"], getattr(self, f.name)) for f in _fields(self, "side")
            if getattr(self, f.name) is not None]

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

  def over_slots(self, slots: Any, kv_len: int) -> Mask:
    """This object over a KV cache of `kv_len` slots, the new tokens written at `slots`
    [B, T]: what a query-side rule becomes when the keys are the cache (itself, unless it
    holds query-side arrays whose key side defaults to them)."""
    del slots, kv_len
    return self

  def array_sides(self) -> set[str]:
    """The sides ("q", "kv", "qk") of the arrays this mask holds, over every part."""
    own = {f.metadata["side"] for f in _fields(self, "side") if getattr(self, f.name) is not None}
    return own.union(*(child.array_sides() for child in self._children()))

  def config_rules(self) -> dict[str, Any] | None:
    """This object as AttentionConfig rule keywords ({"causal": True}, {"window": (l, r)},
    {"chunk_size": c}, merged over `&`), or None when the config cannot say it."""
    return None

  def _children(self) -> tuple[Mask, ...]:
    return tuple(getattr(self, f.name) for f in _fields(self, "part"))

  def map_arrays(self, f: Callable[[str, Any], Any]) -> Mask:
    """This mask with each array leaf `a` of side `side` replaced by `f(side, a)`."""
    changes = {field.name: f(field.metadata["side"], getattr(self, field.name))
               for field in _fields(self, "side") if getattr(self, field.name) is not None}
    changes.update({field.name: getattr(self, field.name).map_arrays(f)
                    for field in _fields(self, "part")})
    return dataclasses.replace(self, **changes)

  def parts(self) -> Iterator[Mask]:
    """The objects this mask combines (itself for a leaf object)."""
    children = self._children()
    if not children:
      yield self
    for child in children:
      yield from child.parts()

  def map_parts(self, f: Callable[[Mask], Mask]) -> Mask:
    """This mask with each object it combines replaced by `f(object)`."""
    if not _fields(self, "part"):
      return f(self)
    return dataclasses.replace(self, **{field.name: getattr(self, field.name).map_parts(f)
                                        for field in _fields(self, "part")})


def _fields(mask: Mask | type[Mask], kind: str) -> tuple[dataclasses.Field, ...]:
  """The dataclass fields of `mask` whose metadata has `kind` ("side" or "part")."""
  return tuple(f for f in dataclasses.fields(mask) if kind in f.metadata)


def _flatten(mask: Mask) -> tuple[tuple, tuple]:
  dynamic = [f.name for f in dataclasses.fields(mask) if f.metadata]
  static = tuple((f.name, getattr(mask, f.name)) for f in dataclasses.fields(mask)
                 if not f.metadata)
  return tuple(getattr(mask, n) for n in dynamic), (tuple(dynamic), static)


def _unflatten(cls: type[Mask], aux: tuple, children: tuple) -> Mask:
  names, static = aux
  mask = object.__new__(cls)  # no __post_init__: the fields were checked when first built
  for name, value in (*zip(names, children), *static):
    object.__setattr__(mask, name, value)
  return mask


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


def skeleton(rule: Mask | None) -> Mask | None:
  """`rule` with its arrays as ShapeDtypeStructs: hashable and static (for `Facts`)."""
  if rule is None:
    return None
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), rule)
