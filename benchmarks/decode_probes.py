"""The decode bench's diagnoses (`bench_tpu_decode --probes`): the paged kernel with one part of
its work silenced, the step timed as a whole.

"copies": the kernel with its copies and no compute; "compute": its compute on whatever its
buffers hold, with no copy; "glue": neither (its grid, and every XLA operation of the step around
it). Each part of a step alone is what `--profile` shows (`timing.device_profile`: the chip's
time in each operation; a part jitted and timed alone costs a launch, 0.6-0.9 ms on the lent
TPU, which is not its time in a step: the pool's write, 0.7 ms alone, is 5 us of a step).
`block_keys` is a tuning setting of the kernel's keys a grid step.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from splash_hk.backends.tpu import paged_copies
from splash_hk.backends.tpu import paged_kernel as tpu_paged

PROBES = ("copies", "compute", "glue")
_COMPUTE = ((tpu_paged, "_compute"),)
_COPIES = ((paged_copies, "start"), (paged_copies, "wait"))
_SILENCED = {"copies": _COMPUTE, "compute": _COPIES, "glue": _COMPUTE + _COPIES}


@contextlib.contextmanager
def block_keys(keys: int | None) -> Iterator[None]:
  """The paged kernel reads `keys` keys a grid step inside (None: its own choice): a bench-only
  setting of `paged_kernel.BLOCK_KEYS`, its buffers' budget scaled with it."""
  if keys is None:
    yield
    return
  saved = tpu_paged.BLOCK_KEYS, tpu_paged.BUFFER_BUDGET
  tpu_paged.BLOCK_KEYS, tpu_paged.BUFFER_BUDGET = keys, saved[1] * keys // saved[0]
  try:
    yield
  finally:
    tpu_paged.BLOCK_KEYS, tpu_paged.BUFFER_BUDGET = saved


@contextlib.contextmanager
def probed(part: str) -> Iterator[None]:
  """The paged kernel with the parts `part` leaves out silenced (`_SILENCED`)."""
  names = _SILENCED[part]
  saved = [(module, name, getattr(module, name)) for module, name in names]
  for module, name in names:
    setattr(module, name, lambda *args, **kwargs: None)
  try:
    yield
  finally:
    for module, name, fn in saved:
      setattr(module, name, fn)


def seconds(part: str, timed_step: Callable[[], float]) -> float:
  """A decode step with `part` of its kernel alone: `timed_step()` times the whole step, here
  under `probed`."""
  with probed(part):
    return timed_step()
