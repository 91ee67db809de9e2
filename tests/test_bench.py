"""The benchmark binary runs, measures every column, and writes its JSON and plot."""

import json
import os
import subprocess
import sys

import numpy as np

import splash_hk as sh
from splash_hk.examples import bench


def test_bench_writes_table_json_and_plot(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, "-m", "splash_hk.examples.bench", "--seq_lens=256", "--num_heads=4",
       "--masks=causal,window:64", "--num_kv_heads=2", "--repeats=1", "--max_interpret_len=256",
       f"--out={tmp_path}"], capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "speedup of splash_hk_xla over jax_nn: T=256 causal Hkv=2" in proc.stdout
  result = json.loads((tmp_path / "bench.json").read_text())
  assert result["matmul_peaks_gflops"]["square"] > 0
  rows = result["rows"]
  assert {r["impl"] for r in rows} == set(bench.IMPLS) and len(rows) == 2 * len(bench.IMPLS)
  for r in rows:
    assert r["forward_s"] > 0 and r["forward_backward_s"] > 0 and r["temp_mib"] > 0, r
    assert r["max_error"] < 1e-5, r
  assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_visible_pairs():
  assert bench.visible_pairs(4, sh.AttentionConfig()) == 10
  assert bench.visible_pairs(4, sh.AttentionConfig(causal=False)) == 16
  assert bench.visible_pairs(8, sh.AttentionConfig(sliding_window=(1, 0))) == 15
  assert bench.visible_pairs(8, sh.AttentionConfig(chunk_size=4)) == 20
  t = np.arange(64)
  mask = (t[:, None] >= t[None, :]) & (t[:, None] - t[None, :] <= 5)
  assert bench.visible_pairs(64, sh.AttentionConfig(sliding_window=(5, 0))) == mask.sum()
