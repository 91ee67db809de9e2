"""Blocks chosen by data (MoBA's gate) against causal attention, in one process.

  python -m benchmarks.bench_blocks [--rows=attention,memory,train] [--repeats=3]

f32, B = 1, Hq = 8, Hkv = 2, D = 64, `block_size=(128, 128)`, xla path. The choice is MoBA's
(`sh.sparse.top_k_blocks`: the query's own block and the top_k others), computed once and
passed in; the gate's own time is printed beside. Each figure is a ratio of two calls timed in
the same round (each after an untimed call of its own executable), the median over the rounds:

- T = 16384, own + 8 (1152 keys a query): forward and forward+backward, causal / chosen;
- T = 4096, own + 4: forward, causal / chosen;
- T = 65536, own + 8: forward+backward compiled, its temporaries (XLA's memory analysis) against
  the 16 GiB of one dense [T, S] float32 mask;
- a training step at T = 8192 of a two-layer model whose attention is MoBA (gate + chosen
  blocks, own + 8) against the same model with causal attention: causal / MoBA
  (`bench_train_step.moba_over_causal`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_train_step
from benchmarks import timing
import splash_hk as sh

BLOCK = (128, 128)
ATTENTION_ROWS = ((16384, 8, False), (16384, 8, True), (4096, 4, False))  # (T, top_k, backward)
CONFIG = sh.AttentionConfig(platform="xla")


def _inputs(length: int) -> tuple[jax.Array, ...]:
  shapes = ((1, length, 8, 64), (1, length, 2, 64), (1, length, 2, 64))  # q, k, v
  return tuple(jax.random.normal(jax.random.PRNGKey(i), s) for i, s in enumerate(shapes))


def _chosen(q, k, v, lists, counts):
  mask = sh.masks.Blocks(lists, counts, BLOCK) & sh.masks.Causal()
  return sh.attention(q, k, v, mask=mask, config=CONFIG).attention_outputs


def _causal(q, k, v, lists=None, counts=None):
  del lists, counts
  return sh.attention(q, k, v, config=CONFIG).attention_outputs


def _loss(f: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  return jax.value_and_grad(lambda q, k, v, *c: jnp.sum(f(q, k, v, *c) ** 2), argnums=(0, 1, 2))


def _ratio(slow: Callable, fast: Callable, args: Sequence[Any], repeats: int) -> list[float]:
  """slow / fast seconds per round, each timed after an untimed call of itself."""
  return [timing.timed_call(slow, *args)[0] / timing.timed_call(fast, *args)[0]
          for _ in range(repeats)]


def _say(what: str, ratios: list[float]) -> float:
  ratio = float(np.median(ratios))
  print(f"{what}: {ratio:.2f}x (rounds: {', '.join(f'{r:.2f}' for r in ratios)})", flush=True)
  return ratio


def attention_rows(repeats: int, rows: Sequence[tuple[int, int, bool]] = ATTENTION_ROWS
                   ) -> dict[str, float]:
  """The attention ratios (causal / chosen) of `rows`: (T, top_k, with the backward)."""
  out = {}
  for length, top_k, grad in rows:
    q, k, v = _inputs(length)
    gate = jax.jit(lambda q, k: sh.sparse.top_k_blocks(q, k, top_k, BLOCK))
    seconds, chosen = timing.timed_call(gate, q, k)
    args = (q, k, v, chosen.kv_blocks, chosen.counts)
    wrap = (lambda f: jax.jit(_loss(f))) if grad else jax.jit
    name = f"T={length} own+{top_k} {'forward+backward' if grad else 'forward'}"
    out[name] = _say(f"{name}, causal / chosen", _ratio(wrap(_causal), wrap(_chosen), args,
                                                         repeats))
    print(f"  (the gate alone: {seconds * 1e3:.1f} ms)")
  return out


def memory_row(length: int = 65536) -> float:
  """GiB of temporaries of the forward+backward at T = `length`, compiled (not run)."""
  q, k, v = (jax.ShapeDtypeStruct((1, length, h, 64), jnp.float32) for h in (8, 2, 2))
  nq = length // BLOCK[0]
  lists = jax.ShapeDtypeStruct((1, 2, nq, 9), jnp.int32)
  counts = jax.ShapeDtypeStruct((1, 2, nq), jnp.int32)
  compiled = jax.jit(_loss(_chosen)).lower(q, k, v, lists, counts).compile()
  gib = compiled.memory_analysis().temp_size_in_bytes / 2**30
  dense = length * length * 4 / 2**30
  print(f"T={length} own+8 forward+backward: {gib:.2f} GiB of temporaries (a dense [T, S] "
        f"float32 mask: {dense:.0f} GiB)", flush=True)
  return gib


def train_row(repeats: int, length: int = 8192) -> float:
  """causal / MoBA seconds of one training step at T = `length` (`bench_train_step`'s)."""
  return _say(f"training step at T={length}, causal / MoBA (gate + own+8)",
              bench_train_step.moba_over_causal(length, repeats))


def main(argv: Sequence[str]) -> None:
  del argv
  repeats = flags.FLAGS.repeats
  rows = {"attention": lambda: attention_rows(repeats), "memory": memory_row,
          "train": lambda: train_row(repeats)}
  for name in flags.FLAGS.rows:
    rows[name]()


if __name__ == "__main__":
  flags.DEFINE_list("rows", ["attention", "memory", "train"], "Which rows to run.")
  flags.DEFINE_integer("repeats", 3, "Rounds per ratio (the median is reported).")
  app.run(main)
