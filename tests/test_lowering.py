"""The backend chosen per lowering platform: `jax.export` from this CPU host for TPU holds the
splash kernel, one artifact for ["cpu", "tpu"] holds each platform's choice (and runs here
against the float64 oracle), and a plain call on CPU is the program it was."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
from splash_hk import lowering
import harness
from cases import Case

CASE = Case("gqa_window", batch=1, query_len=256, kv_len=256, num_heads=4, num_kv_heads=2,
            head_dim=128, window=(100, 0), sinks="heads")
TPU_KERNEL = "tpu_custom_call"


def _loss(config):
  def loss(q, k, v, sinks):
    out = sh.attention(q, k, v, config=config, softmax_aux=sinks).attention_outputs
    return jnp.sum(out ** 2)
  return loss


def _specs(case):
  q, k, v, extras = case.arrays(seed=1)
  return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v, extras["softmax_aux"])]


def test_export_for_tpu_from_cpu_holds_the_splash_kernel_forward_and_backward():
  forward = lambda q, k, v, s: sh.attention(q, k, v, config=CASE.config, softmax_aux=s)
  exported = jax.export.export(jax.jit(forward), platforms=["tpu"])(*_specs(CASE))
  assert exported.mlir_module().count(TPU_KERNEL) == 1
  grad = jax.jit(jax.grad(_loss(CASE.config), argnums=(0, 1, 2, 3)))
  exported = jax.export.export(grad, platforms=["tpu"])(*_specs(CASE))
  assert exported.mlir_module().count(TPU_KERNEL) >= 2  # forward, the (fused) backward
  assert sh.explain(*_specs(CASE)[:3], config=CASE.config, softmax_aux=_specs(CASE)[3],
                    for_platform="tpu").backend == "splash"


def test_one_artifact_for_cpu_and_tpu_runs_here_against_the_oracle():
  """The ["cpu", "tpu"] artifact holds the TPU kernel and, called on this CPU, runs xla's
  program: values and gradients against the float64 oracle."""
  q, k, v, extras = CASE.arrays(seed=1)
  grad = jax.jit(jax.value_and_grad(_loss(CASE.config), argnums=(0, 1, 2, 3)))
  exported = jax.export.export(grad, platforms=["cpu", "tpu"])(*_specs(CASE))
  assert exported.platforms == ("cpu", "tpu")
  assert exported.mlir_module().count(TPU_KERNEL) >= 2
  value, grads = exported.call(q, k, v, extras["softmax_aux"])
  with jax.enable_x64(True):
    def theirs(q, k, v, s):
      return jnp.sum(CASE.oracle(q, k, v, {"softmax_aux": s}, xp=jnp)[0] ** 2)
    f64 = [jnp.asarray(a, jnp.float64) for a in (q, k, v, extras["softmax_aux"])]
    want_value, want = jax.value_and_grad(theirs, argnums=(0, 1, 2, 3))(*f64)
  harness.assert_near(value, want_value, "out")
  for name, got, w in zip("qkvs", grads, want):
    harness.assert_near(np.asarray(got), np.asarray(w), "grad", err_msg=name)


def _ops(compiled_text):
  text = re.sub(r", metadata=\{[^}]*\}", "", compiled_text)
  return collections.Counter(re.findall(r"= \S+ ([\w-]+)\(", text))


def test_a_plain_cpu_call_compiles_to_the_program_of_the_xla_backend():
  """On this host the per-platform choice lowers only the CPU branch: the compiled training
  step has the same operations as one that asks for xla (no other branch's residuals)."""
  q, k, v, extras = CASE.arrays(seed=1)
  args = (q, k, v, extras["softmax_aux"])
  auto = jax.jit(jax.grad(_loss(CASE.config), argnums=(0, 1, 2, 3)))
  xla = jax.jit(jax.grad(_loss(CASE.config.replace(platform="xla")), argnums=(0, 1, 2, 3)))
  assert _ops(auto.lower(*args).compile().as_text()) == _ops(xla.lower(*args).compile().as_text())
  for got, want in zip(auto(*args), xla(*args)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_tpu_fallback_is_exported_as_xla_with_the_reason_explain_gives():
  specs = _specs(CASE)
  decision = sh.explain(*specs[:3], config=CASE.config, return_residuals=True,
                        for_platform="tpu")
  assert decision.backend == "xla" and decision.fallback
  assert "return_residuals" in decision.reason
  forward = lambda q, k, v: sh.attention(q, k, v, config=CASE.config, return_residuals=True).lse
  exported = jax.export.export(jax.jit(forward), platforms=["tpu"])(*specs[:3])
  assert TPU_KERNEL not in exported.mlir_module()


def test_a_forbidden_tpu_fallback_fails_the_tpu_export_and_not_the_cpu_call():
  q, k, v, _ = CASE.arrays(seed=1)
  config = CASE.config.replace(allow_fallback=False)
  forward = lambda q, k, v: sh.attention(q, k, v, config=config, return_residuals=True).lse
  lse = jax.jit(forward)(q, k, v)  # on CPU xla is the first choice: no fallback
  assert lse.shape == (1, 256, 4)
  with pytest.raises(ValueError, match="cannot lower for 'tpu'.*allow_fallback=False"):
    jax.export.export(jax.jit(forward), platforms=["tpu"])(*_specs(CASE)[:3])


def test_asking_for_splash_on_a_cpu_host_exports_it_for_tpu():
  """platform="splash" with no fallback allowed: on this host the call cannot run (the reason
  when it is lowered for CPU), and its TPU export holds the kernel."""
  q, k, v, _ = CASE.arrays(seed=1)
  config = CASE.config.replace(platform="splash", allow_fallback=False)
  forward = lambda q, k, v: sh.attention(q, k, v, config=config).attention_outputs
  exported = jax.export.export(jax.jit(forward), platforms=["tpu"])(*_specs(CASE)[:3])
  assert exported.mlir_module().count(TPU_KERNEL) == 1
  with pytest.raises(ValueError, match="needs a TPU \\(this is cpu\\)"):
    jax.jit(forward)(q, k, v)


@pytest.mark.parametrize("extra,reason", [
    ("mask", "on tpu: .*splash: the mask holds a Dense part"),
    ("bias", "on tpu: .*splash: a `bias` was given")])
def test_a_splash_export_no_platform_serves_says_the_tpus_reason(extra, reason):
  """platform="splash" and no fallback, with what the TPU kernel does not take: the TPU's own
  reason (it said only "needs a TPU (this is cpu)")."""
  specs = _specs(CASE)[:3]
  dense = jnp.ones((1, 1, 256, 256), bool if extra == "mask" else jnp.float32)
  config = CASE.config.replace(platform="splash", allow_fallback=False)
  forward = lambda q, k, v: sh.attention(q, k, v, config=config, **{extra: dense}).attention_outputs
  with pytest.raises(ValueError, match=f"on cpu: .*needs a TPU .*{reason}"):
    jax.export.export(jax.jit(forward), platforms=["tpu"])(*specs)


def test_the_gpu_export_from_a_cpu_host_names_the_triton_kernel_and_what_to_do():
  forward = lambda q, k, v: sh.attention(q, k, v).attention_outputs
  with pytest.raises(ValueError, match="triton.*platform='xla'"):
    jax.export.export(jax.jit(forward), platforms=["cuda"])(*_specs(CASE)[:3])
  portable = lambda q, k, v: sh.attention(
      q, k, v, config=sh.AttentionConfig(platform="xla")).attention_outputs
  exported = jax.export.export(jax.jit(portable), platforms=["cuda"])(*_specs(CASE)[:3])
  assert exported.platforms == ("cuda",)


def test_vmap_and_a_mesh_keep_the_choice_per_platform():
  q, k, v, extras = CASE.arrays(seed=2)
  mesh = jax.make_mesh((2,), ("heads",), axis_types=(jax.sharding.AxisType.Auto,))
  axes = sh.MeshAxes(batch=None, heads="heads")
  sharded = lambda q, k, v: sh.attention(q, k, v, config=CASE.config, mesh=mesh, axes=axes,
                                         softmax_aux=extras["softmax_aux"]).attention_outputs
  want, _ = CASE.oracle(q, k, v, extras)
  np.testing.assert_allclose(np.asarray(jax.jit(sharded)(q, k, v)), want, **harness.tol())
  exported = jax.export.export(jax.jit(sharded), platforms=["tpu"])(*_specs(CASE)[:3])
  assert exported.mlir_module().count(TPU_KERNEL) == 1
  batched = jax.vmap(lambda q, k, v: sh.attention(q, k, v, config=CASE.config,
                                                  softmax_aux=extras["softmax_aux"]))
  out = jax.jit(batched)(q[None], k[None], v[None]).attention_outputs
  np.testing.assert_allclose(np.asarray(out[0]), want, **harness.tol())


def test_per_platform_runs_the_host_branch_and_differentiates_it():
  branches = {"cpu": lambda x: {"y": 2.0 * x}, "gpu": lambda x: {"y": 5.0 * x},
              "tpu": lambda x: {"y": jnp.sin(x) * 3.0}}
  f = lambda x: lowering.per_platform(branches, x)["y"]
  x = jnp.arange(3.0)
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), 2.0 * np.arange(3.0))
  np.testing.assert_array_equal(np.asarray(jax.grad(lambda x: f(x).sum())(x)), [2.0] * 3)
  exported = jax.export.export(jax.jit(jax.grad(lambda x: f(x).sum())),
                               platforms=["cpu", "tpu"])(x)
  np.testing.assert_array_equal(np.asarray(exported.call(x)), [2.0] * 3)
  with pytest.raises(ValueError, match="`branches` must have one branch per hardware"):
    lowering.per_platform({"cpu": branches["cpu"]}, x)


