"""The decision table: which backend serves a call, as a pure function of static facts.

`BACKENDS` is the table of every backend; they are tried best first, each
says itself why it cannot serve a call (its `why_not`), and the first that
can, does. Adding a backend is its file and one line in `BACKENDS`.
"""

from __future__ import annotations

from typing import Sequence

from absl import logging
import jax

from splash_hk import inputs
from splash_hk.backends import base
from splash_hk.backends import splash
from splash_hk.backends import triton
from splash_hk.backends import xla
from splash_hk.config import AttentionConfig
from splash_hk.fallback import reference
from splash_hk.types import Decision, Facts

BACKENDS: dict[str, base.Backend] = {
    b.name: b for b in (splash.BACKEND, triton.BACKEND, xla.BACKEND, reference.BACKEND)}
_ACCELERATOR_KERNEL = {"tpu": "splash", "gpu": "triton"}
_LOGGED_REASONS: set[str] = set()  # a cache: each fallback reason is logged once


def candidates(platform: str, hardware: str) -> tuple[str, ...]:
  """Backends to try, best first: the requested one (or the hardware's kernel), xla, reference."""
  if platform == "auto":
    first = (_ACCELERATOR_KERNEL[hardware],) if hardware in _ACCELERATOR_KERNEL else ()
  else:
    first = (platform,)
  return tuple(dict.fromkeys(first + ("xla", "reference")))


def select(facts: Facts, hardware: str | None = None) -> Decision:
  """Picks the backend for a call from its facts (see `select_backend`)."""
  hardware = hardware or jax.default_backend()
  config, mode = facts.config, facts.mode.value
  refusals = []
  for backend in candidates(config.platform, hardware):
    why_not = BACKENDS[backend].why_not(facts, hardware)
    if why_not is None:
      break
    refusals.append(f"{backend}: {why_not}")
  if not refusals:
    asked = "requested" if config.platform == backend else f"first choice on {hardware}"
    return Decision(backend, f"{backend} is the {asked} ({mode} mode)")
  reason = f"falling back to {backend} ({mode} mode) because " + "; ".join(refusals)
  if not config.allow_fallback:
    raise ValueError(f"{reason}. AttentionConfig(allow_fallback=False) forbids fallbacks: "
                     "change the inputs or the platform, or allow the fallback.")
  return Decision(backend, reason, fallback=True)


def select_backend(
    config: AttentionConfig,
    *,
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    value_shape: Sequence[int] | None = None,
    mask_shape: Sequence[int] | None = None,
    default_positions: bool = True,
    sequence_shards: int = 1,
    return_weights: bool = False,
    hardware: str | None = None,
) -> Decision:
  """Picks the backend for one call, from static shapes and config alone.

  Args:
    config: the attention config (platform, interpret, mask features).
    query_shape: [B, T, Hq, D].
    key_shape: [B, S, Hkv, D].
    value_shape: [B, S, Hkv, Dv]; default: Dv == D.
    mask_shape: shape of the dense mask, if one is given.
    default_positions: whether positions are the end-aligned defaults (no
      explicit q_positions/kv_positions).
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
  facts = inputs.facts_from_shapes(
      config, query_shape, key_shape, None if value_shape is None else value_shape[-1],
      default_positions=default_positions, mask_shape=mask_shape,
      return_weights=return_weights, sequence_shards=sequence_shards)
  return select(facts, hardware)


def log_fallback(decision: Decision) -> None:
  """Logs a fallback's reason, once per distinct reason."""
  if decision.fallback and decision.reason not in _LOGGED_REASONS:
    _LOGGED_REASONS.add(decision.reason)
    logging.warning("splash_hk: %s", decision.reason)
