"""The decision table: which backend serves a call, as a pure function of static facts."""

from __future__ import annotations

from typing import Sequence

from absl import logging
import jax

from splash_hk.config import AttentionConfig
from splash_hk.mode import detect_mode
from splash_hk.types import Decision, Mode

_ACCELERATOR_KERNEL = {"tpu": "splash", "gpu": "triton"}
LANE = 128  # the splash kernel's block granularity
_LOGGED_REASONS: set[str] = set()  # a cache: each fallback reason is logged once


def _kernel_limit(
    backend: str,
    config: AttentionConfig,
    *,
    hardware: str,
    mode: Mode,
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    value_dim: int,
    mask_shape: Sequence[int] | None,
    positions_given: bool,
    sequence_shards: int,
    return_weights: bool,
) -> str | None:
  """Why `backend` cannot serve this call, or None if it can."""
  if backend == "reference":
    return None
  if return_weights:
    return "attention weights were requested and only the reference path materialises them"
  if backend == "xla":
    return None
  query_len, kv_len = query_shape[1], key_shape[1]
  if backend == "splash":
    if hardware != "tpu" and not config.interpret:
      return (f"the Pallas splash kernel needs a TPU (this is {hardware}); set "
              "AttentionConfig(interpret=True) to run it in interpret mode")
    if mode is Mode.DECODE:
      return "decode (T == 1): one query row does not fill a splash block"
    if sequence_shards > 1 and query_len // sequence_shards < LANE:
      return (f"query_len {query_len} in {sequence_shards} sequence shards: a shard shorter "
              f"than one {LANE}-row splash block is cheaper unpadded")
    if min(query_len, kv_len) < LANE:
      return (f"query_len {query_len} / kv_len {kv_len}: a sequence shorter than one "
              f"{LANE}-row splash block is cheaper unpadded")
    if mask_shape is not None:
      return "a dense mask was given: a traced mask cannot be proven a segment mask"
    if positions_given:
      return ("explicit q_positions/kv_positions were given and splash masks are static "
              "(built from indices at trace time)")
    bad = [b for b in config.block_sizes.resolve(LANE, LANE) if b % LANE]
    if bad:
      return f"splash block sizes must be multiples of {LANE}, got {config.block_sizes}"
    return None
  if backend == "triton":
    if hardware != "gpu":
      return f"ejkernel's Triton kernel needs a GPU (this is {hardware})"
    if mode is Mode.DECODE:
      return "decode (T == 1): ejkernel's Triton kernel tiles queries in blocks of 16 or more"
    if query_shape[-1] % 16 or value_dim % 16:
      return (f"head dims {query_shape[-1]} / {value_dim} are not multiples of 16, which "
              "ejkernel's Triton kernel needs")
    if mask_shape is not None:
      return ("a dense mask was given and ejkernel's Triton kernel would turn it into segment "
              "ids (a traced mask cannot be proven a segment mask)")
    if config.chunk_size is not None:
      return "chunked masks: ejkernel's Triton kernel ignores chunk_size"
    return None
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
    value_shape: Sequence[int] | None = None,
    mask_shape: Sequence[int] | None = None,
    positions_given: bool = False,
    sequence_shards: int = 1,
    return_weights: bool = False,
    hardware: str | None = None,
) -> Decision:
  """Picks the backend for one call.

  Args:
    config: the attention config (platform, interpret, mask features).
    query_shape: [B, T, Hq, D].
    key_shape: [B, S, Hkv, D].
    value_shape: [B, S, Hkv, Dv]; default: Dv == D.
    mask_shape: shape of the dense mask, if one is given.
    positions_given: whether explicit q_positions/kv_positions are given.
    sequence_shards: how many shards the query sequence axis is split into.
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
    why_not = _kernel_limit(
        backend, config, hardware=hardware, mode=mode, query_shape=query_shape,
        key_shape=key_shape, value_dim=(value_shape or query_shape)[-1], mask_shape=mask_shape,
        positions_given=positions_given, sequence_shards=sequence_shards,
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
