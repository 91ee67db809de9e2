"""The TPU bench of blocks chosen by data: MoBA's choice against the causal attention it stands
in for, in one run, on the chip.

  python -m benchmarks.bench_tpu_blocks --out=DIR [--rows=own8_128_16k,...] [--repeats=5]
                                        [--smoke] [--profile]

Rows (bf16, B1 Hq16 Hkv4 D128, causal): each query block's own block and the top_k others of
`sh.sparse.top_k_blocks` (MoBA's gate, one choice per GQA group; computed once, passed in, its
time beside): own + 8 of 128 and own + 3 of 512 at T = 16384, own + 8 of 128 at T = 32768, and
NSA-style per-token choices (query blocks of 1 row, 16 key blocks of 64) where the kernel serves
them (else the reason it does not). Each row's forward and forward+backward (the gradient of q,
k and v) are timed after an untimed call of the same executable (median of `--repeats`),
against causal attention over the same q, k, v at the library's TPU defaults: "causal over
chosen" (> 1: the choice pays), the work saved (the keys causal attention reads over those the
choice's blocks hold), and the fraction of the matmul peak measured in the run on the chosen
work (the whole products of the listed blocks: 4 flops a query row, key and channel forward,
3.5x that forward+backward). Quest's decode (a choice of pages) is a row of
`bench_tpu_decode` (`quest16_p64`). `--smoke` runs tiny rows in interpret mode (CPU: the
bench's own test).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_report
from benchmarks import timing
import splash_hk as sh


@dataclasses.dataclass(frozen=True)
class Row:
  """A choice's shape: the length, its blocks (bq, bk) and top_k beside the own block."""

  length: int
  block: tuple[int, int]
  top_k: int
  heads: int = 16
  kv_heads: int = 4
  dim: int = 128


ROWS = {"own8_128_16k": Row(16384, (128, 128), 8), "own3_512_16k": Row(16384, (512, 512), 3),
        "own8_128_32k": Row(32768, (128, 128), 8), "nsa_token_16k": Row(16384, (1, 64), 16)}
SMOKE_ROWS = {"own8_128_16k": Row(384, (128, 128), 1, 4, 2),
              "nsa_token_16k": Row(256, (1, 64), 2, 4, 2)}


def inputs(row: Row, seed: int = 0) -> tuple[jax.Array, ...]:
  """bf16 normal q [1, T, Hq, D], k, v [1, T, Hkv, D] and the cotangent (q's shape)."""
  keys = jax.random.split(jax.random.key(seed), 4)
  shape = lambda h: (1, row.length, h, row.dim)
  heads = (row.heads, row.kv_heads, row.kv_heads, row.heads)
  return tuple(jax.random.normal(key, shape(h), jnp.bfloat16) for key, h in zip(keys, heads))


def mask(row: Row, lists: jax.Array, counts: jax.Array) -> sh.masks.Mask:
  """The row's choice as a mask: its chosen blocks, causal inside them."""
  return sh.masks.Blocks(lists, counts, row.block) & sh.masks.Causal()


def calls(row: Row, interpret: bool) -> tuple[Callable[..., jax.Array], ...]:
  """(causal, chosen): q, k, v, lists, counts -> out, at the library's defaults."""
  config = sh.AttentionConfig(interpret=interpret)

  def causal(q, k, v, lists, counts):
    del lists, counts
    return sh.attention(q, k, v, config=config).attention_outputs

  def chosen(q, k, v, lists, counts):
    return sh.attention(q, k, v, mask=mask(row, lists, counts),
                        config=config).attention_outputs

  return causal, chosen


def programs(call: Callable[..., jax.Array],
             cot: jax.Array) -> dict[str, Callable[..., Any]]:
  """`call` jitted, forward and forward+backward (the gradient of q, k and v against `cot`)."""
  loss = lambda *a: jnp.sum(call(*a).astype(jnp.float32) * cot.astype(jnp.float32))
  return {"forward": jax.jit(call), "forward+backward": jax.jit(jax.grad(loss, argnums=(0, 1, 2)))}


def timings(call: Callable[..., jax.Array], args: tuple[jax.Array, ...], cot: jax.Array,
            repeats: int) -> tuple[float, float]:
  """(forward, forward+backward) seconds of `call`, medians of `repeats` timed calls, each after
  an untimed one."""
  median = lambda fn: float(np.median([timing.timed_call(fn, *args)[0]
                                       for _ in range(repeats)]))
  forward, both = programs(call, cot).values()
  return median(forward), median(both)


def profile(call: Callable[..., jax.Array], args: tuple[jax.Array, ...], cot: jax.Array,
            repeats: int) -> dict[str, dict[str, float]]:
  """The chosen call's device operations by time (microseconds a call), forward and
  forward+backward (`timing.top_ops`): the kernels against the XLA around them."""
  return {what: timing.top_ops(lambda fn=fn: fn(*args), repeats, top=12)
          for what, fn in programs(call, cot).items()}


