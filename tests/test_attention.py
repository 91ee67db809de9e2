"""sh.attention on every CPU platform against the float64 NumPy oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
import harness
import oracle
from cases import CASES, CASES_BY_NAME

PLATFORMS = ("xla", "reference")  # "auto" is "xla" on CPU (tests/test_selector.py)


def _run(case, platform, q, k, v, extras, **config_changes):
  config = case.config.replace(platform=platform, **config_changes)
  fn = jax.jit(functools.partial(sh.attention, config=config))
  return fn(q, k, v, **extras).attention_outputs


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_f32_matches_oracle(case, platform):
  q, k, v, extras = case.arrays()
  out = _run(case, platform, q, k, v, extras)
  expected, _ = case.oracle(q, k, v, extras)
  assert out.shape == expected.shape and out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), expected, **harness.tol())


def _naive_bf16(case, q, k, v, extras):
  """Attention computed entirely in bfloat16: the bar for our bf16 error."""
  b, t, hq, d = q.shape
  s = k.shape[1]
  allowed = oracle.visible(b, t, s, hq, causal=case.causal, window=case.window, chunk=case.chunk,
                           q_seg=extras.get("q_segment_ids"), kv_seg=extras.get("kv_segment_ids"),
                           q_pos=extras.get("q_positions"), kv_pos=extras.get("kv_positions"),
                           mask=extras.get("mask"))
  q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
  g = hq // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  logits = jnp.einsum("bthd,bshd->bhts", q, k) * jnp.bfloat16(case.scale or d ** -0.5)
  if case.soft_cap:
    logits = case.soft_cap * jnp.tanh(logits / case.soft_cap)
  logits = jnp.where(allowed, logits, -jnp.inf)
  weights = jnp.where(allowed.any(-1, keepdims=True), jax.nn.softmax(logits, axis=-1), 0)
  return jnp.einsum("bhts,bshd->bthd", weights.astype(jnp.bfloat16), v)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", ["mha_causal", "gqa_causal", "window_int", "segments_padding",
                                  "soft_cap", "decode", "value_dim"])
def test_bf16_error_at_most_twice_naive(name, platform):
  case = CASES_BY_NAME[name]
  q, k, v, extras = case.arrays(seed=1)
  q, k, v = (np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)) for a in (q, k, v))
  expected, _ = case.oracle(q, k, v, extras)
  bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)
  out = _run(case, platform, bf16(q), bf16(k), bf16(v), extras)
  assert out.dtype == jnp.bfloat16
  ours = np.abs(np.asarray(out, np.float64) - expected).max()
  naive = np.abs(np.asarray(_naive_bf16(case, q, k, v, extras), np.float64) - expected).max()
  assert ours <= 2 * naive, (ours, naive)


GRAD_CASES = ["gqa_causal", "window_pair_bidirectional", "chunk", "segments_padding",
              "soft_cap", "sinks_heads_n", "sinks_kv_n_gqa", "decode_window_sinks", "prefill",
              "everything"]


@pytest.mark.parametrize("platform", ["xla", "reference"])
@pytest.mark.parametrize("name", GRAD_CASES)
def test_gradients_match_float64_oracle(name, platform):
  case = CASES_BY_NAME[name]
  q, k, v, extras = case.arrays(seed=2)
  cotangent = np.random.default_rng(3).normal(
      size=(case.batch, case.query_len, case.num_heads, case.value_dim or case.head_dim))
  sinks = extras.pop("softmax_aux", None)
  config = case.config.replace(platform=platform)

  def ours(q, k, v, sinks):
    out = sh.attention(q, k, v, config=config, softmax_aux=sinks, **extras).attention_outputs
    return jnp.sum(out * cotangent.astype(np.float32))

  argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
  got = jax.jit(jax.grad(ours, argnums=argnums))(q, k, v, sinks)
  with jax.enable_x64(True):
    def theirs(q, k, v, sinks):
      with_sinks = dict(extras, softmax_aux=sinks) if sinks is not None else extras
      out, _ = case.oracle(q, k, v, with_sinks, xp=jnp)
      return jnp.sum(out * cotangent)
    f64 = lambda a: None if a is None else jnp.asarray(a, jnp.float64)
    want = jax.grad(theirs, argnums=argnums)(f64(q), f64(k), f64(v), f64(sinks))
  for name_, g, w in zip("qkvs", got, want):
    assert np.all(np.isfinite(np.asarray(g))), name_
    harness.assert_near(np.asarray(g), np.asarray(w), "grad", err_msg=name_)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_fully_masked_rows_are_zero_without_nan(platform):
  # Row 0 of batch 0 is padding; window (0, 0) with gapped positions leaves rows with no key.
  b, t, h, d = 2, 8, 2, 8
  rng = np.random.default_rng(4)
  q, k, v = (rng.normal(size=(b, t, h, d)).astype(np.float32) for _ in range(3))
  seg = np.zeros((b, t), np.int32)
  seg[0, :3] = -1
  kv_seg = np.zeros((b, t), np.int32)
  kv_pos = np.tile(np.arange(0, 2 * t, 2, dtype=np.int32), (b, 1))
  q_pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
  sinks = rng.normal(size=(h,)).astype(np.float32)
  config = sh.AttentionConfig(causal=True, sliding_window=(0, 0), platform=platform)

  def loss(q, k, v, sinks):
    out = sh.attention(q, k, v, config=config, q_segment_ids=seg, kv_segment_ids=kv_seg,
                       q_positions=q_pos, kv_positions=kv_pos, softmax_aux=sinks).attention_outputs
    return out, jnp.sum(out ** 2)

  out, _ = jax.jit(loss)(q, k, v, sinks)
  grads = jax.jit(jax.grad(lambda *a: loss(*a)[1], argnums=(0, 1, 2, 3)))(q, k, v, sinks)
  out = np.asarray(out)
  empty = np.zeros((b, t), bool)
  empty[0, :3] = True
  empty |= (q_pos % 2 == 1)  # odd query positions have no key at distance 0
  assert np.all(out[empty] == 0.0)
  assert np.all(np.abs(out[~empty]).sum(-1) > 0)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
  expected, _ = oracle.attention(q, k, v, causal=True, window=(0, 0), q_seg=seg, kv_seg=kv_seg,
                                 q_pos=q_pos, kv_pos=kv_pos, sinks=sinks)
  np.testing.assert_allclose(out, expected, **harness.tol())


def test_reference_weights_match_oracle():
  case = CASES_BY_NAME["everything"]
  q, k, v, extras = case.arrays()
  got = sh.attention(q, k, v, config=case.config, return_weights=True, **extras)
  out, weights = case.oracle(q, k, v, extras)
  np.testing.assert_allclose(np.asarray(got.attention_weights), weights, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got.attention_outputs), out, **harness.tol())
  public = sh.fallback.reference_attention(q, k, v, case.config, return_weights=True, **extras)
  np.testing.assert_allclose(np.asarray(public.attention_weights), weights, atol=1e-6)
  assert sh.attention(q, k, v, config=case.config, **extras).attention_weights is None


def test_reference_attention_takes_config_overrides():
  case = CASES_BY_NAME["full"]
  q, k, v, extras = case.arrays()
  out = sh.fallback.reference_attention(q, k, v, causal=False).attention_outputs
  np.testing.assert_allclose(np.asarray(out), case.oracle(q, k, v, extras)[0], **harness.tol())


def test_runtime_dtype_casts_inputs_and_output():
  case = CASES_BY_NAME["gqa_causal"]
  q, k, v, extras = case.arrays()
  config = case.config.replace(runtime_dtype=jnp.bfloat16)
  out = sh.attention(q, k.astype(np.float16), v, config=config, **extras).attention_outputs
  assert out.dtype == jnp.bfloat16
  expected, _ = case.oracle(q, k, v, extras)
  np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=5e-2)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("given", ["q_positions", "kv_positions"])
def test_positions_given_alone_serve_both_sides(platform, given):
  # Packed documents of 40, 24 and 32 tokens, positions restarting per document; tiles of 16
  # so documents straddle blocks. With S == T one positions argument serves both sides.
  b, t, hq, hkv, d = 2, 96, 4, 2, 8
  rng = np.random.default_rng(7)
  q, k, v = (rng.normal(size=(b, t, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
  lengths = [[40, 24, 32], [8, 56, 32]]
  seg = np.stack([np.repeat(np.arange(3), n) for n in lengths]).astype(np.int32)
  pos = np.stack([np.concatenate([np.arange(m) for m in n]) for n in lengths]).astype(np.int32)
  config = sh.AttentionConfig(platform=platform, block_sizes=sh.BlockSizes(16, 16, 16, 16))
  out = jax.jit(lambda q, k, v, p: sh.attention(q, k, v, config=config, q_segment_ids=seg,
                                                **{given: p}).attention_outputs)(q, k, v, pos)
  expected, _ = oracle.attention(q, k, v, q_seg=seg, q_pos=pos, kv_pos=pos)
  np.testing.assert_allclose(np.asarray(out), expected, **harness.tol())


def test_positions_of_one_side_keep_the_other_default_when_lengths_differ():
  # T = 4 queries at explicit positions against S = 12 keys at the default arange(12).
  rng = np.random.default_rng(8)
  q = rng.normal(size=(2, 4, 2, 8)).astype(np.float32)
  k, v = (rng.normal(size=(2, 12, 2, 8)).astype(np.float32) for _ in range(2))
  q_pos = np.array([[2, 5, 6, 7], [8, 9, 10, 11]], np.int32)
  out = sh.attention(q, k, v, q_positions=q_pos).attention_outputs
  expected, _ = oracle.attention(q, k, v, q_pos=q_pos, kv_pos=np.arange(12)[None])
  np.testing.assert_allclose(np.asarray(out), expected, **harness.tol())
