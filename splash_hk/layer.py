"""The attention layer without a framework: what the Haiku and Flax modules share.

A module projects its inputs to heads and its output back; everything between
is here: leading batch dims, module-style masks (Haiku's and Flax's: any dtype,
nonzero = attend, broadcastable to [..., H, T, S]) and mask objects, the KV
cache append with its failure rules, ids over the cache's slots, and a serving
step over a `PagedKVCache` (the step's tokens flat, as `paged_attention` takes them).

Glossary of shapes:
- ...: any leading batch dims, flattened to B for the attention call.
- T: query length; S: key/value length (the cache's slots with a cache).
- N: a paged step's tokens, every sequence's new ones concatenated.
- H, Hkv: query and key/value heads; K: key size; V: value size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from splash_hk import kv_cache as kv_cache_lib
from splash_hk import owners
from splash_hk import sparse
from splash_hk.attention import attend as attend_heads
from splash_hk.config import AttentionConfig
from splash_hk.kv_cache import KVCache, row_lengths
from splash_hk.masks import Mask
from splash_hk.masks._tree import Tree, misused, positions as tree_positions
from splash_hk.paged import paged_attention
from splash_hk.pages import PagedKVCache, RaggedBatch
from splash_hk.quant import Quantized
from splash_hk.scores import Score
from splash_hk.sharding.axes import MeshAxes
from splash_hk.types import Array, Extras


class Call(NamedTuple):
  """One layer call's arguments beside the heads, as the modules take them."""

  mask: ArrayLike | Mask | None = None  # [..., H|1, T, S] any dtype, or a mask object
  bias: Array | Score | None = None  # [B|1, H|1, T, S] float, or a score object
  q_segment_ids: Array | None = None  # [..., T] int
  kv_segment_ids: Array | None = None  # [..., S] int
  q_positions: Array | None = None  # [..., T] int
  kv_positions: Array | None = None  # [..., S] int
  kv_cache: kv_cache_lib.Cache | PagedKVCache | None = None
  lengths: ArrayLike | None = None  # [...] or [] int: tokens each row appends
  batch: RaggedBatch | None = None  # with a PagedKVCache: the step's sequences
  page_top_k: int | None = None  # with a PagedKVCache: read each sequence's chosen pages (Quest)
  dropout_rng: Any = None  # a jax.random key: attention dropout at the config's rate
  dropout_broadcast: bool = False  # one dropout mask for every batch row and head (Flax's)


class Settings(NamedTuple):
  """What a layer fixes at construction: its rules, mesh and name (the cache's owner)."""

  config: AttentionConfig
  mesh: jax.sharding.Mesh | None
  axes: MeshAxes
  layer: str


def dropout_rate(config: AttentionConfig, rate: float, word: str = "dropout_rate") -> float:
  """A module's attention dropout rate from its `word` (checked) and its config's: either may
  state it; both stating different rates is a ValueError naming both (one place for a fact)."""
  rate = AttentionConfig(dropout_rate=rate).dropout_rate
  if rate and config.dropout_rate and rate != config.dropout_rate:
    raise ValueError(
        f"`{word}={rate}` and `config.dropout_rate={config.dropout_rate}` both state the "
        f"attention dropout rate, and they differ: state it in one place (`{word}`, or "
        "AttentionConfig(dropout_rate=...)).")
  return rate or config.dropout_rate


