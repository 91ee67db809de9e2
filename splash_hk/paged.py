"""`paged_attention` and `explain_paged`: one serving step over a paged KV cache.

A step's new tokens (prefills, chunked prefills and decodes of many sequences, concatenated)
are written into their sequences' pages, then each attends to its sequence's keys, in one call.
The page allocator and the scheduler are the caller's (`examples/serve/`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from splash_hk import inputs
from splash_hk import kernel
from splash_hk import lists
from splash_hk import lowering
from splash_hk import owners
from splash_hk import platforms
from splash_hk import quant
from splash_hk import sharding
from splash_hk import validation
from splash_hk import validation_paged
from splash_hk.config import AttentionConfig, staged, traced
from splash_hk.fallback import selector
from splash_hk.masks import Mask
from splash_hk.masks import _rules
from splash_hk.nodes import Static, skeleton
from splash_hk import ragged
from splash_hk.pages import Layout, PagedCall, PagedFacts, PagedInputs, PagedKVCache, RaggedBatch
from splash_hk.pages import StepLists
from splash_hk.pages import PageSelection, SharedPrefix
from splash_hk.scores import Score
from splash_hk.types import Array, Decision, Shaped, as_score

__all__ = ("PageSelection", "PagedKVCache", "RaggedBatch", "SharedPrefix", "explain_paged",
           "paged_attention")


def paged_facts(query: Shaped, key: Shaped, value: Shaped, cache: Any, batch: Any, *,
           config: AttentionConfig, mask: Any, bias: Any, softmax_aux: Any) -> PagedFacts:
  """Validates a paged call's arguments (shapes and dtypes only); returns its facts."""
  validation_paged.validate_paged(query, key, value, cache, batch, config, mask, bias, softmax_aux)
  rule = _rules.call_rule(**config.rules, mask=mask)
  return PagedFacts(config=config, query_shape=tuple(query.shape),
                    cache_shape=tuple(cache.key.shape), value_dim=cache.value.shape[-1],
                    max_seqs=batch.kv_lens.shape[0], pages_per_seq=batch.page_table.shape[1],
                    rule=skeleton(rule), bias=skeleton(as_score(bias)),
                    quantized=any(quant.is_quantized(a) for a in (cache.key, cache.value)),
                    storage=(quant.storage(cache.key), quant.storage(cache.value)),
                    cascade=batch.prefix is not None, selected=batch.selection is not None,
                    tree=batch.tree is not None)


def explain_paged(query: Shaped, key: Shaped, value: Shaped, cache: Any, batch: Any, *,
                  config: AttentionConfig = AttentionConfig(), mask: Mask | None = None,
                  bias: Score | None = None, softmax_aux: Shaped | None = None,
                  owner: str | None = None, for_platform: str | None = None) -> Decision:
  """The backend `paged_attention` would use for these arguments, and why (arrays may be
  `jax.ShapeDtypeStruct` specs); `for_platform` as `explain`'s: another hardware's choice."""
  hardware = platforms.hardware(for_platform)
  if isinstance(cache, PagedKVCache):
    owners.check(cache, owner, "cache")
  facts = paged_facts(query, key, value, cache, batch, config=config, mask=mask, bias=bias,
                 softmax_aux=softmax_aux)
  return selector.select_paged(facts, hardware)


