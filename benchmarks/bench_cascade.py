"""What a cascade saves: a decode step whose sequences share a prefix, with and without the
grouping (`RaggedBatch.prefix`), same run (f32, Hq = 8, Hkv = 2, D = 64, pages of 16).

  python -m benchmarks.bench_cascade [--prefix=4096] [--seqs=32] [--repeats=5]

- shared: --seqs sequences behind one --prefix-token prefix, each with its own 64..512 cached
  tokens and one new token; the grouped step against the plain one (every row reading the
  prefix's pages itself);
- unshared: the same sequences with prefixes of their own (nothing to share), grouped (every
  sequence its own group of one) against plain: what the grouping costs when it saves nothing.
"""

from __future__ import annotations

from typing import Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_paged
import splash_hk as sh

HQ, HKV, D, PAGE = 8, 2, 64, 16


def _step(prefix: int, own: np.ndarray, shared: bool, grouped: bool):
  """A compiled decode step over such sequences and its arguments, as a thunk."""
  seqs, rng = len(own), np.random.default_rng(0)
  prefix_pages = prefix // PAGE
  own_pages = [-(-(n + 1) // PAGE) for n in own]
  total = prefix_pages * (1 if shared else seqs) + sum(own_pages)
  width = prefix_pages + max(own_pages)
  table = np.zeros((seqs, width), np.int32)
  pages = np.zeros((seqs if not shared else 1, prefix_pages), np.int32)
  order, start = rng.permutation(total), 0
  for g in range(pages.shape[0]):
    pages[g], start = order[start:start + prefix_pages], start + prefix_pages
  for s, n in enumerate(own_pages):
    table[s, :prefix_pages] = pages[0 if shared else s]
    table[s, prefix_pages:prefix_pages + n], start = order[start:start + n], start + n
  cache = sh.PagedKVCache(jnp.asarray(rng.normal(size=(total, HKV, PAGE, D)), jnp.float32),
                          jnp.asarray(rng.normal(size=(total, HKV, PAGE, D)), jnp.float32))
  group = np.zeros(seqs, np.int32) if shared else np.arange(seqs, dtype=np.int32)
  batch = sh.RaggedBatch(
      jnp.arange(seqs + 1, dtype=jnp.int32), jnp.asarray(prefix + own, jnp.int32),
      jnp.asarray(table), jnp.asarray(seqs, jnp.int32),
      prefix=sh.SharedPrefix(jnp.asarray(pages), jnp.full((len(pages),), prefix, jnp.int32),
                             jnp.asarray(group)) if grouped else None)
  q = jnp.asarray(rng.normal(size=(seqs, HQ, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(seqs, HKV, D)), jnp.float32)
  return bench_paged.donated_step(q, k, cache, batch)


def report(prefix: int, seqs: int, repeats: int) -> dict[str, float]:
  own = np.linspace(64, 512, seqs).astype(np.int64)
  figures = {
      "shared_plain_over_grouped": bench_paged.ratio([_step(prefix, own, True, False)],
                                                     [_step(prefix, own, True, True)], repeats),
      "unshared_grouped_over_plain": bench_paged.ratio([_step(prefix, own, False, True)],
                                                       [_step(prefix, own, False, False)],
                                                       repeats),
  }
  print(f"decode, {seqs} sequences behind one {prefix}-token prefix (own 64..512): plain / "
        f"grouped = {figures['shared_plain_over_grouped']:.2f}x")
  print(f"the same sequences with prefixes of their own: grouped / plain = "
        f"{figures['unshared_grouped_over_plain']:.2f}x")
  return figures


def main(argv: Sequence[str]) -> None:
  del argv
  report(flags.FLAGS.prefix, flags.FLAGS.seqs, flags.FLAGS.repeats)


if __name__ == "__main__":
  flags.DEFINE_integer("prefix", 4096, "Shared prefix tokens (whole pages).")
  flags.DEFINE_integer("seqs", 32, "Sequences in the step.")
  flags.DEFINE_integer("repeats", 5, "Rounds (the median ratio).")
  app.run(main)
