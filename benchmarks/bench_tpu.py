"""The TPU bench: splash_hk's default call against the TPU attention kernels a user could pick
instead, in one run, each peer at its best tiles.

  python -m benchmarks.bench_tpu [--rows=causal_4k,causal_16k,...] [--repeats=5] [--out=DIR]
                                 [--peers=jax_splash,tokamax_splash,tokamax_mosaic,xla] [--smoke]
                                 [--guards=none,bthd,...] [--programs]

Rows (bf16): causal B4 T4096 H16 D128; causal B1 T16384 H16; GQA B1 T16384 Hq32 Hkv8; a window
of 1024 at T16384; packed documents (8 x 2048 in 16384, segment ids, causal within); Gemma-like
B2 T8192 Hq8 Hkv4 D256. Each row's forward and forward+backward (the gradient of q, k and v)
as a fraction of the matmul peak measured in the same run (a bf16 8192^3 product;
forward+backward counted as 3.5x the forward's flops, the flops of the visible pairs), and
splash_hk's time over each peer's (> 1: splash_hk is faster). Peers: JAX's splash kernel and
tokamax's experimental TPU splash kernel at the best of their candidate tiles, tokamax's
`mosaic` attention and jax.nn's xla; one that cannot serve a row (memory, a mask it lacks, a
missing package) says why. Every call computes the same attention (q scaled in the call) and
is timed after an untimed call of the same executable (`timing.timed_call`, median of
`--repeats`). `--smoke` runs tiny rows in interpret mode (CPU: the bench's own test).
`--guards` also times our call under other garbage guards (`benchmarks/guards.py`: "none", the
kernels alone, gives the guard's share of ours); `--programs` writes the compiled programs of
ours and of each variant (forward and forward+backward) into programs_<row>.txt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, NamedTuple

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_report
from benchmarks import guards
from benchmarks import tpu_peers
from benchmarks import timing
import splash_hk as sh



@dataclasses.dataclass(frozen=True)
class Row:
  """One bench shape: batch, length, query and kv heads, head dim, and its mask."""

  batch: int
  length: int
  heads: int
  kv_heads: int
  dim: int
  mask: str  # "causal", "window" (left WINDOW, causal), "packed" (DOCS documents, causal)

  @property
  def window(self) -> tuple[int, int] | None:
    """The (left, right) window of a "window" row, else None."""
    return (WINDOW, 0) if self.mask == "window" else None

  def visible_pairs(self) -> int:
    """Query-key pairs a row sees, per batch row and head."""
    t = self.length
    if self.mask == "window":
      return sum(min(i, WINDOW) + 1 for i in range(t))
    if self.mask == "packed":
      doc = t // DOCS
      return DOCS * doc * (doc + 1) // 2
    return t * (t + 1) // 2

  def forward_flops(self) -> float:
    """Two products (q.k and p.v) of 2 flops a multiply-add over the visible pairs."""
    return 4.0 * self.batch * self.heads * self.dim * self.visible_pairs()


WINDOW, DOCS = 1024, 8
ROWS = {
    "causal_4k": Row(4, 4096, 16, 16, 128, "causal"),
    "causal_16k": Row(1, 16384, 16, 16, 128, "causal"),
    "gqa_16k": Row(1, 16384, 32, 8, 128, "causal"),
    "window_16k": Row(1, 16384, 16, 16, 128, "window"),
    "packed_16k": Row(1, 16384, 16, 16, 128, "packed"),
    "gemma_8k": Row(2, 8192, 8, 4, 256, "causal"),
}
SMOKE_ROWS = {  # interpret mode on CPU: the bench's own test
    "causal_4k": Row(1, 256, 1, 1, 128, "causal"),
    "window_16k": Row(1, 256, 2, 1, 128, "window"),
    "packed_16k": Row(1, 256, 1, 1, 128, "packed"),
}
PEERS = ("jax_splash", "tokamax_splash", "tokamax_mosaic", "xla")

class Inputs(NamedTuple):
  """A row's arrays: q [B, T, Hq, D], k, v [B, T, Hkv, D], the cotangent [B, T, Hq, D] and
  segment ids [B, T] (None but for packed documents)."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  cot: jax.Array
  segments: jax.Array | None


