"""A decoder-only Transformer in Haiku (pre-LN; learned positions, ALiBi or T5 buckets) on
splash attention."""

from __future__ import annotations

import dataclasses
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import splash_hk as sh


POSITION_BIASES = ("none", "alibi", "t5")
T5_BUCKETS = 32
T5_MAX_DISTANCE = 128  # T5's: distances under 16 get a bucket each, farther ones share


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  max_len: int
  num_layers: int = 2
  model_size: int = 64
  num_heads: int = 4
  num_kv_heads: int | None = None
  num_sinks: int = 0
  attention: str = "splash"  # "splash" (sh.MultiHeadAttention) or "reference" (hk.MultiHeadAttention)
  attention_config: sh.AttentionConfig = sh.AttentionConfig()
  axes: sh.MeshAxes = sh.MeshAxes()  # with a mesh: batch, heads and sequence axes
  prefix_len: int = 0  # > 0: prefix-LM, the first prefix_len positions see each other
  position_bias: str = "none"  # "none" (learned positions), "alibi" or "t5": a bias in their place
  attention_dropout: float = 0.0  # on the attention probabilities, in training (is_training)

  def __post_init__(self):
    if self.model_size % self.num_heads:
      raise ValueError(f"--model_size ({self.model_size}) must be a multiple of --num_heads "
                       f"({self.num_heads}).")
    kv = self.num_kv_heads or self.num_heads
    if self.num_heads % kv:
      raise ValueError(f"--num_heads ({self.num_heads}) must be a multiple of --num_kv_heads ({kv}).")
    if self.attention == "reference" and (kv != self.num_heads or self.num_sinks):
      raise ValueError("--attention=reference is Haiku's own hk.MultiHeadAttention: it has no GQA "
                       "or sinks; use --num_kv_heads=--num_heads and --num_sinks=0.")
    if self.attention == "reference" and self.prefix_len:
      raise ValueError("--prefix_lm needs --attention=splash (a mask object).")
    if self.position_bias not in POSITION_BIASES:
      raise ValueError(f"--position_bias must be one of {POSITION_BIASES}, got "
                       f"{self.position_bias!r}.")
    if self.attention == "reference" and self.position_bias != "none":
      raise ValueError("--position_bias needs --attention=splash (hk.MultiHeadAttention takes "
                       "no bias).")
    if self.attention == "reference" and self.attention_dropout:
      raise ValueError("--attention_dropout needs --attention=splash (hk.MultiHeadAttention has "
                       "no attention dropout).")
    if not 0 <= self.attention_dropout < 1:
      raise ValueError(f"--attention_dropout must lie in [0, 1), got {self.attention_dropout}.")

  @property
  def module_config(self) -> sh.AttentionConfig:
    """The attention config of the layers: with a prefix, the mask object holds the rule."""
    return self.attention_config.replace(sliding_window=None) if self.prefix_len else (
        self.attention_config)

  def mask(self, positions: jax.Array, segment_ids: jax.Array | None) -> sh.masks.Mask | None:
    """Prefix-LM: (causal [& window]) | the prefix of each document, seen whole; else None."""
    if not self.prefix_len:
      return None
    rule = _causal(self.attention_config.window)
    docs = jnp.zeros_like(positions) if segment_ids is None else segment_ids
    return rule | sh.masks.Bidirectional(jnp.where(positions < self.prefix_len, docs, -1))


