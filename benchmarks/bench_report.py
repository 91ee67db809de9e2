"""The bench's table, the ratios docs/guide/performance.md quotes, and its plot; the TPU
benches' result files (`write`)."""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Sequence

import numpy as np


def report(rows: Sequence[Any], peaks: dict[str, float]) -> None:
  """Prints the table (fractions of the square matmul peak) and the ratio lines."""
  square = peaks["square"]
  print(f"matmul peaks: square {square:.1f} GFLOP/s, QK^T-shaped {peaks['qk_shaped']:.1f} "
        "GFLOP/s; frac = useful GFLOP/s / square peak; work = pairs computed / useful pairs")
  print(f"{'impl':21s} {'workload':20s} {'Hkv':>3s} {'compile':>7s} {'fwd s':>8s} {'f+b s':>8s} "
        f"{'temp MiB':>9s} {'GF/s fwd':>8s} {'frac':>5s} {'GF/s f+b':>8s} {'frac':>5s} "
        f"{'max err':>8s} {'work':>5s}  note")
  for r in rows:
    print(f"{r.impl:21s} {r.workload:20s} {r.num_kv_heads:3d} {r.compile_s:7.2f} "
          f"{r.forward_s:8.4f} {r.forward_backward_s:8.4f} {r.temp_mib:9.1f} "
          f"{r.gflops_forward:8.1f} {r.gflops_forward / square:5.2f} "
          f"{r.gflops_forward_backward:8.1f} {r.gflops_forward_backward / square:5.2f} "
          f"{r.max_error:8.1e} {r.work:5.2f}  {r.note}")
  for line in ratios(rows):
    print(line)


def _times(r) -> str:
  backward = np.isfinite(r[0].forward_backward_s) and np.isfinite(r[1].forward_backward_s)
  text = f"forward {r[0].forward_s / r[1].forward_s:.2f}x"
  if backward:
    text += f", forward+backward {r[0].forward_backward_s / r[1].forward_backward_s:.2f}x"
  return text


def ratios(rows: Sequence[Any]) -> list[str]:
  """Speedups over jax_nn, cache capacity and sequence-shard time ratios."""
  by_key = {(r.impl, r.workload, r.num_kv_heads): r for r in rows}
  ran = lambda r: r is not None and np.isfinite(r.forward_s)
  lines = []
  for r in rows:
    base = by_key.get(("jax_nn", r.workload, r.num_kv_heads))
    if r.impl == "splash_hk_xla" and ran(base) and ran(r):
      speedup = _times((base, r))
      lines.append(f"speedup of splash_hk_xla over jax_nn: {r.workload} Hkv={r.num_kv_heads}: "
                   f"{speedup}")
    one = by_key.get(("splash_hk_xla", r.workload, r.num_kv_heads))
    how = {"splash_hk_xla_sp": "all-gathered", "splash_hk_ring": "as a load-balanced ring",
           "splash_hk_ulysses": "Ulysses: heads sharded"}.get(r.impl)
    if how and ran(one) and ran(r):
      lines.append(f"{r.workload} Hkv={r.num_kv_heads} with the query sequence sharded ({how}) "
                   f"vs unsharded: {_times((r, one))} the time")
  caches = collections.defaultdict(list)  # (impl, kind:first, Hkv) -> [(capacity, row)]
  for r in rows:
    kind, _, sizes = r.workload.partition(":")
    if kind in ("decode", "prefill") and ran(r):
      first, _, capacity = sizes.partition("/")
      caches[(r.impl, f"{kind} {first}", r.num_kv_heads)].append((int(capacity), r))
  for (impl, what, hkv), found in caches.items():
    found.sort(key=lambda c: c[0])
    for capacity, r in found[1:]:
      lines.append(f"{what} tokens, cache of {capacity} vs {found[0][0]} slots ({impl}, "
                   f"Hkv={hkv}): {r.forward_s / found[0][1].forward_s:.2f}x the time")
  return lines


def plot(rows: Sequence[Any], path: str) -> None:
  """Bars of forward (and forward+backward) seconds per workload and implementation."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:  # e.g. a machine with only the library's requirements: the table suffices
    print(f"no plot: matplotlib is not installed (pip install 'splash_hk[examples]'); not {path}")
    return
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fields = [f for f in ("forward_s", "forward_backward_s")
            if any(np.isfinite(getattr(r, f)) for r in rows)]
  groups = list(dict.fromkeys(f"{r.workload} Hkv={r.num_kv_heads}" for r in rows))
  impls = list(dict.fromkeys(r.impl for r in rows))
  fig, axes = plt.subplots(len(fields), 1, figsize=(max(6.0, 1.2 * len(groups) * len(impls) / 3),
                                                     3.5 * len(fields)), squeeze=False)
  width = 0.8 / len(impls)
  for ax, field in zip(axes[:, 0], fields):
    for n, impl in enumerate(impls):
      values = {f"{r.workload} Hkv={r.num_kv_heads}": getattr(r, field) for r in rows
                if r.impl == impl}
      heights = [values.get(g, np.nan) for g in groups]
      ax.bar(np.arange(len(groups)) + n * width, heights, width, label=impl)
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, groups, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("seconds")
    ax.set_title("forward" if field == "forward_s" else "forward+backward")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)


def write(out: str, name: str, payload: dict[str, Any], text: str) -> None:
  """A bench's results into folder `out`: `name`.json (`payload`) and `name`.txt (`text`)."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f"{name}.json"), "w") as f:
    json.dump(payload, f, indent=1)
  with open(os.path.join(out, f"{name}.txt"), "w") as f:
    f.write(text + "\n")
