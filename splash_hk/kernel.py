"""The kernel call: look up one backend in the table and run it on one shard.

Knows nothing of meshes: `attention` (or its shard_map wrapper) hands each
call the arrays of one shard in `KernelInputs` form. Each backend keeps its
limits and its call in its own file (`splash_hk/backends/`, the reference in
`splash_hk/fallback/`); the table is the selector's `BACKENDS`.
"""

from __future__ import annotations

from splash_hk.fallback.selector import BACKENDS
from splash_hk.types import Facts, KernelInputs, KernelOutput

__all__ = ("BACKENDS", "run")


def run(backend: str, x: KernelInputs, facts: Facts) -> KernelOutput:
  """Runs `backend` on one shard: KernelInputs -> KernelOutput (out [B, T, Hq, Dv], ...)."""
  return BACKENDS[backend].attend(x, facts)