class Transformer(hk.Module):
  """Tokens [B, T] -> logits [B, T, V]; with `caches`, also returns the new caches.

  A serving step (`batch=`, paged `caches`) takes the step's tokens flat: [N] -> [N, V].
  """

  def __init__(self, config: ModelConfig, mesh: jax.sharding.Mesh | None = None, name=None):
    super().__init__(name=name)
    self.config = config
    self.mesh = mesh

  def _attention(self, i: int):
    c = self.config
    w_init = hk.initializers.VarianceScaling(1.0 / c.num_layers)
    if c.attention == "reference":
      return hk.MultiHeadAttention(c.num_heads, c.model_size // c.num_heads, w_init=w_init,
                                   name=f"attention_{i}")
    return sh.MultiHeadAttention(c.num_heads, c.model_size // c.num_heads,
                                 num_kv_heads=c.num_kv_heads, w_init=w_init,
                                 config=c.module_config, mesh=self.mesh, axes=c.axes,
                                 num_sinks=c.num_sinks, dropout_rate=c.attention_dropout,
                                 name=f"attention_{i}")

  def _position_bias(self):
    """layer -> its bias: ALiBi with learnable slopes per layer (from the paper's), or a
    learned T5 table of relative-position buckets per layer."""
    c = self.config
    if c.position_bias == "alibi":
      slopes = lambda: sh.scores.alibi_slopes(c.num_heads)
      return lambda i: sh.scores.Alibi(hk.get_parameter(
          f"alibi_slopes_{i}", (c.num_heads,), jnp.float32, init=lambda *_: slopes()))
    if c.position_bias == "t5":
      table = lambda i: hk.get_parameter(f"relative_position_{i}", (T5_BUCKETS, c.num_heads),
                                         jnp.float32, init=lambda *_: _recency_table(c))
      return lambda i: sh.scores.RelativePosition(table(i), max_distance=T5_MAX_DISTANCE,
                                                   bidirectional=False)
    return _no_bias

  def init_caches(self, batch: int, capacity: int | None = None,
                  dtype: Any = jnp.float32) -> list[sh.KVCache]:
    """Empty KV caches of `capacity` slots (default: the model's max_len)."""
    c = self.config
    return [sh.KVCache.zeros(batch, capacity or c.max_len, c.num_kv_heads or c.num_heads,
                             c.model_size // c.num_heads, dtype=dtype)
            for _ in range(c.num_layers)]

  def init_paged_caches(self, num_pages: int, page_size: int, dtype: Any = jnp.float32,
                        page_summaries: bool = False) -> list[sh.PagedKVCache]:
    """One empty pool of `num_pages` pages of `page_size` slots per layer (int8 or fp8:
    quantized as written; `page_summaries`: with each page's key bounds, for Quest)."""
    c = self.config
    return [sh.PagedKVCache.zeros(num_pages, page_size, c.num_kv_heads or c.num_heads,
                                  c.model_size // c.num_heads, dtype=dtype,
                                  page_summaries=page_summaries)
            for _ in range(c.num_layers)]

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               caches: list[sh.KVCache] | list[sh.PagedKVCache] | None = None,
               segment_ids: jax.Array | None = None, lengths: jax.Array | None = None,
               batch: sh.RaggedBatch | None = None, is_training: bool = False,
               page_top_k: int | None = None):
    """tokens [B, T] -> logits [B, T, V] (and the new caches, with `caches`).

    Args:
      tokens: [B, T] token ids; with `batch`, a serving step's tokens flat, [N].
      positions: [B, T] token positions (default arange(T)); with `batch`, [N], each token's
        position in its sequence (what `batch` says: kv_lens[s] + its index in s).
      caches: one KVCache per layer: append the tokens and attend to the cache; with `batch`,
        one PagedKVCache per layer.
      segment_ids: [B, T] documents packed in a row (negative = padding); not with caches.
      lengths: with caches, [B] how many of the T tokens each row appends.
      batch: a serving step's sequences over the flat tokens (with paged `caches`).
      is_training: attention dropout (`attention_dropout`) on; needs an rng.
      page_top_k: with `batch`, each layer reads only the pages its queries choose (Quest).
    """
    c = self.config
    if batch is not None and (caches is None or positions is None or c.prefix_len
                              or c.attention != "splash"):
      raise ValueError("A serving step (batch=) needs paged caches, the tokens' positions, "
                       "and a causal splash model (no --prefix_lm, --attention=splash).")
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)  # [B, T]
    h = _embed(c, tokens, positions)  # [B, T, D]; serving: [N, D]
    new_caches, bias = [], self._position_bias()
    mask = None if batch is not None else c.mask(positions, segment_ids)
    for i in range(c.num_layers):
      x = hk.LayerNorm(-1, True, True, name=f"ln_attn_{i}")(h)
      attend = self._attention(i)
      if batch is not None:
        a, cache = attend(x, kv_cache=caches[i], batch=batch, bias=bias(i),
                          page_top_k=page_top_k)
        new_caches.append(cache)
      elif caches is not None:
        a, cache = attend(x, kv_cache=caches[i], lengths=lengths, mask=mask, bias=bias(i))
        new_caches.append(cache)
      elif c.attention == "reference":
        a = attend(x, x, x, mask=_reference_mask(tokens.shape[1], c.attention_config.window,
                                                 segment_ids))
      else:
        a = attend(x, q_segment_ids=segment_ids, mask=mask, bias=bias(i), is_training=is_training)
      h = _mlp(c, i, h + a)  # [B, T, D]
    logits = _unembed(c, h)  # [B, T, V]; serving: [N, V]
    return logits if caches is None else (logits, new_caches)


