"""The native backend: a C++ kernel for decode and short query runs on CPU, through the XLA FFI.

Reads a paged pool's pages (head-major: each kv head's page one contiguous block) or a fixed
cache's rows once per step, for every query head of the kv head's group and every row of the
item, with the SIMD chosen at run time and the next block prefetched while one is read; keys
and values in float32, bfloat16, float16, int8 or fp8 (scales per token applied in the kernel,
never a dequantized copy). The C++ is `native/` (`native/kernel.h`: the arithmetic; `native/handlers.cc`: the
two FFI handlers), built by `native_build`.

It serves what a decode step is: at most `SHORT_ROWS` rows a sequence (on average, for a paged
step), the config's rules (causal, window, chunk), sinks, soft cap, ALiBi (`sh.scores.Alibi`),
GQA of up to `MAX_GROUP` query heads a kv head, the log-sum-exp. A differentiated `attention` call runs xla's kernel (its
forward and backward: `jax.custom_vjp`), as does everything it refuses, with the reason.

Threads: `SPLASH_HK_NATIVE_THREADS` (read when a call is traced), default every core. SIMD:
AVX-512 or AVX2/FMA where the CPU has them (else portable C++); `SPLASH_HK_NATIVE_SIMD`
(`portable`, `avx2`, `avx512`) caps the level, read when a call is traced.
"""

from __future__ import annotations

import dataclasses

import os

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk import pages
from splash_hk import quant
from splash_hk.backends import base
from splash_hk.backends.native import build as native_build
from splash_hk.backends.xla import backend as xla
from splash_hk.masks import _objects
from splash_hk.scores import Alibi
from splash_hk.types import Facts, KernelInputs, KernelOutput

SHORT_ROWS = 8  # query rows a sequence (a decode step's, a verification's): more run on xla
MAX_GROUP = 16  # query heads per kv head in one item (kernel.h's kMaxGroup)
STORAGE = ("float32", "bfloat16", "float16", "int8/token", "float8_e4m3fn/token",
           "float8_e5m2/token")
THREADS_ENV = "SPLASH_HK_NATIVE_THREADS"
SIMD_ENV = "SPLASH_HK_NATIVE_SIMD"
# The kernel's SIMD levels (kernel.h's `Simd`), lowest first; it runs the highest the CPU has
# up to the one asked for.
SIMD_LEVELS = ("portable", "avx2", "avx512")


def threads() -> int:
  """Threads a call runs on: `SPLASH_HK_NATIVE_THREADS`, else every core of the machine."""
  said = os.environ.get(THREADS_ENV, "")
  if said:
    if not said.isdigit() or int(said) < 1:
      raise ValueError(f"`{THREADS_ENV}` must be a positive thread count, got {said!r}.")
    return int(said)
  return os.cpu_count() or 1


def simd() -> int:
  """The highest SIMD level a call may run (an index of `SIMD_LEVELS`): `SPLASH_HK_NATIVE_SIMD`
  (read when a call is traced), else the highest; the kernel takes the CPU's best up to it."""
  said = os.environ.get(SIMD_ENV, "") or SIMD_LEVELS[-1]
  if said not in SIMD_LEVELS:
    raise ValueError(f"`{SIMD_ENV}` must be one of {', '.join(SIMD_LEVELS)}, got {said!r}.")
  return SIMD_LEVELS.index(said)


def _common_refusal(hardware: str, storage: tuple[str, ...], heads: int, kv_heads: int,
                    rule: _objects.Mask | None, bias) -> str | None:
  """Why the kernel cannot serve a call, whichever its kind (paged or a cache), or None."""
  if hardware != "cpu":
    return "the native kernel runs on CPU only"
  missing = native_build.unavailable()
  if missing:
    return f"the native kernel is unavailable: {missing}"
  if len(set(storage)) > 1:  # one element type per call (handlers.cc reads both as the key's)
    return f"keys and values are stored differently ({' and '.join(storage)})"
  bad = [s for s in storage if s not in STORAGE]
  if bad:
    return (f"keys/values stored as {' and '.join(sorted(set(bad)))} (it reads "
            f"{', '.join(STORAGE)})")
  if heads // kv_heads > MAX_GROUP:
    return f"{heads // kv_heads} query heads per kv head (it serves up to {MAX_GROUP})"
  if bias is not None and not isinstance(bias, Alibi):
    return "a `bias` other than sh.scores.Alibi was given (the one score it adds)"
  if rule is not None and _objects.as_rules(rule) is None:
    return ("the mask is not the config's rules (causal, window, chunk): it builds those "
            "alone")
  return None


