"""The kernel call: the library's backends registered, and one backend run on one shard.

Knows nothing of meshes: `attention` (or its shard_map wrapper) hands each
call the arrays of one shard in `KernelInputs` form. Each backend keeps its
limits, hardware, rank and call in its own file (`splash_hk/backends/`);
which one serves a call is the selector's decision (`splash_hk.fallback.selector`),
made from the registered table (`splash_hk.platforms`).
"""

from __future__ import annotations

from typing import Mapping

import jax

from splash_hk.backends import base
from splash_hk.backends.native import backend as native
from splash_hk.backends import reference
from splash_hk import platforms
from splash_hk.backends.tpu import backend as splash
from splash_hk.backends.gpu import backend as triton
from splash_hk.backends.xla import backend as xla
from splash_hk.pages import PagedFacts, PagedInputs
from splash_hk.types import Facts, KernelInputs, KernelOutput

__all__ = ("backend", "backends", "run", "run_paged")

for _backend in (splash.BACKEND, triton.BACKEND, native.BACKEND, xla.BACKEND, reference.BACKEND):
  platforms.register(_backend)


def backends() -> Mapping[str, base.Backend]:
  """Every registered backend by name (read-only)."""
  return platforms.backends()


def backend(name: str) -> base.Backend:
  """The registered backend `name`."""
  return backends()[name]


def run(name: str, x: KernelInputs, facts: Facts) -> KernelOutput:
  """Runs backend `name` on one shard: KernelInputs -> KernelOutput (out [B, T, Hq, Dv], ...)."""
  return backend(name).attend(x, facts)


def run_paged(name: str, x: PagedInputs, facts: PagedFacts) -> tuple[jax.Array, jax.Array]:
  """Runs backend `name`'s paged kernel: PagedInputs -> (out [N, Hq, Dv], lse [N, Hq])."""
  paged = backend(name).paged_attend
  if paged is None:
    raise ValueError(f"the {name} backend has no paged kernel (the selector chose it: a bug)")
  return paged(x, facts)
