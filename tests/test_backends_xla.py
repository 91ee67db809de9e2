"""The xla backend (splash_hk/backends/xla.py): many tiles per call, the static plan, memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
from splash_hk.backends import xla
from cases import CASES, Case

TILES = [sh.BlockSizes(4, 8, 8, 4), sh.BlockSizes(5, 3, 3, 7)]
LONG = [
    Case("long_window_sinks_segments", query_len=300, kv_len=300, num_kv_heads=2, window=(40, 3),
         sinks="heads_n", segments="packed"),
    Case("long_chunk_prefill", query_len=200, kv_len=500, chunk=64, causal=False),
    Case("long_causal_mask", query_len=130, kv_len=257, mask="heads", value_dim=8),
]


@pytest.mark.parametrize("tiles", TILES, ids=str)
@pytest.mark.parametrize("case", CASES + LONG, ids=lambda c: c.name)
def test_many_tiles_match_oracle(case, tiles):
  q, k, v, extras = case.arrays(seed=11)
  config = case.config.replace(platform="xla", block_sizes=tiles, allow_fallback=False)
  out = jax.jit(functools.partial(sh.attention, config=config))(q, k, v, **extras)
  np.testing.assert_allclose(np.asarray(out.attention_outputs), case.oracle(q, k, v, extras)[0],
                             atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["long_window_sinks_segments", "long_chunk_prefill",
                                  "long_causal_mask"])
def test_many_tiles_gradients_match_oracle(name):
  case = {c.name: c for c in LONG}[name]
  q, k, v, extras = case.arrays(seed=12)
  sinks = extras.pop("softmax_aux", None)
  config = case.config.replace(platform="xla", block_sizes=TILES[1])
  cot = np.random.default_rng(13).normal(size=(*q.shape[:3], v.shape[-1]))
  argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
  got = jax.jit(jax.grad(lambda *a: jnp.sum(sh.attention(
      *a[:3], config=config, softmax_aux=a[3], **extras).attention_outputs * cot.astype(np.float32)),
      argnums=argnums))(q, k, v, sinks)
  with jax.enable_x64(True):
    f64 = lambda a: None if a is None else jnp.asarray(a, jnp.float64)
    want = jax.grad(lambda *a: jnp.sum(case.oracle(
        *a[:3], dict(extras, softmax_aux=a[3]) if sinks is not None else extras, xp=jnp)[0] * cot),
        argnums=argnums)(f64(q), f64(k), f64(v), f64(sinks))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=1e-4)


def _plan(t, s, block, **rules):
  rules = dict(dict(causal=True, window=None, chunk_size=None, default_positions=True), **rules)
  return xla.make_plan(t, s, block_q=block, block_kv=block, **rules)


def test_plan_skips_invisible_blocks():
  causal = _plan(1024, 1024, 256)
  assert list(zip(causal.q_block, causal.kv_block)) == [(i, j) for i in range(4) for j in range(i + 1)]
  assert list(causal.masked) == [i == j for i in range(4) for j in range(i + 1)]  # diagonal only
  window = _plan(1024, 1024, 128, window=(128, 0))
  assert len(window.q_block) == 8 + 7 and window.masked.all()  # a band of two blocks per row
  chunk = _plan(1024, 1024, 256, causal=False, chunk_size=256)
  assert list(zip(chunk.q_block, chunk.kv_block)) == [(i, i) for i in range(4)]
  assert not chunk.masked.any()
  prefill = _plan(256, 1024, 256)  # end-aligned: the queries are the last 256 positions
  assert list(prefill.kv_block) == [0, 1, 2, 3] and list(prefill.masked) == [False] * 3 + [True]
  explicit = _plan(1024, 1024, 256, default_positions=False)
  assert len(explicit.q_block) == 16 and explicit.masked.all()  # positions unknown: all pairs


def test_plan_first_and_last_mark_query_blocks():
  plan = _plan(512, 512, 128)
  assert list(plan.first) == [True, True, False, True, False, False, True, False, False, False]
  assert list(plan.last) == [True, False, True, False, False, True, False, False, False, True]


def test_default_tiles_follow_the_mask():
  assert xla.default_tiles(sh.AttentionConfig()) == (512, 512, 512, 128)
  assert xla.default_tiles(sh.AttentionConfig(sliding_window=(512, 0))) == (256,) * 3 + (128,)
  assert xla.default_tiles(sh.AttentionConfig(sliding_window=(64, 64)))[:2] == (128, 128)
  assert xla.default_tiles(sh.AttentionConfig(sliding_window=(4096, 0)))[:2] == (512, 512)


def test_causal_16k_forward_and_backward_memory_is_linear():
  q = jax.ShapeDtypeStruct((1, 16384, 8, 64), jnp.float32)
  config = sh.AttentionConfig(platform="xla")
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
      sh.attention(q, k, v, config=config).attention_outputs), argnums=(0, 1, 2)))
  temp = grad.lower(q, q, q).compile().memory_analysis().temp_size_in_bytes
  assert temp < 1.5 * 2**30, temp / 2**30
  dense = 8 * 16384 * 16384 * 4  # one f32 [H, T, S] logits tensor
  assert temp < dense / 16
