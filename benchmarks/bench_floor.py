"""What XLA:CPU can read a KV cache at: the measurements behind the paged decode's floor.

  python -m benchmarks.bench_floor [--repeats=9] [--gib=1]

Every figure is a fraction of this machine's read bandwidth measured in the same run (a
jitted sum over a --gib GiB array):
- pages gathered: a pool of pages of 16 tokens (Hkv = 2, D = 64, f32: 8 KiB a page) read in a
  shuffled order by XLA's gather (`pool[pages]`, the only way a jitted program reads pages a
  table names), then summed; also a loop of dynamic slices, 32 pages a step;
- dense decode: one query token against [16, Hkv, 8192, D] keys and values laid out
  head-major and token-major (a plain einsum, the elementwise form, and flash-decoding's
  split of the keys into 8 parts), every slot read.
A paged decode step reads each sequence's pages through such a gather, so the gather's fraction
bounds the step's.
"""

from __future__ import annotations

from typing import Callable, Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing

HKV, G, D, PAGE, ROWS, SLOTS = 2, 4, 64, 16, 16, 8192


def _gathers(pool: jax.Array, pages: jax.Array) -> dict[str, Callable[[], jax.Array]]:
  """The ways a jitted program can read the pool's pages in `pages`' order, each summed."""
  def sliced(a, i):
    def step(j, total):
      block = [jax.lax.dynamic_index_in_dim(a, i[j * 32 + t], 0, False) for t in range(32)]
      return total + jnp.sum(jnp.stack(block))
    return jax.lax.fori_loop(0, i.shape[0] // 32, step, 0.0)
  take = jax.jit(lambda a, i: jnp.sum(a[i]))
  loop = jax.jit(sliced)
  return {"pages gathered (pool[pages])": lambda: take(pool, pages),
          "pages by dynamic slices, 32 a step": lambda: loop(pool, pages)}


def _decodes(q: jax.Array, head_major: tuple[jax.Array, jax.Array],
             token_major: tuple[jax.Array, jax.Array]) -> dict[str, Callable[[], jax.Array]]:
  """One decode token per row over every slot, in three forms and two layouts."""
  def softmax_pv(s, v, spec):
    return jnp.einsum(spec, jax.nn.softmax(s, axis=-1), v)

  def split(q, k, v):
    parts = 8
    kk = k.reshape(*k.shape[:2], parts, -1, D)
    vv = v.reshape(*v.shape[:2], parts, -1, D)
    s = jnp.einsum("bkgd,bkcsd->bkcgs", q, kk)
    m = s.max(-1, keepdims=True)
    p = jnp.exp(s - m)
    o = jnp.einsum("bkcgs,bkcsd->bkcgd", p, vv)
    top = m.max(2, keepdims=True)
    w = jnp.exp(m - top)
    return (o * w).sum(2) / (p.sum(-1, keepdims=True) * w).sum(2)

  forms = {
      "head-major einsum": (lambda q, k, v: softmax_pv(
          jnp.einsum("bkgd,bksd->bkgs", q, k), v, "bkgs,bksd->bkgd"), head_major),
      "head-major elementwise": (lambda q, k, v: jnp.sum(jax.nn.softmax(jnp.sum(
          k[:, :, None] * q[:, :, :, None], -1), -1)[..., None] * v[:, :, None], 3), head_major),
      "head-major split in 8 (flash-decoding)": (split, head_major),
      "token-major einsum": (lambda q, k, v: softmax_pv(
          jnp.einsum("bkgd,bskd->bkgs", q, k), v, "bkgs,bskd->bkgd"), token_major),
  }
  return {name: (lambda f=jax.jit(f), kv=kv: f(q, *kv)) for name, (f, kv) in forms.items()}


def report(repeats: int, gib: float) -> dict[str, float]:
  """Prints and returns each figure as a fraction of the read bandwidth."""
  bandwidth = timing.read_bandwidth(gib, repeats)
  rng = np.random.default_rng(0)
  num_pages = ROWS * SLOTS // PAGE // 2  # the 65 MiB of keys a 64..8192-token batch holds
  pool = jnp.asarray(rng.normal(size=(num_pages, HKV, PAGE, D)), jnp.float32)
  pages = jnp.asarray(rng.permutation(num_pages).astype(np.int32))
  figures = {name: pool.nbytes / timing.median_seconds(call, repeats=repeats) / bandwidth
             for name, call in _gathers(pool, pages).items()}
  q = jnp.asarray(rng.normal(size=(ROWS, HKV, G, D)), jnp.float32)
  head_major = tuple(jnp.asarray(rng.normal(size=(ROWS, HKV, SLOTS, D)), jnp.float32)
                     for _ in range(2))  # keys, values [B, Hkv, S, D]
  token_major = tuple(jnp.swapaxes(a, 1, 2) + 0 for a in head_major)  # [B, S, Hkv, D]
  for name, call in _decodes(q, head_major, token_major).items():
    seconds = timing.median_seconds(call, repeats=repeats)
    figures[name] = 2 * head_major[0].nbytes / seconds / bandwidth
  print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s (a jitted sum over {gib:g} GiB)")
  for name, fraction in figures.items():
    print(f"{name}: {fraction:.2f} of it")
  return figures


def main(argv: Sequence[str]) -> None:
  del argv
  report(flags.FLAGS.repeats, flags.FLAGS.gib)


if __name__ == "__main__":
  flags.DEFINE_integer("repeats", 9, "Timed calls per figure (the median).")
  flags.DEFINE_float("gib", 1.0, "Size of the array the read bandwidth is measured on.")
  app.run(main)
