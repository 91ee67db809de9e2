"""Hypothesis: random shapes and features, "xla" against the float64 oracle."""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import numpy as np

import splash_hk as sh
from cases import Case


@st.composite
def cases(draw):
  num_kv_heads = draw(st.sampled_from([1, 2, 4]))
  kv_len = draw(st.integers(1, 24))
  return Case(
      name="drawn",
      batch=draw(st.integers(1, 3)),
      query_len=draw(st.integers(1, kv_len)),
      kv_len=kv_len,
      num_kv_heads=num_kv_heads,
      num_heads=num_kv_heads * draw(st.sampled_from([1, 2, 4])),
      head_dim=draw(st.sampled_from([4, 8, 16])),
      value_dim=draw(st.sampled_from([None, 8])),
      causal=draw(st.booleans()),
      window=draw(st.one_of(st.none(), st.integers(0, 8), st.tuples(st.integers(0, 8), st.integers(0, 8)))),
      chunk=draw(st.one_of(st.none(), st.integers(1, 8))),
      soft_cap=draw(st.one_of(st.none(), st.floats(0.5, 20.0))),
      scale=draw(st.one_of(st.none(), st.floats(0.05, 1.0))),
      segments=draw(st.sampled_from([None, "packed"])) if kv_len >= 3 else None,
      positions=draw(st.booleans()),
      mask=draw(st.sampled_from([None, "shared", "heads"])),
      sinks=draw(st.sampled_from([None, "heads", "heads_n", "kv_n"])),
  )


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(case=cases(), seed=st.integers(0, 2**16))
def test_xla_matches_oracle_on_drawn_cases(case, seed):
  q, k, v, extras = case.arrays(seed=seed)
  config = case.config.replace(platform="xla")
  out = jax.jit(functools.partial(sh.attention, config=config))(q, k, v, **extras)
  expected, _ = case.oracle(q, k, v, extras)
  out = np.asarray(out.attention_outputs)
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, expected, atol=2e-5, rtol=1e-5)