def why_not(facts: Facts, hardware: str) -> str | None:
  """Why the native kernel cannot serve an `attention` call, or None."""
  if facts.query_len > SHORT_ROWS:
    return (f"query_len {facts.query_len} is more than the {SHORT_ROWS} rows of a decode or "
            "a short run it serves")
  if facts.return_weights:
    return base.WEIGHTS_REFUSAL
  if facts.config.dropout_rate > 0:
    return base.DROPOUT_REFUSAL
  if "query" in facts.quantized:
    return "the query is quantized (it takes floating queries)"
  if facts.sequence_shards > 1:
    return "the query sequence is sharded (it reads whole rows of keys)"
  return _common_refusal(hardware, facts.storage, facts.num_heads, facts.key_shape[2],
                         facts.rule, facts.bias)


def paged_why_not(facts: pages.PagedFacts, hardware: str) -> str | None:
  """Why the native kernel cannot serve a paged call, or None."""
  if facts.num_tokens > SHORT_ROWS * facts.max_seqs:
    return (f"{facts.num_tokens} rows for {facts.max_seqs} sequences is more than the "
            f"{SHORT_ROWS} rows a sequence of a decode step it serves")
  if facts.cascade:
    return "the batch has a shared prefix (a cascade reads it once per group on xla's tiles)"
  rules = facts.static_rules or {}
  if facts.tree and (rules.get("window") or rules.get("chunk_size")):
    return ("the batch has draft trees (RaggedBatch.tree) under a window or chunk rule (by "
            "depth), which xla's tiles serve")
  return _common_refusal(hardware, facts.storage, facts.num_heads, facts.num_kv_heads,
                         facts.rule, facts.bias)


def _sinks(sinks: jax.Array | None, heads: int) -> jax.Array:
  """[Hq] float32: each head's sinks as one logit (their logsumexp), -inf without."""
  if sinks is None:
    return jnp.full((heads,), -jnp.inf, jnp.float32)
  return base.sink_logsumexp(sinks.astype(jnp.float32))


def _slopes(bias) -> jax.Array:
  """[Hq] float32: an Alibi's slopes of this shard's query heads (they travel with their
  heads), or a dummy [1] without one."""
  if bias is None:
    return jnp.zeros((1,), jnp.float32)
  return jnp.asarray(bias.slopes, jnp.float32).reshape(-1)


def _attrs(soft_cap: float | None, quantized: bool, bias) -> dict:
  """The attributes both handlers take, typed as they declare them (float32 / int32)."""
  return dict(soft_cap=np.float32(soft_cap or 0.0), threads=np.int32(threads()),
              simd=np.int32(simd()), quantized=np.int32(quantized),
              alibi=np.int32(bias is not None))


