"""The checks of a paged call (`paged_attention`, `explain_paged`): the pool, the ragged
batch, its prefix and selection, and rules and scores over positions only; each refusal a
ValueError naming the argument and what to pass instead (`validation`'s helpers).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from splash_hk.config import AttentionConfig
from splash_hk.masks import _objects
from splash_hk.masks._chosen import Blocks
from splash_hk.pages import PageSelection, PagedKVCache, RaggedBatch, SharedPrefix
from splash_hk.quant import Quantized, as_quantized, is_quantized, shaped
from splash_hk.scores import Score
from splash_hk.validation import (Shaped, array, fail, integer, one_rule_place, rank,
                                  validate_sinks)


def validate_paged(query: Shaped, key: Shaped, value: Shaped, cache: Any, batch: Any,
                   config: AttentionConfig, mask: Any, bias: Any, softmax_aux: Any) -> None:
  """A paged call: query [N, Hq, D], key [N, Hkv, D], value [N, Hkv, Dv] against the cache's
  pages and the batch's arrays; rules and scores over positions only."""
  if not isinstance(config, AttentionConfig):
    fail(f"`config` must be a splash_hk.AttentionConfig, got {type(config).__name__}.")
  if not isinstance(cache, PagedKVCache):
    fail(f"`cache` must be a splash_hk.PagedKVCache, got {type(cache).__name__}; build one with "
          "PagedKVCache.zeros(num_pages, page_size, num_kv_heads, key_size, value_size).")
  if not isinstance(batch, RaggedBatch):
    fail(f"`batch` must be a splash_hk.RaggedBatch(cu_q_lens, kv_lens, page_table, num_seqs), "
          f"got {type(batch).__name__}.")
  quantized = isinstance(cache.key, Quantized)
  _quantized_pool(cache)
  written_quantized = {name for a, name in ((key, "key"), (value, "value")) if is_quantized(a)}
  query, key, value = (shaped(a, name) for a, name in ((query, "query"), (key, "key"),
                                                       (value, "value")))
  rank(shaped(cache.key, "cache.key"), 4, "cache.key",
        "[num_pages, num_kv_heads, page_size, head_dim] (build it with PagedKVCache.zeros)")
  rank(shaped(cache.value, "cache.value"), 4, "cache.value",
        "[num_pages, num_kv_heads, page_size, value_head_dim]")
  pool = tuple(cache.key.shape[:3])
  if tuple(cache.value.shape[:3]) != pool:
    fail(f"`cache.value` must be [num_pages, num_kv_heads, page_size, value_head_dim] = "
          f"{(*pool, 'Dv')}, got {tuple(cache.value.shape)}.")
  rank(query, 3, "query", "[num_tokens, num_heads, head_dim]")
  num_tokens, num_heads, head_dim = query.shape
  num_kv_heads, dv = pool[1], cache.value.shape[3]
  for name, x, cached, want in (("key", key, cache.key, (num_tokens, num_kv_heads, head_dim)),
                                ("value", value, cache.value, (num_tokens, num_kv_heads, dv))):
    rank(x, 3, name, f"[num_tokens, num_kv_heads, head_dim] = {want}")
    if tuple(x.shape) != want:
      fail(f"`{name}` must be [num_tokens, num_kv_heads (the cache's), size (the cache's)] = "
            f"{want}, got {tuple(x.shape)}{_token_major_hint(x.shape, cached.shape)}.")
    if not quantized and name not in written_quantized and x.dtype != cached.dtype:
      fail(f"`{name}` is {x.dtype} and the cache holds {cached.dtype}: pass "
            f"{name}.astype(cache.{name}.dtype).")
  if not jnp.issubdtype(query.dtype, jnp.floating) or num_heads % num_kv_heads:
    fail(f"`query` must be floating with a multiple of the cache's {num_kv_heads} kv heads, got "
          f"{query.dtype} with {num_heads} heads.")
  _validate_batch(batch, num_kv_heads)
  if batch.tree is not None:
    _validate_tree(batch.tree, num_tokens)
  _validate_summaries(cache)
  if config.dropout_rate:
    fail(f"`config.dropout_rate` is {config.dropout_rate}: attention dropout is for training and "
          "a paged call serves inference; pass a config with dropout_rate=0.")
  _validate_positions_only(mask, bias, config, num_heads)
  if softmax_aux is not None:
    validate_sinks(softmax_aux, num_heads, num_kv_heads)


