"""Bad inputs raise ValueError naming the argument; good ones pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
import harness
import oracle

B, T, S, HQ, HKV, D = 2, 8, 8, 4, 2, 16


def _qkv(**shapes):
  q = jnp.ones(shapes.get("q", (B, T, HQ, D)), shapes.get("q_dtype", jnp.float32))
  k = jnp.ones(shapes.get("k", (B, S, HKV, D)), shapes.get("k_dtype", jnp.float32))
  v = jnp.ones(shapes.get("v", (B, S, HKV, D)), shapes.get("v_dtype", jnp.float32))
  return q, k, v


I32 = lambda *s: jnp.zeros(s, jnp.int32)

BAD_CALLS = [
    ("query", dict(q=(B, T, HQ)), {}),
    ("key", dict(k=(B, S, HKV, D, 1)), {}),
    ("value", dict(v=(B, S, HKV)), {}),
    ("batch size", dict(k=(B + 1, S, HKV, D), v=(B + 1, S, HKV, D)), {}),
    ("head_dim", dict(k=(B, S, HKV, D + 1)), {}),
    ("`value` must have the kv_len", dict(v=(B, S + 1, HKV, D)), {}),
    ("num_kv_heads", dict(k=(B, S, 3, D), v=(B, S, 3, D)), {}),
    ("floating", dict(q_dtype=jnp.int32), {}),
    ("share a dtype", dict(k_dtype=jnp.bfloat16), {}),
    ("empty axis", dict(q=(B, 0, HQ, D)), {}),
    ("q_segment_ids", {}, dict(q_segment_ids=I32(B, T + 1))),
    ("kv_segment_ids", {}, dict(kv_segment_ids=I32(B))),
    ("q_segment_ids", {}, dict(q_segment_ids=jnp.zeros((B, T), jnp.float32))),
    ("kv_segment_ids", dict(q=(B, 4, HQ, D)), dict(q_segment_ids=I32(B, 4))),
    ("q_positions", {}, dict(q_positions=I32(B + 1, T))),
    ("kv_positions", {}, dict(kv_positions=jnp.zeros((B, S), jnp.float32))),
    ("mask", {}, dict(mask=jnp.ones((B, HQ, T), bool))),
    ("mask", {}, dict(mask=jnp.ones((B, 3, T, S), bool))),
    ("mask", {}, dict(mask=jnp.ones((B, 1, T, S), jnp.float32))),
    ("softmax_aux", {}, dict(softmax_aux=jnp.zeros((HKV,)))),
    ("softmax_aux", {}, dict(softmax_aux=jnp.zeros((3, 2)))),
    ("softmax_aux", {}, dict(softmax_aux=jnp.zeros((HQ, 2, 1)))),
    ("softmax_aux", {}, dict(softmax_aux=jnp.zeros((HQ,), jnp.int32))),
    ("config", {}, dict(config="causal")),
]


@pytest.mark.parametrize("needle,shapes,kwargs", BAD_CALLS,
                         ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_input_raises_value_error_naming_it(needle, shapes, kwargs):
  q, k, v = _qkv(**shapes)
  with pytest.raises(ValueError, match=needle):
    sh.attention(q, k, v, **kwargs)
  with pytest.raises(ValueError, match=needle):  # explain validates the same way, from shapes
    sh.explain(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v)),
               **{n: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a
                  for n, a in kwargs.items()})


BAD_CONFIGS = [
    ("sliding_window", dict(sliding_window=-1)),
    ("sliding_window", dict(sliding_window=(1, 2, 3))),
    ("sliding_window", dict(sliding_window=(1, -2))),
    ("sliding_window", dict(sliding_window=1.5)),
    ("chunk_size", dict(chunk_size=0)),
    ("logits_soft_cap", dict(logits_soft_cap=0.0)),
    ("logits_soft_cap", dict(logits_soft_cap=-1.0)),
    ("softmax_scale", dict(softmax_scale=float("inf"))),
    ("softmax_scale", dict(softmax_scale=float("nan"))),
    ("softmax_scale", dict(softmax_scale=0)),
    ("platform", dict(platform="cuda")),
    ("runtime_dtype", dict(runtime_dtype=jnp.int8)),
    ("causal", dict(causal=1)),
    ("block_sizes", dict(block_sizes=(128, 128))),
]


@pytest.mark.parametrize("needle,kwargs", BAD_CONFIGS, ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_CONFIGS)])
def test_bad_config_raises_value_error_naming_it(needle, kwargs):
  with pytest.raises(ValueError, match=needle):
    sh.AttentionConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(block_q=0), dict(block_kv=-128), dict(block_q_bwd=0),
                                    dict(block_kv=128.0)])
def test_bad_block_sizes(kwargs):
  with pytest.raises(ValueError, match=next(iter(kwargs))):
    sh.BlockSizes(**kwargs)


def test_config_is_hashable_and_normalised():
  a = sh.AttentionConfig(sliding_window=[3, 4], logits_soft_cap=5, runtime_dtype="bfloat16")
  b = sh.AttentionConfig(sliding_window=(3, 4), logits_soft_cap=5.0, runtime_dtype=jnp.bfloat16)
  assert a == b and hash(a) == hash(b)
  assert a.window == (3, 4) and sh.AttentionConfig(sliding_window=2).window == (2, 2)
  assert sh.BlockSizes(block_q=64).resolve(512, 256, 128, 128) == (64, 256, 64, 128)
  assert sh.BlockSizes().resolve(512, 256, 128, 64) == (512, 256, 128, 64)
  assert sh.BlockSizes(block_kv_bwd=32).resolve(8, 16) == (8, 16, 8, 32)
  # A config is a valid static argument.
  f = jax.jit(lambda q, config: sh.attention(q, q, q, config=config).attention_outputs,
              static_argnames="config")
  q = jnp.ones((1, 4, 2, 8))
  np.testing.assert_allclose(f(q, config=a.replace(runtime_dtype=None)), q, atol=1e-6)


@pytest.mark.parametrize("given", ["q_segment_ids", "kv_segment_ids"])
def test_one_segment_side_defaults_to_the_other_when_lengths_match(given):
  rng = np.random.default_rng(3)
  q, k, v = (rng.normal(size=a.shape).astype(np.float32) for a in _qkv())
  seg = np.array([[0] * 4 + [1] * 4, [2] * 3 + [-1] + [2] * 4], np.int32)
  out = sh.attention(q, k, v, **{given: seg}).attention_outputs
  expected, _ = oracle.attention(q, k, v, q_seg=seg, kv_seg=seg)
  np.testing.assert_allclose(np.asarray(out), expected, **harness.tol())


@pytest.mark.parametrize("build,value,needle", [
    (lambda w: sh.AttentionConfig(sliding_window=w), 4, "`sliding_window` is static"),
    (lambda w: sh.AttentionConfig(sliding_window=(w, 0)), 4, "`sliding_window` is static"),
    (lambda c: sh.AttentionConfig(chunk_size=c), 4, "`chunk_size` is static"),
    (lambda c: sh.AttentionConfig(logits_soft_cap=c), 4.0, "`logits_soft_cap` is static"),
    (lambda s: sh.AttentionConfig(softmax_scale=s), 0.5,
     "`softmax_scale` is static.*static_argnums.*learnable temperature, multiply the query"),
    (lambda b: sh.BlockSizes(block_q=b), 64, "`BlockSizes.block_q` is static"),
    (lambda w: sh.masks.SlidingWindow(w), 4, "`SlidingWindow.window` is static"),
    (lambda c: sh.masks.Chunked(c), 4, "`Chunked.size` is static"),
], ids=["window", "window_pair", "chunk", "soft_cap", "scale", "block", "SlidingWindow", "Chunked"])
def test_a_traced_static_field_says_to_pass_it_static(build, value, needle):
  with pytest.raises(ValueError, match=needle + ".*" if "static_argnums" in needle else needle):
    jax.jit(build)(value)
  build(jnp.asarray(value))  # a concrete scalar array is a Python value


def test_messages_start_with_the_sentence_that_helps():
  q, k, v = _qkv(q=(B, T, HQ))
  with pytest.raises(ValueError) as e:
    sh.attention(q, k, v)
  assert str(e.value).startswith("`query` must be [batch, query_len, num_heads, head_dim], got "
                                 "shape (2, 8, 4).")
  q, k, v = _qkv()
  with pytest.raises(ValueError) as e:
    sh.attention(q, k, v, q_positions=I32(B, T + 1))
  assert str(e.value).startswith("`q_positions` must be [batch, query_len] = (2, 8), got (2, 9).")


@pytest.mark.parametrize("build,needle", [
    (lambda: sh.masks.SlidingWindow(True), "SlidingWindow.window"),  # the config's own rule
    (lambda: sh.masks.SlidingWindow(None), "SlidingWindow.window"),
    (lambda: sh.masks.SlidingWindow((1, -2)), "SlidingWindow.window"),
    (lambda: sh.masks.Chunked(0), "Chunked.size"),
    (lambda: sh.masks.Chunked(2.5), "Chunked.size"),
], ids=["window_bool", "window_none", "window_negative", "chunk_zero", "chunk_float"])
def test_mask_objects_check_their_fields_as_the_config_does(build, needle):
  with pytest.raises(ValueError, match=needle):
    build()
