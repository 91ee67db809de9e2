"""The benchmark binary runs, measures every column, and writes its JSON and plot."""

import itertools
import json
import math
import pathlib
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import bench
from benchmarks import bench_layout
from benchmarks import bench_native
from benchmarks import bench_paged
from benchmarks import bench_blocks
from benchmarks import bench_quant
from benchmarks import bench_tpu
from benchmarks import bench_tpu_decode
from benchmarks import timing
from benchmarks import tpu_programs
from benchmarks import bench_report
from benchmarks import bench_workloads
from benchmarks import guards
from examples.train import paths
import harness
import oracle
import processes
from splash_hk import platforms


def test_bench_writes_table_json_and_plot(tmp_path):
  # As `bazel run //benchmarks:bench -- --out=out` runs it: in another directory (the
  # checkout on the path, as Bazel puts the runfiles root), with the user's directory
  # in BUILD_WORKING_DIRECTORY; a relative --out lands there.
  env = processes.env()
  env["BUILD_WORKING_DIRECTORY"] = str(tmp_path)
  env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parent.parent)
  (tmp_path / "runfiles").mkdir()
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.bench", "--seq_lens=256", "--num_heads=4",
       "--masks=window:64", "--num_kv_heads=2", "--repeats=1", "--max_interpret_len=256",
       "--out=out"], capture_output=True, text=True, env=env, timeout=300,
      cwd=tmp_path / "runfiles")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not list((tmp_path / "runfiles").iterdir())
  tmp_path = tmp_path / "out"
  assert "speedup of splash_hk_xla over jax_nn: window:64@256 Hkv=2" in proc.stdout
  result = json.loads((tmp_path / "bench.json").read_text())
  assert result["matmul_peaks_gflops"]["square"] > 0
  rows = result["rows"]
  assert {r["impl"] for r in rows} == set(bench.DEFAULT_IMPLS)
  assert len(rows) == len(bench.DEFAULT_IMPLS)
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


def test_cache_and_shard_workloads_print_their_ratios(tmp_path):
  env = processes.env()
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.bench", "--cpu_devices=2", "--sequence_shards=2",
       "--impls=splash_hk_xla,splash_hk_xla_sp,splash_hk_ulysses", "--num_heads=2",
       "--num_kv_heads=1", "--workloads=packed:2@128,decode:40/256,decode:40/64",
       "--repeats=1", "--nobackward", "--tiles=32x16", "--traffic_len=1024"],
      capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "decode 40 tokens, cache of 256 vs 64 slots (splash_hk_xla, Hkv=1):" in out
  assert "packed:2@128 Hkv=1 with the query sequence sharded (all-gathered) vs unsharded" in out
  assert "packed:2@128 Hkv=1 with the query sequence sharded (Ulysses: heads sharded)" in out
  # MiB each device sends per forward, measured then analytic, at T=1024, sp=2, H=2, D=64 (at
  # n = 2 all three send one K/V-sized array: 4 (n-1) / n^2 == 2 (n-1) / n); Ulysses holds least.
  table = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in out.splitlines()
           if line.split()[:1] in (["all_gather"], ["ring"], ["ulysses"])}
  assert all(table[s][:2] == [0.5, 0.5] for s in ("all_gather", "ring", "ulysses")), out
  assert table["ulysses"][3] < table["all_gather"][3], out
  rows = [line.split() for line in out.splitlines() if line.startswith("splash_hk_xla")]
  errors = [float(r[-2]) for r in rows if r[-2] != "nan"]  # max err, then work
  assert errors and max(errors) < 1e-5, out
  swept = [r for r in rows if r[0] == "splash_hk_xla@32x16"]
  assert len(swept) == 3 and all(float(r[-2]) < 1e-5 for r in swept), out


def test_tile_rows_count_the_pairs_their_blocks_compute():
  work = lambda impl, spec: bench.work_ratio(impl, bench_workloads.parse(spec))
  # 8 documents of 512: each 512-row block meets 2 key blocks of 256; 128-tiles: 1+2+3+4 blocks.
  assert work("splash_hk_xla@512x256", "packed:8@4096") == pytest.approx(2 * 512 * 256 / 131328)
  assert work("splash_hk_xla@128x128", "packed:8@4096") == pytest.approx(10 * 128**2 / 131328)
  assert work("splash_hk_xla@32x16", "causal@64") == pytest.approx(6 * 32 * 16 / 2080)
  assert work("splash_hk_xla@32x16", "full@64") == 1.0
  assert work("splash_hk_xla", "decode:40/256") == pytest.approx(256 / 41)  # one key block
  assert math.isnan(work("jax_nn", "causal@64"))
  with pytest.raises(ValueError, match="BQxBK"):
    bench.parse_tile("512by256")