def paged_attention(
    query: Array,
    key: Array,
    value: Array,
    cache: PagedKVCache,
    batch: RaggedBatch,
    *,
    config: AttentionConfig = AttentionConfig(),
    mask: Mask | None = None,
    bias: Score | None = None,
    softmax_aux: Array | None = None,
    mesh: jax.sharding.Mesh | None = None,
    axes: sharding.MeshAxes = sharding.MeshAxes(),
    owner: str | None = None,
    return_residuals: bool = False,
) -> tuple[jax.Array, PagedKVCache] | tuple[jax.Array, PagedKVCache, jax.Array]:
  """Writes a step's new tokens into their pages, then attends each to its sequence's keys.

  Glossary of shapes: N new tokens (rows) of all sequences, Hq query heads, Hkv kv heads, D
  key size, Dv value size, P pages of `page_size` slots.

  Args:
    query: [N, Hq, D], the rows of sequence s at `batch.cu_q_lens[s]:cu_q_lens[s+1]`.
    key: [N, Hkv, D], written at each row's position (`kv_lens[s]` + its index in s).
    value: [N, Hkv, Dv].
    cache: the pool (`PagedKVCache`: its pages in the library's layout, built by `.zeros`).
    batch: the step's `RaggedBatch` (row offsets, lengths before the call, page table).
    config: the rules (default causal: each row sees its sequence up to its own position),
      soft cap, scale and platform, as for `attention`.
    mask: a mask object over positions (the whole rule, as for `attention`); objects with
      per-token arrays cannot describe a pool and are refused.
    bias: a position score object (Alibi, RelativePosition, ScoreFn, sums of them).
    softmax_aux: sinks [Hq], [Hq, n] or [Hkv, n].
    mesh, axes: shard the query heads and the pool's kv heads over the head axis
      (`MeshAxes.heads`) where it divides the kv heads; the flat token axis, the batch's
      arrays and the pages stay whole.
    owner: the calling layer's name (the modules pass theirs): a pool another layer wrote
      first is a ValueError naming both, and the returned pool records its owner (the given
      one, else the pool's).
    return_residuals: also return each row's log-sum-exp [N, Hq] (float32; -inf for padding
      rows and rows that see nothing, NaN for a misusing sequence's), as `attention`'s.

  Returns:
    The output [N, Hq, Dv] and the cache with the step written (and, with
    `return_residuals`, the lse [N, Hq]). Padding rows output 0 and
    write nothing. A sequence that misuses the cache (docs/guide/caches.md) is a ValueError
    naming the argument when `batch` is concrete; under `jit` it writes nothing and outputs
    NaN, the others proceed.
  """
  facts = dataclasses.replace(
      paged_facts(query, key, value, cache, batch, config=config, mask=mask, bias=bias,
                  softmax_aux=softmax_aux), residuals=return_residuals)
  owners.check(cache, owner, "cache")
  if mesh is not None:
    validation.validate_mesh(mesh, axes)
  decisions = selector.per_platform(lambda hardware: selector.select_paged(facts, hardware))
  host = decisions[jax.default_backend()]
  if isinstance(host, Decision):
    selector.log_fallback(host)
  choice = tuple(decisions.items())
  with jax.ensure_compile_time_eval():  # a concrete batch (a captured constant too): now
    layout, step_lists = _plan(batch, Static(facts))  # the batch read once, for every backend
  if not traced(layout.misuse):  # known now: check it now
    ragged.raise_misuse(layout.misuse, n=facts.num_tokens, max_seqs=facts.max_seqs,
                        capacity=facts.pages_per_seq * facts.page_size,
                        num_pages=facts.num_pages)
  query, key, value, softmax_aux, bias = _not_differentiated(
      (query, key, value, softmax_aux, bias))
  query = quant.checked(query, "query")
  query = query.dequantize() if isinstance(query, quant.Quantized) else jnp.asarray(query)
  if config.runtime_dtype is not None:
    query = query.astype(config.runtime_dtype)
  new = lambda a, name: quant.checked(a, name) if quant.is_quantized(a) else jnp.asarray(a)
  rule = _rules.call_rule(**config.rules, mask=mask)
  score = as_score(bias)
  call = PagedCall(
      query=query,  # [N, Hq, D]
      key=new(key, "key"),  # [N, Hkv, D] (quantized ones are written dequantized)
      value=new(value, "value"),  # [N, Hkv, Dv]
      cache=cache, layout=layout, lists=step_lists,
      rule=None if rule is None else rule.map_arrays(lambda side, a: jnp.asarray(a)),
      bias=None if score is None else score.map_arrays(lambda side, a, **_: jnp.asarray(a)),
      sinks=inputs.sinks(softmax_aux, facts.num_heads),  # [Hq, n] or None
      heads=jnp.arange(facts.num_heads, dtype=jnp.int32))  # [Hq]
  if mesh is None and staged(call):
    out, written, lse = _step(call, facts, choice)
  elif mesh is None:
    out, written, lse = _whole(call, Static(facts), choice)
  else:
    out, written, lse = sharding.shard_paged(lambda c, f: _step(c, f, choice), call,
                                             facts, mesh=mesh, axes=axes)
  written = written.replace(owner=owner or cache.owner)
  return (out, written, lse) if return_residuals else (out, written)