def _embed(c: ModelConfig, tokens: jax.Array, positions: jax.Array) -> jax.Array:
  """[...] tokens at [...] positions -> [..., D] (positions learned unless a bias says them)."""
  h = hk.Embed(c.vocab_size, c.model_size, name="embed")(tokens)  # [..., D]
  if c.position_bias == "none":
    h = h + hk.Embed(c.max_len, c.model_size, name="position")(positions)  # [..., D]
  return h


def _mlp(c: ModelConfig, i: int, h: jax.Array) -> jax.Array:
  """Layer i's MLP block on the residual stream [..., D]."""
  x = hk.LayerNorm(-1, True, True, name=f"ln_mlp_{i}")(h)
  return h + hk.nets.MLP([4 * c.model_size, c.model_size], activation=jax.nn.gelu,
                         name=f"mlp_{i}")(x)


def _unembed(c: ModelConfig, h: jax.Array) -> jax.Array:
  """The residual stream [..., D] -> logits [..., V]."""
  h = hk.LayerNorm(-1, True, True, name="ln_final")(h)
  return hk.Linear(c.vocab_size, name="unembed")(h)


def _recency_table(c: ModelConfig) -> jax.Array:
  """A T5 table [buckets, H] that starts as ALiBi: each bucket's least distance times -slope.

  From zero (T5's own start) the model has no sense of order at all, and the recall task
  learned nothing in 1200 steps; from ALiBi's recency it learns as ALiBi does."""
  distance = np.arange(c.max_len)
  index = sh.scores.RelativePosition(jnp.arange(T5_BUCKETS, dtype=jnp.float32)[:, None],
                                     T5_MAX_DISTANCE, bidirectional=False)  # "bias": the bucket
  bucket = np.asarray(index.scores(distance.reshape(1, 1, 1, -1, 1), np.zeros((1, 1, 1, 1, 1), int),
                                   np.zeros((1, 1, 1, 1, 1)))).reshape(-1)  # [T]
  least = np.array([distance[bucket == b].min(initial=c.max_len) for b in range(T5_BUCKETS)])
  return -least[:, None] * sh.scores.alibi_slopes(c.num_heads)[None, :]


def _no_bias(layer: int) -> None:
  del layer


def _causal(window: tuple[int, int] | None) -> sh.masks.Mask:
  """The model's rule as a mask object: causal, within the window when there is one."""
  return sh.masks.Causal() if window is None else sh.masks.Causal() & sh.masks.SlidingWindow(window)


def _reference_mask(seq_len: int, window: tuple[int, int] | None,
                    segment_ids: jax.Array | None = None) -> jax.Array:
  """Causal (and window, and same-document) mask [1 or B, 1, T, T] for hk.MultiHeadAttention."""
  pos = np.arange(seq_len)
  mask = _causal(window).visible(pos[:, None], pos[None, :])[None, None]  # [1, 1, T, T]
  if segment_ids is None:
    return mask
  same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]
  return mask & (same & (segment_ids[:, :, None] >= 0))[:, None]  # [B, 1, T, T]
