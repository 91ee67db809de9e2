r"""Benchmarks attention implementations on this machine: time, memory, GFLOP/s, error.

  python -m splash_hk.examples.bench --seq_lens=4096 --masks=causal --num_kv_heads=8,2 \
      --impls=splash_hk_xla,jax_nn --out=/tmp/bench

For each (sequence length, mask, kv heads, implementation): compile time, forward
and forward+backward time (median of --repeats after a warm-up, all
implementations interleaved in one process), peak temporary memory of the
compiled forward+backward (XLA's memory analysis), achieved GFLOP/s on useful
FLOPs (visible query-key pairs only) and its fraction of matmul peaks measured
in the same run, and the max error of the forward output against the reference.
Prints a table, writes bench.json and bench.png under --out.
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

import splash_hk as sh
from splash_hk import masks
from splash_hk.examples import baselines
from splash_hk.examples import paths

IMPLS = ("splash_hk_xla", "splash_interpret", "reference", "jax_nn", "ejkernel_xla")
DENSE = ("reference", "jax_nn", "ejkernel_xla")

_SEQ_LENS = flags.DEFINE_list("seq_lens", ["1024", "4096"], "Sequence lengths (T == S).")
_MASKS = flags.DEFINE_list("masks", ["causal", "window:512", "chunk:1024", "full"],
                           "causal, window:W (causal, W keys back), chunk:C (causal chunks), full.")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 8, "Query heads.")
_NUM_KV_HEADS = flags.DEFINE_list("num_kv_heads", ["8"], "Key/value heads (one run each).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dim.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Input dtype.")
_IMPLS = flags.DEFINE_list("impls", list(IMPLS), f"Implementations, from {IMPLS}.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per measurement (median).")
_BACKWARD = flags.DEFINE_bool("backward", True, "Also time forward+backward.")
_MAX_DENSE_LEN = flags.DEFINE_integer(
    "max_dense_len", 8192, "Dense implementations above this length are compiled (for memory) "
    "but not run.")
_MAX_INTERPRET_LEN = flags.DEFINE_integer("max_interpret_len", 2048,
                                          "Longest sequence for splash in interpret mode.")
_OUT = flags.DEFINE_string("out", None, "Folder for bench.json and bench.png.")


def parse_mask(spec: str) -> tuple[sh.AttentionConfig, dict]:
  """'causal' | 'window:W' | 'chunk:C' | 'full' -> (config, jax.nn keywords)."""
  kind, _, size = spec.partition(":")
  if kind == "causal":
    return sh.AttentionConfig(), dict(is_causal=True)
  if kind == "full":
    return sh.AttentionConfig(causal=False), {}
  if kind == "window" and size.isdigit():
    w = int(size)
    return sh.AttentionConfig(sliding_window=(w, 0)), dict(is_causal=True, local_window_size=(w, 0))
  if kind == "chunk" and size.isdigit():
    return sh.AttentionConfig(chunk_size=int(size)), dict(chunk=int(size))
  raise ValueError(f"--masks: unknown mask {spec!r}; use causal, window:W, chunk:C or full.")


def make_impl(name: str, config: sh.AttentionConfig, nn_kwargs: dict):
  """q [B, T, Hq, D], k, v -> [B, T, Hq, D] for one implementation."""
  if name == "splash_hk_xla":
    return functools.partial(_attention, config=config.replace(platform="xla"))
  if name == "splash_interpret":
    return functools.partial(_attention, config=config.replace(platform="splash", interpret=True,
                                                               allow_fallback=False))
  if name == "reference":
    return lambda q, k, v: sh.fallback.reference_attention(q, k, v, config).attention_outputs
  if name == "ejkernel_xla":
    return functools.partial(baselines.ejkernel_xla, config=config)
  if name == "jax_nn":
    return functools.partial(baselines.jax_nn, nn_kwargs=nn_kwargs)
  raise ValueError(f"--impls: unknown implementation {name!r}; choose from {IMPLS}.")


def _attention(q, k, v, config):
  return sh.attention(q, k, v, config=config).attention_outputs


def matmul_peaks(dtype) -> dict[str, float]:
  """GFLOP/s of a square matmul and of a QK^T-shaped one (inner dim 64), measured now."""
  rng = np.random.default_rng(0)
  out = {}
  for name, (m, k, n) in {"square": (2048, 2048, 2048), "qk_shaped": (4096, 64, 4096)}.items():
    a = jnp.asarray(rng.normal(size=(m, k)), dtype)
    b = jnp.asarray(rng.normal(size=(k, n)), dtype)
    f = jax.jit(jnp.matmul)
    out[name] = 2 * m * k * n / _median_time(f, (a, b), 5) / 1e9
  return out


def _median_time(f, args, repeats) -> float:
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


@dataclasses.dataclass
class Row:
  impl: str
  seq_len: int
  mask: str
  num_kv_heads: int
  compile_s: float = float("nan")
  forward_s: float = float("nan")
  forward_backward_s: float = float("nan")
  temp_mib: float = float("nan")
  gflops_forward: float = float("nan")
  gflops_forward_backward: float = float("nan")
  max_error: float = float("nan")
  note: str = ""


def main(argv):
  del argv
  dtype = jnp.dtype(_DTYPE.value)
  for impl in _IMPLS.value:
    if impl not in IMPLS:
      sys.exit(f"error: --impls: unknown implementation {impl!r}; choose from {IMPLS}.")
  try:
    mask_specs = [(spec, *parse_mask(spec)) for spec in _MASKS.value]
  except ValueError as e:
    sys.exit(f"error: {e}")
  peaks = matmul_peaks(dtype)
  rows, runs = [], []
  for seq_len in map(int, _SEQ_LENS.value):
    for num_kv_heads in map(int, _NUM_KV_HEADS.value):
      rng = np.random.default_rng(seq_len)
      shape = lambda h: (_BATCH.value, seq_len, h, _HEAD_DIM.value)
      q = jnp.asarray(rng.normal(size=shape(_NUM_HEADS.value)), dtype)
      k = jnp.asarray(rng.normal(size=shape(num_kv_heads)), dtype)
      v = jnp.asarray(rng.normal(size=shape(num_kv_heads)), dtype)
      for spec, config, nn_kwargs in mask_specs:
        pairs = masks.visible_pairs(seq_len, seq_len, causal=config.causal, window=config.window,
                                    chunk_size=config.chunk_size)
        flops = 4 * _BATCH.value * _NUM_HEADS.value * _HEAD_DIM.value * pairs
        for impl in _IMPLS.value:
          row = Row(impl, seq_len, spec, num_kv_heads)
          rows.append(row)
          runs.append((row, make_impl(impl, config, nn_kwargs), (q, k, v), flops))
  _measure(runs, peaks)
  _report(rows, peaks)


def _measure(runs, peaks):
  import tqdm  # pylint: disable=g-import-not-at-top
  del peaks
  reference_out = {}
  compiled = []
  for row, fn, args, flops in tqdm.tqdm(runs, desc="compile", disable=not sys.stderr.isatty()):
    too_long = ((row.impl in DENSE and row.seq_len > _MAX_DENSE_LEN.value)
                or (row.impl == "splash_interpret" and row.seq_len > _MAX_INTERPRET_LEN.value))
    forward = jax.jit(fn)
    backward = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                                argnums=(0, 1, 2)))
    try:
      start = time.perf_counter()
      forward_exe = forward.lower(*args).compile()
      row.compile_s = time.perf_counter() - start
      backward_exe = backward.lower(*args).compile() if _BACKWARD.value else None
      analysis = (backward_exe or forward_exe).memory_analysis()
      row.temp_mib = analysis.temp_size_in_bytes / 2**20
    except Exception as e:  # pylint: disable=broad-except
      row.note = f"compile failed: {type(e).__name__}"
      continue
    if too_long:
      row.note = "compiled only (too long to run)"
      continue
    compiled.append((row, forward_exe, backward_exe, args, flops))
  timings = {id(row): ([], []) for row, *_ in compiled}
  total = _REPEATS.value + 1
  for repeat in tqdm.trange(total, desc="time", disable=not sys.stderr.isatty()):
    for row, forward_exe, backward_exe, args, _ in compiled:  # interleaved
      for exe, times in ((forward_exe, timings[id(row)][0]), (backward_exe, timings[id(row)][1])):
        if exe is None:
          continue
        # One untimed call first: a call right after another implementation's runs slower
        # (measured: 0.13 s -> 0.25 s after a dense backward), whichever implementation it is.
        jax.block_until_ready(exe(*args))
        start = time.perf_counter()
        result = jax.block_until_ready(exe(*args))
        if repeat:
          times.append(time.perf_counter() - start)
        elif exe is forward_exe:
          key = (row.seq_len, row.mask, row.num_kv_heads)
          if row.impl == "reference":
            reference_out[key] = np.asarray(result, np.float32)
          row_output = np.asarray(result, np.float32)
          timings[id(row)] = timings[id(row)] + (row_output,)
  for row, _, _, _, flops in compiled:
    forward_times, backward_times, output = timings[id(row)]
    row.forward_s = float(np.median(forward_times))
    row.gflops_forward = flops / row.forward_s / 1e9
    if backward_times:
      row.forward_backward_s = float(np.median(backward_times))
      row.gflops_forward_backward = 3.5 * flops / row.forward_backward_s / 1e9
    reference = reference_out.get((row.seq_len, row.mask, row.num_kv_heads))
    if reference is not None:
      row.max_error = float(np.max(np.abs(output - reference)))


def _report(rows, peaks):
  header = (f"{'impl':17s} {'T':>6s} {'mask':11s} {'Hkv':>3s} {'compile':>8s} {'fwd':>8s} "
            f"{'fwd+bwd':>8s} {'temp MiB':>9s} {'GF/s fwd':>9s} {'%sq':>5s} {'%qk':>5s} "
            f"{'GF/s f+b':>9s} {'max err':>9s}  note")
  print(f"matmul peaks: square {peaks['square']:.1f} GFLOP/s, QK^T-shaped "
        f"{peaks['qk_shaped']:.1f} GFLOP/s")
  print(header)
  for r in rows:
    print(f"{r.impl:17s} {r.seq_len:6d} {r.mask:11s} {r.num_kv_heads:3d} {r.compile_s:8.2f} "
          f"{r.forward_s:8.4f} {r.forward_backward_s:8.4f} {r.temp_mib:9.1f} "
          f"{r.gflops_forward:9.1f} {100 * r.gflops_forward / peaks['square']:5.1f} "
          f"{100 * r.gflops_forward / peaks['qk_shaped']:5.1f} {r.gflops_forward_backward:9.1f} "
          f"{r.max_error:9.2e}  {r.note}")
  _print_speedups(rows)
  if _OUT.value:
    out = paths.user_path(_OUT.value)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.json"), "w") as f:
      json.dump({"matmul_peaks_gflops": peaks, "flags": {
          "num_heads": _NUM_HEADS.value, "head_dim": _HEAD_DIM.value, "batch": _BATCH.value,
          "dtype": _DTYPE.value, "repeats": _REPEATS.value},
                 "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
    _plot(rows, os.path.join(out, "bench.png"))


def _print_speedups(rows):
  by_key = {(r.impl, r.seq_len, r.mask, r.num_kv_heads): r for r in rows}
  for r in rows:
    base = by_key.get(("jax_nn", r.seq_len, r.mask, r.num_kv_heads))
    if r.impl == "splash_hk_xla" and base is not None and np.isfinite(base.forward_s):
      both = np.isfinite(base.forward_backward_s) and np.isfinite(r.forward_backward_s)
      backward = (f", forward+backward {base.forward_backward_s / r.forward_backward_s:.2f}x"
                  if both else "")
      print(f"speedup of splash_hk_xla over jax_nn: T={r.seq_len} {r.mask} Hkv={r.num_kv_heads}: "
            f"forward {base.forward_s / r.forward_s:.2f}x{backward}")


def _plot(rows, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  groups = sorted({(r.mask, r.num_kv_heads) for r in rows})
  fields = [f for f in ("forward_s", "forward_backward_s")
            if any(np.isfinite(getattr(r, f)) for r in rows)]
  fig, axes = plt.subplots(len(fields), len(groups), figsize=(4.5 * len(groups), 3.5 * len(fields)),
                           squeeze=False)
  for col, (mask, hkv) in enumerate(groups):
    for line, field in enumerate(fields):
      ax = axes[line][col]
      for impl in sorted({r.impl for r in rows}):
        points = sorted((r.seq_len, getattr(r, field)) for r in rows
                        if (r.mask, r.num_kv_heads, r.impl) == (mask, hkv, impl)
                        and np.isfinite(getattr(r, field)))
        if points:
          ax.plot(*zip(*points), marker="o", label=impl)
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_title(f"{mask}, Hkv={hkv}: {'forward' if field == 'forward_s' else 'forward+backward'}")
      ax.set_xlabel("sequence length")
      ax.set_ylabel("seconds")
      ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)


if __name__ == "__main__":
  app.run(main)
