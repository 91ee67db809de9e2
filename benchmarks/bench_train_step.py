"""End to end: a training step of the example Transformer on packed documents, two attentions.

The same parameters and batch run with `sh.MultiHeadAttention` (segment ids:
each document attends causally within itself) and with Haiku's own
`hk.MultiHeadAttention` (the same visibility as a dense mask); the parameter
trees are identical, so the step is the same computation. `moba_over_causal`: a two-layer model
whose attention is MoBA (its gate choosing key blocks) against the same model causal, at long T
(`benchmarks.bench_blocks` prints it).
"""

from __future__ import annotations

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import timing
from examples.train import model as model_lib
import splash_hk as sh

VOCAB = 256


def _batch(batch: int, seq_len: int, documents: int, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, size=(batch, seq_len + 1)).astype(np.int32)
  segments = np.repeat(np.arange(documents, dtype=np.int32), seq_len // documents)
  positions = np.tile(np.arange(seq_len // documents, dtype=np.int32), documents)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "segment_ids": np.tile(segments, (batch, 1)), "positions": np.tile(positions, (batch, 1))}


def _step(config: model_lib.ModelConfig, optimizer):
  forward = hk.without_apply_rng(hk.transform(
      lambda b: model_lib.Transformer(config)(b["inputs"], b["positions"],
                                              segment_ids=b["segment_ids"])))

  def loss(params, b):
    logits = forward.apply(params, b).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

  @jax.jit
  def step(params, opt_state, b):
    value, grads = jax.value_and_grad(loss)(params, b)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return forward, step


def tokens_per_second(seq_len: int, documents: int, batch: int, repeats: int) -> dict[str, float]:
  """{"sh.MultiHeadAttention": tokens/s, "hk.MultiHeadAttention": tokens/s} of one training step."""
  config = model_lib.ModelConfig(vocab_size=VOCAB, max_len=seq_len, num_layers=2, model_size=64,
                                 num_heads=4)
  b = _batch(batch, seq_len, documents)
  optimizer = optax.adamw(1e-3)
  forward, splash_step = _step(config, optimizer)
  _, haiku_step = _step(dataclasses.replace(config, attention="reference"), optimizer)
  params = forward.init(jax.random.PRNGKey(0), b)
  opt_state = optimizer.init(params)
  rates = {}
  for name, step in (("sh.MultiHeadAttention", splash_step), ("hk.MultiHeadAttention", haiku_step)):
    jax.block_until_ready(step(params, opt_state, b))  # compiles
    rates[name] = batch * seq_len / timing.median_seconds(step, params, opt_state, b,
                                                          repeats=repeats)
  return rates


def report(seq_len: int, documents: int, batch: int, repeats: int) -> None:
  rates = tokens_per_second(seq_len, documents, batch, repeats)
  ours, haiku = rates["sh.MultiHeadAttention"], rates["hk.MultiHeadAttention"]
  print(f"training step of the example Transformer (2 layers, d=64, 4 heads), batch {batch} x "
        f"{seq_len} tokens of {documents} packed documents: sh.MultiHeadAttention {ours:.0f} "
        f"tokens/s, hk.MultiHeadAttention {haiku:.0f} tokens/s ({ours / haiku:.1f}x)")


# MoBA (a gate choosing key blocks, `sh.sparse.top_k_blocks`) against causal attention in a
# training step of a two-layer model at long T: what the choice is worth end to end.
MOBA_BLOCK = (128, 128)
MOBA_CONFIG = sh.AttentionConfig(platform="xla")


class _MoBALayer(hk.Module):
  """Attention (MoBA's gate + chosen blocks when `top_k`, else causal) and an MLP, residual."""

  def __init__(self, top_k: int | None):
    super().__init__(name="layer")
    self.top_k = top_k

  def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, M]
    b, t, m = x.shape
    proj = lambda heads, name: hk.Linear(heads * 16, name=name)(x).reshape(b, t, heads, 16)
    q, k, v = proj(8, "query"), proj(2, "key"), proj(2, "value")
    mask = sh.masks.Causal()
    if self.top_k is not None:
      mask = sh.sparse.top_k_blocks(q, k, self.top_k, MOBA_BLOCK) & mask
    h = sh.attention(q, k, v, mask=mask, config=MOBA_CONFIG).attention_outputs  # [B, T, 8, 16]
    h = h.reshape(b, t, -1)
    x = x + hk.Linear(m, name="out")(h)
    return x + hk.nets.MLP([4 * m, m], name="mlp")(x)


def _train_step(top_k: int | None):
  def forward(tokens):  # [B, T] -> logits [B, T, V]
    x = hk.Embed(256, 128)(tokens)
    for _ in range(2):
      x = _MoBALayer(top_k)(x)
    return hk.Linear(256)(x)

  model = hk.without_apply_rng(hk.transform(forward))
  optimizer = optax.adamw(1e-3)

  def loss(params, tokens):
    logits = model.apply(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return model, optimizer, jax.jit(step)


def moba_over_causal(length: int, repeats: int, top_k: int = 8) -> list[float]:
  """causal / MoBA seconds of one training step at T = `length`, one ratio per round (same
  parameters and batch; each call timed after an untimed call of itself)."""
  tokens = jax.random.randint(jax.random.PRNGKey(0), (1, length + 1), 0, 256)
  model, optimizer, moba = _train_step(top_k)
  _, _, causal = _train_step(None)
  params = model.init(jax.random.PRNGKey(1), tokens[:, :-1])
  state = optimizer.init(params)
  args = (params, state, tokens)
  return [timing.timed_call(causal, *args)[0] / timing.timed_call(moba, *args)[0]
          for _ in range(repeats)]
