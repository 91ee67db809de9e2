"""Runs splash_hk.attention on a few shapes and logs the backend and the error of each.

  python -m splash_hk.quickcheck --platform=auto

Exits non-zero when an error is above the tolerance (the report goes to absl's log).
"""

from __future__ import annotations

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

import splash_hk as sh
from splash_hk import platforms

_PLATFORM = flags.DEFINE_enum("platform", "auto", list(platforms.names()),
                              "Platform to ask for.")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed of the inputs.")

# (name, B, T, S, Hq, Hkv, D, config)
SHAPES = (
    ("causal MHA", 2, 256, 256, 8, 8, 64, sh.AttentionConfig()),
    ("causal GQA window", 2, 256, 256, 8, 2, 64, sh.AttentionConfig(sliding_window=64)),
    ("chunked, soft cap", 1, 200, 200, 4, 4, 32, sh.AttentionConfig(chunk_size=64, logits_soft_cap=30.0)),
    ("prefill T<S", 2, 64, 512, 8, 2, 64, sh.AttentionConfig()),
    ("decode T=1", 4, 1, 512, 8, 1, 128, sh.AttentionConfig()),
)


def main(argv):
  del argv
  key = jax.random.PRNGKey(_SEED.value)
  worst = 0.0
  for name, b, t, s, hq, hkv, d, config in SHAPES:
    config = config.replace(platform=_PLATFORM.value)
    key, kq, kk, kv = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, t, hq, d), jnp.float32)  # [B, T, Hq, D]
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.float32)  # [B, S, Hkv, D]
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.float32)  # [B, S, Hkv, D]
    decision = sh.explain(q, k, v, config=config)
    out = jax.jit(lambda q, k, v, c=config: sh.attention(q, k, v, config=c).attention_outputs)(q, k, v)
    ref = sh.fallback.reference_attention(q, k, v, config).attention_outputs
    err = float(np.max(np.abs(np.asarray(out) - np.asarray(ref))))
    worst = max(worst, err)
    logging.info("%-22s backend=%-9s max|err|=%.2e  (%s)", name, decision.backend, err,
                 decision.reason)
  # f32 on a CPU matches to rounding; GPU kernels may use TF32 for f32 matmuls.
  tolerance = 1e-5 if jax.default_backend() == "cpu" else 5e-3
  logging.info("worst max|err| vs reference = %.2e (%s, tolerance %.0e on %s)", worst,
               "OK" if worst < tolerance else "TOO LARGE", tolerance, jax.default_backend())
  if worst >= tolerance:
    logging.error("error above %.0e", tolerance)
    raise SystemExit(1)


if __name__ == "__main__":
  app.run(main)
