"""The package beside a user's JAX: no writes under $HOME, ejkernel only where it is needed."""

import os
import subprocess
import sys

import jax
import pytest

import splash_hk as sh
from splash_hk.backends.gpu import ejkernel as _ejkernel
import processes


def test_import_and_a_cpu_call_write_nothing_under_home(tmp_path):
  home = tmp_path / "home"
  home.mkdir()
  script = ("import sys, numpy as np, jax, splash_hk as sh\n"
            "q = np.ones((1, 64, 2, 16), np.float32)\n"
            "f = lambda q: sh.attention(q, q, q, config=sh.AttentionConfig(sliding_window=8))"
            ".attention_outputs.sum()\n"
            "jax.grad(f)(q)\n"
            "assert 'ejkernel' not in sys.modules, 'ejkernel was imported on the CPU path'\n")
  env = processes.env(drop=("EJKERNEL_PERSISTENT_CACHE_DIR",))
  env["HOME"] = str(home)
  subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
  assert [str(p.relative_to(home)) for p in home.rglob("*")] == []


def test_without_ejkernel_triton_falls_back_naming_the_extra(monkeypatch):
  monkeypatch.setattr(_ejkernel, "available", lambda: False)
  q = jax.ShapeDtypeStruct((1, 256, 4, 64), jax.numpy.float32)
  d = sh.fallback.select_backend(sh.AttentionConfig(), query_shape=q.shape, key_shape=q.shape,
                                 hardware="gpu")
  assert d.backend == "xla" and d.fallback and "pip install 'splash_hk[gpu]'" in d.reason
  with pytest.raises(ValueError, match=r"splash_hk\[gpu\]"):
    sh.fallback.select_backend(sh.AttentionConfig(platform="triton", allow_fallback=False),
                               query_shape=q.shape, key_shape=q.shape, hardware="gpu")
  _ejkernel._modules.cache_clear()  # pylint: disable=protected-access
  with pytest.raises(ImportError, match=r"splash_hk\[gpu\]"):
    _ejkernel.blocksparse_op()
  _ejkernel._modules.cache_clear()  # pylint: disable=protected-access


def test_setup_declares_ranges_not_pins():
  setup = open(os.path.join(os.path.dirname(__file__), "..", "setup.py")).read()
  requirements = setup[setup.index("install_requires"):setup.index("extras_require")]
  assert "==" not in requirements and "ejkernel" not in requirements
  assert '"gpu": ["ejkernel>=0.0.80.3"]' in setup and '"py.typed"' in setup