def test_workloads_count_their_visible_pairs():
  for spec in ("causal@64", "window:5@64", "chunk:16@64", "full@64", "packed:4@64",
               "decode:20/64", "prefill:12/64"):
    w = bench_workloads.parse(spec)
    visible = w.dense_mask(2)  # [B, 1, T, S], from positions and segment ids
    assert visible.shape == (2, 1, w.query_len, w.kv_len)
    assert visible[0].sum() == w.useful_pairs, spec
  with pytest.raises(ValueError, match="unknown workload"):
    bench_workloads.parse("packed:3@64")  # 64 tokens do not split into 3 documents


def test_ratios_without_backward_timings_name_only_the_forward(tmp_path):
  rows = [bench.Row("splash_hk_xla", "causal@256", 8, forward_s=0.5),
          bench.Row("jax_nn", "causal@256", 8, forward_s=2.0)]
  assert bench_report.ratios(rows) == [
      "speedup of splash_hk_xla over jax_nn: causal@256 Hkv=8: forward 4.00x"]
  rows[0].forward_backward_s, rows[1].forward_backward_s = 1.0, 3.0
  assert bench_report.ratios(rows)[0].endswith("forward 4.00x, forward+backward 3.00x")
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # e.g. an empty forward+backward panel's legend
    bench_report.plot(rows[:1], tmp_path / "forward_only.png")
  assert (tmp_path / "forward_only.png").stat().st_size > 5_000


RULES = [dict(causal=c, window=w, chunk_size=k) for c, w, k in itertools.product(
    [True, False], [None, (0, 0), (3, 1), (2, 9)], [None, 1, 4])]


@pytest.mark.parametrize("rules", RULES, ids=str)
@pytest.mark.parametrize("query_len,kv_len", [(9, 9), (3, 12), (1, 5)])
def test_visible_interval_is_exactly_the_visible_keys(rules, query_len, kv_len):
  q_pos = np.arange(query_len) + kv_len - query_len
  lo, hi = bench_workloads.visible_interval(q_pos, kv_len, **rules)
  want = oracle.visible(1, query_len, kv_len, 1, causal=rules["causal"], window=rules["window"],
                        chunk=rules["chunk_size"])[0, 0]
  keys = np.arange(kv_len)
  got = (keys[None, :] >= lo[:, None]) & (keys[None, :] <= hi[:, None])
  np.testing.assert_array_equal(got, want)
  assert bench_workloads.visible_pairs(query_len, kv_len, **rules) == want.sum()


