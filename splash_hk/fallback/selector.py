"""The decision table: which backend serves a call, as a pure function of static facts."""

from __future__ import annotations

from typing import Sequence

from absl import logging
import jax

from splash_hk.config import AttentionConfig
from splash_hk.mode import detect_mode
from splash_hk.types import Decision, Mode

_ACCELERATOR_KERNEL = {"tpu": "splash", "gpu": "triton"}
_LOGGED_REASONS: set[str] = set()  # a cache: each fallback reason is logged once


def _kernel_limit(
    backend: str,
    config: AttentionConfig,
    *,
    hardware: str,
    mode: Mode,
    mask_shape: Sequence[int] | None,
    return_weights: bool,
) -> str | None:
  """Why `backend` cannot serve this call, or None if it can."""
  if backend == "reference":
    return None
  if return_weights:
    return "attention weights were requested and only the reference path materialises them"
  if backend == "xla":
    if mask_shape is not None and mask_shape[1] > 1:
      return ("a per-head dense mask was given and ejkernel's XLA block-sparse path reads only "
              "head 0 of a dense mask")
    return None
  if backend == "splash":
    if hardware != "tpu" and not config.interpret:
      return (f"the Pallas splash kernel needs a TPU (this is {hardware}); set "
              "AttentionConfig(interpret=True) to run it in interpret mode")
    return "the Pallas splash kernel is not wired into this version of splash_hk"
  if backend == "triton":
    if hardware != "gpu":
      return f"ejkernel's Triton kernel needs a GPU (this is {hardware})"
    return "ejkernel's Triton kernel is not wired into this version of splash_hk"
  raise ValueError(f"Unknown backend {backend!r}.")


def candidates(platform: str, hardware: str) -> tuple[str, ...]:
  """Backends to try, best first: the requested one (or the hardware's kernel), xla, reference."""
  if platform == "auto":
    first = (_ACCELERATOR_KERNEL[hardware],) if hardware in _ACCELERATOR_KERNEL else ()
  else:
    first = (platform,)
  return tuple(dict.fromkeys(first + ("xla", "reference")))


def select_backend(
    config: AttentionConfig,
    *,
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    mask_shape: Sequence[int] | None = None,
    return_weights: bool = False,
    hardware: str | None = None,
) -> Decision:
  """Picks the backend for one call.

  Args:
    config: the attention config (platform, interpret, mask features).
    query_shape: [B, T, Hq, D].
    key_shape: [B, S, Hkv, D].
    mask_shape: shape of the dense mask, if one is given.
    return_weights: whether attention weights are requested.
    hardware: "cpu", "gpu" or "tpu"; default `jax.default_backend()`.

  Returns:
    Decision(backend, reason, fallback). `fallback` is True when the first
    choice (the requested platform, or the hardware's kernel on "auto") could
    not serve; `reason` then says why.

  Raises:
    ValueError: on a fallback when `config.allow_fallback` is False.
  """
  hardware = hardware or jax.default_backend()
  mode = detect_mode(query_shape[1], key_shape[1])
  options = candidates(config.platform, hardware)
  refusals = []
  for backend in options:
    why_not = _kernel_limit(backend, config, hardware=hardware, mode=mode, mask_shape=mask_shape,
                            return_weights=return_weights)
    if why_not is None:
      break
    refusals.append(f"{backend}: {why_not}")
  if not refusals:
    asked = "requested" if config.platform == backend else f"first choice on {hardware}"
    return Decision(backend, f"{backend} is the {asked} ({mode.value} mode)")
  reason = f"falling back to {backend} ({mode.value} mode) because " + "; ".join(refusals)
  if not config.allow_fallback:
    raise ValueError(f"{reason}. AttentionConfig(allow_fallback=False) forbids fallbacks: "
                     "change the inputs or the platform, or allow the fallback.")
  return Decision(backend, reason, fallback=True)


def log_fallback(decision: Decision) -> None:
  """Logs a fallback's reason, once per distinct reason."""
  if decision.fallback and decision.reason not in _LOGGED_REASONS:
    _LOGGED_REASONS.add(decision.reason)
    logging.warning("splash_hk: %s", decision.reason)
