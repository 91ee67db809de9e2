"""The decision table: which backend serves a call, as a pure function of static facts.

The registered backends (`splash_hk.platforms`) are tried best first, in
the order their own `hardware` and `rank` give; each says itself why it cannot
serve a call (its `why_not`), and the first that can, does.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from absl import logging
import jax

from splash_hk import kernel
from splash_hk.backends import base
from splash_hk.backends.xla import lists as xla_lists
from splash_hk import platforms
from splash_hk.config import AttentionConfig
from splash_hk.pages import PagedFacts
from splash_hk.types import Decision, Facts

_LOGGED_REASONS: set[str] = set()  # a cache: each fallback reason is logged once


def candidates(platform: str, hardware: str) -> tuple[str, ...]:
  """Backends to try, best first: the requested one (on "auto": those made for `hardware`, by
  rank), then the portable ones (made for no hardware in particular), by rank."""
  table = sorted(kernel.backends().values(), key=lambda b: b.rank)
  if platform == platforms.AUTO:
    first = [b.name for b in table if hardware in b.hardware]
  else:
    first = [platform]
  return tuple(dict.fromkeys(first + [b.name for b in table if not b.hardware]))


def select(facts: Facts, hardware: str | None = None) -> Decision:
  """Picks the backend (and, for a sharded sequence, ring, Ulysses or not) from a call's facts;
  the decision lists the mesh axis names the call dropped."""
  decision = _select(facts, hardware or jax.default_backend())
  return dataclasses.replace(decision, dropped_axes=facts.dropped_axes)


def per_platform(select_on: Callable[[str], Decision]) -> dict[str, Decision | str]:
  """Each hardware's decision (`select_on(hardware)`, e.g. `lambda h: select(facts, h)`), for a
  call lowered per platform (`splash_hk.lowering`); where one cannot be made (a fallback
  `allow_fallback=False` forbids) or traced on this host, the reason instead, raised when the
  call is lowered for that hardware. Raises it now when no hardware has a decision."""
  decisions: dict[str, Decision | str] = {}
  for hardware in platforms.HARDWARE:
    try:
      decision = select_on(hardware)
    except ValueError as refusal:
      decisions[hardware] = str(refusal)
      continue
    if hardware != jax.default_backend() and not kernel.backend(decision.backend).traces_off_host:
      decisions[hardware] = (
          f"on {hardware} the choice is {decision.backend} ({decision.reason}), whose kernel can "
          f"only be traced on a {hardware} host: lower it there, or pass "
          "AttentionConfig(platform='xla') for one portable program")
    else:
      decisions[hardware] = decision
  if all(isinstance(d, str) for d in decisions.values()):
    raise ValueError(_every_refusal(decisions))
  return decisions


def _every_refusal(reasons: dict[str, Decision | str]) -> str:
  """One message of every hardware's refusal (this host's first): exported for another
  platform, the call must say that platform's reason, not only this host's."""
  host = jax.default_backend()
  said: dict[str, list[str]] = {}
  for hardware in sorted(reasons, key=lambda h: h != host):  # this host first
    said.setdefault(str(reasons[hardware]), []).append(hardware)
  if len(said) == 1:
    return str(reasons[host])
  return "; ".join(f"on {' and '.join(where)}: {why}" for why, where in said.items())


def same_program(decisions: dict[str, Decision | str]) -> bool:
  """Whether every hardware's decision runs the same program (backend and sequence strategy)."""
  kinds = {d if isinstance(d, str) else (d.backend, d.ring, d.ulysses) for d in decisions.values()}
  return len(kinds) == 1


def _select(facts: Facts, hardware: str) -> Decision:
  """`select` on `hardware`."""
  if facts.sequence_shards == 1 or facts.sequence_strategy == "all_gather":
    return _pick(facts, hardware)
  strategy = facts.sequence_strategy
  if strategy == "ulysses":
    why_not = ulysses_refusal(facts)
    if why_not is None:
      decision = _pick(facts.on_whole_sequence(), hardware)
      heads = facts.num_heads // (facts.head_shards * facts.sequence_shards)
      return dataclasses.replace(decision, ulysses=True, reason=(
          f"{decision.reason}, on the whole sequence with {heads} of {facts.num_heads} query "
          f"heads per device (Ulysses over {facts.sequence_shards} sequence shards)"))
    decision = _pick(facts, hardware)
  else:
    decision = _pick(facts, hardware)
    why_not = ring_refusal(facts, kernel.backend(decision.backend))
    if why_not is None:
      return dataclasses.replace(decision, ring=True, reason=(
          f"{decision.reason}, as a ring over {facts.sequence_shards} sequence shards"))
  return _fallback(facts.config, dataclasses.replace(decision, fallback=True, reason=(
      f"{decision.reason}; sequence_strategy={strategy!r} falls back to all_gather because "
      f"{why_not}")))


def _pick(facts: Facts, hardware: str) -> Decision:
  """The first backend of `candidates` that serves the call; the others' refusals as reason."""
  decision = _first(facts.config, hardware, lambda b: b.why_not(facts, hardware),
                    f"{facts.mode.value} mode")
  describe = kernel.backend(decision.backend).describe
  said = None if describe is None else describe(facts)
  return dataclasses.replace(decision, reason=decision.reason + _plan_note(
      facts, decision.backend) + ("" if said is None else f"; {said}"))