def test_paged_bench_prints_its_ratios_and_bytes(capsys):
  figures = bench_paged.report(repeats=1, max_len=256, head_dims=(64,), prompts=(256,),
                               quest_len=512)
  out = capsys.readouterr().out
  assert "one prompt of 256 tokens in one step, paged / attention" in out
  assert "pages_per_seq for 2048 / for 256 tokens" in out and "KVCache(max_len=256)" in out
  assert "1/16 of the pages chosen" in out and "not donated / donated" in out
  names = ("prefill_256_paged_over_attention", "chunk_paged_over_kv_cache", "mixed_over_apart",
           "decode_paged_over_kv_cache", "decode_read_fraction", "decode_wide_over_narrow",
           "decode_undonated_over_donated", "quest_every_page_over_chosen")
  assert all(figures[f"{k}_d64"] > 0 for k in names), figures
  # 16 sequences of 64..255 tokens (+1 new each) in pages of 16, against 16 rows of 256 slots.
  used = sum(-(-(n + 1) // 16) for n in np.linspace(64, 255, 16).astype(int)) * 16
  assert figures["paged_mib_d64"] == pytest.approx(used * 2 * 64 * 4 * 2 / 2**20)
  assert figures["kv_cache_mib_d64"] == pytest.approx(16 * 256 * 2 * 64 * 4 * 2 / 2**20)


def test_layout_bench_times_the_same_attention_in_both_layouts(capsys):
  figures = bench_layout.report(repeats=1, max_len=128, head_dims=(64,))
  assert "pool token-major / head-major" in capsys.readouterr().out
  assert set(figures) == {"pool_token_over_head_major_d64", "kv_cache_head_over_token_major_d64"}
  assert all(v > 0 for v in figures.values()), figures
  rng = np.random.default_rng(0)
  pages, seqs, num_pages = bench_layout._items(np.array([40, 200]), rng)
  q = rng.normal(size=(2, 2, 4, 8)).astype(np.float32)
  kv = rng.normal(size=(2, num_pages, 16, 2, 8)).astype(np.float32)  # token-major
  pages, seqs, q = jnp.asarray(pages, jnp.int32), jnp.asarray(seqs, jnp.int32), jnp.asarray(q)
  token = bench_layout.pool_decode(False, pages, seqs, q, *jnp.asarray(kv))
  head = bench_layout.pool_decode(True, pages, seqs, q, *jnp.swapaxes(kv, 2, 3))
  np.testing.assert_allclose(head, token, rtol=1e-5, atol=1e-5)


@harness.needs_native
def test_native_bench_prints_its_figures_per_thread_count(capsys):
  figures = bench_native.report(max_len=256, repeats=1, threads=(1,))
  names = ("read_fraction", "xla_over_native", "f32_over_int8", "module_read_fraction",
           "module_xla_over_native", "module_fixed_ms", "module_cache_fraction")
  assert set(figures) == {"bandwidth_gbs", "one_core_bandwidth_gbs", "read_fraction_one_core_t1",
                          *(f"{n}_t1" for n in names)}
  assert all(v > 0 for v in figures.values()), figures
  assert "1 thread(s): f32 pool" in capsys.readouterr().out


def test_quant_bench_prints_its_figures(capsys):
  figures = bench_quant.report(max_len=512, dims=[64], repeats=1)
  names = ("pool_tokens_int8_over_f32", "paged_decode_int8_over_f32", "fixed_decode_int8_over_f32",
           "paged_prefill_int8_over_f32", "int8_decode_temp_over_dequantized_pool")
  assert set(figures) == {f"{n}_d64" for n in names}
  assert all(v > 0 for v in figures.values()), figures
  assert figures["pool_tokens_int8_over_f32_d64"] == 256 / 68  # bytes: (4 * 64) / (64 + 4)
  assert "fixed_decode_int8_over_f32_d64" in capsys.readouterr().out


def test_blocks_bench_prints_its_ratios_and_memory(capsys):
  ratios = bench_blocks.attention_rows(1, rows=((512, 1, False), (512, 1, True)))
  assert set(ratios) == {"T=512 own+1 forward", "T=512 own+1 forward+backward"}
  assert all(r > 0 for r in ratios.values())
  assert bench_blocks.memory_row(length=16384) < 16384 * 16384 * 4 / 2**30 / 4  # a dense mask / 4
  assert bench_blocks.train_row(1, length=512) > 0
  out = capsys.readouterr().out
  assert "causal / chosen" in out and "GiB of temporaries" in out and "causal / MoBA" in out


def test_tpu_bench_rows_compare_each_peer_in_interpret_mode():
  """The TPU bench's wiring on CPU (`--smoke`: tiny rows, interpret mode): each peer's figures or
  why it is skipped (tokamax's mosaic attention runs on a TPU only), ratios over ours."""
  row = bench_tpu.SMOKE_ROWS["window_16k"]
  result = bench_tpu.run_row("window_16k", row, ["jax_splash", "tokamax_mosaic", "xla"], 1,
                             peak=1e12, interpret=True, variants=["none"],
                             with_programs=True)
  assert result["splash_hk"]["ms"][0] > 0 and len(result["jax_splash"]["ours_over"]) == 2
  assert 0 < result["layout_share_of_forward"] < 1  # four transposes against a whole call
  assert result["jax_splash"]["tiles"] == ["128/128/128"] * 2
  assert "skipped" in result["tokamax_mosaic"] and result["xla"]["ours_over"][1] > 0
  assert row.visible_pairs() == sum(min(i, bench_tpu.WINDOW) + 1 for i in range(256))
  assert "window_16k |" in bench_tpu.report([result], 1e12)
  assert "layout changes alone" in bench_tpu.report([result], 1e12)
  # The guard variants, timed and registered for the timing only ("none": the kernels alone).
  assert set(result["guards"]) == {"none"} and "guard none:" in bench_tpu.report(
      [result], 1e12)
  assert all(share < 1 for g in result["guards"].values() for share in g["share_of_ours"])
  assert not [n for n in platforms.names() if n.startswith("splash_guard_")]
  # Different programs (the guard's check and branch in ours), the texts XLA's own.
  counts, texts = result["programs"], result["program_text"]
  assert set(counts) == {f"{v} {p}" for v in ("ours", "none") for p in ("fwd", "f+b")}
  assert counts["ours fwd"] != counts["none fwd"] and counts["ours fwd"]["fusion"] > 0
  assert all("HloModule" in text for text in texts.values())
  assert "program ours fwd: copy " in bench_tpu.report([result], 1e12)
  checks = lambda platform: str(jax.make_jaxpr(bench_tpu.splash_hk_call(row, True, platform))(
      *bench_tpu.inputs(row)[:3], None)).count("is_finite")
  with guards.registered("none") as name:  # the same kernel, its output left unchecked
    assert checks(name) == 0 < checks("splash")


def test_tpu_decode_bench_times_the_paged_kernel_and_hands_the_peer_the_same_step():
  """The decode bench's wiring on CPU (interpret mode, a tiny row of 4 rows a sequence): ours
  runs the paged kernel on a donated pool; the peer's inputs (its interleaved layout, the new
  tokens written in) through JAX's own reference give our output (its kernel runs on a TPU
  only)."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
  row = bench_tpu_decode.SMOKE_ROWS["verify4_p64"]
  rate = timing.Bandwidth(back_to_back=1e10, launch=1e10, device=None)
  result = bench_tpu_decode.run_row("verify4_p64", row, 1, bandwidth=rate, interpret=True,
                                    peers=False, probes=("glue",), profile=True)
  assert result["decision"].startswith("splash") and result["ms"] > 0
  assert result["launch_ms"] > 0 and result["device_ms"] is None, result  # a CPU: no chip time
  assert result["dispatch_ms"] > 0, result  # the host's launches, timed apart
  assert result["probes_ms"]["glue"] > 0 and result["ops_us"] == {}, result
  step = bench_tpu_decode.make_step(row)
  assert step.bytes_read == int(step.lens.sum()) * 2 * 128 * 2 * 2
  _, ours = bench_tpu_decode.ours_seconds(step, 1, True)
  theirs = rpa.ref_ragged_paged_attention(*bench_tpu_decode.peer_inputs(step),
                                          sm_scale=128 ** -0.5)
  np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32),
                             atol=2e-2, rtol=2e-2)
  assert "verify4_p64 (mean length" in bench_tpu_decode.report([result], rate)
  fixed = bench_tpu_decode.run_fixed_row("fixed_t4", bench_tpu_decode.SMOKE_FIXED["fixed_t4"], 1,
                                         bandwidth=rate, interpret=True)
  assert fixed["peers"]["jax_nn_xla"]["max_difference"] < 5e-3  # the same rule as the peer's
  assert "jax_nn_xla: " in bench_tpu_decode.report([fixed], rate)


def _smoke_decode_row(name):
  rate = timing.Bandwidth(back_to_back=1e10, launch=1e10, device=None)
  return bench_tpu_decode.run_row(name, bench_tpu_decode.SMOKE_ROWS[name], 1, bandwidth=rate,
                                  interpret=True, peers=False), rate


def test_tpu_decode_bench_holds_a_mixed_step_and_a_prefill_against_their_own():
  """A mixed step against its parts apart, a prefill against `attention`; a mixed step's peer
  inputs give our output through JAX's reference (interpret mode, tiny rows)."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
  (mixed, _), (prefill, _) = _smoke_decode_row("mixed_p64"), _smoke_decode_row("prefill2k_p64")
  assert len(mixed["parts_ms"]) == 2 and mixed["over_parts"] > 0, mixed
  assert prefill["attention_ms"] > 0 and prefill["over_attention"] > 0, prefill
  step = bench_tpu_decode.make_step(bench_tpu_decode.SMOKE_ROWS["mixed_p64"])
  assert list(np.diff(np.asarray(step.batch.cu_q_lens))) == [48, 48, 1]
  _, ours = bench_tpu_decode.ours_seconds(step, 1, True)
  theirs = rpa.ref_ragged_paged_attention(*bench_tpu_decode.peer_inputs(step),
                                          sm_scale=128 ** -0.5)
  np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32),
                             atol=2e-2, rtol=2e-2)


