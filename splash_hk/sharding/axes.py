"""Which mesh axes carry which attention dimension."""

from __future__ import annotations

import dataclasses

AxisEntry = str | tuple[str, ...] | None


def _as_tuple(entry: AxisEntry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """Mesh axis names for the batch, head and (optional) query-sequence dimensions.

  Each field is an axis name, a tuple of names (sharded over their product), or
  None. Axes missing from a mesh, or not dividing a dimension, are dropped per
  call (see `stable_spec`), so one MeshAxes serves every mesh shape.
  """

  batch: AxisEntry = ("dp", "fsdp")
  heads: AxisEntry = "tp"
  sequence: AxisEntry = None

  def __post_init__(self):
    seen = []
    for field in dataclasses.fields(self):
      entry = getattr(self, field.name)
      names = _as_tuple(entry)
      if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"MeshAxes.{field.name} must be an axis name, a tuple of names or None, "
                         f"got {entry!r}.")
      if isinstance(entry, list):
        object.__setattr__(self, field.name, tuple(entry))
      seen.extend(names)
    repeated = sorted({n for n in seen if seen.count(n) > 1})
    if repeated:
      raise ValueError(f"MeshAxes names each mesh axis at most once; {repeated} repeat in {self}.")