def select_paged(facts: PagedFacts, hardware: str | None = None) -> Decision:
  """The backend of a paged call: the first of `candidates` with a paged kernel that serves it."""
  hardware = hardware or jax.default_backend()

  def why_not(backend: base.Backend) -> str | None:
    said = None if backend.paged_why_not is None else backend.paged_why_not(facts, hardware)
    if backend.paged_attend is None:
      return said or "it has no paged kernel"
    return said

  return _first(facts.config, hardware, why_not, "paged")


def _first(config: AttentionConfig, hardware: str, why_not: Callable[[base.Backend], str | None],
           what: str, note: str = "") -> Decision:
  """The first backend of `candidates` that `why_not` lets serve; the others' refusals as reason
  (`what`: the kind of call, in words; `note`: words said of it whichever backend serves)."""
  refusals: list[str] = []
  passed: list[str] = []  # an optional backend's refusals on auto: said, not a fallback
  for name in candidates(config.platform, hardware):
    backend = kernel.backend(name)
    refusal = why_not(backend)
    if refusal is None:
      break
    optional = backend.optional and config.platform == platforms.AUTO
    (passed if optional else refusals).append(f"{name}: {refusal}")
  what = "; not ".join([what, *passed])
  if not refusals:
    asked = "requested" if config.platform == name else f"first choice on {hardware}"
    return Decision(name, f"{name} is the {asked} ({what}){note}")
  return _fallback(config, Decision(
      name, f"falling back to {name} ({what}) because " + "; ".join(refusals) + note,
      fallback=True))


def _plan_note(facts: Facts, backend: str) -> str:
  """What the block plan reads whole (MaskFn parts without a range rule) and how `backend`
  runs chosen blocks, in words (or "")."""
  if facts.rule is None:
    return ""
  note = ""
  if xla_lists.chooses(facts) and backend == "splash":
    note = "; the chosen blocks (Blocks) run on the block-list kernel"
  elif xla_lists.chooses(facts) and backend == "xla":
    refusal = xla_lists.why_not(facts)
    note = ("; the chosen blocks (Blocks) run on xla's gathered tiles" if refusal is None else
            f"; the chosen blocks (Blocks) run on xla's block plan, not its gathered tiles: {refusal}")
  names = [p.name for p in facts.rule.parts() if p.evaluated_per_pair()]
  if not names:
    return note
  return (f"{note}; {', '.join(names)} has no range rule: its blocks are classified by "
          "evaluating it on every (query, key) pair, once per call")


def _fallback(config: AttentionConfig, decision: Decision) -> Decision:
  if not config.allow_fallback:
    raise ValueError(f"{decision.reason}. AttentionConfig(allow_fallback=False) forbids fallbacks: "
                     "change the inputs, the platform or the mesh axes, or allow the fallback.")
  return decision


def ring_refusal(facts: Facts, backend: base.Backend) -> str | None:
  """Why a sharded sequence cannot run as a ring with `backend`, or None."""
  if facts.query_len != facts.kv_len:
    return (f"the ring needs self-attention (query_len == kv_len), got query_len "
            f"{facts.query_len}, kv_len {facts.kv_len}")
  if facts.rule is not None and "qk" in facts.rule.array_sides():
    return "a dense mask was given (the ring passes keys, not mask columns, around)"
  if facts.bias is not None and "qk" in facts.bias.array_sides():
    return ("a dense `bias` was given (the ring passes keys, not bias columns, around; "
            "position objects travel with the keys' positions)")
  if facts.return_weights:
    return "attention weights were requested"
  if facts.explicit_dropout:
    return "a dense `dropout_mask` was given (the ring passes keys, not mask columns, around)"
  if backend.forward is None or backend.backward is None:
    return f"the {backend.name} backend has no forward/backward halves for ring steps"
  return None


def ulysses_refusal(facts: Facts) -> str | None:
  """Why a sharded sequence cannot run Ulysses-style (heads split over the sequence axis), or None."""
  n, heads = facts.sequence_shards, facts.num_heads // facts.head_shards
  if facts.return_weights:
    return "attention weights were requested"
  if heads % n:
    return (f"the {heads} query heads per device after the head axis ({facts.head_shards} "
            f"shards) do not divide over {n} sequence shards; use a multiple of "
            f"{n * facts.head_shards} query heads or fewer sequence shards")
  if facts.kv_len % n:
    return f"kv_len {facts.kv_len} does not divide over {n} sequence shards"
  return None


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
  mask = None if mask_shape is None else jax.ShapeDtypeStruct(tuple(mask_shape), bool)
  facts = Facts.from_shapes(
      config, query_shape, key_shape, None if value_shape is None else value_shape[-1],
      default_positions=default_positions, mask=mask, return_weights=return_weights,
      sequence_shards=sequence_shards)
  return select(facts, hardware)


def log_fallback(decision: Decision) -> None:
  """Logs a fallback's reason, once per distinct reason."""
  if decision.fallback and decision.reason not in _LOGGED_REASONS:
    _LOGGED_REASONS.add(decision.reason)
    logging.warning("splash_hk: %s", decision.reason)