def inputs(row: Row, seed: int = 0) -> Inputs:
  """bf16 normal inputs of `row`."""
  keys = jax.random.split(jax.random.key(seed), 4)
  shape = lambda h: (row.batch, row.length, h, row.dim)
  draw = lambda key, h: jax.random.normal(key, shape(h), jnp.bfloat16)
  segments = None
  if row.mask == "packed":
    segments = jnp.broadcast_to(jnp.arange(row.length, dtype=jnp.int32) // (row.length // DOCS),
                                (row.batch, row.length))
  return Inputs(draw(keys[0], row.heads), draw(keys[1], row.kv_heads), draw(keys[2], row.kv_heads),
                draw(keys[3], row.heads), segments)


def splash_hk_call(row: Row, interpret: bool = False,
                   platform: str = "auto") -> Callable[..., jax.Array]:
  """splash_hk's call at its defaults (tiles from its table): q, k, v, segments -> out."""
  config = sh.AttentionConfig(sliding_window=row.window, interpret=interpret, platform=platform,
                              allow_fallback=platform == "auto")

  def call(q, k, v, segments):
    return sh.attention(q, k, v, config=config, q_segment_ids=segments).attention_outputs

  return call


def timings(call: Callable[..., jax.Array], x: Inputs, repeats: int) -> tuple[float, float]:
  """(forward seconds, forward+backward seconds) of `call`, medians of `repeats` timed calls,
  each after an untimed one."""
  forward = jax.jit(call)

  def loss(q, k, v, segments, cot):
    return jnp.sum(call(q, k, v, segments).astype(jnp.float32) * cot.astype(jnp.float32))

  both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  median = lambda fn, *a: float(np.median([timing.timed_call(fn, *a)[0]
                                           for _ in range(repeats)]))
  return (median(forward, x.q, x.k, x.v, x.segments),
          median(both, x.q, x.k, x.v, x.segments, x.cot))


def layout_seconds(x: Inputs, repeats: int) -> float:
  """Seconds of the layout changes around a head-major kernel that a [B, T, H, D] call makes (q,
  k, v to [B, H, T, D], an output of q's shape back), timed alone. The peers, handed the same
  arrays, make the same changes (`tpu_peers._per_head_layout`): the share is what a kernel
  reading the call's own layout could win, not a difference from them."""
  swap = jax.jit(lambda *arrays: tuple(jnp.swapaxes(a, 1, 2) for a in arrays))
  out = swap(x.q)[0]  # [B, H, T, D]: the kernel's output, as q's
  return timing.median_seconds(swap, x.q, x.k, x.v, out, repeats=repeats)


def guard_times(row: Row, x: Inputs, ours: tuple[float, float], repeats: int, interpret: bool,
                variants: list[str]) -> dict[str, Any]:
  """Our call under each guard `variants` names (`guards.VARIANTS`): its times, and 1 - its time
  over ours ("none": the guard's share of ours)."""
  found = {}
  for variant in variants:
    with guards.registered(variant) as name:
      seconds = timings(splash_hk_call(row, interpret, platform=name), x, repeats)
    found[variant] = {"ms": [round(s * 1e3, 3) for s in seconds],
                      "share_of_ours": [round(1 - b / a, 3) for a, b in zip(ours, seconds)]}
  return found


PROGRAM_OPS = ("copy", "copy-start", "fusion", "while", "conditional", "custom-call")


