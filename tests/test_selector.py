"""The decision table, mode detection and fallback logging."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import logging as absl_logging

import splash_hk as sh
from splash_hk import platforms
from splash_hk.backends import base
from splash_hk.backends import reference
from splash_hk.fallback import selector
import harness
import oracle

Q = (2, 256, 8, 64)
K = (2, 256, 2, 64)


@pytest.mark.parametrize("t,s,mode", [(1, 1, sh.Mode.DECODE), (1, 4096, sh.Mode.DECODE),
                                      (7, 64, sh.Mode.PREFILL), (64, 64, sh.Mode.TRAIN),
                                      (65, 64, sh.Mode.TRAIN)])
def test_detect_mode_uses_sequence_lengths(t, s, mode):
  assert sh.detect_mode(t, s) is mode


def test_detect_mode_ignores_heads():
  # EasyDeL's bug was reading the head axis: one head, long query must not be DECODE.
  q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.float32)
  assert "train mode" in sh.explain(q, q, q).reason


def test_detect_mode_rejects_empty():
  with pytest.raises(ValueError, match="query_len"):
    sh.detect_mode(0, 4)


@pytest.mark.parametrize("hardware,expected", [("cpu", ("native", "xla", "reference")),
                                               ("tpu", ("splash", "xla", "reference")),
                                               ("gpu", ("triton", "xla", "reference"))])
def test_auto_candidates_follow_hardware(hardware, expected):
  assert selector.candidates("auto", hardware) == expected


def test_auto_on_cpu_is_xla_without_fallback():
  d = sh.fallback.select_backend(sh.AttentionConfig(), query_shape=Q, key_shape=K, hardware="cpu")
  assert d == sh.Decision("xla", d.reason) and not d.fallback


def test_reference_when_requested():
  d = sh.fallback.select_backend(sh.AttentionConfig(platform="reference"), query_shape=Q,
                                 key_shape=K)
  assert d.backend == "reference" and not d.fallback and "requested" in d.reason


def test_xla_serves_every_mask():
  for mask_shape in [(2, 8, 256, 256), (2, 1, 256, 256), None]:
    d = sh.fallback.select_backend(sh.AttentionConfig(chunk_size=64), query_shape=(2, 1, 8, 64),
                                   key_shape=K, mask_shape=mask_shape, default_positions=False,
                                   hardware="cpu")
    # A decode on CPU: the native kernel where its rules say the mask (the config's), else
    # xla, neither a fallback (native is an optional kernel: its refusal is said).
    want = "native" if mask_shape is None and harness.NATIVE_MISSING is None else "xla"
    assert d.backend == want and not d.fallback, d
    assert want == "native" or "not native: " in d.reason, d


def test_weights_need_reference():
  d = sh.fallback.select_backend(sh.AttentionConfig(), query_shape=Q, key_shape=K,
                                 return_weights=True, hardware="cpu")
  assert d.backend == "reference" and "weights" in d.reason


def test_kernel_without_its_hardware_falls_back_with_reason():
  d = sh.fallback.select_backend(sh.AttentionConfig(platform="triton"), query_shape=Q,
                                 key_shape=K, hardware="cpu")
  assert d.backend == "xla" and d.fallback and "needs a GPU" in d.reason


def test_disallowed_fallback_raises_with_reason():
  config = sh.AttentionConfig(platform="splash", allow_fallback=False)
  with pytest.raises(ValueError, match="needs a TPU.*allow_fallback=False"):
    sh.fallback.select_backend(config, query_shape=Q, key_shape=K, hardware="cpu")
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="weights were requested"):
    sh.attention(q, q, q, config=sh.AttentionConfig(allow_fallback=False), return_weights=True)


def test_selection_is_made_at_trace_time_from_shapes():
  decisions = []

  @jax.jit
  def f(q):
    decisions.append(sh.explain(q, q, q))  # q is a tracer: only shapes are known
    return sh.attention(q, q, q).attention_outputs

  q = jnp.ones((1, 40, 2, 8))
  f(q)
  f(q + 1)  # cached: no retrace, no second decision
  assert [d.backend for d in decisions] == ["xla"]
  spec = jax.ShapeDtypeStruct(q.shape, q.dtype)
  assert sh.explain(spec, spec, spec) == decisions[0]


def test_each_fallback_reason_is_logged_once(monkeypatch):
  seen = []
  monkeypatch.setattr(absl_logging, "warning", lambda msg, *args: seen.append(msg % args))
  monkeypatch.setattr(selector, "_LOGGED_REASONS", set())
  q = jnp.ones((1, 4, 2, 8))
  for _ in range(3):
    sh.attention(q, q, q, config=sh.AttentionConfig(platform="triton"))
  sh.attention(q, q, q)  # no fallback, nothing logged
  sh.attention(q, q, q, return_weights=True)
  assert len(seen) == 2 and "needs a GPU" in seen[0] and "weights" in seen[1]


def test_a_backend_is_one_file_and_one_line():
  """A toy backend, registered here as `splash_hk.kernel` registers the library's, is chosen on
  its hardware, explained, and refused in its own words; it serves calls through the same
  interface (here: the reference backend's computation, counted)."""
  calls = []

  def why_not(facts, hardware):
    del hardware
    return "the toy kernel does not decode" if facts.mode is sh.Mode.DECODE else None

  def attend(x, facts):
    calls.append(x.query.shape)
    return reference.attend(x, facts)

  toy = base.Backend(name="toy", why_not=why_not, attend=attend, hardware=("cpu",), rank=-1)
  platforms.register(toy)
  try:
    assert selector.candidates("auto", "cpu") == ("toy", "native", "xla", "reference")
    q = np.random.default_rng(0).normal(size=(2, 16, 4, 8)).astype(np.float32)
    decision = sh.explain(q, q, q)
    assert decision == sh.Decision("toy", "toy is the first choice on cpu (train mode)")
    out = sh.attention(q, q, q).attention_outputs
    np.testing.assert_allclose(np.asarray(out), oracle.attention(q, q, q)[0], **harness.tol())
    assert calls == [(2, 16, 4, 8)]
    decode = sh.explain(q[:, :1], q, q)  # the next on cpu: the native decode kernel
    assert decode.backend == ("native" if harness.NATIVE_MISSING is None else "xla")
    assert decode.fallback
    assert "toy: the toy kernel does not decode" in decode.reason
    assert sh.AttentionConfig(platform="toy").platform == "toy"
    with pytest.raises(ValueError, match="toy: the toy kernel does not decode"):
      sh.explain(q[:, :1], q, q, config=sh.AttentionConfig(platform="toy", allow_fallback=False))
  finally:
    platforms.unregister("toy")
  with pytest.raises(ValueError, match="platform must be one of"):
    sh.AttentionConfig(platform="toy")
  assert sh.explain(q, q, q).backend == "xla"


def test_explain_names_another_platforms_choice_from_this_host():
  q = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16)
  here = sh.explain(q, k, k)
  assert here.backend == "xla" and "first choice on cpu" in here.reason
  tpu = sh.explain(q, k, k, for_platform="tpu")
  assert tpu == sh.Decision("splash", "splash is the first choice on tpu (train mode); JAX's "
                                      "splash kernel at tiles 512/1024/512, backward "
                                      "512/1024/512 fused (rule)")
  gpu = sh.explain(q, k, k, for_platform="cuda")  # jax.export's name for a GPU
  assert gpu.backend in ("triton", "xla") and "on gpu" in gpu.reason, gpu
  chosen = sh.masks.Blocks(jax.ShapeDtypeStruct((1, 2, 16, 4), jnp.int32),
                           jax.ShapeDtypeStruct((1, 2, 16), jnp.int32), (128, 128))
  served = sh.explain(q, k, k, mask=chosen, for_platform="tpu")
  assert served.backend == "splash" and "the block-list kernel" in served.reason
  per_token = sh.masks.Blocks(jax.ShapeDtypeStruct((1, 2, 2048, 4), jnp.int32),
                              jax.ShapeDtypeStruct((1, 2, 2048), jnp.int32), (1, 128))
  refused = sh.explain(q, k, k, mask=per_token, for_platform="tpu")
  assert refused.backend == "xla" and "splash: Blocks.block_size (1, 128)" in refused.reason
  with pytest.raises(ValueError, match=r"`for_platform` must be one of \('cpu', 'gpu', 'tpu'\)"):
    sh.explain(q, k, k, for_platform="metal")
