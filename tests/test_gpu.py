"""ejkernel's Triton kernel on a real GPU against the float64 oracle (skipped without a GPU).

Run by `make gpu-check` on a machine with a GPU; CPU CI covers everything up to
the kernel call in tests/test_backends_triton.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
from cases import Case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]

GPU_CASES = [
    Case("causal", batch=2, query_len=256, kv_len=256, num_heads=4, num_kv_heads=4, head_dim=64),
    Case("gqa_window", batch=1, query_len=512, kv_len=512, num_heads=8, num_kv_heads=2,
         head_dim=64, window=(128, 0)),
    Case("segments_sinks_softcap", batch=2, query_len=256, kv_len=256, num_heads=4, num_kv_heads=2,
         head_dim=64, segments="packed", sinks="heads_n", soft_cap=20.0),
    Case("prefill", batch=1, query_len=128, kv_len=384, num_heads=4, num_kv_heads=1, head_dim=128),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_triton_matches_oracle(case):
  config = case.config.replace(platform="triton", allow_fallback=False)
  q, k, v, extras = case.arrays(seed=1)
  assert sh.explain(q, k, v, config=config, **extras).backend == "triton"
  out = jax.jit(functools.partial(sh.attention, config=config))(q, k, v, **extras)
  np.testing.assert_allclose(np.asarray(out.attention_outputs), case.oracle(q, k, v, extras)[0],
                             atol=3e-3)
  grads = jax.jit(jax.grad(lambda q: jnp.sum(sh.attention(
      q, k, v, config=config, **extras).attention_outputs ** 2)))(q)
  with jax.enable_x64(True):
    want = jax.grad(lambda q: jnp.sum(case.oracle(q, k, v, extras, xp=jnp)[0] ** 2))(
        jnp.asarray(q, jnp.float64))
  np.testing.assert_allclose(np.asarray(grads), np.asarray(want), atol=2e-2)


def test_auto_picks_triton_on_gpu():
  q = jnp.ones((1, 256, 4, 64))
  assert sh.explain(q, q, q).backend == "triton"
