"""What 8-bit keys and values buy: tokens per pool byte, and decode and prefill time against
float32 caches, same run (f32 queries, Hq = 8, Hkv = 2, pages of 16).

  python -m benchmarks.bench_quant [--max_len=8192] [--head_dims=64,128] [--repeats=5]

- pool: tokens an int8 pool holds for the bytes of a float32 pool (values plus a float32 scale
  per token and kv head);
- paged decode: 16 sequences of 64..max_len cached tokens, one new token each;
- fixed decode: one token per row against a [16, max_len] cache (`attention`);
- paged prefill: 2 chunks of max_len / 16 tokens against max_len / 2 cached ones, beside 14
  decodes;
- peak memory: the compiled int8 paged decode step's temporaries against the bytes a
  dequantized float32 copy of its pool would take.
Each time figure is int8 / float32 (the median of --repeats rounds, both timed in each round).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_paged
import splash_hk as sh

HQ, HKV, PAGE, ROWS = bench_paged.HQ, bench_paged.HKV, bench_paged.PAGE, 16


def _paged(lens, q_lens, dim: int, dtype: Any) -> tuple[Callable[[], Any], Any]:
  """A compiled paged step over such sequences as a thunk (the pool donated, as a server runs
  it: written in place), and the step lowered so."""
  cache, batch = bench_paged.pool_for(lens, q_lens, max(-(-(n + q) // PAGE) for n, q in
                                                        zip(lens, q_lens)), dim=dim, dtype=dtype)
  rng = np.random.default_rng(1)
  n = int(sum(q_lens))
  q = jnp.asarray(rng.normal(size=(n, HQ, dim)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(n, HKV, dim)), jnp.float32)
  call = lambda q, k, c, b: sh.paged_attention(q, k, k, c, b)
  return (bench_paged.donated_step(q, k, cache, batch),
          jax.jit(call, donate_argnums=(2,)).lower(q, k, cache, batch))


def pool_tokens_ratio(dim: int, dtype: Any = jnp.int8) -> float:
  """Tokens a `dtype` pool holds for the bytes of a float32 one (scales included)."""
  nbytes = lambda a: a.nbytes
  per_token = lambda dt: sum(nbytes(a) for a in jax.tree.leaves(
      sh.PagedKVCache.zeros(1, PAGE, HKV, dim, dtype=dt))) / PAGE
  return per_token(jnp.float32) / per_token(dtype)


def report(max_len: int, dims: Sequence[int], repeats: int) -> dict[str, float]:
  """Prints and returns every figure, per head dim."""
  lens = np.linspace(64, max_len - 1, ROWS).astype(np.int32)
  chunk = max_len // 16
  prefill_lens, prefill_q = [max_len // 2] * 2 + list(lens[:14]), [chunk] * 2 + [1] * 14
  figures = {}
  for dim in dims:
    run = lambda dtype, lens=lens, q=(1,) * ROWS: _paged(lens, q, dim, dtype)[0]
    figures[f"pool_tokens_int8_over_f32_d{dim}"] = pool_tokens_ratio(dim)
    figures[f"paged_decode_int8_over_f32_d{dim}"] = bench_paged.ratio(
        [run(jnp.int8)], [run(jnp.float32)], repeats)
    figures[f"fixed_decode_int8_over_f32_d{dim}"] = bench_paged.ratio(
        [bench_paged.fixed_call(lens, max_len, dim, jnp.int8)],
        [bench_paged.fixed_call(lens, max_len, dim, jnp.float32)], repeats)
    figures[f"paged_prefill_int8_over_f32_d{dim}"] = bench_paged.ratio(
        [run(jnp.int8, prefill_lens, prefill_q)], [run(jnp.float32, prefill_lens, prefill_q)],
        repeats)
    pages = sum(-(-(int(n) + 1) // PAGE) for n in lens)
    memory = _paged(lens, (1,) * ROWS, dim, jnp.int8)[1].compile().memory_analysis()
    figures[f"int8_decode_temp_over_dequantized_pool_d{dim}"] = (
        memory.temp_size_in_bytes / (2 * 4 * pages * PAGE * HKV * dim))
    for name, value in figures.items():
      if name.endswith(f"d{dim}"):
        print(f"{name}: {value:.3f}")
  return figures


def main(argv: Sequence[str]) -> None:
  del argv
  report(flags.FLAGS.max_len, [int(d) for d in flags.FLAGS.head_dims], flags.FLAGS.repeats)


if __name__ == "__main__":
  flags.DEFINE_integer("max_len", 8192, "Longest sequence (tokens cached before the step).")
  flags.DEFINE_list("head_dims", ["64", "128"], "Head dims to measure.")
  flags.DEFINE_integer("repeats", 5, "Rounds (the median ratio).")
  app.run(main)
