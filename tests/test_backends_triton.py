"""The triton backend (ejkernel's GPU kernel) on CPU, up to the kernel call: limits, arguments.

The kernel itself runs only on a GPU (tests/test_gpu.py, `make gpu-check`).
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
from splash_hk import inputs
from splash_hk.backends.gpu import ejkernel as _ejkernel
from splash_hk.backends.gpu import backend as triton
from splash_hk.types import Extras


class _RecordingOp:
  """Stands in for ejkernel's BlockSparseAttention: records `run`'s arguments."""

  def __init__(self):
    self.calls = []

  def run(self, **kwargs):
    self.calls.append(kwargs)
    q = kwargs["query"]
    return jnp.ones((*q.shape[:3], kwargs["value"].shape[-1]), q.dtype)


def test_triton_gets_end_aligned_positions_disjoint_padding_and_explicit_config(monkeypatch):
  op = _RecordingOp()
  monkeypatch.setattr(_ejkernel, "blocksparse_op", lambda: op)
  config = sh.AttentionConfig(sliding_window=(32, 0), logits_soft_cap=20.0, platform="triton",
                              block_sizes=sh.BlockSizes(block_q=64, block_kv=32))
  b, t, s = 2, 48, 80
  q = np.ones((b, t, 4, 64), np.float32)
  kv = np.ones((b, s, 2, 64), np.float32)
  q_seg = np.zeros((b, t), np.int32)
  q_seg[0, -5:] = -1
  kv_seg = np.zeros((b, s), np.int32)
  kv_seg[1, :3] = -3
  sinks = np.arange(8, dtype=np.float32).reshape(4, 2)
  extras = Extras(q_segment_ids=q_seg, kv_segment_ids=kv_seg, softmax_aux=sinks)
  x, facts = inputs.normalise(q, kv, kv, config=config, extras=extras)
  out = triton.attend(x, facts).out  # the adapter itself (its BACKEND wraps it in the garbage guard)
  (call,) = op.calls
  np.testing.assert_array_equal(call["q_positions"], np.tile(np.arange(t) + s - t, (b, 1)))
  np.testing.assert_array_equal(call["kv_positions"], np.tile(np.arange(s), (b, 1)))
  assert set(np.unique(call["q_segment_ids"])) == {-1, 0}
  assert set(np.unique(call["kv_segment_ids"])) == {-2, 0}
  assert call["platform"] == "triton" and call["causal"] and call["sliding_window"] == (32, 0)
  assert call["logits_soft_cap"] == 20.0 and call["softmax_scale"] == 64 ** -0.5
  np.testing.assert_allclose(call["softmax_aux"], jax.nn.logsumexp(sinks, axis=-1), rtol=1e-6)
  cfg = call["cfg"]
  assert (cfg.platform, cfg.backend) == ("triton", "gpu")
  assert (cfg.fwd_params.q_blocksize, cfg.fwd_params.kv_blocksize) == (64, 32)
  assert (cfg.bwd_params.q_blocksize, cfg.bwd_params.kv_blocksize) == (64, 32)
  # Padding query rows are zeroed after the kernel.
  out = np.asarray(out)
  assert np.all(out[0, -5:] == 0) and np.all(out[0, :-5] == 1) and np.all(out[1] == 1)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(query_len=1), "decode"),
    (dict(head_dim=40), "multiples of 16"),
    (dict(value_dim=24), "multiples of 16"),
    (dict(mask=True), "Dense part"),
    (dict(chunk=64), "chunk_size"),
])
def test_triton_limits_fall_back_with_reason(kwargs, needle):
  t, d = kwargs.get("query_len", 128), kwargs.get("head_dim", 64)
  config = sh.AttentionConfig(chunk_size=kwargs.get("chunk"))
  d = sh.fallback.select_backend(
      config, query_shape=(1, t, 4, d), key_shape=(1, 256, 2, d),
      value_shape=(1, 256, 2, kwargs.get("value_dim", d)),
      mask_shape=(1, 1, t, 256) if kwargs.get("mask") else None, hardware="gpu")
  assert d.backend == "xla" and d.fallback and needle in d.reason


def test_triton_is_auto_on_gpu():
  d = sh.fallback.select_backend(sh.AttentionConfig(sliding_window=256), query_shape=(1, 512, 8, 64),
                                 key_shape=(1, 512, 2, 64), hardware="gpu")
  assert d.backend == "triton" and not d.fallback


def test_ejkernel_config_is_explicit():
  cfg = _ejkernel.blocksparse_config(sh.AttentionConfig(block_sizes=sh.BlockSizes(256, 128, 64, 32)),
                                     "xla")
  assert (cfg.fwd_params.q_blocksize, cfg.fwd_params.kv_blocksize) == (256, 128)
  assert (cfg.bwd_params.q_blocksize, cfg.bwd_params.kv_blocksize) == (64, 32)


def test_ejkernel_never_autotunes_nor_writes_its_cache_to_home(tmp_path):
  # ejkernel's own XLA op, called the way our backends call it (explicit config, forward and
  # backward), in a process where any autotuning raises.
  script = (
      "import numpy as np, jax\n"
      "from ejkernel.ops.config import selection\n"
      "from ejkernel.ops.execution import tuning\n"
      "def refuse(*args, **kwargs): raise AssertionError('ejkernel autotuned')\n"
      "selection.Tuner.autotune = tuning.Autotuner.autotune = refuse\n"
      "import splash_hk as sh\n"
      "from benchmarks import baselines\n"
      "q = np.random.default_rng(0).normal(size=(1, 300, 2, 64)).astype(np.float32)\n"
      "f = lambda q: baselines.ejkernel_xla(q, q, q, sh.AttentionConfig())\n"
      "jax.grad(lambda q: f(q).sum())(q)\n"
      "print('ran ejkernel')\n")
  env = dict(os.environ, HOME=str(tmp_path), TMPDIR=str(tmp_path / "tmp"))
  env.pop("EJKERNEL_PERSISTENT_CACHE_DIR", None)
  env.pop("EJKERNEL_AUTOTUNE_POLICY", None)
  (tmp_path / "tmp").mkdir()
  done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0 and "ran ejkernel" in done.stdout, done.stderr[-3000:]
  written = [p for p in tmp_path.rglob("*") if p.is_file()]
  assert not [p for p in written if "presistent" in str(p) and tmp_path / "tmp" not in p.parents]
