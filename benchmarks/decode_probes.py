"""The decode bench's diagnoses (`bench_tpu_decode --probes`): what a paged decode step spends its
time on, each part timed alone in the same run (none of them is attention).

"copies": the paged kernel with its copies and no compute; "compute": its compute on whatever its
buffers hold, with no copy; "glue": neither (its grid, and every XLA operation of the step around
it); "plan": the step's lists and rows (`lists.plan`, jitted alone); "write": the new tokens
written into the pool (`pool.write`, jitted alone, the pool donated). `block_keys` is a tuning
setting of the kernel's keys a grid step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from benchmarks import timing
from splash_hk import lists
from splash_hk import pool as pool_lib
from splash_hk.backends.tpu import paged_kernel as tpu_paged

PROBES = ("copies", "compute", "glue", "plan", "write")
_SILENCED = {"copies": ("_compute",), "compute": ("_start", "_wait"),
             "glue": ("_compute", "_start", "_wait")}


@contextlib.contextmanager
def block_keys(keys: int | None) -> Iterator[None]:
  """The paged kernel reads `keys` keys a grid step inside (None: its own choice): a bench-only
  setting of `paged_kernel.BLOCK_KEYS`, its buffers' budget scaled with it."""
  if keys is None:
    yield
    return
  saved = tpu_paged.BLOCK_KEYS, tpu_paged.BUFFER_BUDGET
  tpu_paged.BLOCK_KEYS, tpu_paged.BUFFER_BUDGET = keys, saved[1] * max(1, keys // saved[0])
  try:
    yield
  finally:
    tpu_paged.BLOCK_KEYS, tpu_paged.BUFFER_BUDGET = saved


@contextlib.contextmanager
def probed(part: str) -> Iterator[None]:
  """The paged kernel with the parts `part` leaves out silenced (`_SILENCED`)."""
  names = _SILENCED[part]
  saved = {name: getattr(tpu_paged, name) for name in names}
  for name in names:
    setattr(tpu_paged, name, lambda *args, **kwargs: None)
  try:
    yield
  finally:
    for name, fn in saved.items():
      setattr(tpu_paged, name, fn)


def seconds(part: str, step: Any, repeats: int, timed_step: Callable[[], float]) -> float:
  """`part` of a decode step (`bench_tpu_decode.Step`) alone: `timed_step()` times the whole step
  (under `probed` for a kernel part)."""
  if part in _SILENCED:
    with probed(part):
      return timed_step()
  batch, cache = step.batch, step.pool
  if part == "plan":
    plan = jax.jit(lambda b: lists.plan(b, step.q.shape[0], cache.num_pages, cache.page_size,
                                        None))
    return timing.median_seconds(plan, batch, repeats=repeats)
  rows = step.q.shape[0] // len(step.lens)  # each sequence's new rows, its last tokens
  seq = jnp.repeat(jnp.arange(len(step.lens)), rows)  # [N]
  pos = jnp.asarray(step.lens)[seq] - rows + jnp.tile(jnp.arange(rows), len(step.lens))  # [N]
  page = batch.page_table[seq, pos // cache.page_size]
  write = jax.jit(lambda c, k, v: pool_lib.write(c, k, v, page, pos % cache.page_size),
                  donate_argnums=0)
  state = {"pool": jax.tree.map(jnp.copy, cache)}

  def once():
    state["pool"] = write(state["pool"], step.k, step.v)
    return state["pool"]

  return timing.median_seconds(once, repeats=repeats)