def compiled(call: Callable[..., jax.Array], x: Inputs, differentiated: bool = False
             ) -> tuple[str, dict[str, int]]:
  """The program XLA compiled for `call` on x (forward, or with `differentiated` the gradient of
  q, k and v; its optimized HLO text) and how many of each `PROGRAM_OPS` instruction it holds:
  what to read where two calls' times differ."""
  loss = lambda q, k, v, s: jnp.sum(call(q, k, v, s).astype(jnp.float32))
  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)) if differentiated else call)
  text = fn.lower(x.q, x.k, x.v, x.segments).compile().as_text()
  lines = text.splitlines()
  return text, {op: sum(f" {op}(" in line for line in lines) for op in PROGRAM_OPS}


def programs(row: Row, x: Inputs, interpret: bool, variants: list[str]
             ) -> dict[str, tuple[str, dict[str, int]]]:
  """Our compiled forward and forward+backward (`compiled`), and each guard variant's."""
  found = {}
  for variant in ["ours", *variants]:
    with (contextlib.nullcontext("auto") if variant == "ours"
          else guards.registered(variant)) as name:
      for differentiated, part in ((False, "fwd"), (True, "f+b")):
        found[f"{variant} {part}"] = compiled(splash_hk_call(row, interpret, platform=name), x,
                                              differentiated)
  return found


def run_row(name: str, row: Row, peers: list[str], repeats: int, peak: float,
            interpret: bool, candidates: tuple[tuple[int, int, int], ...] = (),
            variants: list[str] = (), with_programs: bool = False) -> dict[str, Any]:
  """One row's figures: splash_hk's and each peer's times, fractions of the peak, ratios (with
  guard `variants` their times and shares of ours; with `with_programs` our compiled forward and
  forward+backward and each variant's, their texts under "program_text")."""
  x = inputs(row)
  flops = row.forward_flops()
  result: dict[str, Any] = {"row": name, "shape": dataclasses.asdict(row)}
  decision = sh.explain(x.q, x.k, x.v, q_segment_ids=x.segments, for_platform="tpu",
                        config=sh.AttentionConfig(sliding_window=row.window,
                                                  interpret=interpret))
  result["splash_hk_decision"] = f"{decision.backend}: {decision.reason}"
  ours = timings(splash_hk_call(row, interpret), x, repeats)
  result["splash_hk"] = _figures(ours, flops, peak)
  result["layout_share_of_forward"] = round(layout_seconds(x, repeats) / ours[0], 3)
  if variants:
    result["guards"] = guard_times(row, x, ours, repeats, interpret, list(variants))
  if with_programs:
    found = programs(row, x, interpret, list(variants))
    result["programs"] = {name: counts for name, (_, counts) in found.items()}
    result["program_text"] = {name: text for name, (text, _) in found.items()}
  for peer in peers:
    try:
      best = tpu_peers.best(peer, row, x, lambda call: timings(call, x, repeats), interpret,
                            candidates)
    except tpu_peers.CannotServe as why:
      result[peer] = {"skipped": str(why)}
      continue
    except Exception as failure:  # a peer that breaks (memory, a compile error) says so
      logging.exception("peer %s on %s", peer, name)
      result[peer] = {"skipped": f"{type(failure).__name__}: {str(failure)[:300]}"}
      continue
    result[peer] = {**_figures(best.seconds, flops, peak), "tiles": best.tiles,
                    "ours_over": [round(b / a, 3) for a, b in zip(ours, best.seconds)]}
  return result


def _figures(seconds: tuple[float, float], flops: float, peak: float) -> dict[str, Any]:
  fwd, both = seconds
  return {"ms": [round(fwd * 1e3, 3), round(both * 1e3, 3)],
          "fraction_of_peak": [round(flops / fwd / peak, 3),
                               round(timing.FB_FACTOR * flops / both / peak, 3)]}


