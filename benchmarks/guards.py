"""Ways to guard the TPU kernel's output against spread garbage, timed apart (`bench_tpu --guards`).

The splash backend guards its dense kernel on the head-major arrays the kernel reads
(`guard.guard_head_major`: a call that is not differentiated checks v first and runs the kernel
or the xla path; differentiated, the outputs and gradients are checked after). Each variant
here is the splash backend under another guard, registered apart for the run, so the bench can
time them in one process and write their compiled programs:

- `none`: no guard (the kernels alone): the guard's share of ours.
- `bthd`: the guard before this one: the output checked after the kernel on the caller's
  [B, T, H, D] arrays (`guard.guard_garbage` around the whole call), kept by a while loop.
- `bthd_cond`: the same, kept by a `lax.cond`.
- `after`: the head-major guard checking the output after the kernel in the primal too.
- `select`: not a guard; the output's check joined to it by a `where` (NaN where not finite),
  without control flow: what the check and its dependency cost alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from splash_hk import platforms
from splash_hk.backends import base
from splash_hk.backends import guard
from splash_hk.backends.tpu import backend as splash_tpu
from splash_hk.backends.xla import backend as xla
from splash_hk.types import KernelOutput

VARIANTS = ("none", "bthd", "bthd_cond", "after", "select")


def _cond_keep(ok: jax.Array, value: Any, recompute: Callable[[], Any]) -> Any:
  return jax.lax.cond(ok, lambda: value, recompute)


def _after(kernel: base.Attend, exact: base.Attend) -> base.Attend:
  del kernel  # the head-major kernel, not the [B, T, H, D] attend
  return guard.guard_head_major(splash_tpu.attend_head_major, exact, values_first=False)


def _select(kernel: base.Attend, exact: base.Attend) -> base.Attend:
  del exact

  def attend(x, facts):
    out = kernel(x, facts).out
    return KernelOutput(jnp.where(guard.all_finite(out), out, jnp.nan).astype(out.dtype))

  return attend


def attend(variant: str) -> base.Attend:
  """The splash backend's attend under `variant`'s guard."""
  kernel, exact = splash_tpu.attend, xla.attend
  if variant == "none":
    return kernel
  guards: dict[str, Callable[[base.Attend, base.Attend], base.Attend]] = {
      "bthd": guard.guard_garbage, "bthd_cond": functools.partial(guard.guard_garbage,
                                                                  keep=_cond_keep),
      "after": _after, "select": _select}
  return guards[variant](kernel, exact)


@contextlib.contextmanager
def registered(variant: str) -> Iterator[str]:
  """The splash backend under `variant`'s guard, registered while the block runs (portable and
  last in rank: no "auto" call picks it); yields its name."""
  name = f"splash_guard_{variant}"
  platforms.register(dataclasses.replace(splash_tpu.BACKEND, name=name, attend=attend(variant),
                                         hardware=(), rank=10**6))
  try:
    yield name
  finally:
    platforms.unregister(name)