def attend(query: jax.Array, key: jax.Array, value: jax.Array, call: Call, settings: Settings,
           sinks: jax.Array | None = None) -> tuple[jax.Array, Any]:
  """query [..., T, H, K], key [..., S, Hkv, K], value [..., S, Hkv, V] -> [..., T, H, V].

  With `call.kv_cache` the new keys/values are appended first (row b's first `lengths[b]`
  at its length) and the queries attend to the row's filled slots; the new cache comes
  back beside the output (None without a cache). A row that could not append outputs NaN.
  With a `PagedKVCache` and `call.batch`, the heads are a serving step's tokens ([N, H, K]:
  `attend_paged`). `sinks`: [H, n] float or None.
  """
  if isinstance(call.kv_cache, PagedKVCache) or call.batch is not None:
    return attend_paged(query, key, value, call, settings, sinks)
  if call.page_top_k is not None:
    raise ValueError(f"`page_top_k={call.page_top_k}` chooses pages of a paged cache: pass it "
                     "with kv_cache=sh.PagedKVCache(..., page_summaries=True) and batch=; with "
                     "a fixed KVCache or no cache, choose key blocks with "
                     "mask=sh.sparse.top_k_blocks(...) instead.")
  *lead, query_len, num_heads, _ = query.shape
  flat = lambda x: x.reshape(-1, *x.shape[len(lead):])  # [..., X] -> [B, X]
  q, k, v = flat(query), flat(key), flat(value)  # [B, T, H, K], [B, S, Hkv, K], [B, S, Hkv, V]
  rows = lambda x: None if x is None else flat(jnp.broadcast_to(x, (*lead, x.shape[-1])))
  extras = Extras(q_segment_ids=rows(call.q_segment_ids), kv_segment_ids=rows(call.kv_segment_ids),
                  q_positions=rows(call.q_positions), kv_positions=rows(call.kv_positions))
  step = None
  if call.kv_cache is not None:
    if any(x is not None for x in extras[:4]):  # segment ids and positions
      raise ValueError("`kv_cache` derives positions and padding itself: do not pass "
                       "q_segment_ids, kv_segment_ids, q_positions or kv_positions with it.")
    _check_cache_dtype(call.kv_cache, k, settings.config)
    step = kv_cache_lib.append_to(call.kv_cache, k, v,
                                  row_lengths(call.lengths, tuple(lead), query_len), settings.layer)
    k, v, extras = step.key, step.value, step.extras  # [B, S_max, Hkv, *]
    extras = extras._replace(dropout_q_index=extras.q_positions)  # the new tokens' slots
  elif call.lengths is not None:
    raise ValueError("`lengths` says how many tokens each row appends to `kv_cache`; pass "
                     "it with a kv_cache (or use q_segment_ids to mark padding).")
  mask = flat_mask(call.mask, lead, num_heads, query_len, k.shape[1], step)
  tree = _tree_of(mask)
  if step is not None and tree is not None:  # a draft tree over the cache: positions by depth
    q_pos, kv_pos = tree_positions(tree, jnp.asarray(step.extras.q_positions), k.shape[1])
    extras = extras._replace(q_positions=q_pos, kv_positions=kv_pos)  # [B, T], [B, S_max]
  extras = extras._replace(mask=mask, bias=call.bias, softmax_aux=sinks,
                           dropout_rng=call.dropout_rng, dropout_broadcast=call.dropout_broadcast)
  out = attend_heads(q, k, v, extras, config=settings.config, mesh=settings.mesh,
                     axes=settings.axes).attention_outputs  # [B, T, H, V]
  if step is not None:  # a row that could not append says so: NaN, never a finite wrong answer
    failed = step.failed if tree is None else step.failed | misused(tree)  # [B]
    out = jnp.where(failed[:, None, None, None], jnp.nan, out)  # [B, T, H, V]
  out = out.reshape(*lead, *out.shape[1:])  # [..., T, H, V]
  if step is None:
    return out, None
  if tree is None:
    return out, step.cache
  return out, step.cache.replace(parents=kv_cache_lib.record_parents(  # what `accept` checks
      step.cache.parents, jnp.asarray(step.extras.q_positions), jnp.asarray(tree.parents),
      k.shape[1]))


def _tree_of(mask: Any) -> Tree | None:
  """The `Tree` among a mask object's parts (one at most), or None."""
  if not isinstance(mask, Mask):
    return None
  found = [part for part in mask.parts() if isinstance(part, Tree)]
  if len(found) > 1:
    raise ValueError("`mask` holds more than one Tree: one call verifies one set of draft trees.")
  return found[0] if found else None


