r"""Benchmarks attention implementations on this machine: time, memory, fraction of matmul peak.

  python -m benchmarks.bench --seq_lens=4096 --masks=causal --num_kv_heads=8,2 \
      --impls=splash_hk_xla,jax_nn --out=/tmp/bench
  python -m benchmarks.bench --cpu_devices=4 --impls=splash_hk_xla,splash_hk_xla_sp \
      --workloads=causal@4096,packed:8@4096,decode:1000/16384,decode:1000/1024
  python -m benchmarks.bench --impls=splash_hk_xla --tiles=256x256,128x128 \
      --workloads=full@4096,packed:8@4096 --nobackward
  python -m benchmarks.bench --cpu_devices=8 --workloads= --traffic_len=65536 --sequence_shards=8

For each (workload, kv heads, implementation): compile time, forward and
forward+backward time (median of --repeats, every timed call preceded by an
untimed call of the same executable, all implementations interleaved in one
process), peak temporary memory of the compiled program (XLA's memory
analysis), achieved GFLOP/s on useful FLOPs (visible query-key pairs only;
forward+backward as 3.5x forward) and its fraction of a 2048x2048 f32 matmul
measured in the same run, and the max error of the forward output on up to
ERROR_ROWS query rows against float64 NumPy attention (`baselines.float64_rows`,
not another implementation of ours); for splash_hk_xla rows (one per --tiles
tile too) the pairs its blocks compute per useful pair ("work": a tile's fraction is at most its
full-attention fraction / work). Workloads: `bench_workloads.py`. Prints a
table and the ratios docs/guide/performance.md quotes; writes bench.json and bench.png under
--out.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

import splash_hk as sh
from splash_hk import kernel
from splash_hk.backends.xla import backend as xla
from splash_hk.types import Facts
from benchmarks import baselines
from benchmarks import bench_report
from benchmarks import bench_train_step
from benchmarks import bench_workloads
from benchmarks import plan_cost
from benchmarks import timing
from benchmarks import traffic_table
from examples.train import paths

SEQUENCE_SHARDED = {"splash_hk_xla_sp": "all_gather", "splash_hk_ring": "ring",
                    "splash_hk_ulysses": "ulysses"}
IMPLS = ("splash_hk_xla", *SEQUENCE_SHARDED, "splash_hk_auto", "splash_interpret",
         "reference", "jax_nn", "jax_nn_auto", "ejkernel_xla")
DEFAULT_IMPLS = ("splash_hk_xla", "splash_interpret", "reference", "jax_nn", "ejkernel_xla")
DENSE = ("reference", "jax_nn", "jax_nn_auto", "ejkernel_xla")
ERROR_ROWS = 64  # query rows (evenly spaced) each output is checked on

_SEQ_LENS = flags.DEFINE_list("seq_lens", ["1024", "4096"], "Sequence lengths of --masks.")
_MASKS = flags.DEFINE_list("masks", ["causal", "window:512", "chunk:1024", "full"],
                           "causal, window:W, chunk:C, full, packed:N (run at each --seq_lens).")
_WORKLOADS = flags.DEFINE_list(
    "workloads", None, "Workloads instead of --masks x --seq_lens: MASK@T, decode:L/C (one token "
    "after L in a cache of C slots), prefill:N/C (N tokens into an empty cache of C slots).")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 8, "Query heads.")
_NUM_KV_HEADS = flags.DEFINE_list("num_kv_heads", ["8"], "Key/value heads (one run each).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dim.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Input dtype.")
_IMPLS = flags.DEFINE_list("impls", list(DEFAULT_IMPLS), f"Implementations, from {IMPLS}.")
_SEQUENCE_SHARDS = flags.DEFINE_integer(
    "sequence_shards", 4, "Devices splash_hk_xla_sp shards the query sequence over.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None, "Virtual CPU devices (for splash_hk_xla_sp).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per measurement (median).")
_BACKWARD = flags.DEFINE_bool("backward", True, "Also time forward+backward.")
_MAX_DENSE_LEN = flags.DEFINE_integer(
    "max_dense_len", 8192, "Dense implementations over more than this length squared (query x "
    "key) are compiled (for memory) but not run.")
_MAX_INTERPRET_LEN = flags.DEFINE_integer("max_interpret_len", 2048,
                                          "Longest sequence for splash in interpret mode.")
_TILES = flags.DEFINE_list(
    "tiles", [], "Also run splash_hk_xla with each of these tiles, BQxBK (query x key rows, "
    "forward and backward), e.g. 512x256,256x256: a tile sweep on this machine.")
_OUT = flags.DEFINE_string("out", None, "Folder for bench.json and bench.png.")
_TRAIN_SEQ_LEN = flags.DEFINE_integer(
    "train_seq_len", 0, "If > 0, also time a training step of the example Transformer on packed "
    "documents of this length, sh.MultiHeadAttention vs hk.MultiHeadAttention.")
_PLAN_WORKLOADS = flags.DEFINE_list(
    "plan_workloads", [], "Workloads (as --workloads) whose xla block plan is timed alone.")
_TRAFFIC_LEN = flags.DEFINE_integer(
    "traffic_len", 0, "If > 0, print per sequence strategy (all_gather, ring, ulysses) the bytes "
    "each of --sequence_shards devices sends per attention call of this length, and its peak "
    "memory, from the compiled program (needs --cpu_devices >= --sequence_shards on CPU).")
_TRAIN_DOCUMENTS = flags.DEFINE_integer("train_documents", 8, "Documents packed per row.")
_TRAIN_BATCH = flags.DEFINE_integer("train_batch", 2, "Rows of the training-step batch.")


@dataclasses.dataclass
class Row:
  impl: str
  workload: str
  num_kv_heads: int
  compile_s: float = float("nan")
  forward_s: float = float("nan")
  forward_backward_s: float = float("nan")
  temp_mib: float = float("nan")
  gflops_forward: float = float("nan")
  gflops_forward_backward: float = float("nan")
  max_error: float = float("nan")
  work: float = float("nan")  # (query, key) pairs the blocks compute / useful pairs (xla rows)
  note: str = ""


def make_impl(name: str, workload: bench_workloads.Workload, batch: int):
  """(q [B, T, Hq, D], k, v, *`bias_arguments`) -> [B, T, Hq, D] for one implementation and
  workload."""
  if bias_arguments(name, workload):  # a dense bias: an argument of the call, as a user's is
    plain = dataclasses.replace(workload, bias=None)
    if name.startswith("jax_nn"):
      kwargs = bench_workloads.jax_nn_kwargs(plain, batch)
      return lambda q, k, v, bias: baselines.jax_nn(
          q, k, v, implementation="xla" if name == "jax_nn" else None,
          nn_kwargs={**kwargs, "bias": bias})
    config, extras = workload.config.replace(platform="xla"), plain.extras(batch)
    return lambda q, k, v, bias: sh.attention(q, k, v, config=config, bias=sh.scores.Dense(bias),
                                              **extras).attention_outputs
  config, extras = workload.config, workload.extras(batch)
  attend = lambda q, k, v, config, **kw: sh.attention(q, k, v, config=config, **extras,
                                                       **kw).attention_outputs
  if name == "splash_hk_xla":
    return functools.partial(attend, config=config.replace(platform="xla"))
  if name.startswith("splash_hk_xla@"):
    block_q, block_kv = parse_tile(name.partition("@")[2])
    return functools.partial(attend, config=config.replace(
        platform="xla", block_sizes=sh.BlockSizes(block_q, block_kv)))
  if name in SEQUENCE_SHARDED:
    return _sequence_sharded(config.replace(platform="xla"), extras, SEQUENCE_SHARDED[name])
  if name == "splash_hk_auto":  # the hardware's kernel (Triton on a GPU), with its fallbacks
    return functools.partial(attend, config=config)
  if name == "splash_interpret":
    return functools.partial(attend, config=config.replace(platform="splash", interpret=True,
                                                           allow_fallback=False))
  if name == "reference":
    return lambda q, k, v: sh.fallback.reference_attention(q, k, v, config, **extras).attention_outputs
  if name == "ejkernel_xla":
    return functools.partial(baselines.ejkernel_xla, config=config, **extras)
  if name in ("jax_nn", "jax_nn_auto"):  # auto: XLA's choice (cuDNN on a GPU where it serves)
    return functools.partial(baselines.jax_nn, implementation="xla" if name == "jax_nn" else None,
                             nn_kwargs=bench_workloads.jax_nn_kwargs(workload, batch))
  raise ValueError(f"--impls: unknown implementation {name!r}; choose from {IMPLS}.")


def bias_arguments(name: str, workload: bench_workloads.Workload) -> tuple:
  """The dense bias [1, Hq, T, S] a call takes as an argument (jax.nn's for every bias; ours
  for a dense one), or ()."""
  dense = name.startswith("jax_nn") or (workload.bias == "dense" and name == "splash_hk_xla")
  if workload.bias is None or not dense:
    return ()
  return (jnp.asarray(workload.bias_rows(1, np.arange(workload.query_len))),)


def parse_tile(spec: str) -> tuple[int, int]:
  """(block_q, block_kv) from "BQxBK"; ValueError naming the spec."""
  try:
    block_q, block_kv = map(int, spec.split("x"))
    if block_q > 0 and block_kv > 0:
      return block_q, block_kv
  except ValueError:
    pass
  raise ValueError(f"--tiles: {spec!r} is not BQxBK with positive sizes, e.g. 512x256.")


def work_ratio(impl: str, workload: bench_workloads.Workload) -> float:
  """(query, key) pairs the xla blocks compute over the useful pairs (NaN for other impls).

  Counted by the xla backend itself (`Backend.count_pairs`), with the impl's tiles.
  """
  if impl != "splash_hk_xla" and not impl.startswith("splash_hk_xla@"):
    return float("nan")
  tile = impl.partition("@")[2]
  config = workload.config
  if tile:
    block_q, block_kv = parse_tile(tile)
    config = config.replace(block_sizes=sh.BlockSizes(block_q, block_kv))
  facts = Facts.from_shapes(config, (1, workload.query_len, 1, 1), (1, workload.kv_len, 1, 1))
  block_q, block_kv = (min(b, n) for b, n in zip(xla.tiles_for(facts)[:2],
                                                 (workload.query_len, workload.kv_len)))
  e = workload.extras(1)
  q_seg = e.get("q_segment_ids")
  pairs = kernel.backend("xla").count_pairs(facts, *workload.positions(1), q_seg,
                                             e.get("kv_segment_ids", q_seg), workload.mask(1))
  return pairs * block_q * block_kv / workload.useful_pairs


def _sequence_sharded(config: sh.AttentionConfig, extras: dict, strategy: str):
  """The query sequence over --sequence_shards devices: contiguous with all_gather and
  Ulysses, or a load-balanced ring (inputs put in load-balanced order and the output
  restored, included in its time: a model pays that once per batch, not per layer)."""
  n = _SEQUENCE_SHARDS.value
  mesh = jax.make_mesh((n,), ("sp",), devices=jax.devices()[:n])
  ring = strategy == "ring"
  axes = sh.MeshAxes(batch=None, heads=None, sequence="sp", sequence_strategy=strategy,
                     load_balanced=ring)
  order = (lambda a: sh.sharding.load_balance(a, n)) if ring else (lambda a: a)
  in_order = lambda v: (v.map_arrays(lambda side, a: order(a)) if isinstance(v, sh.masks.Mask)
                        else order(v))
  extras = {k: in_order(v) for k, v in extras.items()}
  attend = lambda q, k, v: sh.attention(order(q), order(k), order(v), config=config, mesh=mesh,
                                        axes=axes, **extras).attention_outputs
  return (lambda q, k, v: sh.sharding.restore_order(attend(q, k, v), n)) if ring else attend


def matmul_peaks(dtype) -> dict[str, float]:
  """GFLOP/s of a square matmul and of a QK^T-shaped one (inner dim 64), measured now."""
  rng = np.random.default_rng(0)
  out = {}
  for name, (m, k, n) in {"square": (2048, 2048, 2048), "qk_shaped": (4096, 64, 4096)}.items():
    a = jnp.asarray(rng.normal(size=(m, k)), dtype)
    b = jnp.asarray(rng.normal(size=(k, n)), dtype)
    seconds = timing.median_seconds(jax.jit(jnp.matmul), a, b, repeats=5)
    out[name] = 2 * m * k * n / seconds / 1e9
  return out


def _workloads() -> list[bench_workloads.Workload]:
  specs = _WORKLOADS.value
  if specs is None:  # `--workloads=` (empty) runs none, e.g. with --train_seq_len only
    specs = [f"{m}@{t}" for t in _SEQ_LENS.value for m in _MASKS.value]
  return [dataclasses.replace(bench_workloads.parse(s), num_heads=_NUM_HEADS.value) for s in specs]


def main(argv):
  del argv
  if _CPU_DEVICES.value:  # before any backend starts (importing jax starts none)
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  dtype = jnp.dtype(_DTYPE.value)
  for impl in _IMPLS.value:
    if impl not in IMPLS:
      sys.exit(f"error: --impls: unknown implementation {impl!r}; choose from {IMPLS}.")
  try:
    workloads = _workloads()
  except ValueError as e:
    sys.exit(f"error: --workloads/--masks: {e}")
  try:
    impls = list(_IMPLS.value) + [f"splash_hk_xla@{'x'.join(map(str, parse_tile(t)))}"
                                  for t in _TILES.value]
  except ValueError as e:
    sys.exit(f"error: {e}")
  sharded = [i for i in _IMPLS.value if i in SEQUENCE_SHARDED]
  if _TRAFFIC_LEN.value:
    sharded.append("--traffic_len")
  if sharded and jax.device_count() < _SEQUENCE_SHARDS.value:
    sys.exit(f"error: {sharded[0]} needs --sequence_shards={_SEQUENCE_SHARDS.value} devices; "
             f"there are {jax.device_count()} (set --cpu_devices).")
  peaks = matmul_peaks(dtype)
  rows, runs = [], []
  for workload in workloads:
    for num_kv_heads in map(int, _NUM_KV_HEADS.value):
      rng = np.random.default_rng(workload.query_len)
      shape = lambda t, h: (_BATCH.value, t, h, _HEAD_DIM.value)
      q = jnp.asarray(rng.normal(size=shape(workload.query_len, _NUM_HEADS.value)), dtype)
      k, v = (jnp.asarray(rng.normal(size=shape(workload.kv_len, num_kv_heads)), dtype)
              for _ in range(2))
      flops = 4 * _BATCH.value * _NUM_HEADS.value * _HEAD_DIM.value * workload.useful_pairs
      for impl in impls:
        row = Row(impl, workload.name, num_kv_heads, work=work_ratio(impl, workload))
        rows.append(row)
        args = (q, k, v, *bias_arguments(impl, workload))
        runs.append((row, make_impl(impl, workload, _BATCH.value), args, flops, workload))
  _measure(runs)
  bench_report.report(rows, peaks)
  plans = plan_cost.report(_PLAN_WORKLOADS.value, _REPEATS.value)
  traffic = {}
  if _TRAFFIC_LEN.value:
    traffic = traffic_table.report(_TRAFFIC_LEN.value, _SEQUENCE_SHARDS.value, _BATCH.value,
                                   _NUM_HEADS.value, _HEAD_DIM.value, dtype)
  if _TRAIN_SEQ_LEN.value:
    bench_train_step.report(_TRAIN_SEQ_LEN.value, _TRAIN_DOCUMENTS.value, _TRAIN_BATCH.value,
                            _REPEATS.value)
  if _OUT.value:
    out = paths.user_path(_OUT.value)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.json"), "w") as f:
      json.dump({"matmul_peaks_gflops": peaks, "flags": {
          "num_heads": _NUM_HEADS.value, "head_dim": _HEAD_DIM.value, "batch": _BATCH.value,
          "dtype": _DTYPE.value, "repeats": _REPEATS.value},
                 "rows": [dataclasses.asdict(r) for r in rows], "plan_seconds": plans,
                 "traffic_mib": traffic},
                f, indent=1)
    bench_report.plot(rows, os.path.join(out, "bench.png"))


def _compile(row: Row, fn, args, workload: bench_workloads.Workload):
  """(forward, forward+backward or None) executables, or None with row.note saying why."""
  forward = jax.jit(fn)
  backward = jax.jit(jax.grad(lambda q, k, v, *rest: jnp.sum(fn(q, k, v, *rest).astype(
      jnp.float32)), argnums=(0, 1, 2)))
  try:
    start = time.perf_counter()
    forward_exe = forward.lower(*args).compile()
    row.compile_s = time.perf_counter() - start
    backward_exe = backward.lower(*args).compile() if _BACKWARD.value else None
  except Exception as e:  # pylint: disable=broad-except
    row.note = f"cannot run: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    return None
  row.temp_mib = (backward_exe or forward_exe).memory_analysis().temp_size_in_bytes / 2**20
  area = workload.query_len * workload.kv_len
  if ((row.impl in DENSE and area > _MAX_DENSE_LEN.value**2)
      or (row.impl == "splash_interpret" and area > _MAX_INTERPRET_LEN.value**2)):
    row.note = "compiled only (too long to run)"
    return None
  return forward_exe, backward_exe


def _measure(runs) -> None:
  """Fills each row's times, GFLOP/s and error; all executables timed interleaved."""
  compiled = []
  for row, fn, args, flops, workload in tqdm.tqdm(runs, desc="compile",
                                                   disable=not sys.stderr.isatty()):
    exes = _compile(row, fn, args, workload)
    if exes is not None:
      compiled.append((row, *exes, args, flops, workload))
  times = {id(row): ([], []) for row, *_ in compiled}
  outputs = {}
  for repeat in tqdm.trange(_REPEATS.value + 1, desc="time", disable=not sys.stderr.isatty()):
    for row, forward_exe, backward_exe, args, *_ in compiled:  # interleaved
      for exe, bucket in ((forward_exe, times[id(row)][0]), (backward_exe, times[id(row)][1])):
        if exe is None:
          continue
        seconds, result = timing.timed_call(exe, *args)
        if repeat:
          bucket.append(seconds)
        elif exe is forward_exe:
          outputs[id(row)] = np.asarray(result, np.float32)
  for row, _, _, _, flops, _ in compiled:
    forward_times, backward_times = times[id(row)]
    row.forward_s = float(np.median(forward_times))
    row.gflops_forward = flops / row.forward_s / 1e9
    if backward_times:
      row.forward_backward_s = float(np.median(backward_times))
      row.gflops_forward_backward = 3.5 * flops / row.forward_backward_s / 1e9
  _max_errors(compiled, outputs)


def _max_errors(compiled, outputs) -> None:
  """Each row's max error on up to ERROR_ROWS query rows against float64 NumPy attention."""
  expected = {}
  for row, _, _, (q, k, v, *_), _, workload in compiled:
    rows = np.unique(np.linspace(0, workload.query_len - 1, ERROR_ROWS).astype(int))
    key = (row.workload, row.num_kv_heads)
    if key not in expected:
      config = workload.config
      expected[key] = baselines.float64_rows(
          np.asarray(q)[:, rows], k, v, workload.mask_rows(q.shape[0], rows),
          scale=config.softmax_scale or q.shape[-1] ** -0.5, soft_cap=config.logits_soft_cap,
          bias=workload.bias_rows(q.shape[0], rows))
    row.max_error = float(np.max(np.abs(outputs[id(row)][:, rows] - expected[key])))


if __name__ == "__main__":
  app.run(main)
