"""Every TPU call the library makes, lowered to Mosaic for TPU from this CPU host.

Interpret mode (test_backends_splash.py) checks the kernels' numbers; this checks that Mosaic
accepts them (block shapes, dtypes, scalar prefetch): `jax.export` for TPU lowers, it compiles
nothing. The calls ask for no fallback, so a TPU call that does not lower fails here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
from cases import Case, GRAD_CASES, SPLASH_CASES

TPU_KERNEL = "tpu_custom_call"


def _specs(case, dtype=jnp.float32):
  q, k, v, extras = case.arrays(seed=0)
  spec = lambda a, d: jax.ShapeDtypeStruct(a.shape, d if a.dtype == np.float32 else a.dtype)
  arrays = {n: spec(a, jnp.float32) for n, a in extras.items()}
  return [spec(a, dtype) for a in (q, k, v)], arrays


def _tpu_kernels(fn, *specs) -> int:
  exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*specs)
  assert exported.platforms == ("tpu",)
  return exported.mlir_module().count(TPU_KERNEL)


def _attention(config, extras, mask=None):
  def forward(q, k, v, *arrays):
    named = dict(zip(extras, arrays))
    return sh.attention(q, k, v, config=config, mask=mask, **named).attention_outputs
  return forward


def _grad(forward, extras):
  floats = [i for i, n in enumerate(("q", "k", "v", *extras)) if n in "qkv" or n == "softmax_aux"]
  loss = lambda *a: jnp.sum(forward(*a).astype(jnp.float32) ** 2)
  return jax.grad(loss, argnums=tuple(floats))


@pytest.mark.parametrize("case", SPLASH_CASES, ids=lambda c: c.name)
def test_splash_forward_and_backward_lower_to_mosaic(case):
  config = case.config.replace(allow_fallback=False)
  (q, k, v), extras = _specs(case)
  forward = _attention(config, extras)
  assert sh.explain(q, k, v, config=config, **extras, for_platform="tpu").backend == "splash"
  assert _tpu_kernels(forward, q, k, v, *extras.values()) >= 1
  if case.name in GRAD_CASES:  # the backward fused (the default: one kernel), and split (two)
    assert _tpu_kernels(_grad(forward, extras), q, k, v, *extras.values()) >= 2
    split = _attention(config.replace(fused_backward=False), extras)
    assert _tpu_kernels(_grad(split, extras), q, k, v, *extras.values()) >= 3


MASK_OBJECTS = {
    "causal_and_window": lambda b, t: sh.masks.Causal() & sh.masks.SlidingWindow((96, 0)),
    "chunked": lambda b, t: sh.masks.Chunked(128),
    "mask_fn_band": lambda b, t: sh.masks.MaskFn(lambda q, kv: (kv <= q) & (q - kv < 200)),
    "causal_or_spans": lambda b, t: sh.masks.Causal() | sh.masks.Bidirectional(
        jnp.asarray(np.repeat([[0, 1, 1, 2]], b, 0).repeat(t // 4, 1))),
}


@pytest.mark.parametrize("name", sorted(MASK_OBJECTS))
def test_splash_mask_objects_lower_to_mosaic(name):
  case = Case(name, batch=2, query_len=512, kv_len=512, num_heads=4, num_kv_heads=2,
              head_dim=64)
  (q, k, v), _ = _specs(case)
  config = sh.AttentionConfig(allow_fallback=False)
  mask = MASK_OBJECTS[name](case.batch, case.query_len)
  assert sh.explain(q, k, v, config=config, mask=mask, for_platform="tpu").backend == "splash"
  forward = _attention(config, {}, mask=mask)
  assert _tpu_kernels(_grad(forward, {}), q, k, v) >= 2  # forward, fused backward


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused_backward"])
def test_splash_at_a_real_size_in_bfloat16_lowers_to_mosaic(fused):
  """T = 8192, D 128, bf16, GQA, causal with sinks and packed segments: a training step."""
  case = Case("real", batch=1, query_len=8192, kv_len=8192, num_heads=8, num_kv_heads=2,
              head_dim=128, segments="packed", sinks="heads")
  config = case.config.replace(allow_fallback=False, fused_backward=fused)
  (q, k, v), extras = _specs(case, jnp.bfloat16)
  forward = _attention(config, extras)
  assert _tpu_kernels(_grad(forward, extras), q, k, v, *extras.values()) >= (2 if fused else 3)


def test_a_block_shape_mosaic_refuses_fails_the_export():
  """The check can fail: a block that breaks Mosaic's (8, 128) tiling is refused when lowered
  (an export that lowered anything would prove nothing)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top

  def copy(x, block):
    return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
                          grid=(x.shape[1] // block[1],),
                          in_specs=[pl.BlockSpec(block, lambda j: (0, j))],
                          out_specs=pl.BlockSpec(block, lambda j: (0, j)),
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

  spec = jax.ShapeDtypeStruct((8, 400), jnp.float32)
  with pytest.raises(ValueError, match="128"):
    _tpu_kernels(lambda x: copy(x, (8, 100)), spec)
  assert _tpu_kernels(lambda x: copy(x, (8, 400)), spec) == 1