def attend_paged(query: jax.Array, key: jax.Array, value: jax.Array, call: Call,
                 settings: Settings, sinks: jax.Array | None = None
                 ) -> tuple[jax.Array, PagedKVCache]:
  """One serving step: query [N, H, K], key [N, Hkv, K], value [N, Hkv, V] (every sequence's
  new tokens, flat) written into `call.kv_cache`'s pages and attended (`paged_attention`)
  -> ([N, H, V], the new cache)."""
  if not isinstance(call.kv_cache, PagedKVCache) or not isinstance(call.batch, RaggedBatch):
    raise ValueError("A serving step takes kv_cache=sh.PagedKVCache(...) and "
                     "batch=sh.RaggedBatch(...) together; got kv_cache of type "
                     f"{type(call.kv_cache).__name__} and batch of type {type(call.batch).__name__}.")
  if query.ndim != 3:
    raise ValueError(f"With a PagedKVCache the inputs are the step's tokens, flat: [N, D] (every "
                     f"sequence's new tokens concatenated), got {query.ndim - 1} dims before the "
                     "heads.")
  given = [name for name in ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions",
                             "lengths") if getattr(call, name) is not None]
  batch = call.batch
  if given:
    raise ValueError(f"With a PagedKVCache, `batch` says each token's sequence and position: do "
                     f"not pass {', '.join(given)}.")
  rules: Any = dict(mask=call.mask, bias=call.bias)  # arrays: paged validation says what to pass
  owners.check(call.kv_cache, settings.layer, "kv_cache")
  # A pool stores keys in its own dtype (cast or quantized as written) and the kernel reads
  # them in the query's: narrower pools are a choice, not a mismatch.
  if not isinstance(call.kv_cache.key, Quantized):  # a quantized pool quantizes as it writes
    key, value = key.astype(call.kv_cache.key.dtype), value.astype(call.kv_cache.value.dtype)
  if call.page_top_k is not None:  # Quest: this layer's queries choose its pages (and their own)
    batch = dataclasses.replace(batch, selection=sparse.top_k_pages(
        query, call.kv_cache, batch, top_k=call.page_top_k))
  result = paged_attention(query, key, value, call.kv_cache, batch, config=settings.config,
                           softmax_aux=sinks, mesh=settings.mesh, axes=settings.axes,
                           owner=settings.layer, **rules)
  return result[0], result[1]  # [N, H, V], the cache


def _check_cache_dtype(cache: Any, key: jax.Array, config: AttentionConfig) -> None:
  """A cache of another dtype than the layer's keys, with no `runtime_dtype` to reconcile them,
  is a ValueError naming `kv_cache` (the caller passed no query, key or value to blame)."""
  if isinstance(getattr(cache, "key", None), Quantized):  # quantized as written, from any float
    return
  held = getattr(getattr(cache, "key", None), "dtype", None)
  if held is None or held == key.dtype or config.runtime_dtype is not None:
    return
  raise ValueError(
      f"`kv_cache` holds {held} keys and values and this layer computes {key.dtype} ones: build "
      f"the cache in the layer's dtype (init_cache(..., dtype=jnp.{key.dtype})), or set "
      f"AttentionConfig(runtime_dtype=jnp.{held}) to attend in the cache's dtype.")


def flat_mask(mask: ArrayLike | Mask | None, lead: list[int], num_heads: int, query_len: int,
              kv_len: int, step: kv_cache_lib.Append | None = None) -> jax.Array | Mask | None:
  """A module's `mask` with the leading dims flattened: a module-style array as bool
  [B, 1|H, T, S]; a mask object with its arrays [..., T] -> [B, T] (with a cache, over its
  slots: `Mask.over_slots`, where the new tokens are written)."""
  if mask is None:
    return None
  if not isinstance(mask, Mask):
    return module_mask(mask, lead, num_heads, query_len, kv_len)

  def flat(side: str, a: jax.Array, **_: Any) -> jax.Array:
    if side in ("free", "head"):  # no token axis: as given
      return a
    if side == "qk":
      return module_mask(a, lead, num_heads, query_len, kv_len)  # [B, 1|H, T, S]
    a = jnp.asarray(a)
    return jnp.broadcast_to(a, (*lead, a.shape[-1])).reshape(-1, a.shape[-1])  # [B, T|S]

  mask = mask.map_arrays(flat)
  if step is None:
    return mask
  slots = step.extras.q_positions  # [B, T]: where each new token is written
  return mask.map_parts(lambda part: part.over_slots(slots, kv_len))


def module_mask(mask: ArrayLike, lead: list[int], num_heads: int, query_len: int,
                kv_len: int) -> jax.Array:
  """A module-style mask (any dtype, nonzero = attend, broadcastable to [..., H, T, S])
  -> bool [B, 1 or H, T, S] with the leading dims flattened into B."""
  mask = jnp.asarray(mask)
  given = tuple(mask.shape)  # errors report what the caller passed
  full = (*lead, num_heads, query_len, kv_len)
  if mask.ndim > len(full):
    raise ValueError(f"`mask` of shape {given} has more dims than [..., H, T, S] = {full}.")
  mask = mask.reshape((1,) * (len(full) - mask.ndim) + mask.shape)
  heads = 1 if mask.shape[-3] == 1 else num_heads
  try:
    mask = jnp.broadcast_to(mask != 0, (*lead, heads, query_len, kv_len))
  except ValueError as e:
    raise ValueError(f"`mask` of shape {given} does not broadcast to [..., H, T, S] = "
                     f"{full}.") from e
  return mask.reshape(math.prod(lead), heads, query_len, kv_len)