def run_row(name: str, row: Row, repeats: int, peak: float, interpret: bool,
            with_profile: bool = False) -> dict[str, Any]:
  """A row's figures: causal and chosen times, causal over chosen, the work saved and the
  chosen work's fraction of the peak (with `with_profile`, the chosen call's operations); a
  choice the kernel does not serve, its reason."""
  q, k, v, cot = inputs(row)
  gate = jax.jit(lambda q, k: sh.sparse.top_k_blocks(q, k, row.top_k, row.block))
  gate_seconds, choice = timing.timed_call(gate, q, k)
  args = (q, k, v, choice.kv_blocks, choice.counts)
  causal, chosen = calls(row, interpret)
  decision = sh.explain(q, k, v, mask=mask(row, *args[3:]), for_platform="tpu",
                        config=sh.AttentionConfig(interpret=interpret))
  result: dict[str, Any] = {"row": name, "shape": dataclasses.asdict(row),
                            "decision": f"{decision.backend}: {decision.reason}",
                            "gate_ms": round(gate_seconds * 1e3, 3)}
  if decision.backend != "splash":
    return {**result, "skipped": f"the kernel does not serve it: {decision.reason}"}
  bq, bk = row.block
  held = int(np.sum(np.asarray(choice.counts))) * bq * bk * (row.heads // row.kv_heads)
  causal_keys = row.heads * row.length * (row.length + 1) / 2
  work = 4.0 * row.dim * held  # the listed blocks' whole products, forward
  ours, theirs = timings(chosen, args, cot, repeats), timings(causal, args, cot, repeats)
  if with_profile:
    result["ops_us"] = profile(chosen, args, cot, repeats)
  return {**result, "chosen_ms": [round(t * 1e3, 3) for t in ours],
          "causal_ms": [round(t * 1e3, 3) for t in theirs],
          "causal_over_chosen": [round(c / o, 3) for c, o in zip(theirs, ours)],
          "work_saved": round(causal_keys / held, 2),
          "fraction_of_peak_on_chosen_work": [
              round(work / ours[0] / peak, 3),
              round(timing.FB_FACTOR * work / ours[1] / peak, 3)]}


def report(results: list[dict[str, Any]], peak: float) -> str:
  """A line a row: causal over chosen (forward / forward+backward), the work saved, the chosen
  work's fraction of the peak, each time, the gate's."""
  lines = [f"matmul peak measured: {peak / 1e12:.1f} TFLOP/s (bf16)",
           "row | causal over chosen fwd / f+b | work saved | fraction of the peak on the "
           "chosen work fwd / f+b | chosen ms, causal ms | gate ms"]
  for r in results:
    if "skipped" in r:
      lines.append(f"{r['row']} | skipped: {r['skipped'][:160]}")
      continue
    over, frac = r["causal_over_chosen"], r["fraction_of_peak_on_chosen_work"]
    lines.append(f"{r['row']} | {over[0]:.2f}x / {over[1]:.2f}x | {r['work_saved']:.1f}x | "
                 f"{frac[0]:.3f} / {frac[1]:.3f} | {r['chosen_ms'][0]:.3f} / "
                 f"{r['chosen_ms'][1]:.3f}, {r['causal_ms'][0]:.3f} / {r['causal_ms'][1]:.3f} "
                 f"| {r['gate_ms']:.3f}")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv
  f = flags.FLAGS
  rows = SMOKE_ROWS if f.smoke else ROWS
  unknown = [r for r in f.rows if r not in ROWS]
  if unknown:
    raise app.UsageError(f"unknown rows: {unknown}; rows are {list(ROWS)}")
  peak = timing.matmul_peak(f.repeats, 1024 if f.smoke else 8192)
  results = [run_row(name, rows[name], f.repeats, peak, f.smoke, f.profile) for name in f.rows
             if name in rows]
  text = report(results, peak)
  print(text)
  if f.out:
    bench_report.write(f.out, "bench_tpu_blocks", {
        "device": str(jax.devices()[0].device_kind), "peak_flops": peak, "results": results},
        text)

if __name__ == "__main__":
  flags.DEFINE_list("rows", list(ROWS), f"Rows to run, of {list(ROWS)}.")
  flags.DEFINE_integer("repeats", 5, "Timed calls per figure (the median is kept).")
  flags.DEFINE_string("out", None, "A folder for bench_tpu_blocks.json (None: print only).")
  flags.DEFINE_bool("smoke", False, "Tiny rows in interpret mode (a CPU check).")
  flags.DEFINE_bool("profile", False, "Also trace the chosen call (forward, forward+backward) "
                    "and keep its device operations' times (ops_us in the json).")
  app.run(main)
