"""The TPU decode kernel (`backends/tpu/decode.py`: a few query rows over a long fixed cache) in
interpret mode against the float64 oracle: every rule it serves, segments and padding, explicit
positions, sinks, soft cap, GQA, Dv != D, caches that are not whole blocks, garbage where no
row looks and a NaN where one does; what it refuses, by reason; its TPU lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
import splash_hk as sh
from splash_hk.backends.tpu import decode

INTERPRET = dict(platform="splash", interpret=True, allow_fallback=False)


def _arrays(seed, batch=2, rows=1, heads=16, kv_heads=8, keys=700, d=128, dv=None,
            dtype=np.float32):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(batch, rows, heads, d)).astype(dtype)
  k = rng.normal(size=(batch, keys, kv_heads, d)).astype(dtype)
  v = rng.normal(size=(batch, keys, kv_heads, dv or d)).astype(dtype)
  return q, k, v


def _run(q, k, v, config, **named):
  f = jax.jit(lambda q, k, v, named: sh.attention(q, k, v, config=config,
                                                  **named).attention_outputs)
  return np.asarray(f(q, k, v, named), np.float64)


def _served(q, k, v, config, **named):
  decision = sh.explain(q, k, v, config=config, for_platform="tpu", **named)
  assert decision.backend == "splash" and "TPU decode kernel" in decision.reason, decision


RULES = {  # config words, the oracle's
    "none": (dict(causal=False), dict(causal=False)),
    "causal": (dict(causal=True), dict(causal=True)),
    "window": (dict(causal=True, sliding_window=(100, 0)), dict(causal=True, window=(100, 0))),
    "chunk": (dict(causal=True, chunk_size=256), dict(causal=True, chunk=256)),
}


@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("rule", list(RULES))
def test_a_few_rows_over_a_cache_match_the_oracle(rule, rows):
  words, rules = RULES[rule]
  q, k, v = _arrays(rows, rows=rows, dv=256)
  config = sh.AttentionConfig(**INTERPRET, **words)
  _served(q, k, v, config)
  np.testing.assert_allclose(_run(q, k, v, config), oracle.attention(q, k, v, **rules)[0],
                             **harness.tol())


def test_padding_segments_positions_sinks_and_soft_cap_match_the_oracle():
  """Each item's cache filled to its own length (the rest padding: segment -1, garbage in its
  keys and values), positions that are not the defaults, two sinks a head, a soft cap."""
  q, k, v = _arrays(1, batch=3, rows=2, keys=1500)
  lengths = np.asarray([1500, 37, 900])
  kv_seg = np.where(np.arange(1500)[None] < lengths[:, None], 0, -1).astype(np.int32)
  k[kv_seg < 0], v[kv_seg < 0] = np.nan, np.inf  # nobody looks there
  q_seg = np.zeros((3, 2), np.int32)
  q_pos = (lengths[:, None] - 2 + np.arange(2)[None]).astype(np.int32)
  kv_pos = np.broadcast_to(np.arange(1500, dtype=np.int32), (3, 1500))
  sinks = np.random.default_rng(2).normal(size=(16, 2)).astype(np.float32)
  config = sh.AttentionConfig(**INTERPRET, causal=True, logits_soft_cap=20.0)
  named = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos,
               kv_positions=kv_pos, softmax_aux=sinks)
  _served(q, k, v, config, **named)
  want = oracle.attention(q, k, v, causal=True, soft_cap=20.0, q_seg=q_seg, kv_seg=kv_seg,
                          q_pos=q_pos, kv_pos=kv_pos, sinks=sinks)[0]
  np.testing.assert_allclose(_run(q, k, v, config, **named), want, **harness.tol())


def test_a_visible_nan_reaches_only_the_rows_that_see_it_and_a_row_seeing_nothing_is_zero():
  """A NaN value at key 500 of item 0: rows that see it (window 200 from row positions past
  it) are NaN in that column; item 1's rows see no key (their segment is nowhere): 0."""
  q, k, v = _arrays(3, rows=2, keys=1024)
  v[0, 500, 3, 5] = np.nan
  q_seg = np.asarray([[0, 0], [7, 7]], np.int32)
  kv_seg = np.zeros((2, 1024), np.int32)
  q_pos = np.asarray([[650, 750], [650, 750]], np.int32)  # row 0 sees 450..650, row 1 550..750
  config = sh.AttentionConfig(**INTERPRET, causal=True, sliding_window=(200, 0))
  named = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos)
  out = _run(q, k, v, config, **named)
  want = oracle.attention(q, k, v, causal=True, window=(200, 0), q_seg=q_seg, kv_seg=kv_seg,
                          q_pos=q_pos)[0]
  group = 16 // 8
  assert np.isnan(out[0, 0, 3 * group:3 * group + group, 5]).all()
  assert not np.isnan(np.delete(out[0], np.s_[3 * group:3 * group + group], axis=1)).any()
  assert not np.isnan(out[0, 1]).any() and (out[1] == 0).all()
  np.testing.assert_allclose(out, want, **harness.tol())


def test_sixteen_kv_heads_match_the_oracle():
  q, k, v = _arrays(8, rows=3, heads=32, kv_heads=16, keys=500)
  config = sh.AttentionConfig(**INTERPRET, causal=True)
  _served(q, k, v, config)
  np.testing.assert_allclose(_run(q, k, v, config), oracle.attention(q, k, v, causal=True)[0],
                             **harness.tol())


