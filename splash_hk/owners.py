"""A cache's owner as pytree metadata: the layer that first wrote it, part of its structure.

`KVCache` and `PagedKVCache` keep their owner (a layer's name, or None before any layer wrote
them) as static metadata, so the owner check costs nothing under `jit`. The price: an unwritten
cache and a written one are two pytree structures, so a `lax.scan` / `while_loop` carry must
enter written. JAX's error for a carry whose structure changes prints each side's metadata;
`Owner`'s repr is that metadata, and for an unwritten cache it says what to do instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.tree_util import GetAttrKey

__all__ = ("Owner", "check", "checked", "register")

UNWRITTEN = ("an unwritten cache (no layer has written it yet; a loop carry must enter written: "
             "write it once before the loop, or build it owned: mha.init_cache(..., "
             "owner=mha.module_name) in Haiku, owner=mha.name in Flax, or KVCache.zeros(..., "
             "owner=the layer's name))")


@dataclasses.dataclass(frozen=True)
class Owner:
  """A cache's pytree metadata: its owner, equal and hashed by the name alone."""

  name: str | None

  def __repr__(self) -> str:
    return f"owner={self.name!r}" if self.name is not None else f"owner=None, {UNWRITTEN}"


def checked(owner: Any) -> str | None:
  """A cache's `owner` argument: a layer's name, or None."""
  if owner is not None and not isinstance(owner, str):
    raise ValueError(f"`owner` must be a layer's name (a str, e.g. mha.module_name) or None, got "
                     f"{owner!r}.")
  return owner


def check(cache: Any, owner: str | None, argument: str) -> None:
  """A cache another layer wrote first (`cache.owner` set and not `owner`) is a ValueError naming
  `argument` and both layers."""
  checked(owner)
  if owner is not None and cache.owner is not None and cache.owner != owner:
    kind = type(cache).__name__
    raise ValueError(
        f"`{argument}` belongs to layer {cache.owner!r} (it wrote it first) and was given to layer "
        f"{owner!r}: every attention layer needs a cache of its own (one {kind} per layer, e.g. a "
        "list with one per layer); a cache chained through layers, or two layers' caches swapped, "
        "would attend to the wrong keys.")


def register(cls: type, data_fields: tuple[str, ...]) -> type:
  """Registers the frozen dataclass `cls` (fields `data_fields`, then `owner`) as a pytree whose
  children are `data_fields` (keyed by attribute, as `register_dataclass` keys them) and whose
  metadata is its `Owner`."""

  def flatten_with_keys(c: Any) -> tuple[tuple[tuple[GetAttrKey, Any], ...], Owner]:
    return tuple((GetAttrKey(f), getattr(c, f)) for f in data_fields), Owner(c.owner)

  def flatten(c: Any) -> tuple[tuple[Any, ...], Owner]:
    return tuple(getattr(c, f) for f in data_fields), Owner(c.owner)

  def unflatten(meta: Owner, children: Any) -> Any:
    made: Any = object.__new__(cls)  # no __init__/__post_init__: leaves may be anything (tracers, specs)
    for f, child in zip(data_fields, children):
      object.__setattr__(made, f, child)
    object.__setattr__(made, "owner", meta.name)
    return made

  jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
  return cls