@jax.custom_jvp
def _not_differentiated(args: Any) -> Any:
  """`args` unchanged; differentiating them is a ValueError that says what to use instead."""
  return args


@_not_differentiated.defjvp
def _not_differentiated_jvp(primals, tangents):  # JAX calls it only when something is perturbed
  del primals, tangents
  raise ValueError(
      "paged_attention serves inference and is not differentiable: to train, attend with "
      "sh.attention (or a module) over a fixed KVCache, or without a cache; wrap its inputs in "
      "jax.lax.stop_gradient where a gradient reaches them by accident.")


Choice = tuple[tuple[str, Decision | str], ...]  # (hardware, its decision, or why it has none)


@functools.partial(jax.jit, static_argnums=(1,))
def _plan(batch: RaggedBatch, facts: Static) -> tuple[Layout, StepLists]:
  """`lists.plan` of a batch, jitted (one dispatch for an eager call, checked or not)."""
  f = facts.value
  return lists.plan(batch, f.num_tokens, f.num_pages, f.page_size, f.static_rules)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _whole(call: PagedCall, facts: Static,
           choice: Choice) -> tuple[jax.Array, PagedKVCache, jax.Array]:
  """`_step` on all heads of an eager call, jitted: one compile (cached per facts) instead of
  one per operation."""
  return _step(call, facts.value, choice)


def _step(call: PagedCall, facts: PagedFacts,
          choice: Choice) -> tuple[jax.Array, PagedKVCache, jax.Array]:
  """Write, then attend (on one shard of heads, or all): (out [N, Hq, Dv], cache, lse [N, Hq]).
  `choice`: each hardware's backend (the kernel lowered per platform where they differ)."""
  layout = call.layout
  cache = ragged.write(call.cache, call.key, call.value, layout)
  x = PagedInputs(query=call.query, cache=cache, layout=layout, lists=call.lists, rule=call.rule,
                  bias=call.bias, sinks=call.sinks, heads=call.heads,
                  new_key=quant.as_held(call.cache.key, call.key, "key"),
                  new_value=quant.as_held(call.cache.value, call.value, "value"))
  out, lse = _finished(*_run(choice, x, facts), layout)  # [N, Hq, Dv], [N, Hq]
  return out.astype(call.query.dtype), cache, lse


def _finished(out: jax.Array, lse: jax.Array, layout: Layout) -> tuple[jax.Array, jax.Array]:
  """out [N, Hq, Dv] and lse [N, Hq] with the rows the batch does not make live set: a padding
  row's 0 and -inf, a misusing sequence's NaN. A pass over them only where some row is not live
  (a while loop run zero times or once: XLA returns its state in place; the select alone took
  208 us of a prompt of 8192 rows on the v5e)."""
  def finish(state):
    out, lse, _ = state
    out = jnp.where(layout.row_bad[:, None, None], jnp.nan, out)
    out = jnp.where((layout.row_live | layout.row_bad)[:, None, None], out, 0)
    lse = jnp.where(layout.row_bad[:, None], jnp.nan, lse)
    lse = jnp.where((layout.row_live | layout.row_bad)[:, None], lse, -jnp.inf)
    return out, lse, jnp.asarray(True)

  done = (out, lse, jnp.all(layout.row_live))
  out, lse, _ = jax.lax.while_loop(lambda state: ~state[2], finish, done)
  return out, lse


def _run(choice: Choice, x: PagedInputs, facts: PagedFacts) -> tuple[jax.Array, jax.Array]:
  """Each hardware's paged kernel (`choice`), one program per lowering platform."""
  named = dict(choice)
  run = lambda name: lambda y: kernel.run_paged(name, y, facts)
  if selector.same_program(named):
    host = named[jax.default_backend()]
    assert isinstance(host, Decision), "per_platform raises when no hardware has a decision"
    return run(host.backend)(x)
  return lowering.per_platform(lowering.branches_of(named, lambda d: run(d.backend)), x)
