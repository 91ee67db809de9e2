"""The kernel call: the table of backends, and one backend run on one shard.

Knows nothing of meshes: `attention` (or its shard_map wrapper) hands each
call the arrays of one shard in `KernelInputs` form. Each backend keeps its
limits and its call in its own file (`splash_hk/backends/`); which one serves
a call is the selector's decision (`splash_hk.fallback.selector`), made from
this table.
"""

from __future__ import annotations

from splash_hk.backends import base
from splash_hk.backends import reference
from splash_hk.backends import splash
from splash_hk.backends import triton
from splash_hk.backends import xla
from splash_hk.types import Facts, KernelInputs, KernelOutput

__all__ = ("BACKENDS", "run")

# Every backend, by platform name; the selector tries them best first.
BACKENDS: dict[str, base.Backend] = {
    b.name: b for b in (splash.BACKEND, triton.BACKEND, xla.BACKEND, reference.BACKEND)}


def run(backend: str, x: KernelInputs, facts: Facts) -> KernelOutput:
  """Runs `backend` on one shard: KernelInputs -> KernelOutput (out [B, T, Hq, Dv], ...)."""
  return BACKENDS[backend].attend(x, facts)
