"""The caches' storage layouts, measured: token-major [.., S, Hkv, D] against head-major
[.., Hkv, S, D] (f32, Hq = 8, Hkv = 2, pages of 16; per head dim), as same-run ratios.

  python -m benchmarks.bench_layout [--repeats=3] [--head_dims=64,128] [--max_len=8192]

- pool: one decode row for each of 16 sequences of 64..--max_len tokens over shuffled pages, the
  way the paged tiles read them (runs of 8 pages gathered, one dot per kv head, a softmax per
  run), from a token-major pool against a head-major one (the pool's choice);
- KVCache: the same decode through `attention` over a `KVCache`'s slots, the cache head-major
  (handed to `attention` through a transpose) against token-major (the fixed cache's choice).
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
from splash_hk.backends.xla import paged_items as items_lib

HQ, HKV, PAGE, RUN, STEP = 8, 2, 16, 8, 16  # RUN pages an item, STEP items a loop step


def _items(lens: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
  """(pages [I, RUN] physical, seq [I]) of every run of each sequence's shuffled pages, padded
  to whole loop steps, and the pool's pages."""
  need = [-(-(int(n) + 1) // PAGE) for n in lens]
  order = rng.permutation(sum(need))
  pages, seqs, start = [], [], 0
  for s, n in enumerate(need):
    for first in range(0, n, RUN):
      run = np.zeros(RUN, np.int64)
      run[:min(RUN, n - first)] = order[start + first:start + min(first + RUN, n)]
      pages.append(run)
      seqs.append(s)
    start += n
  pad = -len(pages) % STEP
  return (np.pad(np.stack(pages), ((0, pad), (0, 0))), np.pad(np.array(seqs), (0, pad)),
          sum(need))


def pool_decode(head_major: bool, pages: jax.Array, seqs: jax.Array, q: jax.Array,
                key: jax.Array, value: jax.Array) -> jax.Array:
  """Every item's runs of pages gathered from the pool (`head_major`: [P, Hkv, page, D], else
  [P, page, Hkv, D]) and attended by its sequence's row, q [16, Hkv, G, D]; summed."""
  dim, groups = q.shape[-1], HQ // HKV

  def body(i: jax.Array, total: jax.Array) -> jax.Array:
    ph = jax.lax.dynamic_slice_in_dim(pages, i * STEP, STEP)  # [I, RUN]
    qq = q[jax.lax.dynamic_slice_in_dim(seqs, i * STEP, STEP)]  # [I, Hkv, G, D]
    if head_major:
      k, _ = items_lib.gather(key, ph[:, None], HKV)  # [I, Hkv, S', D], as the tiles read it
      v, _ = items_lib.gather(value, ph[:, None], HKV)
      s = jnp.einsum("ikgd,iksd->ikgs", qq, k)  # [I, Hkv, G, S']
      p = jax.nn.softmax(s, axis=-1)
      return total + jnp.einsum("ikgs,iksd->kgd", p, v)
    k = key[ph].reshape(STEP, RUN * PAGE, HKV, dim)  # [I, S', Hkv, D]
    v = value[ph].reshape(STEP, RUN * PAGE, HKV, dim)
    p = jax.nn.softmax(jnp.einsum("ikgd,iskd->ikgs", qq, k), axis=-1)  # [I, Hkv, G, S']
    return total + jnp.einsum("ikgs,iskd->kgd", p, v)

  zero = jnp.zeros((HKV, groups, dim), jnp.float32)
  return jax.lax.fori_loop(0, pages.shape[0] // STEP, body, zero)


def pool_ratio(dim: int, max_len: int, repeats: int) -> float:
  """A decode's gathered runs from a token-major pool / from a head-major pool."""
  rng = np.random.default_rng(0)
  pages, seqs, num_pages = _items(np.linspace(64, max_len - 1, 16).astype(np.int32), rng)
  q = jnp.asarray(rng.normal(size=(16, HKV, HQ // HKV, dim)), jnp.float32)
  token = jnp.asarray(rng.normal(size=(2, num_pages, PAGE, HKV, dim)), jnp.float32)
  head = jnp.swapaxes(token, 2, 3)  # the same keys and values, head-major
  args = (jnp.asarray(pages, jnp.int32), jnp.asarray(seqs, jnp.int32), q)
  run = jax.jit(pool_decode, static_argnums=0)
  return _ratio(lambda: run(False, *args, *token), lambda: run(True, *args, *head), repeats)


def kv_cache_ratio(dim: int, max_len: int, repeats: int) -> float:
  """A decode through `attention` over a KVCache's slots: head-major (transposed) / token-major."""
  rng = np.random.default_rng(1)
  lens = np.linspace(64, max_len - 1, 16).astype(np.int32)
  q = jnp.asarray(rng.normal(size=(16, 1, HQ, dim)), jnp.float32)  # [B, 1, Hq, D]
  kv = jnp.asarray(rng.normal(size=(16, max_len, HKV, dim)), jnp.float32)  # [B, S, Hkv, D]
  slots = np.arange(max_len)
  extra = dict(q_positions=jnp.asarray(lens[:, None]), q_segment_ids=jnp.zeros((16, 1), jnp.int32),
               kv_positions=jnp.asarray(np.tile(slots, (16, 1)), jnp.int32),
               kv_segment_ids=jnp.asarray(np.where(slots <= lens[:, None], 0, -1), jnp.int32))
  token = jax.jit(lambda q, kv: sh.attention(q, kv, kv, **extra).attention_outputs)
  head = jax.jit(lambda q, kv: sh.attention(q, jnp.swapaxes(kv, 1, 2), jnp.swapaxes(kv, 1, 2),
                                            **extra).attention_outputs)
  head_major = jnp.swapaxes(kv, 1, 2)  # [B, Hkv, S, D]
  return _ratio(lambda: head(q, head_major), lambda: token(q, kv), repeats)


def _ratio(slow: Callable[[], Any], fast: Callable[[], Any], repeats: int) -> float:
  """The median over rounds of slow's time / fast's, each timed after an untimed call."""
  return float(np.median([timing.timed_call(slow)[0] / timing.timed_call(fast)[0]
                          for _ in range(repeats)]))


def report(repeats: int, max_len: int = 8192,
           head_dims: Sequence[int] = (64, 128)) -> dict[str, float]:
  """Prints and returns both ratios per head dim (keys suffixed `_d{dim}`)."""
  figures = {}
  for dim in head_dims:
    pool, fixed = pool_ratio(dim, max_len, repeats), kv_cache_ratio(dim, max_len, repeats)
    figures.update({f"pool_token_over_head_major_d{dim}": pool,
                    f"kv_cache_head_over_token_major_d{dim}": fixed})
    print(f"D = {dim}, 16 sequences of 64..{max_len} decoding: pool token-major / head-major "
          f"{pool:.2f}x; KVCache head-major (transposed into attention) / token-major "
          f"{fixed:.2f}x")
  return figures


def main(argv: Sequence[str]) -> None:
  del argv
  f = flags.FLAGS
  report(f.repeats, f.max_len, [int(d) for d in f.head_dims])


if __name__ == "__main__":  # flags defined here: the bench (imported beside) has its own
  flags.DEFINE_integer("repeats", 3, "Rounds per ratio (the median).")
  flags.DEFINE_integer("max_len", 8192, "The longest decoding sequence.")
  flags.DEFINE_list("head_dims", ["64", "128"], "Head dims measured.")
  app.run(main)
