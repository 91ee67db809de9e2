"""The paged cache's figures, as same-run ratios (f32, Hq = 8, Hkv = 2, pages of 16; per head dim).

  python -m benchmarks.bench_paged [--repeats=3] [--head_dims=64,128] [--max_len=8192]
                                   [--prompts=4096,16384] [--quest_len=16384]

- prefill: one prompt of each --prompts length in one paged step, against `attention` over the
  same tokens (causal self-attention);
- chunk: a 512-token prefill chunk after --max_len cached tokens, against `attention` over a
  `KVCache`'s slots (the same step with the fixed cache);
- mixed: 2 prefill chunks of 512 tokens after 512 cached ones, and 14 decodes, in one step,
  against the two steps done separately;
- decode: one new token for each of 16 sequences whose lengths spread over 64..--max_len,
  against the same step with `KVCache` of --max_len; its fraction of the read bandwidth (a
  jitted sum over 1 GiB in the same run); a page table wide enough for 8 * --max_len tokens
  against one for --max_len (the work follows the lengths); the pool not donated;
- quest: a decode of 8 sequences of --quest_len tokens with 1/16 of each sequence's pages
  chosen by `sh.sparse.top_k_pages` (the choice in the step), against the same step reading
  every page;
- memory: the KV bytes each cache holds for the decode's 16 sequences.

Every paged step donates its pool (`donate_argnums`), as users are told to.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
import splash_hk as sh

HQ, HKV, D, PAGE, CHUNK = 8, 2, 64, 16, 512


def pool_for(lens: Sequence[int], q_lens: Sequence[int], pages_per_seq: int, seed: int = 0,
             dim: int = D, dtype: Any = jnp.float32,
             summaries: bool = False) -> tuple[sh.PagedKVCache, sh.RaggedBatch]:
  """A pool holding exactly the sequences' pages (shuffled), of head dim `dim` in `dtype`
  (int8, fp8: quantized; `summaries`: with page summaries), and the step's batch."""
  rng = np.random.default_rng(seed)
  need = [-(-(n + q) // PAGE) for n, q in zip(lens, q_lens)]
  order = rng.permutation(sum(need))
  table = np.zeros((len(lens), pages_per_seq), np.int32)
  start = 0
  for s, n in enumerate(need):
    table[s, :n] = order[start:start + n]
    start += n
  pool = sum(need)
  keys = rng.normal(size=(pool, PAGE, HKV, dim))
  cache = sh.PagedKVCache.from_token_major(_stored(keys, dtype),
                                           _stored(rng.normal(size=keys.shape), dtype))
  if summaries:  # the bounds of every slot (the benchmark's pages are full of its tokens)
    held = jnp.swapaxes(jnp.asarray(keys, jnp.float32), 1, 2)  # [P, Hkv, page, D]
    cache = cache.replace(key_min=jnp.min(held, axis=2), key_max=jnp.max(held, axis=2))
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  batch = sh.RaggedBatch(jnp.asarray(cu), jnp.asarray(lens, jnp.int32), jnp.asarray(table),
                         jnp.asarray(len(lens), jnp.int32))
  return cache, batch


def donated_step(q: jax.Array, k: jax.Array, cache: sh.PagedKVCache, batch: sh.RaggedBatch,
                 donate: bool = True, top_k: int | None = None,
                 config: sh.AttentionConfig = sh.AttentionConfig()) -> Callable[[], Any]:
  """A thunk running one compiled paged step with the pool donated, as a server runs it (each
  call writes the step's tokens again, the same values at the same slots, into the pool the
  last call returned); `donate=False`: the pool copied each call, what not donating costs;
  `top_k`: each sequence reads its last page and the `top_k` pages Quest's bound chooses;
  `config`: the attention config (its platform)."""
  def step(q, k, c, b):
    if top_k is not None:
      b = dataclasses.replace(b, selection=sh.sparse.top_k_pages(q, c, b, top_k=top_k))
    return sh.paged_attention(q, k, k, c, b, config=config)

  compiled = jax.jit(step, donate_argnums=(2,) if donate else ())
  pool = [cache]

  def run() -> jax.Array:
    out, pool[0] = compiled(q, k, pool[0], batch)
    return out

  return run


def paged_call(lens, q_lens, pages_per_seq, dim: int = D, donate: bool = True,
               top_k: int | None = None) -> Callable[[], Any]:
  """A compiled paged step over such sequences, and its arguments, as a thunk."""
  cache, batch = pool_for(lens, q_lens, pages_per_seq, dim=dim, summaries=top_k is not None)
  rng = np.random.default_rng(1)
  n = int(sum(q_lens))
  q = jnp.asarray(rng.normal(size=(n, HQ, dim)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(n, HKV, dim)), jnp.float32)
  return donated_step(q, k, cache, batch, donate, top_k)


def _stored(a: np.ndarray, dtype: Any) -> Any:
  """`a` as a cache stores it in `dtype`: float32, or quantized per (token, kv head)."""
  a = jnp.asarray(a, jnp.float32)
  return a if dtype == jnp.float32 else sh.quantize(a, dtype)


def fixed_call(lens, max_len, dim: int = D, dtype: Any = jnp.float32,
               q_len: int = 1) -> Callable[[], Any]:
  """`q_len` new tokens per row against a [rows, max_len] KVCache's slots (`attention`, the
  rows' cached and new tokens visible), keys and values of head dim `dim` stored in `dtype`
  (int8, fp8: quantized)."""
  rng = np.random.default_rng(2)
  rows, lens = len(lens), np.asarray(lens)
  q = jnp.asarray(rng.normal(size=(rows, q_len, HQ, dim)), jnp.float32)
  kv = _stored(rng.normal(size=(rows, max_len, HKV, dim)), dtype)
  slots = np.arange(max_len)
  extras = dict(q_positions=jnp.asarray(lens[:, None] + np.arange(q_len), jnp.int32),
                kv_positions=jnp.asarray(np.tile(slots, (rows, 1)), jnp.int32),
                q_segment_ids=jnp.zeros((rows, q_len), jnp.int32),
                kv_segment_ids=jnp.asarray(np.where(slots[None] < (lens + q_len)[:, None],
                                                    0, -1), jnp.int32))
  step = jax.jit(lambda q, kv, e: sh.attention(q, kv, kv, **e).attention_outputs)
  return lambda: step(q, kv, extras)


def self_attention_call(length: int, dim: int) -> Callable[[], Any]:
  """Causal self-attention (`attention`) over one prompt of `length` tokens."""
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.normal(size=(1, length, HQ, dim)), jnp.float32)
  kv = jnp.asarray(rng.normal(size=(1, length, HKV, dim)), jnp.float32)
  step = jax.jit(lambda q, kv: sh.attention(q, kv, kv).attention_outputs)
  return lambda: step(q, kv)


def ratio(first: Sequence[Callable[[], Any]], second: Sequence[Callable[[], Any]],
          repeats: int) -> float:
  """Median over `repeats` rounds of (time of the `first` calls) / (time of the `second`),
  the two timed one after the other in each round (the machine's drift cancels)."""
  seconds = lambda calls: sum(timing.timed_call(call)[0] for call in calls)
  return float(np.median([seconds(first) / seconds(second) for _ in range(repeats)]))


def prefill_rows(dim: int, prompts: Sequence[int], max_len: int,
                 repeats: int) -> dict[str, float]:
  """One prompt in one step / `attention`; a chunk after max_len cached / KVCache; mixed."""
  out = {}
  for length in prompts:
    out[f"prefill_{length}_paged_over_attention"] = ratio(
        [paged_call([0], [length], -(-length // PAGE), dim)], [self_attention_call(length, dim)],
        repeats)
  out["chunk_paged_over_kv_cache"] = ratio(
      [paged_call([max_len], [CHUNK], -(-(max_len + CHUNK) // PAGE), dim)],
      [fixed_call([max_len], max_len + CHUNK, dim, q_len=CHUNK)], repeats)
  lens = np.linspace(64, max_len - 1, 16).astype(np.int32)
  pages = -(-max(max_len + CHUNK, 2 * CHUNK) // PAGE)
  mixed = paged_call([CHUNK, CHUNK] + list(lens[:14]), [CHUNK, CHUNK] + [1] * 14, pages, dim)
  apart = [paged_call([CHUNK, CHUNK], [CHUNK, CHUNK], pages, dim),
           paged_call(lens[:14], [1] * 14, pages, dim)]
  out["mixed_over_apart"] = ratio([mixed], apart, repeats)
  return out


def decode_rows(dim: int, max_len: int, repeats: int) -> dict[str, float]:
  """16 sequences of 64..max_len: paged / KVCache, read fraction, wide / narrow, undonated."""
  lens = np.linspace(64, max_len - 1, 16).astype(np.int32)
  narrow_pages, ones = max_len // PAGE, [1] * 16
  narrow = paged_call(lens, ones, narrow_pages, dim)
  used = sum(-(-(int(n) + 1) // PAGE) for n in lens) * PAGE
  paged_bytes = used * HKV * dim * 4 * 2
  bandwidth = timing.read_bandwidth(1.0, repeats)
  seconds = float(np.median([timing.timed_call(narrow)[0] for _ in range(repeats)]))
  return {
      "decode_paged_over_kv_cache": ratio([narrow], [fixed_call(lens, max_len, dim)], repeats),
      "decode_read_fraction": paged_bytes / seconds / bandwidth,
      "decode_wide_over_narrow": ratio([paged_call(lens, ones, 8 * narrow_pages, dim)],
                                       [narrow], repeats),
      "decode_undonated_over_donated": ratio([paged_call(lens, ones, narrow_pages, dim, False)],
                                             [narrow], repeats),
      "paged_mib": paged_bytes / 2**20, "kv_cache_mib": 16 * max_len * HKV * dim * 8 / 2**20}


def quest_row(dim: int, length: int, repeats: int) -> float:
  """8 sequences of `length` tokens decoding: every page / 1/16 of the pages chosen (Quest)."""
  lens, pages = [length] * 8, -(-(length + 1) // PAGE)
  top_k = max(pages // 16 - 1, 1)  # plus the last page: 1/16 of the pages
  return ratio([paged_call(lens, [1] * 8, pages, dim)],
               [paged_call(lens, [1] * 8, pages, dim, top_k=top_k)], repeats)


def report(repeats: int, max_len: int = 8192, head_dims: Sequence[int] = (64, 128),
           prompts: Sequence[int] = (4096, 16384), quest_len: int = 16384) -> dict[str, float]:
  """Prints and returns the figures of each head dim (keys suffixed `_d{dim}`)."""
  figures = {}
  for dim in head_dims:
    rows = {**prefill_rows(dim, prompts, max_len, repeats), **decode_rows(dim, max_len, repeats),
            "quest_every_page_over_chosen": quest_row(dim, quest_len, repeats)}
    figures.update({f"{name}_d{dim}": value for name, value in rows.items()})
    _print(dim, rows, prompts, max_len, quest_len)
  return figures


def _print(dim: int, rows: dict[str, float], prompts: Sequence[int], max_len: int,
           quest_len: int) -> None:
  print(f"D = {dim} (f32, Hq {HQ}, Hkv {HKV}, pages of {PAGE}; paged steps donated):")
  for length in prompts:
    print(f"  one prompt of {length} tokens in one step, paged / attention: "
          f"{rows[f'prefill_{length}_paged_over_attention']:.2f}x")
  print(f"  a {CHUNK}-token chunk after {max_len} cached, paged / KVCache: "
        f"{rows['chunk_paged_over_kv_cache']:.2f}x")
  print(f"  mixed step (2 chunks of {CHUNK} + 14 decodes) / the two apart: "
        f"{rows['mixed_over_apart']:.2f}x")
  print(f"  decode, 16 sequences of 64..{max_len}: paged / KVCache(max_len={max_len}): "
        f"{rows['decode_paged_over_kv_cache']:.2f}x; paged reads at "
        f"{rows['decode_read_fraction']:.2f} of the read bandwidth; pages_per_seq for "
        f"{8 * max_len} / for {max_len} tokens: {rows['decode_wide_over_narrow']:.2f}x; the pool "
        f"not donated / donated: {rows['decode_undonated_over_donated']:.2f}x")
  print(f"  Quest, 8 sequences of {quest_len} tokens decoding, every page / 1/16 of the pages "
        f"chosen (choice included): {rows['quest_every_page_over_chosen']:.2f}x")
  print(f"  KV bytes for the decode's 16 sequences: paged {rows['paged_mib']:.1f} MiB (their "
        f"tokens, rounded up to pages of {PAGE}), KVCache {rows['kv_cache_mib']:.1f} MiB")


def main(argv: Sequence[str]) -> None:
  del argv
  f = flags.FLAGS
  report(f.repeats, f.max_len, [int(d) for d in f.head_dims], [int(p) for p in f.prompts],
         f.quest_len)


if __name__ == "__main__":  # flags defined here: the bench (imported beside) has its own
  flags.DEFINE_integer("repeats", 3, "Rounds per ratio (the median).")
  flags.DEFINE_integer("max_len", 8192, "The longest decoding sequence; the chunk's cached "
                       "tokens.")
  flags.DEFINE_list("head_dims", ["64", "128"], "Head dims measured.")
  flags.DEFINE_list("prompts", ["4096", "16384"], "Prompt lengths prefilled in one step.")
  flags.DEFINE_integer("quest_len", 16384, "Tokens of each sequence of the Quest decode.")
  app.run(main)