def _token_major_hint(new: tuple[int, ...], pool: tuple[int, ...]) -> str:
  """What to say when the pool's axes look token-major ([P, page_size, Hkv, D])."""
  if len(new) == 3 and new[1] == pool[2] and new[1] != pool[1]:
    return (f"; the cache's pages look token-major {tuple(pool)} = [num_pages, page_size, "
            "num_kv_heads, size]: the pool stores them head-major, [num_pages, num_kv_heads, "
            "page_size, size]; build it with PagedKVCache.zeros or "
            "PagedKVCache.from_token_major(key, value)")
  return ""


def _quantized_pool(cache: PagedKVCache) -> None:
  """A pool holds floats in both fields, or `Quantized` in both with a scale per (token, head)."""
  kinds = {isinstance(cache.key, Quantized), isinstance(cache.value, Quantized)}
  if kinds == {False}:
    return
  if len(kinds) == 2:
    fail("`cache.key` and `cache.value` must both be quantized or both floating; build the pool "
          "with PagedKVCache.zeros(..., dtype=jnp.int8).")
  for name in ("key", "value"):
    a = as_quantized(getattr(cache, name), f"cache.{name}")
    if tuple(a.scale.shape) != (*a.shape[:-1], 1):
      fail(f"`cache.{name}.scale` must hold one scale per (token, kv head), "
            f"{(*a.shape[:-1], 1)}, got {tuple(a.scale.shape)}; build the pool with "
            "PagedKVCache.zeros(..., dtype=...).")


def _validate_selection(selection: Any, max_seqs: int, num_kv_heads: int) -> None:
  """`batch.selection`: a PageSelection of pages [max_seqs, Hkv, K] and counts [max_seqs, Hkv]."""
  if not isinstance(selection, PageSelection):
    fail(f"`batch.selection` must be a splash_hk.PageSelection(pages, counts) (from "
          f"sh.sparse.top_k_pages) or None, got {type(selection).__name__}.")
  rank(selection.pages, 3, "batch.selection.pages", f"[max_seqs, num_kv_heads, K] = "
        f"[{max_seqs}, {num_kv_heads}, K]")
  rank(selection.counts, 2, "batch.selection.counts", f"[max_seqs, num_kv_heads] = "
        f"[{max_seqs}, {num_kv_heads}]")
  if (tuple(selection.pages.shape[:2]) != (max_seqs, num_kv_heads)
      or tuple(selection.counts.shape) != (max_seqs, num_kv_heads)):
    fail(f"`batch.selection` must hold pages [max_seqs, num_kv_heads, K] and counts [max_seqs, "
          f"num_kv_heads] = [{max_seqs}, {num_kv_heads}] (a list per sequence and kv head of this "
          f"cache), got {tuple(selection.pages.shape)} and {tuple(selection.counts.shape)}.")
  for name in ("pages", "counts"):
    integer(getattr(selection, name), f"batch.selection.{name}")


def _validate_tree(tree: Shaped, num_tokens: int) -> None:
  """`batch.tree`: [num_tokens] integer parents."""
  want = f"[num_tokens] = [{num_tokens}] (each row's parent within its sequence, -1 for a root)"
  rank(tree, 1, "batch.tree", want)
  if tree.shape[0] != num_tokens:
    fail(f"`batch.tree` must be {want}, got {tuple(tree.shape)}.")
  integer(tree, "batch.tree")


def _validate_summaries(cache: PagedKVCache) -> None:
  """Page summaries: both or neither, float32 [P, Hkv, D] each."""
  if (cache.key_min is None) != (cache.key_max is None):
    fail("`cache.key_min` and `cache.key_max` must both be set or both None; build the pool "
          "with PagedKVCache.zeros(..., page_summaries=True).")
  if cache.key_min is None:
    return
  want = (cache.key.shape[0], cache.key.shape[1], cache.key.shape[-1])
  for name in ("key_min", "key_max"):
    got = shaped(getattr(cache, name), f"cache.{name}")
    if tuple(got.shape) != want or got.dtype != jnp.float32:
      fail(f"`cache.{name}` must be float32 [num_pages, num_kv_heads, head_dim] = {want}, got "
            f"{got.dtype} {tuple(got.shape)}; build the pool with PagedKVCache.zeros(..., "
            "page_summaries=True).")


