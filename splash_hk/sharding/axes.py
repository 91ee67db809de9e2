"""Which mesh axes carry which attention dimension, and how a sharded sequence is attended."""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import logging

AxisEntry = str | tuple[str, ...] | None
SEQUENCE_STRATEGIES = ("all_gather", "ring", "ulysses")


def _as_tuple(entry: AxisEntry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """Mesh axis names for the batch, head and (optional) sequence dimensions.

  Each axis field is an axis name, a tuple of names (sharded over their
  product), or None. Axes missing from a mesh, or not dividing a dimension, are
  dropped per call (see `stable_spec`), so one MeshAxes serves every mesh shape.

  Attributes:
    batch: axes of the batch dimension.
    heads: axes of the head dimension.
    sequence: axes of the query sequence (context parallelism), or None.
    sequence_strategy: "all_gather" (every shard sees all keys/values),
      "ring" (keys/values stay sharded too and travel around the ring) or
      "ulysses" (all-to-all: every device attends the whole sequence with its
      share of the heads, on any backend).
    load_balanced: the sequence is in dual-chunk order (`load_balance`), so
      causal work is even across shards; needs `sequence`.
  """

  batch: AxisEntry = ("dp", "fsdp")
  heads: AxisEntry = "tp"
  sequence: AxisEntry = None
  sequence_strategy: str = "all_gather"
  load_balanced: bool = False

  def __post_init__(self) -> None:
    seen: list[str] = []
    for name in ("batch", "heads", "sequence"):
      entry = getattr(self, name)
      names = _as_tuple(entry)
      if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"MeshAxes.{name} must be an axis name, a tuple of names or None, "
                         f"got {entry!r}.")
      if isinstance(entry, list):
        object.__setattr__(self, name, tuple(entry))
      seen.extend(names)
    repeated = sorted({n for n in seen if seen.count(n) > 1})
    if repeated:
      raise ValueError(f"MeshAxes names each mesh axis at most once; {repeated} repeat in {self}.")
    if self.sequence_strategy not in SEQUENCE_STRATEGIES:
      raise ValueError(f"MeshAxes.sequence_strategy must be one of {SEQUENCE_STRATEGIES}, got "
                       f"{self.sequence_strategy!r}.")
    if not isinstance(self.load_balanced, bool):
      raise ValueError(f"MeshAxes.load_balanced must be a bool, got {self.load_balanced!r}.")
    if self.load_balanced and self.sequence is None:
      raise ValueError("MeshAxes(load_balanced=True) needs `sequence` (the axis the balanced "
                       "sequence is sharded over), e.g. MeshAxes(sequence='sp', load_balanced=True).")

  def names(self) -> tuple[str, ...]:
    """Every mesh axis name these axes mention (batch, heads, sequence), in that order."""
    return tuple(n for entry in (self.batch, self.heads, self.sequence) for n in _as_tuple(entry))


_DEFAULT_NAMES = frozenset(MeshAxes().names())  # meshes often lack one (fsdp): said quietly
_LOGGED: set[tuple[tuple[str, ...], tuple[str, ...]]] = set()  # a cache: each said once


def dropped_names(axes: MeshAxes, mesh: Any) -> tuple[str, ...]:
  """The names of `axes` that `mesh` lacks (they are dropped: one MeshAxes serves many meshes),
  logged once per (names, mesh names); axes of which the mesh has no name at all are a
  ValueError naming `axes` and the mesh's names (they would leave the call silently unsharded).
  """
  have = tuple(mesh.shape)
  missing = tuple(n for n in axes.names() if n not in have)
  if axes.names() and len(missing) == len(axes.names()):
    raise ValueError(f"`axes` names mesh axes {list(axes.names())} and the mesh has none of them "
                     f"(its axes are {list(have)}): name the mesh's axes, e.g. "
                     f"MeshAxes(batch={have[0]!r}{f', heads={have[-1]!r}' if len(have) > 1 else ''}).")
  if missing and (missing, have) not in _LOGGED:
    _LOGGED.add((missing, have))
    log = logging.info if set(missing) <= _DEFAULT_NAMES else logging.warning
    log("splash_hk: mesh axes %s of `axes` are not in the mesh (its axes are %s): dropped, "
        "those dimensions are not sharded over them.", list(missing), list(have))
  return missing
