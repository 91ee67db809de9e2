"""The xla backend (splash_hk/backends/xla/backend.py): many tiles per call, the static plan, memory."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
from splash_hk import inputs
from splash_hk import tiles
from splash_hk.backends.xla import blocks as xla_blocks
from splash_hk.backends.xla import plan as xla_plan
from splash_hk.types import Extras
import harness
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
                             **harness.tol())


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
    harness.assert_near(np.asarray(g), np.asarray(w), "grad")


def _assert_value_and_grads_match(case, config, q, k, v, extras, cot):
  """sum(attention * cot) and its q/k/v gradients on the xla path vs the float64 oracle."""
  got = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(sh.attention(
      q, k, v, config=config, **extras).attention_outputs * cot), argnums=(0, 1, 2)))(q, k, v)
  with jax.enable_x64(True):
    want = jax.value_and_grad(lambda q, k, v: jnp.sum(case.oracle(q, k, v, extras, xp=jnp)[0] * cot),
                              argnums=(0, 1, 2))(*(jnp.asarray(a, jnp.float64) for a in (q, k, v)))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    harness.assert_near(np.asarray(g), np.asarray(w), "grad")


def test_narrow_window_reads_kv_in_place_and_matches_oracle():
  case = Case("narrow_window", query_len=150, kv_len=150, num_kv_heads=2, window=(6, 0),
              soft_cap=5.0, segments="packed")
  q, k, v, extras = case.arrays(seed=14)
  config = case.config.replace(platform="xla", block_sizes=sh.BlockSizes(8, 4, 8, 4))
  x, facts = inputs.normalise(q, k, v, config=config, extras=Extras(**extras))
  views = lambda facts: xla_blocks.Views(x, facts, xla_plan.Grid.of(x, 8, 4))
  assert not views(facts).heads_major  # each key block read ~1.4 times
  causal = dataclasses.replace(facts, config=config.replace(sliding_window=None),
                               rule=sh.masks.Causal())
  assert views(causal).heads_major  # up to every query block
  cot = np.random.default_rng(15).normal(size=q.shape)
  _assert_value_and_grads_match(case, config, q, k, v, extras, cot)


def _schedule(t, s, block, config=sh.AttentionConfig(), batch=1, **extras):
  """The plan as lists: the live kv blocks and the full ones, per (row group, query block)."""
  q = jnp.zeros((batch, t, 1, 64))
  k = jnp.zeros((batch, s, 1, 64))
  x, facts = inputs.normalise(q, k, k, config=config, extras=Extras(**extras))
  grid = xla_plan.Grid.of(x, block, block)
  plan = xla_plan.block_plan(x, grid)
  order, live, full = (np.asarray(a) for a in plan)
  assert order.shape == (grid.num_groups, grid.num_q_blocks, grid.num_kv_blocks)
  assert all(sorted(row) == list(range(grid.num_kv_blocks)) for row in order.reshape(
      -1, grid.num_kv_blocks))  # a permutation of the kv blocks
  pairs = [[list(order[g, i, :live[g, i]]) for i in range(grid.num_q_blocks)]
           for g in range(grid.num_groups)]
  fulls = [[set(order[g, i, :full[g, i]]) for i in range(grid.num_q_blocks)]
           for g in range(grid.num_groups)]
  return pairs, fulls


def test_schedule_of_default_positions_is_the_static_plan():
  pairs, full = _schedule(1024, 1024, 256)
  assert pairs == [[list(range(i + 1)) for i in range(4)]]  # causal: the lower triangle
  assert full == [[set(range(i)) for i in range(4)]]  # only the diagonal needs a mask
  pairs, full = _schedule(1024, 1024, 128, sh.AttentionConfig(sliding_window=(128, 0)))
  assert pairs == [[[max(0, i - 1), i][(i == 0):] for i in range(8)]]
  assert full == [[set()] * 8]
  pairs, full = _schedule(1024, 1024, 128, sh.AttentionConfig(sliding_window=(256, 0)))
  assert pairs == [[[0], [0, 1], *([i - 1, i - 2, i] for i in range(2, 8))]]  # full block first
  assert full == [[set(), *({i - 1} for i in range(1, 8))]]
  pairs, full = _schedule(1024, 1024, 256, sh.AttentionConfig(causal=False, chunk_size=256))
  assert pairs == [[[i] for i in range(4)]] and full == [[{i} for i in range(4)]]
  pairs, _ = _schedule(256, 1024, 256)  # end-aligned: the queries are the last 256 positions
  assert pairs == [[[0, 1, 2, 3]]]


def test_a_dense_mask_empties_blocks_and_runs_its_all_true_blocks_unmasked():
  t = 512
  mask = np.zeros((1, 1, t, t), bool)
  mask[..., :128, :128] = mask[..., 384:, 256:] = True  # only blocks (0, 0), (3, 2), (3, 3)
  pairs, full = _schedule(t, t, 128, sh.AttentionConfig(causal=False), mask=mask)
  assert pairs == [[[0], [], [], [2, 3]]] and full == [[{0}, set(), set(), {2, 3}]]
  mask[..., 400, 300] = False  # one pair of block (3, 2) hidden: it runs masked
  pairs, full = _schedule(t, t, 128, sh.AttentionConfig(causal=False), mask=mask)
  assert pairs == [[[0], [], [], [3, 2]]] and full == [[{0}, set(), set(), {3}]]


def test_schedule_follows_packed_documents_and_cache_lengths():
  seg = np.repeat(np.arange(8), 128)[None]  # 8 documents of 128 tokens
  pairs, full = _schedule(1024, 1024, 128, q_segment_ids=seg)
  assert pairs == [[[i] for i in range(8)]]  # each block sees only its own document
  lengths = np.array([100, 700])
  kv_seg = np.where(np.arange(1024)[None] < lengths[:, None], 0, -1)
  pairs, _ = _schedule(1, 1024, 256, batch=2, q_segment_ids=np.zeros((2, 1), np.int32),
                       kv_segment_ids=kv_seg, q_positions=lengths[:, None] - 1,
                       kv_positions=np.tile(np.arange(1024), (2, 1)))
  assert pairs == [[[0, 1, 2]]]  # decode: the whole batch computes the longest row's blocks


ADVERSARIAL = {
    # name: (segment ids [T] or None, positions [T] or None, config)
    "unsorted_segments": (np.array([2, 0, 1, 2, 1, 0, 2, 2] * 8), None, sh.AttentionConfig()),
    "segment_across_blocks": (np.repeat([0, 1, 2], [13, 40, 11]), None,
                              sh.AttentionConfig(sliding_window=(9, 0))),
    "padding_inside_blocks": (np.where(np.arange(64) % 11 == 3, -1, np.arange(64) // 20), None,
                              sh.AttentionConfig(causal=False, chunk_size=12)),
    "jumping_positions": (None, np.concatenate([np.arange(20), 500 + np.arange(24), 90 + np.arange(20)]),
                          sh.AttentionConfig(sliding_window=(30, 2))),
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_skipping_is_exact_on_adversarial_layouts(name):
  seg, pos, config = ADVERSARIAL[name]
  rng = np.random.default_rng(21)
  q, k, v = (rng.normal(size=(2, 64, 2, 8)).astype(np.float32) for _ in range(3))
  extras = {}
  if seg is not None:
    extras["q_segment_ids"] = np.stack([seg, seg[::-1]]).astype(np.int32)
  if pos is not None:
    extras["q_positions"] = extras["kv_positions"] = np.stack([pos, pos[::-1]]).astype(np.int32)
  case = Case(name, causal=config.causal, window=config.window, chunk=config.chunk_size)
  config = config.replace(platform="xla", block_sizes=sh.BlockSizes(8, 8, 8, 8))
  cot = rng.normal(size=q.shape)
  _assert_value_and_grads_match(case, config, q, k, v, extras, cot)


def test_default_tiles_follow_the_mask():
  assert tiles.default_tiles(sh.AttentionConfig()) == (512, 256, 512, 256)
  assert tiles.default_tiles(sh.AttentionConfig(sliding_window=(512, 0))) == (512, 256, 512, 256)
  assert tiles.default_tiles(sh.AttentionConfig(sliding_window=(100, 100)))[:3] == (128, 256, 128)
  assert tiles.default_tiles(sh.AttentionConfig(sliding_window=(20, 0)))[0] == 128


def test_causal_16k_forward_and_backward_memory_is_linear():
  q = jax.ShapeDtypeStruct((1, 16384, 8, 64), jnp.float32)
  config = sh.AttentionConfig(platform="xla")
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
      sh.attention(q, k, v, config=config).attention_outputs), argnums=(0, 1, 2)))
  temp = grad.lower(q, q, q).compile().memory_analysis().temp_size_in_bytes
  assert temp < 1.5 * 2**30, temp / 2**30
  dense = 8 * 16384 * 16384 * 4  # one f32 [H, T, S] logits tensor
  assert temp < dense / 16
