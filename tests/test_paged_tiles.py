"""paged_attention's tiles (the xla backend's gathered-tile kernel) against the float64 oracle:
steps whose sequences have enough rows to fill tiles of every width, and what a tile's rows
must not share."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import paged_cases
import splash_hk as sh
from splash_hk.backends.xla import paged as xla_paged_tiles
from splash_hk.backends.xla import paged_items as xla_paged_items

PAGE = paged_cases.PAGE
# A step of 530 rows (every width tiled) whose sequences' rows cross every tile width (256, 16,
# 1) and partial tiles: 470 = 256 + 214 (a partial 256), 45 = 16 + 16 + 13 (a partial 16), 9
# and 2 (partial 16s), 1 (a tile of one); lengths start mid-page and end mid-page.
TILED = dict(kv_lens=(5, 0, 12, 3, 41), q_lens=(1, 45, 9, 470, 2), max_seqs=6, pad_rows=3,
             pages_per_seq=120, num_pages=170)


def _tiled(seed, **kwargs):
  return paged_cases.step(seed, **{**TILED, **kwargs})


def _run(step, config, **kwargs):
  config = dataclasses.replace(config, platform="xla", allow_fallback=False)
  return jax.jit(lambda *a: sh.paged_attention(*a, config=config, **kwargs))(
      step.q, step.k, step.v, step.cache, step.batch)


def test_the_steps_rows_fill_tiles_of_every_width():
  widths = [w for w, _, _ in xla_paged_tiles.bounds(sum(TILED["q_lens"]) + 3,
                                                     TILED["max_seqs"])]
  assert widths == list(xla_paged_tiles.WIDTHS)
  assert all(widths[0] % w == 0 for w in widths)


def _tile_counts(rows_per_owner):
  """{width: tiles} of the tiling rule (whole tiles, one partial tile of at least the width's
  partial rows, the rest to the next width), simulated in Python."""
  left, out = list(rows_per_owner), {}
  n = sum(rows_per_owner)
  for width, partial, least in zip(xla_paged_tiles.WIDTHS, xla_paged_tiles.PARTIAL_FROM,
                                   xla_paged_tiles.PASS_FROM):
    if n < least:
      continue
    taken = [r if r % width >= partial else r // width * width for r in left]
    out[width] = sum(-(-t // width) for t in taken)
    left = [r - t for r, t in zip(left, taken)]
  assert not any(left)
  return out


def test_the_static_tile_bounds_hold_for_every_split_of_the_rows():
  rng = np.random.default_rng(0)
  for n, owners in [(1038, 16), (1024, 2), (4096, 1), (600, 5), (40, 3), (14, 14), (700, 16)]:
    bound = {w: c for w, _, c in xla_paged_tiles.bounds(n, owners)}
    splits = [rng.multinomial(n, rng.dirichlet(np.ones(owners))) for _ in range(300)]
    splits += [[n // owners + (i < n % owners) for i in range(owners)],  # even
               [n - owners + 1] + [1] * (owners - 1)]
    for split in splits:
      for width, count in _tile_counts(split).items():
        assert count <= bound[width], (n, owners, list(split), width, count, bound)


@pytest.mark.parametrize("rule", list(paged_cases.RULES))
def test_tiles_of_every_width_match_the_oracle(rule):
  config, rules = paged_cases.RULES[rule]
  step = _tiled(seed=31)
  out, _ = _run(step, config)
  np.testing.assert_allclose(np.asarray(out), paged_cases.attend(step, **rules), **harness.tol())


def test_tiles_with_sinks_gqa_value_size_bias_and_soft_cap():
  step = _tiled(seed=32, value_dim=24, hq=8)
  sinks = np.random.default_rng(3).normal(size=(8, 2)).astype(np.float32)
  params, dense = harness.score_case("t5_uni", np.arange(500)[None], np.arange(500)[None], 8)
  bias = lambda ql, s: np.asarray(dense(params))[:, :, s - ql:s, :s]
  config = sh.AttentionConfig(logits_soft_cap=3.0, sliding_window=(50, 0))
  out, _ = _run(step, config, softmax_aux=sinks, bias=harness.score_object("t5_uni", params))
  want = paged_cases.attend(step, sinks=sinks, bias=bias, soft_cap=3.0, window=(50, 0))
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())


def test_a_nan_value_reaches_only_the_rows_of_a_tile_that_see_it():
  # Sequence 3 (470 rows after 3 cached tokens, a tile of 256 first) gets a NaN in value
  # column 0 of its new token at position 70: under the causal rule rows before it are finite.
  step = _tiled(seed=33)
  first = sum(TILED["q_lens"][:3])
  step.v[first + 70 - 3, 0, 0] = np.nan
  step.history_v[3][70, 0, 0] = np.nan
  out = np.asarray(_run(step, sh.AttentionConfig())[0])
  want = paged_cases.attend(step)
  rows = np.arange(470) + first
  before, after = rows[:70 - 3], rows[70 - 3:]
  assert np.isfinite(out[before]).all()
  assert np.isnan(out[after][:, :2, 0]).all() and np.isfinite(out[after][:, :, 1:]).all()
  assert np.isfinite(out[after][:, 2:]).all()  # the other kv head's query heads
  np.testing.assert_allclose(out, want, **harness.tol())


def test_the_same_step_gives_the_same_bits_every_run():
  step = _tiled(seed=34, hq=8)
  config = sh.AttentionConfig(sliding_window=(60, 0))
  first, second = _run(step, config)[0], _run(step, config)[0]
  np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


def test_a_quantized_pool_in_tiles_matches_the_oracle():
  step = _tiled(seed=35)
  quantize = lambda a: sh.quantize(jnp.nan_to_num(jnp.asarray(a)), jnp.int8)
  pool = sh.PagedKVCache(quantize(step.cache.key), quantize(step.cache.value))
  stored = lambda h: np.asarray(sh.quantize(jnp.asarray(h), jnp.int8).dequantize(), np.float64)
  step.history_k = [stored(h) for h in step.history_k]
  step.history_v = [stored(h) for h in step.history_v]
  step.cache = pool  # the new tokens are quantized as they are written
  out, _ = _run(step, sh.AttentionConfig())
  np.testing.assert_allclose(np.asarray(out), paged_cases.attend(step), **harness.tol())


@pytest.mark.parametrize("rule", ["causal", "chunk"])
def test_more_tiles_than_a_loop_step_takes(rule):
  # 1300 rows: five tiles of 256, more than one loop step's window of tiles.
  step = paged_cases.step(seed=36, kv_lens=(20, 7), q_lens=(1300, 1), max_seqs=3, pad_rows=1,
                          pages_per_seq=340, num_pages=350, hq=8)
  width = xla_paged_tiles.WIDTHS[0]
  run = xla_paged_items.run_length(width, PAGE, 340)
  assert 1300 // width > xla_paged_items.per_step(width, run, _facts(step), 1300)
  config, rules = paged_cases.RULES[rule]
  out, _ = _run(step, config)
  np.testing.assert_allclose(np.asarray(out), paged_cases.attend(step, **rules), **harness.tol())


def _facts(step):
  return sh.paged.paged_facts(step.q, step.k, step.v, step.cache, step.batch,
                              config=sh.AttentionConfig(), mask=None, bias=None, softmax_aux=None)