def test_another_platforms_branch_that_fails_to_trace_breaks_only_its_lowering():
  def broken(x):
    raise RuntimeError("no kernel for this shape")
  branches = {"cpu": lambda x: jnp.sin(x), "gpu": lambda x: jnp.sin(x), "tpu": broken}
  f = lambda x: lowering.per_platform(branches, x).sum()
  x = jnp.arange(3.0)
  np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(f))(x)), np.cos(np.arange(3.0)),
                             rtol=1e-6)
  with pytest.raises(ValueError, match="cannot lower for 'tpu'.*no kernel for this shape"):
    jax.export.export(jax.jit(jax.grad(f)), platforms=["tpu"])(x)


def test_chunked_divides_negative_positions_by_floor():
  pos = jnp.arange(-9, 9, dtype=jnp.int32)
  got = sh.masks.Chunked(4).visible(pos[:, None], pos[None, :])
  want = (np.arange(-9, 9)[:, None] // 4) == (np.arange(-9, 9)[None, :] // 4)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_a_second_eager_call_compiles_nothing():
  """Eager calls of a per-platform choice are jitted once per decisions and facts, as a call
  with one backend is."""
  q, k, v, extras = CASE.arrays(seed=3)
  call = lambda: sh.attention(q, k, v, config=CASE.config, softmax_aux=extras["softmax_aux"])
  call()
  compiles = []
  listener = lambda event, duration, **_: compiles.append(event) if "compile" in event else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    out = call().attention_outputs
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert not [e for e in compiles if "backend_compile" in e], compiles
  want, _ = CASE.oracle(q, k, v, extras)
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())
