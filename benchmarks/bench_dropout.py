"""What attention dropout costs: forward+backward at dropout_rate p against p = 0, same run.

  python -m benchmarks.bench_dropout [--length=4096] [--rate=0.1] [--repeats=5]

Causal self-attention, f32, B = 1, Hq = 8, Hkv = 8, D = 64 on the xla path (the bench's
causal workload), the loss sum(out ** 2); each round times both calls back to back (each after
an untimed call of its own executable) and the figure is the median ratio over the rounds.
"""

from __future__ import annotations

from typing import Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
import splash_hk as sh


def _step(rate: float):
  config = sh.AttentionConfig(dropout_rate=rate, platform="xla")
  key = jax.random.key(0)

  def loss(q, k, v):
    out = sh.attention(q, k, v, config=config, dropout_rng=key if rate else None)
    return jnp.sum(out.attention_outputs ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def report(length: int, rate: float, repeats: int) -> float:
  """Prints and returns the median (p = rate) / (p = 0) forward+backward time ratio."""
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, length, 8, 64)) for i in range(3))
  with_dropout, without = _step(rate), _step(0.0)
  ratios = []
  for _ in range(repeats):
    seconds, _ = timing.timed_call(with_dropout, q, k, v)
    base, _ = timing.timed_call(without, q, k, v)
    ratios.append(seconds / base)
  ratio = float(np.median(ratios))
  print(f"causal {length}, f32, forward+backward: dropout_rate={rate} / 0 = {ratio:.2f}x "
        f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
  return ratio


def main(argv: Sequence[str]) -> None:
  del argv
  report(flags.FLAGS.length, flags.FLAGS.rate, flags.FLAGS.repeats)


if __name__ == "__main__":
  flags.DEFINE_integer("length", 4096, "Sequence length (T = S).")
  flags.DEFINE_float("rate", 0.1, "Dropout rate.")
  flags.DEFINE_integer("repeats", 5, "Rounds (the median ratio).")
  app.run(main)
