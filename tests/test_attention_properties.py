"""Hypothesis: random shapes, features and tiles, "xla" against the float64 oracle."""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

import splash_hk as sh
from cases import Case
import harness
import oracle


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


@hypothesis.settings(max_examples=16, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(case=cases(), seed=st.integers(0, 2**16))
def test_xla_matches_oracle_on_drawn_cases(case, seed):
  q, k, v, extras = case.arrays(seed=seed)
  config = case.config.replace(platform="xla")
  out = jax.jit(functools.partial(sh.attention, config=config))(q, k, v, **extras)
  expected, _ = case.oracle(q, k, v, extras)
  out = np.asarray(out.attention_outputs)
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, expected, **harness.tol())


@st.composite
def long_cases(draw):
  """Cases of many small tiles: T, S up to 300 against tiles of 8 to 64 rows."""
  num_kv_heads = draw(st.sampled_from([1, 2]))
  kv_len = draw(st.integers(2, 300))
  span = st.integers(0, 96)
  case = Case(
      name="long",
      batch=draw(st.integers(1, 3)),
      query_len=draw(st.sampled_from([1, kv_len, draw(st.integers(1, kv_len))])),
      kv_len=kv_len,
      num_kv_heads=num_kv_heads,
      num_heads=num_kv_heads * draw(st.sampled_from([1, 2])),
      head_dim=8,
      value_dim=draw(st.sampled_from([None, 4])),
      causal=draw(st.booleans()),
      window=draw(st.one_of(st.none(), span, st.tuples(span, span))),
      chunk=draw(st.one_of(st.none(), st.integers(1, 96))),
      soft_cap=draw(st.one_of(st.none(), st.floats(0.5, 20.0))),
      segments=draw(st.sampled_from([None, "packed"])),
      positions=draw(st.booleans()),
      mask=draw(st.sampled_from([None, None, "shared", "heads"])),
      sinks=draw(st.sampled_from([None, "heads_n", "kv_n"])),
  )
  tiles = draw(st.sampled_from([(8, 8), (16, 8), (32, 16), (64, 32), (16, 64)]))
  return case, tiles


@hypothesis.settings(max_examples=4, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(drawn=long_cases(), seed=st.integers(0, 2**16))
def test_xla_across_block_boundaries_values_and_gradients(drawn, seed):
  case, (block_q, block_kv) = drawn
  q, k, v, extras = case.arrays(seed=seed)
  sinks = extras.pop("softmax_aux", None)
  config = case.config.replace(platform="xla", block_sizes=sh.BlockSizes(
      block_q, block_kv, block_q, block_kv))
  cot = np.random.default_rng(seed).normal(size=(*q.shape[:3], v.shape[-1])).astype(np.float32)

  def f(q, k, v, s):
    return sh.attention(q, k, v, config=config, softmax_aux=s, **extras).attention_outputs

  out, vjp = jax.vjp(jax.jit(f), q, k, v, sinks)
  got = vjp(jnp.asarray(cot))
  want, want_grads = oracle.out_and_vjp(
      q, k, v, cot, sinks=sinks, causal=case.causal, window=case.window, chunk=case.chunk,
      soft_cap=case.soft_cap, q_seg=extras.get("q_segment_ids"),
      kv_seg=extras.get("kv_segment_ids"), q_pos=extras.get("q_positions"),
      kv_pos=extras.get("kv_positions"), mask=extras.get("mask"))
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())
  for name, g, w in zip("qkvs", [a for a in got if a is not None], want_grads):
    harness.assert_near(np.asarray(g), w, "grad", err_msg=f"d{name}")
