"""A paged step whose sequences have nothing cached before it (prompts' first chunks): the dense
TPU kernel over its new rows.

When no sequence of a step has a key cached before the step, each row's keys are its own
sequence's new rows, so the step is `attention` over its rows packed as one sequence of
documents (segment ids: the rows' sequences) under a rule that reads distances within a sequence
the same over the packed rows' positions (causal, a window: `_rules`). The dense kernel
serves that at its tuned tiles; the paged kernel, built for a few rows over long histories, runs
a prompt in tiles of at most 128 rows against 256 keys a step (a paged prefill of 2048 tokens
took 3.22x `attention`'s time on the v5e, run I2). The pool is written as before. Whether a step
is such a step is known only when it runs, so the TPU paged backend holds both programs and a
`lax.cond` picks one (`serves`: where the dense kernel serves the call; a small step keeps one
program). The dense kernel is the TPU backend's own (`Dense`), guard included.

Glossary: N rows of the step, Hq query heads, Hkv kv heads, D key size, Dv value size.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from splash_hk import inputs
from splash_hk import pages
from splash_hk import quant
from splash_hk.config import AttentionConfig
from splash_hk.masks import _objects
from splash_hk.types import Extras, Facts, KernelInputs, KernelOutput

MIN_ROWS = 512  # a step of fewer rows keeps the paged kernel alone (one program to compile)


def _rules(facts: pages.PagedFacts) -> dict[str, Any] | None:
  """The paged call's rule as config keywords where it reads the same over the packed rows'
  positions as over each sequence's (causal and a window: distances within a sequence; no rule:
  all of it), else None (a chunk or another object reads absolute positions, which the dense
  kernel, its masks built at trace time, takes only as the packed rows' own)."""
  rules = _objects.as_rules(facts.rule)
  return None if rules is None or rules["chunk_size"] is not None else rules


class Dense(NamedTuple):
  """The dense TPU kernel as the paged backend reaches it: its refusal and its call
  (`backends/tpu/backend.py` hands over its own; importing it here would close a circle)."""

  why_not: Callable[[Facts, str], str | None]
  attend: Callable[[KernelInputs, Facts], KernelOutput]


def _call(x: pages.PagedInputs, facts: pages.PagedFacts,
          specs: bool = False) -> tuple[tuple[Any, Any, Any], AttentionConfig, Extras]:
  """The dense call on the step's rows: ((q, k, v), config, extras) (`specs`: their shapes
  only): the rows packed as one sequence [1, N] of documents (segment ids), the paged call's
  scale, soft cap, platform and blocks, and its rules (`_rules`)."""
  rows = x.layout.row_in[:, None, None]  # [N, 1, 1]: padding rows zeroed, as garbage there
  held = lambda a: jnp.where(  # would send the dense kernel's guard to xla's exact path
      rows, quant.tile(a, x.query.dtype) if quant.is_quantized(a) else a, 0)[None]
  seg = jnp.where(x.layout.row_in, x.layout.seq, facts.max_seqs)  # [N]: padding its own
  arrays: tuple[Any, ...] = (held(x.query), held(x.new_key), held(x.new_value), seg[None],
                             x.sinks)  # [1, N, Hq, D], [1, N, Hkv, D] (as the pool holds it), ...
  if specs:
    arrays = tuple(None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
  q, k, v, seg, sinks = arrays
  rules = _rules(facts) or {}
  config = dataclasses.replace(facts.config, causal=rules.get("causal", False),
                               sliding_window=rules.get("window"), chunk_size=None)
  ids = None if _one_prompt(facts, rules) else seg  # no ids: the kernel's static plan alone
  return (q, k, v), config, Extras(q_segment_ids=ids, kv_segment_ids=ids, softmax_aux=sinks)


def _one_prompt(facts: pages.PagedFacts, rules: dict[str, Any]) -> bool:
  """Whether the step's segment ids say nothing its rule does not: one sequence (its rows the
  first, padding rows after them), and a rule under which no row sees a later one (causal, a
  window reaching back only), so no live row sees a padding row. Ids cost the dense kernel a
  plan a call and a compare a logit (a prompt of 8192 tokens took 1.27x `attention`'s time with
  them on the v5e, run I4)."""
  window = rules.get("window")
  return (facts.max_seqs == 1 and bool(rules.get("causal"))
          and (window is None or window[1] == 0))


def serves(x: pages.PagedInputs, facts: pages.PagedFacts, dense: Dense) -> bool:
  """Whether a step of these shapes may run on the dense kernel when nothing is cached: enough
  rows, its new rows at hand, no selection, draft tree, shared prefix or lse asked for (the
  dense kernel returns none), a rule `_rules` reads, and the dense kernel serving the call on a
  TPU (the paged kernel's hardware, whatever host traces it: `jax.export` from a CPU too)."""
  if (facts.num_tokens < MIN_ROWS or x.new_key is None or facts.selected or facts.tree
      or facts.cascade or facts.bias is not None or facts.residuals or _rules(facts) is None):
    return False
  (q, k, v), config, extras = _call(x, facts, specs=True)
  call = inputs.facts(q, k, v, config=config, extras=extras)
  return dense.why_not(call, "tpu") is None


def fresh(x: pages.PagedInputs) -> jax.Array:
  """[] bool: every sequence with live rows this step had no key before it (its length after the
  step is its rows'). The rows a sequence are the lists' count, not a sum over the step's rows
  (a scatter-add: 72 us of a prompt of 8192 rows on the v5e)."""
  rows = x.lists.table.rows  # [max_seqs]: live rows only
  return jnp.all((rows == 0) | (x.layout.kv_len_after == rows))


def attend(x: pages.PagedInputs, facts: pages.PagedFacts,
           dense: Dense) -> tuple[jax.Array, jax.Array]:
  """out [N, Hq, Dv] of a step with nothing cached, by the dense kernel over its rows (a row
  that sees nothing: 0, as the paged kernel's), and an lse [N, Hq] of NaN: `serves` takes no
  call that asks for it."""
  (q, k, v), config, extras = _call(x, facts)
  y, call = inputs.normalise(q, k, v, config=config, extras=extras)
  out = dense.attend(y, call).out[0]  # [N, Hq, Dv]
  return out, jnp.full(out.shape[:2], jnp.nan, jnp.float32)