def test_tpu_decode_bench_holds_int8_and_quest_steps_against_their_own():
  """An int8 pool against the bf16 step (its bytes: codes and per-token scales), Quest's choice
  against every page, pages handed out in order (interpret mode, tiny rows)."""
  (int8, rate), (bf16, _) = _smoke_decode_row("int8_p64"), _smoke_decode_row("decode_p64")
  assert int8["decision"].startswith("splash"), int8  # the TPU kernel reads the codes
  # a token's k and v over 2 kv heads: int8 codes of 128 and a float32 scale, or 128 bf16
  assert int8["bytes_read"] * (2 * 2 * 128 * 2) == bf16["bytes_read"] * (2 * 2 * (128 + 4))
  assert "over the bf16 step: " in bench_tpu_decode.report([bf16, int8], rate)
  quest, _ = _smoke_decode_row("quest16_p64")  # Quest's choice in the step, against every page
  assert quest["decision"].startswith("splash") and quest["every_page_over"] > 0, quest
  rows = bench_tpu_decode.SMOKE_ROWS
  step = bench_tpu_decode.make_step(rows["quest16_p64"])
  assert step.tokens_read < int(step.lens.sum()) and step.top_k == 1
  assert "every page over it: " in bench_tpu_decode.report([quest], rate)
  ordered = bench_tpu_decode.make_step(rows["in_order_p64"])  # each sequence's pages in a run
  table, need = np.asarray(ordered.batch.page_table), -(-ordered.lens // 64)
  assert all((np.diff(table[s, :n]) == 1).all() for s, n in enumerate(need))


def test_tpu_blocks_bench_holds_the_choice_against_causal_and_names_what_it_does_not_serve():
  """The chosen-blocks bench in interpret mode (tiny rows): own + 1 of 128 on the block-list
  kernel against causal attention (the work saved counted from the choice), and per-token
  choices (query blocks of 1 row) skipped with the kernel's reason."""
  from benchmarks import bench_tpu_blocks
  rows = bench_tpu_blocks.SMOKE_ROWS
  own = bench_tpu_blocks.run_row("own8_128_16k", rows["own8_128_16k"], 1, 1e12, True,
                                 with_profile=True)
  assert own["decision"].startswith("splash") and "block-list" in own["decision"], own
  assert own["ops_us"] == {"forward": {}, "forward+backward": {}}, own  # a CPU: no chip ops
  assert all(x > 0 for x in own["causal_over_chosen"] + own["chosen_ms"]), own
  # 3 query tiles of 128 over 3 key blocks: own + 1 holds 1, 2, 2 blocks of the 6 causal
  # reads (in keys: 384 * 385 / 2 per head against 5 * 128 * 128)
  assert own["work_saved"] == round(384 * 385 / 2 / (5 * 128 * 128), 2), own
  token = bench_tpu_blocks.run_row("nsa_token_16k", rows["nsa_token_16k"], 1, 1e12, True)
  assert "skipped" in token and "bq a multiple of 8" in token["skipped"], token
  text = bench_tpu_blocks.report([own, token], 1e12)
  assert "own8_128_16k | " in text and "nsa_token_16k | skipped" in text


HLO = """HloModule jit_step

%fused_computation (param_0: s8[4,8,64,128]) -> s8[4,8,64,128] {
  %param_0 = s8[4,8,64,128]{3,2,1,0:T(32,128)(4,1)} parameter(0)
  ROOT %copy.9 = s8[4,8,64,128]{3,1,2,0:T(8,128)(4,1)} copy(%param_0), backend_config={"estimated_cycles":"7"}
}

ENTRY %main.1 (pool.1: s8[4,8,64,128]) -> s8[4,8,64,128] {
  %pool.1 = s8[4,8,64,128]{3,2,1,0:T(32,128)(4,1)} parameter(0)
  %copy.3 = s8[4,8,64,128]{3,1,2,0:T(8,128)(4,1)} copy(%pool.1), backend_config={"window_config":{},"estimated_cycles":"2217"}
  %scatter_fusion = s8[4,8,64,128]{3,1,2,0:T(8,128)(4,1)} fusion(%copy.3), kind=kCustom, calls=%fused_computation
  %call.1 = (bf16[32,8,16,128]{3,2,1,0:T(8,128)(2,1)}, f32[8]{0}) custom-call(%scatter_fusion), custom_call_target="tpu_custom_call", backend_config={"estimated_cycles":"50"}
  ROOT %copy.4 = s8[4,8,64,128]{3,2,1,0:T(32,128)(4,1)} copy(%scatter_fusion), backend_config={"estimated_cycles":"2300"}
}
"""


def test_the_tpu_programs_summary_counts_the_entrys_kernels_and_copies_and_ranks_by_cycles():
  ops = list(tpu_programs.operations(HLO))
  assert [(kind, name) for kind, name, _, _ in ops] == [
      ("copy", "copy.3"), ("fusion", "scatter_fusion"), ("custom-call:tpu_custom_call", "call.1"),
      ("copy", "copy.4")]  # the entry's only: the fusion's own copy is not one
  assert ops[2][2] == "(bf16[32,8,16,128]" and ops[1][3] == 0
  lines = tpu_programs.summary(HLO, top=2)
  assert lines[0] == "  1 Mosaic kernels, 2 copies (4517 estimated cycles)"
  assert "copy.4" in lines[1] and "copy.3" in lines[2] and len(lines) == 3
