"""The paged cache's figures, as same-run ratios (f32, Hq = 8, Hkv = 2, D = 64, pages of 16).

  python -m benchmarks.bench_paged [--repeats=7] [--max_len=4096]

- decode: one new token for each of 16 sequences whose lengths spread over 64..max_len (4096),
  with page tables wide enough for max_len and for 8 * max_len tokens (the work follows the
  lengths, not the table), against the same step with `KVCache` of max_len (`attention` over
  its slots);
- mixed: 2 prefill chunks of max_len / 16 (256) tokens after as many cached ones, and 14
  decodes, in one step, against the two steps done separately;
- memory: the KV bytes each cache holds for those 16 sequences.

Every paged step donates its pool (`donate_argnums`), as users are told to; the decode is also
timed undonated, for what not donating costs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
import splash_hk as sh

HQ, HKV, D, PAGE = 8, 2, 64, 16


def pool_for(lens: Sequence[int], q_lens: Sequence[int], pages_per_seq: int, seed: int = 0,
             dim: int = D, dtype: Any = jnp.float32) -> tuple[sh.PagedKVCache, sh.RaggedBatch]:
  """A pool holding exactly the sequences' pages (shuffled), of head dim `dim` in `dtype`
  (int8, fp8: quantized), and the step's batch."""
  rng = np.random.default_rng(seed)
  need = [-(-(n + q) // PAGE) for n, q in zip(lens, q_lens)]
  order = rng.permutation(sum(need))
  table = np.zeros((len(lens), pages_per_seq), np.int32)
  start = 0
  for s, n in enumerate(need):
    table[s, :n] = order[start:start + n]
    start += n
  pool = sum(need)
  cache = sh.PagedKVCache(*(_stored(rng.normal(size=(pool, HKV, PAGE, dim)), dtype)
                            for _ in "kv"))
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  batch = sh.RaggedBatch(jnp.asarray(cu), jnp.asarray(lens, jnp.int32), jnp.asarray(table),
                         jnp.asarray(len(lens), jnp.int32))
  return cache, batch


def donated_step(q: jax.Array, k: jax.Array, cache: sh.PagedKVCache, batch: sh.RaggedBatch,
                 donate: bool = True) -> Callable[[], Any]:
  """A thunk running one compiled paged step with the pool donated, as a server runs it (each
  call writes the step's tokens again, the same values at the same slots, into the pool the
  last call returned); `donate=False`: the pool copied each call, what not donating costs."""
  step = jax.jit(lambda q, k, c, b: sh.paged_attention(q, k, k, c, b),
                 donate_argnums=(2,) if donate else ())
  pool = [cache]

  def run() -> jax.Array:
    out, pool[0] = step(q, k, pool[0], batch)
    return out

  return run


def _paged_call(lens, q_lens, pages_per_seq, donate: bool = True) -> Callable[[], Any]:
  """A compiled paged step over such sequences, and its arguments, as a thunk."""
  cache, batch = pool_for(lens, q_lens, pages_per_seq)
  rng = np.random.default_rng(1)
  n = int(sum(q_lens))
  q = jnp.asarray(rng.normal(size=(n, HQ, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(n, HKV, D)), jnp.float32)
  return donated_step(q, k, cache, batch, donate)


def _stored(a: np.ndarray, dtype: Any) -> Any:
  """`a` as a cache stores it in `dtype`: float32, or quantized per (token, kv head)."""
  a = jnp.asarray(a, jnp.float32)
  return a if dtype == jnp.float32 else sh.quantize(a, dtype)


def fixed_call(lens, max_len, dim: int = D, dtype: Any = jnp.float32) -> Callable[[], Any]:
  """One decode token per row against a [16, max_len] KVCache's slots (`attention`), keys and
  values of head dim `dim` stored in `dtype` (int8, fp8: quantized)."""
  rng = np.random.default_rng(2)
  rows = len(lens)
  q = jnp.asarray(rng.normal(size=(rows, 1, HQ, dim)), jnp.float32)
  kv = _stored(rng.normal(size=(rows, max_len, HKV, dim)), dtype)
  slots = np.arange(max_len)
  extras = dict(q_positions=jnp.asarray(np.asarray(lens)[:, None], jnp.int32),
                kv_positions=jnp.asarray(np.tile(slots, (rows, 1)), jnp.int32),
                q_segment_ids=jnp.zeros((rows, 1), jnp.int32),
                kv_segment_ids=jnp.asarray(np.where(slots[None] <= np.asarray(lens)[:, None],
                                                    0, -1), jnp.int32))
  step = jax.jit(lambda q, kv, e: sh.attention(q, kv, kv, **e).attention_outputs)
  return lambda: step(q, kv, extras)


def ratio(first: Sequence[Callable[[], Any]], second: Sequence[Callable[[], Any]],
           repeats: int) -> float:
  """Median over `repeats` rounds of (time of the `first` calls) / (time of the `second`),
  the two timed one after the other in each round (the machine's drift cancels)."""
  seconds = lambda calls: sum(timing.timed_call(call)[0] for call in calls)
  return float(np.median([seconds(first) / seconds(second) for _ in range(repeats)]))


def report(repeats: int, max_len: int = 4096) -> dict[str, float]:
  """Prints and returns the ratios and bytes (sequences of 64..max_len tokens)."""
  lens = np.linspace(64, max_len - 1, 16).astype(np.int32)  # cached tokens before the step
  narrow_pages, chunk = max_len // PAGE, max_len // 16  # the prefill chunks: 256 at 4096
  ones = [1] * 16
  narrow = _paged_call(lens, ones, narrow_pages)
  mixed_lens, mixed_q = [chunk, chunk] + list(lens[:14]), [chunk, chunk] + [1] * 14
  apart = [_paged_call([chunk, chunk], [chunk, chunk], narrow_pages),
           _paged_call(lens[:14], [1] * 14, narrow_pages)]
  used = sum(-(-(int(n) + 1) // PAGE) for n in lens) * PAGE
  paged_bytes, fixed_bytes = used * HKV * D * 4 * 2, 16 * max_len * HKV * D * 4 * 2
  figures = {
      "decode_wide_over_narrow": ratio([_paged_call(lens, ones, 8 * narrow_pages)], [narrow],
                                        repeats),
      "decode_paged_over_kv_cache": ratio([narrow], [fixed_call(lens, max_len)], repeats),
      "mixed_over_apart": ratio([_paged_call(mixed_lens, mixed_q, narrow_pages)], apart,
                                 repeats),
      "decode_undonated_over_donated": ratio([_paged_call(lens, ones, narrow_pages, False)],
                                             [narrow], repeats),
      "paged_mib": paged_bytes / 2**20, "kv_cache_mib": fixed_bytes / 2**20}
  print(f"decode, 16 sequences of 64..{max_len} tokens: pages_per_seq for {8 * max_len} / for "
        f"{max_len} tokens: {figures['decode_wide_over_narrow']:.2f}x; paged / "
        f"KVCache(max_len={max_len}): {figures['decode_paged_over_kv_cache']:.2f}x")
  print(f"the same decode with the pool not donated / donated (a copy of the pool each step): "
        f"{figures['decode_undonated_over_donated']:.2f}x")
  print(f"mixed step (2 prefill chunks of {chunk} after {chunk} cached + 14 decodes) / the two "
        f"apart: {figures['mixed_over_apart']:.2f}x")
  print(f"KV bytes for those 16 sequences: paged {figures['paged_mib']:.1f} MiB (their tokens, "
        f"rounded up to pages of {PAGE}), KVCache {figures['kv_cache_mib']:.1f} MiB")
  return figures


def main(argv: Sequence[str]) -> None:
  del argv
  report(flags.FLAGS.repeats, flags.FLAGS.max_len)


if __name__ == "__main__":  # flags defined here: the bench (imported beside) has its own
  flags.DEFINE_integer("repeats", 7, "Rounds per ratio (the median).")
  flags.DEFINE_integer("max_len", 4096, "The longest sequence (KVCache's max_len).")
  app.run(main)
