"""The rules: every config rule (as mask objects) against the independent oracle's `visible`, on
NumPy and JAX; segments, padding, default positions and the whole-call mask of the kernels."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
from splash_hk.backends import base
from splash_hk.masks import _objects
from splash_hk.masks import _rules
from splash_hk.types import KernelInputs
import oracle

RULES = [dict(causal=c, window=w, chunk_size=k) for c, w, k in itertools.product(
    [True, False], [None, (0, 0), (3, 1), (2, 9)], [None, 1, 4])]


@pytest.mark.parametrize("rules", RULES, ids=str)
def test_config_rules_as_objects_match_the_oracle_on_numpy_and_jax(rules):
  rng = np.random.default_rng(0)
  q_pos = rng.integers(-3, 40, size=(2, 7))
  kv_pos = rng.integers(-3, 40, size=(2, 11))
  want = oracle.visible(2, 7, 11, 1, causal=rules["causal"], window=rules["window"],
                        chunk=rules["chunk_size"], q_pos=q_pos, kv_pos=kv_pos)[:, 0]
  rule = _objects.from_rules(**rules)
  assert (rule is None) == (rules == dict(causal=False, window=None, chunk_size=None))
  assert _objects.as_rules(rule) == rules  # the config can say it back
  for xp in (np, jnp):
    got = np.ones((2, 7, 11), bool) if rule is None else np.broadcast_to(np.asarray(
        rule.visible(xp.asarray(q_pos)[:, :, None], xp.asarray(kv_pos)[:, None, :])), (2, 7, 11))
    np.testing.assert_array_equal(got, want)


def test_objects_say_what_they_are_made_of():
  ids = jnp.zeros((1, 4), jnp.int32)
  rule = (sh.masks.Causal() & sh.masks.SlidingWindow(3)) | sh.masks.Bidirectional(ids)
  assert [p.name for p in rule.parts()] == ["Causal", "SlidingWindow", "Bidirectional"]
  assert rule.array_sides() == {"q"} and not rule.is_static()
  assert (sh.masks.Causal() & sh.masks.Chunked(4)).is_static()
  assert _objects.as_rules(rule) is None and _objects.as_rules(sh.masks.Causal() | sh.masks.Causal()) is None
  assert _objects.causal_or_spans(sh.masks.Bidirectional(ids) | sh.masks.Causal()) is not None
  # A field declared as an array is a leaf wherever it stands; every other field is structure.
  assert jax.tree.leaves(rule) == [ids]
  assert jax.tree.structure(sh.masks.SlidingWindow(3)) != jax.tree.structure(sh.masks.SlidingWindow(4))


def test_segments_padding_never_matches():
  q = np.array([[0, 0, 1, -1, -2]])
  k = np.array([[0, 1, -1, -2]])
  want = oracle.visible(1, 5, 4, 1, causal=False, q_seg=q, kv_seg=k)[0, 0]
  np.testing.assert_array_equal(_rules.segment_mask(q, k)[0], want)
  # Kernels that test only equality get ids whose padding cannot collide.
  dq, dk = base.disjoint_padding(jnp.asarray(q), jnp.asarray(k))
  equal = np.asarray(dq)[0][:, None] == np.asarray(dk)[0][None, :]
  np.testing.assert_array_equal(equal, want)


def test_end_aligned_positions():
  q_pos, kv_pos = _rules.end_aligned_positions(2, 3, 8)
  np.testing.assert_array_equal(q_pos, [[5, 6, 7]] * 2)
  np.testing.assert_array_equal(kv_pos, [list(range(8))] * 2)


def test_full_mask_combines_every_rule():
  rng = np.random.default_rng(1)
  q_pos, kv_pos = _rules.end_aligned_positions(2, 6, 9)
  q_seg = rng.integers(-1, 2, size=(2, 6))
  kv_seg = rng.integers(-1, 2, size=(2, 9))
  dense = rng.random((2, 3, 6, 9)) < 0.7
  rule = sh.masks.Causal() & sh.masks.SlidingWindow((4, 0)) & sh.masks.Chunked(5) & sh.masks.Dense(dense)
  x = KernelInputs(None, None, None, q_pos, kv_pos, q_seg, kv_seg, rule)
  got = base.full_mask(x)
  want = oracle.visible(2, 6, 9, 3, causal=True, window=(4, 0), chunk=5, q_seg=q_seg,
                        kv_seg=kv_seg, mask=dense)
  np.testing.assert_array_equal(np.asarray(got), want)
