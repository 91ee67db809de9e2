"""splash_hk.masks: every rule against the independent oracle's `visible`, on NumPy and JAX."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from splash_hk import masks
from splash_hk.types import KernelInputs
import oracle

RULES = [dict(causal=c, window=w, chunk_size=k) for c, w, k in itertools.product(
    [True, False], [None, (0, 0), (3, 1), (2, 9)], [None, 1, 4])]


@pytest.mark.parametrize("rules", RULES, ids=str)
def test_position_mask_matches_oracle_on_numpy_and_jax(rules):
  rng = np.random.default_rng(0)
  q_pos = rng.integers(-3, 40, size=(2, 7))
  kv_pos = rng.integers(-3, 40, size=(2, 11))
  want = oracle.visible(2, 7, 11, 1, causal=rules["causal"], window=rules["window"],
                        chunk=rules["chunk_size"], q_pos=q_pos, kv_pos=kv_pos)[:, 0]
  for xp in (np, jnp):
    got = masks.position_mask(xp.asarray(q_pos), xp.asarray(kv_pos), **rules)
    got = np.ones((2, 7, 11), bool) if got is None else np.broadcast_to(np.asarray(got), (2, 7, 11))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rules", RULES, ids=str)
@pytest.mark.parametrize("query_len,kv_len", [(9, 9), (3, 12), (1, 5)])
def test_visible_interval_is_exactly_the_visible_keys(rules, query_len, kv_len):
  q_pos = np.arange(query_len) + kv_len - query_len
  lo, hi = masks.visible_interval(q_pos, kv_len, **rules)
  want = oracle.visible(1, query_len, kv_len, 1, causal=rules["causal"], window=rules["window"],
                        chunk=rules["chunk_size"])[0, 0]
  keys = np.arange(kv_len)
  got = (keys[None, :] >= lo[:, None]) & (keys[None, :] <= hi[:, None])
  np.testing.assert_array_equal(got, want)
  assert masks.visible_pairs(query_len, kv_len, **rules) == want.sum()


def test_visible_pairs_counts():
  assert masks.visible_pairs(4, 4, causal=True, window=None, chunk_size=None) == 10
  assert masks.visible_pairs(4, 4, causal=False, window=None, chunk_size=None) == 16
  assert masks.visible_pairs(8, 8, causal=True, window=(1, 0), chunk_size=None) == 15
  assert masks.visible_pairs(8, 8, causal=True, window=None, chunk_size=4) == 20


def test_segments_padding_never_matches():
  q = np.array([[0, 0, 1, -1, -2]])
  k = np.array([[0, 1, -1, -2]])
  want = oracle.visible(1, 5, 4, 1, causal=False, q_seg=q, kv_seg=k)[0, 0]
  np.testing.assert_array_equal(masks.segment_mask(q, k)[0], want)
  # Kernels that test only equality get ids whose padding cannot collide.
  dq, dk = masks.disjoint_padding(jnp.asarray(q), jnp.asarray(k))
  equal = np.asarray(dq)[0][:, None] == np.asarray(dk)[0][None, :]
  np.testing.assert_array_equal(equal, want)


def test_end_aligned_positions():
  q_pos, kv_pos = masks.end_aligned_positions(2, 3, 8)
  np.testing.assert_array_equal(q_pos, [[5, 6, 7]] * 2)
  np.testing.assert_array_equal(kv_pos, [list(range(8))] * 2)


def test_full_mask_combines_every_rule():
  rng = np.random.default_rng(1)
  q_pos, kv_pos = masks.end_aligned_positions(2, 6, 9)
  q_seg = rng.integers(-1, 2, size=(2, 6))
  kv_seg = rng.integers(-1, 2, size=(2, 9))
  dense = rng.random((2, 3, 6, 9)) < 0.7
  rule = masks.Causal() & masks.SlidingWindow((4, 0)) & masks.Chunked(5) & masks.Dense(dense)
  x = KernelInputs(None, None, None, q_pos, kv_pos, q_seg, kv_seg, rule)
  got = masks.full_mask(x)
  want = oracle.visible(2, 6, 9, 3, causal=True, window=(4, 0), chunk=5, q_seg=q_seg,
                        kv_seg=kv_seg, mask=dense)
  np.testing.assert_array_equal(np.asarray(got), want)
