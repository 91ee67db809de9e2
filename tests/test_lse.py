"""One log-sum-exp convention (`splash_hk.backends.base`): -inf means "sees nothing", nothing else.

A row whose real logit is +inf (an Inf key it sees) must not be taken for a row
that sees nothing, nor the other way round, on each backend that returns an lse
(the ring merges its steps by it).
"""

import numpy as np
import pytest

import splash_hk as sh
from splash_hk import inputs
from splash_hk import kernel
from splash_hk.types import Extras
import oracle

CONFIG = sh.AttentionConfig(causal=False, allow_fallback=False)


def _inputs():
  """Rows: 0 sees a +inf logit, 1 a -inf logit beside a finite one, 2 plain, 3 nothing."""
  q = np.zeros((1, 4, 1, 2), np.float32)
  k = np.zeros((1, 4, 1, 2), np.float32)
  v = np.arange(8, dtype=np.float32).reshape(1, 4, 1, 2)
  q[0, :, 0] = [[1.0, 0.5], [-1.0, 0.5], [0.3, -0.2], [0.7, 0.1]]
  k[0, :, 0] = [[0.2, 1.0], [np.inf, 0.0], [0.5, 0.5], [-0.4, 0.9]]
  q_seg = np.array([[0, 0, 1, -1]], np.int32)  # row 3 is padding: it sees nothing
  kv_seg = np.array([[0, 0, 1, 1]], np.int32)
  return q, k, v, dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg)


def _expected_lse(q, k, extras) -> np.ndarray:
  logits = np.einsum("btd,bsd->bts", q[:, :, 0].astype(np.float64), k[:, :, 0]) * 2 ** -0.5
  seen = extras["q_segment_ids"][:, :, None] == extras["kv_segment_ids"][:, None, :]
  seen &= extras["q_segment_ids"][:, :, None] >= 0
  with np.errstate(invalid="ignore", over="ignore"):
    return np.log(np.sum(np.where(seen, np.exp(np.where(seen, logits, 0)), 0), axis=-1))


@pytest.mark.parametrize("backend", ["xla", "reference"])
def test_each_backend_keeps_inf_logits_apart_from_rows_that_see_nothing(backend):
  q, k, v, extras = _inputs()
  x, facts = inputs.normalise(q, k, v, config=CONFIG.replace(platform=backend),
                              extras=Extras(**extras))
  got = kernel.run(backend, x, facts)
  lse = np.asarray(got.lse)[0, :, 0]  # [T]
  expected = _expected_lse(q, k, extras)[0]
  assert lse[0] != -np.inf  # +inf (or NaN): a real logit, not an empty row
  np.testing.assert_allclose(lse[1:3], expected[1:3], rtol=1e-6)
  assert lse[3] == -np.inf  # the empty row, and only it
  want, _ = oracle.attention(q, k, v, causal=False, q_seg=extras["q_segment_ids"],
                             kv_seg=extras["kv_segment_ids"])
  out = np.asarray(got.out)
  assert np.isnan(out[0, 0]).all() and np.isnan(want[0, 0]).all()
  np.testing.assert_allclose(out[0, 1:], want[0, 1:], rtol=1e-6, atol=1e-6)
  assert (out[0, 3] == 0).all()
