"""Decoding with the KV cache: a batch of recall prompts of different lengths, together."""

from __future__ import annotations

import dataclasses
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from examples.train import model as model_lib
from examples.train import recall


def sample(task: recall.RecallTask, config: model_lib.ModelConfig, params, mesh, *, rows: int,
           capacity: int, seed: int) -> None:
  """Decodes a batch of prompts of different lengths together with the KV cache.

  Row b's prompt holds the pairs and its first b % P queries already answered,
  then one more query; the rows prefill together (right-padded, `lengths`),
  then decode in lockstep, one token per step, each row feeding its predicted
  answer and its next query; a finished row appends nothing (`lengths=0`).
  """
  # Decoding needs sh.MultiHeadAttention; it runs on the same mesh, never load-balanced (T != S).
  config = dataclasses.replace(config, attention="splash",
                               axes=dataclasses.replace(config.axes, load_balanced=False))
  model = hk.without_apply_rng(hk.transform(
      lambda tokens, positions, caches, lengths: model_lib.Transformer(config, mesh)(
          tokens, positions, caches, lengths=lengths)))
  step = jax.jit(model.apply, donate_argnums=(3,))
  pairs = task.num_pairs
  example = task.batch(seed, 0, rows)
  inputs, targets = example["inputs"], example["targets"]
  answer = np.arange(rows) % pairs  # the answer each row predicts next
  length = 2 * pairs + 2 * answer + 1  # its prompt: pairs, then queries and answers up to it
  caches = hk.transform(lambda: model_lib.Transformer(config, mesh).init_caches(
      rows, capacity)).apply({}, None)
  prompt = jnp.asarray(inputs[:, :length.max()])
  logits, caches = step(params, prompt, jnp.arange(prompt.shape[1])[None], caches, length)
  logits = logits[jnp.arange(rows), length - 1]  # [R, V] at each row's last prompt token
  one = lambda a: jnp.asarray(a, jnp.int32)[:, None]
  _, caches = step(params, one(answer), one(length), caches, 0 * length)  # compiles, appends nothing
  predicted = [[] for _ in range(rows)]
  expected = [[] for _ in range(rows)]
  active, decoded, started = np.ones(rows, bool), 0, time.perf_counter()
  while active.any():
    guess = np.asarray(jnp.argmax(logits, axis=-1))
    for r in np.flatnonzero(active):
      predicted[r].append(int(guess[r]))
      expected[r].append(int(targets[r, 2 * pairs + 2 * answer[r]]))
    active &= answer + 1 < pairs
    query = inputs[np.arange(rows), np.minimum(2 * pairs + 2 * answer + 2, inputs.shape[1] - 1)]
    for token in (guess, query):  # decode: one token per row and step, T == 1
      logits, caches = step(params, one(token), one(length), caches, active.astype(np.int32))
      length, decoded = length + active, decoded + int(active.sum())
    logits, answer = logits[:, 0], answer + active
  seconds = time.perf_counter() - started
  _print_sample(task, inputs[0], predicted, expected)
  right = sum(p == e for ps, es in zip(predicted, expected) for p, e in zip(ps, es))
  print(f"sample batch: {rows} prompts of {2 * pairs + 1}..{2 * pairs + 2 * min(rows - 1, pairs - 1) + 1} "
        f"tokens decoded together: {right}/{sum(map(len, expected))} answers right; decode "
        f"{decoded / seconds:.0f} tokens/s ({decoded} tokens) with caches of {capacity} slots")


def _print_sample(task: recall.RecallTask, tokens, predicted, expected) -> None:
  """Row 0: the whole problem (every answer decoded)."""
  name = lambda t: f"k{t}" if t < task.num_keys else f"v{t - task.num_keys}"
  pairs = " ".join(name(int(t)) for t in tokens[:2 * task.num_pairs])
  queries = " ".join(name(int(t)) for t in tokens[2 * task.num_pairs::2])
  right = sum(p == e for p, e in zip(predicted[0], expected[0]))
  print(f"sample prompt: {pairs} | queries: {queries}")
  print(f"sample answer: {' '.join(name(t) for t in predicted[0])}")
  print(f"sample expected: {' '.join(name(t) for t in expected[0])} -> "
        f"{'right' if predicted[0] == expected[0] else 'wrong'} ({right}/{len(expected[0])})")
