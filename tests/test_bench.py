"""The benchmark binary runs, measures every column, and writes its JSON and plot."""

import json
import os
import subprocess
import sys
import warnings

from splash_hk.examples import bench
from splash_hk.examples import paths


def test_bench_writes_table_json_and_plot(tmp_path):
  # As `bazel run //:bench -- --out=out` runs it: in another directory, with the
  # user's directory in BUILD_WORKING_DIRECTORY; a relative --out lands there.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["BUILD_WORKING_DIRECTORY"] = str(tmp_path)
  (tmp_path / "runfiles").mkdir()
  proc = subprocess.run(
      [sys.executable, "-m", "splash_hk.examples.bench", "--seq_lens=256", "--num_heads=4",
       "--masks=causal,window:64", "--num_kv_heads=2", "--repeats=1", "--max_interpret_len=256",
       "--out=out"], capture_output=True, text=True, env=env, timeout=300,
      cwd=tmp_path / "runfiles")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not list((tmp_path / "runfiles").iterdir())
  tmp_path = tmp_path / "out"
  assert "speedup of splash_hk_xla over jax_nn: T=256 causal Hkv=2" in proc.stdout
  result = json.loads((tmp_path / "bench.json").read_text())
  assert result["matmul_peaks_gflops"]["square"] > 0
  rows = result["rows"]
  assert {r["impl"] for r in rows} == set(bench.IMPLS) and len(rows) == 2 * len(bench.IMPLS)
  for r in rows:
    assert r["forward_s"] > 0 and r["forward_backward_s"] > 0 and r["temp_mib"] > 0, r
    assert r["max_error"] < 1e-5, r
  assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_user_paths_resolve_against_the_users_directory(monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv("BUILD_WORKING_DIRECTORY", raising=False)
  assert paths.user_path("out") == str(tmp_path / "out")
  monkeypatch.setenv("BUILD_WORKING_DIRECTORY", "/home/me/work")
  assert paths.user_path("out/x") == "/home/me/work/out/x"
  assert paths.user_path("/abs/out") == "/abs/out"
  monkeypatch.setenv("HOME", "/home/me")
  assert paths.user_path("~/ckpt") == "/home/me/ckpt"


def test_speedups_without_backward_timings_name_only_the_forward(capsys, tmp_path):
  rows = [bench.Row("splash_hk_xla", 256, "causal", 8, forward_s=0.5),
          bench.Row("jax_nn", 256, "causal", 8, forward_s=2.0)]
  bench._print_speedups(rows)  # pylint: disable=protected-access
  assert capsys.readouterr().out == (
      "speedup of splash_hk_xla over jax_nn: T=256 causal Hkv=8: forward 4.00x\n")
  rows[0].forward_backward_s, rows[1].forward_backward_s = 1.0, 3.0
  bench._print_speedups(rows)  # pylint: disable=protected-access
  assert capsys.readouterr().out.endswith("forward 4.00x, forward+backward 3.00x\n")
  forward_only = [bench.Row("splash_hk_xla", 256, "causal", 8, forward_s=0.5),
                  bench.Row("jax_nn", 256, "causal", 8, forward_s=2.0)]
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # e.g. an empty forward+backward panel's legend
    bench._plot(forward_only, tmp_path / "forward_only.png")  # pylint: disable=protected-access
  assert (tmp_path / "forward_only.png").stat().st_size > 5_000
