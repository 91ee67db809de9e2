"""How the bench times a call: one untimed call of the same executable, then the timed one.

An untimed call first, because a call right after another implementation's runs
slower (measured: 0.13 s -> 0.25 s after a dense backward), whichever it is.

A call of about a millisecond is timed two more ways, because launching it and waiting for it
costs the lent TPU's host about 0.6 ms a call (a decode step over 32 x 8192 keys: 2.1 ms from
launch to result, 1.4 ms on the chip): `back_to_back_seconds`, calls launched one after the
other and waited for once (a launch hides behind the call before it, as in a serving loop), and
`device_seconds`, the chip's own time for the call's programs (a `jax.profiler` trace).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import tempfile
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


BACK_TO_BACK = 10  # calls launched back to back per timed sample


def _back_to_back(fn: Callable[..., Any], args: tuple[Any, ...], repeats: int,
                  calls: int) -> tuple[float, float]:
  """(a call's share of the time to launch `calls` calls of `fn(*args)` back to back and wait
  for them once, its share of the time to launch them alone): medians over `repeats` samples,
  after an untimed call."""
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    results = [fn(*args) for _ in range(calls)]
    launched = time.perf_counter()
    jax.block_until_ready(results)
    samples.append(((time.perf_counter() - start) / calls, (launched - start) / calls))
  done, launch = np.median(np.asarray(samples), axis=0)
  return float(done), float(launch)


def back_to_back_seconds(fn: Callable[..., Any], *args: Any, repeats: int,
                         calls: int = BACK_TO_BACK) -> float:
  """The median over `repeats` samples of a call's share of `calls` calls of `fn(*args)`
  launched back to back and waited for once (after an untimed call)."""
  return _back_to_back(fn, args, repeats, calls)[0]


def dispatch_seconds(fn: Callable[..., Any], *args: Any, repeats: int,
                     calls: int = BACK_TO_BACK) -> float:
  """The host's time to launch a call of `fn(*args)` back to back (`back_to_back_seconds`'s
  launches, not waited for). Where it nears the back-to-back time, the host, not the chip,
  bounds the calls."""
  return _back_to_back(fn, args, repeats, calls)[1]


def device_profile(fn: Callable[..., Any], *args: Any, repeats: int) -> collections.Counter:
  """Microseconds a call of `fn(*args)` spends in each device operation ("XLA Ops" lines of the
  trace's device planes) and in each program ("module NAME": "XLA Modules" lines), over a trace
  of `repeats` calls after an untimed one; empty where the trace has no device plane (a CPU)."""
  jax.block_until_ready(fn(*args))
  folder = tempfile.mkdtemp(prefix="splash_hk_trace")
  with jax.profiler.trace(folder):
    for _ in range(repeats):
      jax.block_until_ready(fn(*args))
  total: collections.Counter = collections.Counter()
  for path in glob.glob(f"{folder}/**/*.xplane.pb", recursive=True):
    for plane in jax.profiler.ProfileData.from_file(path).planes:
      if not plane.name.startswith("/device:"):
        continue
      for line in plane.lines:
        if line.name in ("XLA Ops", "XLA Modules"):
          prefix = "" if line.name == "XLA Ops" else "module "
          for event in line.events:
            total[prefix + event.name] += event.duration_ns / 1e3 / repeats
  return total


def device_seconds(fn: Callable[..., Any], *args: Any, repeats: int) -> float | None:
  """The chip's time for a call of `fn(*args)`: its programs' time in a trace (`device_profile`),
  or None where the trace has no device plane (a CPU)."""
  modules = [us for name, us in device_profile(fn, *args, repeats=repeats).items()
             if name.startswith("module ")]
  return sum(modules) / 1e6 if modules else None


@dataclasses.dataclass(frozen=True)
class Bandwidth:
  """Bytes a second a jitted sum reads, timed each of the three ways (`timing`)."""

  back_to_back: float
  launch: float
  device: float | None  # None: no device trace (a CPU)

  @classmethod
  def measure(cls, gib: float, repeats: int) -> Bandwidth:
    big = jnp.ones((int(gib * 2**28),), jnp.float32)
    total = jax.jit(jnp.sum)
    device = device_seconds(total, big, repeats=repeats)
    return cls(big.nbytes / back_to_back_seconds(total, big, repeats=repeats),
               big.nbytes / median_seconds(total, big, repeats=repeats),
               None if device is None else big.nbytes / device)


def figures(call: Callable[[], Any], bytes_read: int, bandwidth: Bandwidth, repeats: int,
            back_to_back: float | None = None) -> dict[str, Any]:
  """A call's times (ms: back to back, launched alone, on the chip) and fractions of the
  bandwidth timed the same way; `back_to_back` already measured, or None."""
  seconds = back_to_back or back_to_back_seconds(call, repeats=repeats)
  launch = median_seconds(call, repeats=repeats)
  device = device_seconds(call, repeats=repeats)
  dispatch = dispatch_seconds(call, repeats=repeats)
  fraction = lambda rate, t: None if rate is None or t is None else round(bytes_read / rate / t, 3)
  return {"ms": round(seconds * 1e3, 4), "launch_ms": round(launch * 1e3, 4),
          "device_ms": None if device is None else round(device * 1e3, 4),
          "dispatch_ms": round(dispatch * 1e3, 4),
          "fraction_of_bandwidth": fraction(bandwidth.back_to_back, seconds),
          "launch_fraction": fraction(bandwidth.launch, launch),
          "device_fraction": fraction(bandwidth.device, device)}


def top_ops(call: Callable[[], Any], repeats: int, top: int = 25) -> dict[str, float]:
  """The `top` device operations and programs of a call by time, in microseconds a call."""
  ops = device_profile(call, repeats=repeats)
  return {name: round(us, 2) for name, us in ops.most_common(top)}


FB_FACTOR = 3.5  # a forward+backward's flops over its forward's (the TPU benches' convention)


def matmul_peak(repeats: int, size: int = 8192) -> float:
  """bf16 flop/s of a size^3 product, measured now."""
  a = jnp.ones((size, size), jnp.bfloat16)
  seconds = median_seconds(jax.jit(jnp.dot), a, a, repeats=repeats)
  return 2.0 * size ** 3 / seconds