def report(results: list[dict[str, Any]], peak: float) -> str:
  """The table: per row, splash_hk's fraction of the peak (fwd / f+b) and its speed over each
  peer (peer time / ours: > 1 is faster), each peer's own fraction beside."""
  lines = [f"matmul peak measured: {peak / 1e12:.1f} TFLOP/s (bf16 8192^3)",
           "row | splash_hk fwd / f+b (fraction of peak) | peer: its fraction, ours over it"]
  for r in results:
    ours = r["splash_hk"]["fraction_of_peak"]
    cells = [f"{r['row']} | {ours[0]:.3f} / {ours[1]:.3f}"]
    for peer in PEERS:
      if peer not in r:
        continue
      if "skipped" in r[peer]:
        cells.append(f"{peer}: skipped ({r[peer]['skipped'][:80]})")
        continue
      frac, over = r[peer]["fraction_of_peak"], r[peer]["ours_over"]
      cells.append(f"{peer} {frac[0]:.3f} / {frac[1]:.3f}, ours {over[0]:.2f}x / {over[1]:.2f}x")
    lines.append(" | ".join(cells))
    guard = "".join(f"guard {name}: {g['ms'][0]:.3f} / {g['ms'][1]:.3f} ms, "
                    f"{g['share_of_ours'][0]:.3f} / {g['share_of_ours'][1]:.3f} below ours; "
                    for name, g in r.get("guards", {}).items())
    for name, counts in r.get("programs", {}).items():
      guard += f"program {name}: " + ", ".join(f"{op} {counts[op]}" for op in PROGRAM_OPS) + "; "
    lines.append(f"    (layout changes alone: {r['layout_share_of_forward']:.3f} of our forward; "
                 f"{guard}{r['splash_hk_decision'][:160]})")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv
  f = flags.FLAGS
  rows = SMOKE_ROWS if f.smoke else ROWS
  unknown = ([r for r in f.rows if r not in ROWS] + [p for p in f.peers if p not in PEERS]
             + [g for g in f.guards if g not in guards.VARIANTS])
  if unknown:
    raise app.UsageError(f"unknown rows or peers: {unknown}")
  candidates = tuple(tuple(int(n) for n in t.split("/")) for t in f.peer_tiles)
  peak = timing.matmul_peak(f.repeats, 1024 if f.smoke else 8192)
  results = []
  for name in f.rows:
    if name in rows:
      results.append(run_row(name, rows[name], f.peers, f.repeats, peak, f.smoke, candidates,
                             f.guards, f.programs))
      print(report(results[-1:], peak).split("\n", 2)[-1], flush=True)
  text = report(results, peak)
  print(text)
  texts = {r["row"]: r.pop("program_text") for r in results if "program_text" in r}
  if f.out:
    os.makedirs(f.out, exist_ok=True)
    for row, found in texts.items():  # one file a row: the machine returns few files
      with open(os.path.join(f.out, f"programs_{row}.txt"), "w") as out:
        out.write("\n".join(f"=== {name}\n{program}" for name, program in found.items()))
    bench_report.write(f.out, "bench_tpu", {
        "device": str(jax.devices()[0].device_kind), "peak_flops": peak, "results": results},
        text)


if __name__ == "__main__":  # flags defined here: the bench (imported beside) has its own
  flags.DEFINE_list("rows", list(ROWS), f"Rows to run, of {list(ROWS)}.")
  flags.DEFINE_list("peers", list(PEERS), f"Peers to run, of {list(PEERS)}.")
  flags.DEFINE_integer("repeats", 5, "Timed calls per figure (the median is kept).")
  flags.DEFINE_string("out", None, "A folder for bench_tpu.json (None: print only).")
  flags.DEFINE_bool("smoke", False, "Tiny rows in interpret mode (a CPU check).")
  flags.DEFINE_list("guards", [], f"Also time our call under these garbage guards, of "
                    f"{list(guards.VARIANTS)} (none: the guard's share of ours).")
  flags.DEFINE_bool("programs", False, "Also compile our forward and forward+backward and each "
                    "--guards variant's and count what each program holds (copies, fusions, "
                    "loops); --out gets their texts (programs_<row>.txt).")
  flags.DEFINE_list("peer_tiles", [], "The peers' candidate tiles, each block_q/block_kv/"
                    "block_kv_compute (default: tpu_peers.TILES).")
  app.run(main)