def paged_attend(x: pages.PagedInputs, facts: pages.PagedFacts) -> tuple[jax.Array, jax.Array]:
  """(out [N, Hq, Dv], lse [N, Hq]) of a decode step over the pool's pages."""
  n, hq, _ = x.query.shape
  kv_heads = x.cache.num_kv_heads
  lists = _local_heads(x.lists.own, x.heads, hq // kv_heads, kv_heads)
  k, k_scale, quantized = quant.per_key(x.cache.key)  # [P, Hkv, page, D], [P, Hkv, page]
  v, v_scale, _ = quant.per_key(x.cache.value)
  q = x.query.astype(jnp.float32) * facts.scale  # [N, Hq, D]
  shapes = (jax.ShapeDtypeStruct((n, hq, facts.value_dim), jnp.float32),
            jax.ShapeDtypeStruct((n, hq), jnp.float32))
  ints = lambda *a: [b.astype(jnp.int32) for b in a]
  call = jax.ffi.ffi_call("splash_hk_paged_decode", shapes, vmap_method="sequential")
  out, lse = call(q, k, k_scale, v, v_scale,
                  *ints(lists.blocks, lists.first_key, lists.count, lists.order, lists.offset,
                        lists.rows, lists.lo, lists.hi),
                  _sinks(x.sinks, hq), _slopes(x.bias), *ints(x.layout.at, *_tree(x.layout)),
                  **_attrs(facts.config.logits_soft_cap, quantized, x.bias),
                  tree=np.int32(x.layout.tree is not None))
  return out.astype(x.query.dtype), lse


def _tree(layout: pages.Layout) -> tuple[jax.Array, ...]:
  """A tree batch's rows for the kernel (first_new, first_row, enter, leave: [N] each), or
  dummies [1] for chains."""
  if layout.tree is None:
    return (jnp.zeros((1,), jnp.int32),) * 4
  t = layout.tree
  return t.first_new, t.first_row, t.enter, t.leave


def _local_heads(lists: pages.BlockLists, heads: jax.Array, group: int,
                 kv_heads: int) -> pages.BlockLists:
  """Lists per kv head (a selection's) cut to this shard's kv heads (`heads`: its query heads'
  global indices); lists every kv head shares unchanged."""
  if lists.list_heads == 1 or lists.list_heads == kv_heads:
    return lists
  first = heads[0] // group
  cut = lambda a: jax.lax.dynamic_slice_in_dim(a, first, kv_heads, axis=1)
  return dataclasses.replace(lists, blocks=cut(lists.blocks), first_key=cut(lists.first_key),
                             count=cut(lists.count))


def page_bounds(q: jax.Array, key_min: jax.Array, key_max: jax.Array, table: jax.Array,
                seq: jax.Array, live: jax.Array) -> jax.Array:
  """Quest's bound of every page of every sequence: q [N, Hq, D], key_min / key_max [P, Hkv, D]
  f32, table [S, pps] (clipped into the pool), seq / live [N] (each row's sequence, whether it
  is live) -> [S, Hkv, pps] f32, maxed over each sequence's live rows and the kv head's group
  (-inf: none). One read of each sequence's summaries for all its rows (`sparse.top_k_pages`
  on CPU, where the kernel is available)."""
  shape = jax.ShapeDtypeStruct((table.shape[0], key_min.shape[1], table.shape[1]), jnp.float32)
  call = jax.ffi.ffi_call("splash_hk_page_bounds", shape, vmap_method="sequential")
  ints = lambda a: a.astype(jnp.int32)
  return call(q.astype(jnp.float32), key_min.astype(jnp.float32), key_max.astype(jnp.float32),
              ints(table), ints(seq), ints(live), threads=np.int32(threads()),
              simd=np.int32(simd()))


def _cache_call(x: KernelInputs, facts: Facts) -> tuple[jax.Array, jax.Array]:
  """(out [B, T, Hq, Dv] float32, lse [B, T, Hq]) of a short run over whole rows of keys."""
  b, t, hq, _ = x.query.shape
  k, k_scale, quantized = quant.per_key(x.key)  # [B, S, Hkv, D], [B, S, Hkv]
  v, v_scale, _ = quant.per_key(x.value)
  q_seg, kv_seg = base.segment_ids(x)  # [B, T], [B, S]
  slots = jnp.arange(kv_seg.shape[1], dtype=jnp.int32)
  extent = jnp.max(jnp.where(kv_seg >= 0, slots + 1, 0), axis=1)  # [B]: keys past it are padding
  rules = _objects.as_rules(facts.rule) or {}
  left, right = rules.get("window") or (-1, -1)
  shapes = (jax.ShapeDtypeStruct((b, t, hq, facts.value_dim), jnp.float32),
            jax.ShapeDtypeStruct((b, t, hq), jnp.float32))
  call = jax.ffi.ffi_call("splash_hk_cache_decode", shapes, vmap_method="sequential")
  ints = lambda *a: [c.astype(jnp.int32) for c in a]
  out, lse = call(x.query.astype(jnp.float32) * facts.scale, k, k_scale, v, v_scale,
                  *ints(x.q_positions, q_seg, x.kv_positions, kv_seg, extent),
                  _sinks(x.sinks, hq), _slopes(x.bias),
                  **_attrs(facts.config.logits_soft_cap, quantized, x.bias),
                  causal=np.int32(bool(rules.get("causal"))), left=np.int32(left),
                  right=np.int32(right), chunk=np.int32(rules.get("chunk_size") or 0))
  return out, lse


def attend(x: KernelInputs, facts: Facts) -> KernelOutput:
  """A short run over a cache on one shard: out [B, T, Hq, Dv] and lse [B, T, Hq]; when
  differentiated, xla's forward and backward instead (the kernel has no backward)."""

  def run(y: KernelInputs) -> tuple[jax.Array, jax.Array]:
    out, lse = _cache_call(y, facts)
    return out.astype(y.query.dtype), lse

  return KernelOutput(*xla.with_xla_gradients(run, facts, fields=2)(x))


BACKEND = base.Backend(
    name="native", why_not=why_not, attend=attend, hardware=("cpu",), rank=0, optional=True,
    paged_why_not=paged_why_not, paged_attend=paged_attend)