def _validate_batch(batch: RaggedBatch, num_kv_heads: int) -> None:
  rank(batch.kv_lens, 1, "batch.kv_lens", "[max_seqs]")
  max_seqs = batch.kv_lens.shape[0]
  rank(batch.cu_q_lens, 1, "batch.cu_q_lens", f"[max_seqs + 1] = [{max_seqs + 1}]")
  rank(batch.page_table, 2, "batch.page_table", f"[max_seqs, pages_per_seq] = [{max_seqs}, .]")
  num_seqs = batch.num_seqs
  array(num_seqs, "batch.num_seqs", "[] or [1]")
  if (batch.cu_q_lens.shape[0] != max_seqs + 1 or batch.page_table.shape[0] != max_seqs
      or tuple(num_seqs.shape) not in ((), (1,))):
    fail(f"`batch` must hold cu_q_lens [max_seqs + 1], kv_lens [max_seqs], page_table "
          f"[max_seqs, pages_per_seq] and num_seqs [] or [1] (max_seqs = {max_seqs} from kv_lens), "
          f"got {tuple(batch.cu_q_lens.shape)}, {tuple(batch.kv_lens.shape)}, "
          f"{tuple(batch.page_table.shape)}, {tuple(num_seqs.shape)}.")
  for name in ("cu_q_lens", "kv_lens", "page_table", "num_seqs"):
    integer(getattr(batch, name), f"batch.{name}")
  if batch.selection is not None:
    _validate_selection(batch.selection, max_seqs, num_kv_heads)
  prefix = batch.prefix
  if prefix is None:
    return
  if not isinstance(prefix, SharedPrefix):
    fail(f"`batch.prefix` must be a splash_hk.SharedPrefix(pages, lens, group) or None, got "
          f"{type(prefix).__name__}.")
  rank(prefix.pages, 2, "batch.prefix.pages", "[groups, prefix_pages]")
  groups = prefix.pages.shape[0]
  rank(prefix.lens, 1, "batch.prefix.lens", f"[groups] = [{groups}]")
  rank(prefix.group, 1, "batch.prefix.group", f"[max_seqs] = [{max_seqs}]")
  if prefix.lens.shape[0] != groups or prefix.group.shape[0] != max_seqs or groups < 1:
    fail(f"`batch.prefix` must hold pages [groups, prefix_pages], lens [groups] and group "
          f"[max_seqs] = [{max_seqs}], got {tuple(prefix.pages.shape)}, "
          f"{tuple(prefix.lens.shape)}, {tuple(prefix.group.shape)}.")
  for name in ("pages", "lens", "group"):
    integer(getattr(prefix, name), f"batch.prefix.{name}")


def _validate_positions_only(mask: Any, bias: Any, config: AttentionConfig,
                             num_heads: int) -> None:
  """A pool has no [T, S] layout: rules and scores over positions and heads only."""
  if mask is not None:
    if not isinstance(mask, _objects.Mask):
      fail("`mask` of a paged call must be a mask object over positions (splash_hk.masks: "
            "Causal(), SlidingWindow(w), Chunked(c), MaskFn(fn), combined with & and |); a dense "
            f"array has no meaning over a pool of pages, got {type(mask).__name__}.")
    one_rule_place(mask, config)
    if any(isinstance(part, Blocks) for part in mask.parts()):
      fail("`mask` holds chosen key blocks (Blocks), which paged_attention does not take: a "
            "paged sequence reads the pages its RaggedBatch's page table lists; pass a rule over "
            "positions, or attend the chosen blocks with sh.attention over a KVCache.")
    if mask.array_sides():
      fail(f"`mask` ({mask.name}) holds per-token arrays, which a paged call cannot place; "
            "pass a rule over positions (a MaskFn of q_pos and kv_pos).")
    for part in mask.parts():
      part.check(1, 1, 1)
  if bias is not None:
    if not isinstance(bias, Score) or bias.array_sides() & {"q", "kv", "qk"}:
      fail("`bias` of a paged call must be a position score object (splash_hk.scores: Alibi, "
            "RelativePosition, ScoreFn, added with +); a dense bias has no meaning over a pool "
            f"of pages, got {getattr(bias, 'name', type(bias).__name__)}.")
    for term in bias.parts():  # each term checks itself, naming `bias`
      term.check(1, num_heads, 1, 1)
