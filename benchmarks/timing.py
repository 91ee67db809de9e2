"""How the bench times a call: one untimed call of the same executable, then the timed one.

An untimed call first, because a call right after another implementation's runs
slower (measured: 0.13 s -> 0.25 s after a dense backward), whichever it is.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


def timed_call(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
  """(seconds, result) of `fn(*args)`, timed after one untimed call of it."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  result = jax.block_until_ready(fn(*args))
  return time.perf_counter() - start, result


def read_bandwidth(gib: float, repeats: int) -> float:
  """Bytes per second of a jitted sum over a `gib` GiB float32 array: the machine's read
  bandwidth, in the same run as the figures it divides."""
  big = jnp.ones((int(gib * 2**28),), jnp.float32)
  seconds = median_seconds(jax.jit(jnp.sum), big, repeats=repeats)
  return big.nbytes / seconds


def one_core_bandwidth(gib: float, repeats: int) -> float:
  """Bytes per second of NumPy's sum over a `gib` GiB float32 array: what one core reads (the
  sum runs on the calling thread; XLA's runs on every core)."""
  big = np.ones((int(gib * 2**28),), np.float32)
  seconds = []
  for _ in range(repeats + 1):  # the first call untimed, as `timed_call`
    start = time.perf_counter()
    big.sum()
    seconds.append(time.perf_counter() - start)
  return big.nbytes / float(np.median(seconds[1:]))


def median_seconds(fn: Callable[..., Any], *args: Any, repeats: int) -> float:
  """The median of `repeats` timed calls (`timed_call`) of `fn(*args)`."""
  return float(np.median([timed_call(fn, *args)[0] for _ in range(repeats)]))
