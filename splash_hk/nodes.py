"""Frozen dataclasses that are pytrees by their declared fields: the base of mask and score objects.

A `Node` subclass is a frozen dataclass. Its fields are static (part of the pytree's
structure: hashable, compared by value) unless declared with `array_field` (array
leaves, or a pytree of them, with the side they lie on) or `part_field` (another
node it combines), so a field added anywhere in a class keeps the pytree right.
Sides: "q" ([B, T], with the queries), "kv" ([B, S], with the keys), "qk"
([B|1, 1|H, T, S], with both), "head" (per query head, on axis `axis`), "free"
(any shape, whole on every device).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator, TypeVar

import jax
import numpy as np
from typing_extensions import Self

Shaped = jax.Array | np.ndarray | jax.ShapeDtypeStruct  # an array, or its shape (for `explain`)


def array_field(side: str, default: Any = dataclasses.MISSING, axis: int = 0) -> Any:
  """A node's array field (an array or a pytree of arrays: leaves) lying on `side` (see above);
  `axis`: where a "head" array holds its heads."""
  return dataclasses.field(default=default, metadata={"side": side, "axis": axis})


def part_field() -> Any:
  """A field holding another node (an operand of `&`, `|` or `+`): a pytree child."""
  return dataclasses.field(metadata={"part": True})


@dataclasses.dataclass(frozen=True)
class Node:
  """Walks over a node's arrays and parts; subclasses register as pytrees themselves."""

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)
    jax.tree_util.register_pytree_node(cls, _flatten, functools.partial(_unflatten, cls))

  def array_fields(self) -> list[tuple[str, str, Any]]:
    """(field name, side, value) of this node's own arrays (not its parts'), as given."""
    return [(f.name, f.metadata["side"], getattr(self, f.name)) for f in fields(self, "side")
            if getattr(self, f.name) is not None]

  def array_sides(self) -> set[str]:
    """The sides of the arrays this node holds, over every part."""
    own = {side for _, side, _ in self.array_fields()}
    return own.union(*(child.array_sides() for child in self.children()))

  def children(self) -> tuple[Self, ...]:
    """The nodes this one combines (none for a leaf node)."""
    return tuple(getattr(self, f.name) for f in fields(self, "part"))

  def map_arrays(self, f: Callable[..., Any]) -> Self:
    """This node with each array leaf `a` of a field on `side` replaced by `f(side, a)` (with
    `axis=` for "head" arrays), over every part."""
    def leaf(field: dataclasses.Field) -> Any:
      side, axis = field.metadata["side"], field.metadata["axis"]
      call = (lambda a: f(side, a, axis=axis)) if side == "head" else (lambda a: f(side, a))
      return jax.tree.map(call, getattr(self, field.name))

    changes = {field.name: leaf(field) for field in fields(self, "side")
               if getattr(self, field.name) is not None}
    changes.update({field.name: getattr(self, field.name).map_arrays(f)
                    for field in fields(self, "part")})
    return dataclasses.replace(self, **changes)

  def parts(self) -> Iterator[Self]:
    """The leaf nodes this node combines (itself for a leaf node)."""
    children = self.children()
    if not children:
      yield self
    for child in children:
      yield from child.parts()

  def map_parts(self, f: Callable[[Self], Self]) -> Self:
    """This node with each leaf node it combines replaced by `f(node)`."""
    if not fields(self, "part"):
      return f(self)
    return dataclasses.replace(self, **{field.name: getattr(self, field.name).map_parts(f)
                                        for field in fields(self, "part")})


def fields(node: Node | type[Node], kind: str) -> tuple[dataclasses.Field, ...]:
  """The dataclass fields of `node` whose metadata has `kind` ("side" or "part")."""
  return tuple(f for f in dataclasses.fields(node) if kind in f.metadata)


def _flatten(node: Node) -> tuple[tuple, tuple]:
  dynamic = [f.name for f in dataclasses.fields(node) if f.metadata]
  static = tuple((f.name, getattr(node, f.name)) for f in dataclasses.fields(node)
                 if not f.metadata)
  return tuple(getattr(node, n) for n in dynamic), (tuple(dynamic), static)


def _unflatten(cls: type[Node], aux: tuple, children: tuple) -> Node:
  names, static = aux
  node = object.__new__(cls)  # no __post_init__: the fields were checked when first built
  for name, value in (*zip(names, children), *static):
    object.__setattr__(node, name, value)
  return node


N = TypeVar("N", bound=Node)


def skeleton(node: N | None) -> N | None:
  """`node` with its arrays as ShapeDtypeStructs: static (for `Facts`; hashable, or through
  `Static` when it holds a dict)."""
  if node is None:
    return None
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), node)


def _static_key(value: Any) -> Any:
  """`value` if hashable, else a hashable equivalent: a dataclass by its fields, any other
  pytree (a ScoreFn's dict of params) by its structure and leaves."""
  try:
    hash(value)
    return value
  except TypeError:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      return (type(value), *(_static_key(getattr(value, f.name))
                             for f in dataclasses.fields(value)))
    leaves, treedef = jax.tree.flatten(value)
    return treedef, tuple(_static_key(leaf) for leaf in leaves)


class Static:
  """A static `jax.jit` argument (a call's facts) hashed and compared by value, also when a
  skeleton in it holds a dict (a `ScoreFn`'s params), which has no hash of its own."""

  __slots__ = ("value", "_key")

  def __init__(self, value: Any):
    self.value = value
    self._key = _static_key(value)

  def __hash__(self) -> int:
    return hash(self._key)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Static) and self._key == other._key
