"""The table of backends by platform name, which `AttentionConfig(platform=...)`, the selector and
`explain` read. `splash_hk.kernel` registers the library's backends; a test may register its own.

The table is the one piece of module state beyond caches: written when `splash_hk`
is imported (and by `register`/`unregister` calls), read everywhere else.
"""

from __future__ import annotations

import types
from typing import Any, Mapping

AUTO = "auto"  # not a backend: "the best one for this hardware"
# name -> `splash_hk.backends.base.Backend` (typed where it is read: `splash_hk.kernel`; this
# module imports nothing, so that `AttentionConfig` can check a platform name against it).
_TABLE: dict[str, Any] = {}


HARDWARE = ("cpu", "gpu", "tpu")  # what `jax.default_backend()` names (and `explain` plans for)
EXPORT_NAMES = {"cuda": "gpu", "rocm": "gpu"}  # `jax.export`'s platform names for a GPU


def hardware(for_platform: str | None) -> str | None:
  """`explain`'s `for_platform` as the hardware the selector plans for (None: this host's)."""
  if for_platform is None:
    return None
  name = EXPORT_NAMES.get(for_platform, for_platform)
  if name not in HARDWARE:
    raise ValueError(f"`for_platform` must be one of {HARDWARE} (or jax.export's 'cuda' / "
                     f"'rocm'), or None for this host, got {for_platform!r}.")
  return name


def register(backend: Any) -> Any:
  """Adds `backend` to the table under its name (a new name, not "auto"); returns it."""
  if backend.name == AUTO or backend.name in _TABLE:
    raise ValueError(f"a backend named {backend.name!r} cannot be registered: the name is "
                     f"{'reserved' if backend.name == AUTO else 'taken'}.")
  _TABLE[backend.name] = backend
  return backend


def unregister(name: str) -> None:
  """Removes the backend `name` from the table."""
  del _TABLE[name]


def backends() -> Mapping[str, Any]:
  """Every registered backend by name, in registration order (read-only)."""
  return types.MappingProxyType(_TABLE)


def names() -> tuple[str, ...]:
  """What `AttentionConfig(platform=...)` accepts: "auto" and every registered name."""
  return (AUTO, *_TABLE)