def test_bfloat16_at_a_real_size_matches_the_oracle():
  q, k, v = _arrays(4, batch=2, rows=4, heads=32, kv_heads=8, keys=4096, d=128,
                    dtype=jnp.bfloat16)
  config = sh.AttentionConfig(**INTERPRET, causal=True)
  _served(q, k, v, config)
  want = oracle.attention(q, k, v, causal=True)[0]
  np.testing.assert_allclose(_run(q, k, v, config), want, **harness.tol(dtype=jnp.bfloat16))


def test_block_keys_fit_their_budgets_and_the_cache():
  assert decode.block_keys(1, 32, 8, 256, 2, 8192) == 1024
  assert decode.block_keys(4, 32, 8, 256, 2, 8192) == 512  # the logits' budget
  assert decode.block_keys(8, 32, 8, 256, 2, 8192) == 256
  assert decode.block_keys(1, 32, 8, 256, 2, 300) == 384  # the cache, in whole lanes
  assert decode.block_keys(1, 8, 8, 2048, 4, 8192) == 128  # the buffers' budget


@pytest.mark.parametrize("what,named,words,reason", [
    ("kv_heads", dict(kv_heads=1, heads=8), {}, "a multiple of 8 kv heads"),
    ("kv_heads", dict(kv_heads=2, heads=8), {}, "a multiple of 8 kv heads"),
    ("kv_heads", dict(kv_heads=4, heads=16), {}, "a multiple of 8 kv heads"),
    ("head_dim", dict(d=64), {}, "head dims 64 / 64"),
    ("mask", {}, dict(mask=True), "not the config's rules"),
    ("rows", dict(rows=9), {}, None),
])
def test_what_it_refuses_runs_elsewhere_with_the_reason(what, named, words, reason):
  del what
  q, k, v = _arrays(5, **named)
  extra = dict(mask=sh.masks.Causal() | sh.masks.SlidingWindow(3)) if words else {}
  decision = sh.explain(q, k, v, config=sh.AttentionConfig(interpret=True), for_platform="tpu",
                        **extra)
  assert "TPU decode kernel:" not in decision.reason
  if reason is not None:
    assert reason in decision.reason, decision


def test_a_differentiated_call_matches_the_oracles_gradients():
  q, k, v = _arrays(6, rows=2, keys=300, dv=256)
  cot = np.random.default_rng(7).normal(size=(*q.shape[:3], 256)).astype(np.float32)
  config = sh.AttentionConfig(**INTERPRET, causal=True)
  harness.check_against_oracle(
      lambda q, k, v: sh.attention(q, k, v, config=config).attention_outputs, q, k, v, cot,
      causal=True)


def test_the_kernel_lowers_to_mosaic_for_a_tpu():
  q, k, v = (jax.ShapeDtypeStruct(a.shape, jnp.bfloat16)
             for a in _arrays(0, batch=4, rows=4, heads=32, keys=8192, d=128))
  config = sh.AttentionConfig(platform="splash", allow_fallback=False, causal=True)
  exported = jax.export.export(jax.jit(lambda q, k, v: sh.attention(
      q, k, v, config=config).attention_outputs), platforms=["tpu"])(q, k, v)
  assert exported.mlir_module().count("tpu_custom_call") == 1


def test_the_plan_reads_only_blocks_a_row_sees_and_guards_all_but_whole_ones():
  """Item 0's rows see keys 300-511 (row 1 from 384 on): blocks 2-3 of 128 are read, block 3
  whole; item 1's rows see nothing: no block is read (last before first)."""
  vis = np.zeros((2, 2, 600), bool)
  vis[0, 0, 300:512] = True
  vis[0, 1, 384:512] = True
  spec = decode.Spec(rows=2, heads=8, kv_heads=8, block_keys=128, blocks=5, scale=1.0,
                     soft_cap=None)
  first, last, whole, kernel_vis = decode._plan(jnp.asarray(vis), spec, 600)
  assert first.tolist() == [2, 0] and last.tolist() == [3, -1]
  assert np.asarray(whole).reshape(2, 5).tolist() == [[0, 0, 0, 1, 0], [0] * 5]
  assert kernel_vis.shape == (2, 2, 640) and kernel_vis.dtype == jnp.bfloat16


def test_under_highest_precision_the_visibility_product_asks_for_the_default():
  """A float32 call under "highest": the kernel's 0/1 bf16 product (keys to columns) names the
  default precision, exact for it, where "highest" would reach Mosaic as an fp32 contraction
  of bf16 operands, which it refuses ("Bad lhs type": compiled for a v5e, `make tpu-aot`)."""
  q, k, v = (jax.ShapeDtypeStruct(a.shape, jnp.float32)
             for a in _arrays(0, batch=2, rows=3, heads=16, keys=1000))
  config = sh.AttentionConfig(platform="splash", allow_fallback=False, causal=True)
  with jax.default_matmul_precision("highest"):
    text = str(jax.make_jaxpr(lambda q, k, v: sh.attention(q, k, v, config=config)
                              .attention_outputs)(q, k, v))
  assert "pallas_call" in text and "Precision.DEFAULT" in text
