"""The TPU decode bench: a paged decode step against JAX's ragged paged attention, and a decode
over a fixed cache against jax.nn's xla attention, as a fraction of the read bandwidth measured
in the same run.

A step's floor is reading every cached key and value once. Each row is one decode step (a row
per sequence) of `sh.paged_attention` over a pool of shuffled pages, the pool donated (the step
writes its new tokens, then attends), timed after an untimed call of the same executable; the
peer, JAX's `ragged_paged_attention` (`jax.experimental.pallas.ops.tpu`), reads the same
keys and values in its own layout (k and v heads interleaved, the new tokens already in) at
each of its candidate block sizes, the fastest kept. Bytes: each sequence's keys and values
after the write, once (`decode_steps`: the rows and their steps). A mixed step (prompt chunks
beside decodes) is also held against its parts apart, a prefill against `sh.attention` of the
same rows, an int8 pool (no peer: it takes no per-token scales) against the bf16 step of its
shape, Quest's step (1/16 of the pages chosen by `top_k_pages` in the step; its bytes are the
chosen pages') against the step reading every page. A row named `_xla` times the library's
xla path on its step (what a call the kernel does not serve runs). A fixed-cache row is `sh.attention` of
T rows (end-aligned causal) against B caches of S keys, beside
`jax.nn.dot_product_attention(implementation="xla")` of the same call (its mask the same rule).

Each call is timed three ways (`timing`), and the read bandwidth the same three ways: "ms",
calls launched back to back (a launch hides behind the call before it, as in a serving loop);
"launch_ms", each call launched and waited for alone (the lent TPU's host adds about 0.6 ms a
call); "device_ms", the chip's time in the call's programs (a trace). Each fraction of the
bandwidth divides by the bandwidth timed the same way. "launch" is the host's time to launch a
call (`timing.dispatch_seconds`): where it nears the back-to-back time, the host bounds it.

    python -m benchmarks.bench_tpu_decode --out=DIR [--rows=...] [--repeats=5]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from absl import app
from absl import flags
import jax
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_report
from benchmarks import decode_probes
from benchmarks import decode_steps
from benchmarks.decode_steps import ROWS, SMOKE_ROWS, Row, Step, make_step, peer_inputs
from benchmarks import timing
import splash_hk as sh


@dataclasses.dataclass(frozen=True)
class FixedRow:
  batch: int
  rows: int  # T: 1 a decode, 2-8 a verification of drafts
  keys: int  # S
  heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128


FIXED_ROWS = {"fixed_t1": FixedRow(32, 1, 8192), "fixed_t4": FixedRow(32, 4, 8192),
              "fixed_t8": FixedRow(32, 8, 8192)}
SMOKE_FIXED = {name: dataclasses.replace(r, batch=2, keys=300, heads=4, kv_heads=2)
               for name, r in FIXED_ROWS.items()}
PEER_KEYS = (512, 1024)  # the peer's keys a block (its pages a block: these over the page)
PEER_QUERIES = (8, 32)


def ours_seconds(step: Step, repeats: int, interpret: bool,
                 keys: int | None = None) -> tuple[float, jax.Array]:
  """The median step time of `sh.paged_attention` with the pool donated (each timed call after
  an untimed one of the same executable; the kernel's `keys` a grid step, `block_keys`), and
  its output."""
  with decode_probes.block_keys(keys):
    return _ours_seconds(step, repeats, interpret)


def ours_call(step: Step, interpret: bool) -> Callable[[], jax.Array]:
  """A call of `sh.paged_attention` on the step, its pool donated and carried from call to call
  (the step's own pool stays for the peer); returns the output. The TPU kernel (an int8 pool's
  codes too), no fallback."""
  config = sh.AttentionConfig(platform="splash" if interpret else step.platform,
                              interpret=interpret, allow_fallback=False)
  run = jax.jit(lambda q, k, v, pool, batch: sh.paged_attention(
      q, k, v, pool, step.chosen(q, pool) if step.top_k else batch, config=config),
                donate_argnums=3)
  state = {"pool": jax.tree.map(jnp.copy, step.pool)}

  def call() -> jax.Array:
    out, state["pool"] = run(step.q, step.k, step.v, state["pool"], step.batch)
    return out

  return call


def _ours_seconds(step: Step, repeats: int, interpret: bool) -> tuple[float, jax.Array]:
  call = ours_call(step, interpret)
  seconds = timing.back_to_back_seconds(call, repeats=repeats)
  return seconds, call()


def peer_call(step: Step, keys: int, queries: int) -> Callable[[], jax.Array]:
  """JAX's ragged paged attention on `peer_inputs`, its pages `keys // page` a block and
  `queries` rows a block."""
  q, kv, lens, table, cu, seqs = peer_inputs(step)
  page, d = kv.shape[1], kv.shape[3]
  call = jax.jit(lambda q, kv: rpa.ragged_paged_attention(
      q, kv, lens, table, cu, seqs, sm_scale=d ** -0.5,
      num_kv_pages_per_block=max(1, min(keys // page, table.shape[1])),
      num_queries_per_block=queries))
  return lambda: call(q, kv)


def peer_best(step: Step, repeats: int) -> dict[str, Any]:
  """The peer's fastest candidate: its seconds, block sizes and output."""
  best: dict[str, Any] = {"seconds": np.inf}
  for keys in PEER_KEYS:
    for queries in PEER_QUERIES:
      try:
        call = peer_call(step, keys, queries)
        seconds = timing.back_to_back_seconds(call, repeats=repeats)
      except Exception as failure:  # a candidate it refuses (VMEM): the next
        best.setdefault("refused", []).append(f"{keys}/{queries}: {type(failure).__name__}")
        continue
      if seconds < best["seconds"]:
        best.update(seconds=seconds, blocks=f"{keys} keys / {queries} rows", out=call(),
                    call=call)
  return best


def _compare(peer: dict[str, Any], ours: dict[str, Any], peer_out: jax.Array,
             out: jax.Array, blocks: str) -> dict[str, Any]:
  """The peer's figures with ours over it (back to back and on the chip) and the largest
  difference between the outputs."""
  ratio = lambda key: (None if peer[key] is None or ours[key] is None
                       else round(peer[key] / ours[key], 3))
  return {**peer, "blocks": blocks, "ours_over": ratio("ms"),
          "device_ours_over": ratio("device_ms"),
          "max_difference": float(jnp.max(jnp.abs(peer_out.astype(jnp.float32)
                                                  - out.astype(jnp.float32))))}


def run_row(name: str, row: Row, repeats: int, bandwidth: timing.Bandwidth, interpret: bool,
            peers: bool, tried: tuple[int, ...] = (),
            probes: tuple[str, ...] = (), profile: bool = False) -> dict[str, Any]:
  """A row's figures: ours (and at each of `tried` keys a grid step, and with each of `probes`'
  kernel parts alone), the peer's best."""
  step = make_step(row)
  decision = sh.explain_paged(step.q, step.k, step.v, step.pool,
                              step.chosen(step.q, step.pool), for_platform="tpu",
                              config=sh.AttentionConfig(interpret=interpret))
  call = ours_call(step, interpret)  # one executable for every figure of ours below
  seconds = timing.back_to_back_seconds(call, repeats=repeats)
  out = call()
  ours = timing.figures(call, step.bytes_read, bandwidth, repeats, seconds)
  floor = step.bytes_read / bandwidth.back_to_back
  result = {"row": name, "shape": dataclasses.asdict(row), "mean_len": float(step.lens.mean()),
            "decision": f"{decision.backend}: {decision.reason}",
            "bytes_read": step.bytes_read, **ours}
  result.update(_beside(row, step, seconds, repeats, interpret))
  if peers and not (row.int8 or row.quest or row.platform != "auto"):  # no scales, no choice
    best = peer_best(step, repeats)
    if np.isfinite(best["seconds"]):
      peer = timing.figures(best["call"], step.bytes_read, bandwidth, repeats, best["seconds"])
      result["peers"] = {"ragged_paged_attention": _compare(peer, ours, best["out"], out,
                                                            best["blocks"])}
    result["peer_refused"] = best.get("refused", [])
  result["keys_a_step"] = {keys: round(floor / ours_seconds(step, repeats, interpret, keys)[0], 3)
                           for keys in tried}
  timed = lambda: ours_seconds(step, repeats, interpret)[0]
  result["probes_ms"] = {part: round(decode_probes.seconds(part, timed) * 1e3, 4)
                         for part in probes}
  if profile:
    result["ops_us"] = timing.top_ops(call, repeats)
  return result


def _beside(row: Row, step: Step, seconds: float, repeats: int,
            interpret: bool) -> dict[str, Any]:
  """What a step of its kind is held against, back to back: a mixed step, its parts apart
  (`Row.parts`: the prompt chunks alone, the decodes alone); Quest's, the step reading every
  page; a prefill, `sh.attention` of the same rows (causal, the library's defaults for the
  hardware)."""
  parts = row.parts()
  if parts is not None:
    apart = [ours_seconds(make_step(part), repeats, interpret)[0] for part in parts]
    return {"parts_ms": [round(t * 1e3, 4) for t in apart],
            "over_parts": round(seconds / sum(apart), 3)}
  if row.quest:  # Quest's step (its choice in it) against the step reading every page
    every = ours_seconds(make_step(dataclasses.replace(row, quest=0)), repeats, interpret)[0]
    return {"every_page_ms": round(every * 1e3, 4), "every_page_over": round(every / seconds, 3)}
  if row.prompts == row.seqs == 1:  # nothing cached: its keys are its new rows'
    config = sh.AttentionConfig(interpret=interpret)
    call = jax.jit(lambda q, k, v: sh.attention(q, k, v, config=config).attention_outputs)
    args = (step.q[None], step.k[None], step.v[None])
    alone = timing.back_to_back_seconds(call, *args, repeats=repeats)
    chip = None if interpret else timing.device_seconds(call, *args, repeats=repeats)
    return {"attention_ms": round(alone * 1e3, 4), "over_attention": round(seconds / alone, 3),
            "attention_device_ms": None if chip is None else round(chip * 1e3, 4)}
  return {}


def run_fixed_row(name: str, row: FixedRow, repeats: int, bandwidth: timing.Bandwidth,
                  interpret: bool, profile: bool = False) -> dict[str, Any]:
  """A fixed-cache row's figures: `sh.attention` (the library's TPU choice) and jax.nn's xla."""
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (row.batch, row.rows, row.heads, row.head_dim), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (row.batch, row.keys, row.kv_heads, row.head_dim),
                            jnp.bfloat16) for kk in keys[1:])
  config = sh.AttentionConfig(interpret=interpret)
  decision = sh.explain(q, k, v, for_platform="tpu", config=config)
  ours = jax.jit(lambda q, k, v: sh.attention(q, k, v, config=config).attention_outputs)
  visible = (jnp.arange(row.keys)[None] <= jnp.arange(row.rows)[:, None] + row.keys - row.rows)
  theirs = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=visible[None, None], implementation="xla"))
  bytes_read = 2 * k.size * k.dtype.itemsize
  mine = timing.figures(lambda: ours(q, k, v), bytes_read, bandwidth, repeats)
  peer = timing.figures(lambda: theirs(q, k, v), bytes_read, bandwidth, repeats)
  result = {"row": name, "shape": dataclasses.asdict(row), "mean_len": float(row.keys),
            "decision": f"{decision.backend}: {decision.reason}", "bytes_read": bytes_read,
            **mine, "peers": {"jax_nn_xla": _compare(peer, mine, theirs(q, k, v), ours(q, k, v),
                                                      "-")}}
  if profile:
    result["ops_us"] = timing.top_ops(lambda: ours(q, k, v), repeats)
  return result


def _cell(figures: dict[str, Any]) -> str:
  """ms and fraction back to back; on the chip where traced; launched alone."""
  text = f"{figures['ms']:.3f} ms {figures['fraction_of_bandwidth']:.3f}"
  if figures.get("device_ms") is not None:
    text += f" (chip {figures['device_ms']:.3f} ms {figures['device_fraction']:.3f})"
  return text + f" (alone {figures['launch_ms']:.3f} ms, launch {figures['dispatch_ms']:.3f} ms)"


def _over_bf16(result: dict[str, Any], results: list[dict[str, Any]]) -> str:
  """An int8 pool's step over the bf16 step of the same shape, where both ran."""
  if not result["shape"].get("int8"):
    return ""
  bf16 = [r for r in results if r["shape"] == {**result["shape"], "int8": False}]
  return f" | over the bf16 step: {result['ms'] / bf16[0]['ms']:.2f}x" if bf16 else ""


def report(results: list[dict[str, Any]], bandwidth: timing.Bandwidth) -> str:
  chip = "" if bandwidth.device is None else f", on the chip {bandwidth.device / 1e9:.0f}"
  lines = [f"read bandwidth (jitted sum over 2 GiB), GB/s: back to back "
           f"{bandwidth.back_to_back / 1e9:.0f}{chip}, launched alone {bandwidth.launch / 1e9:.0f}",
           "row | ours: ms, fraction of the bandwidth | peer: the same, ours over it "
           "(back to back; on the chip), blocks"]
  for r in results:
    cell = f"{r['row']} (mean length {r['mean_len']:.0f}) | {_cell(r)}"
    for name, peer in r.get("peers", {}).items():
      chip_ratio = "" if peer["device_ours_over"] is None else f"; {peer['device_ours_over']:.2f}x"
      cell += (f" | {name}: {_cell(peer)}, {peer['ours_over']:.2f}x{chip_ratio}, "
               f"{peer['blocks']} (max diff {peer['max_difference']:.3g})")
    if "over_parts" in r:
      cell += f" | over its parts apart: {r['over_parts']:.2f}x"
    if "every_page_over" in r:
      cell += (f" | every page over it: {r['every_page_over']:.2f}x "
               f"({r['every_page_ms']:.3f} ms)")
    if "over_attention" in r:
      cell += f" | over attention: {r['over_attention']:.2f}x ({r['attention_ms']:.3f} ms"
      if r.get("attention_device_ms") and r.get("device_ms"):
        cell += (f"; on the chip {r['device_ms'] / r['attention_device_ms']:.2f}x, "
                 f"{r['attention_device_ms']:.3f} ms")
      cell += ")"
    cell += _over_bf16(r, results)
    lines.append(cell + "".join(f" | {k} keys a step: {f:.3f}"
                                for k, f in r.get("keys_a_step", {}).items())
                 + "".join(f" | {part} alone: {ms:.3f} ms"
                           for part, ms in r.get("probes_ms", {}).items()))
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv
  f = flags.FLAGS
  rows = SMOKE_ROWS if f.smoke else ROWS
  fixed = SMOKE_FIXED if f.smoke else FIXED_ROWS
  unknown = ([r for r in f.rows if r not in ROWS and r not in FIXED_ROWS]
             + [p for p in f.probes if p not in decode_probes.PROBES])
  if unknown:
    raise app.UsageError(f"unknown rows or probes: {unknown}; rows are "
                         f"{list(ROWS) + list(FIXED_ROWS)}, probes {list(decode_probes.PROBES)}")
  bandwidth = timing.Bandwidth.measure(0.01 if f.smoke else 2.0, f.repeats)
  results = []
  for name in f.rows:
    results.append(
        run_fixed_row(name, fixed[name], f.repeats, bandwidth, f.smoke, f.profile)
        if name in fixed else
        run_row(name, rows[name], f.repeats, bandwidth, f.smoke, not f.smoke,
                tuple(int(k) for k in f.block_keys), tuple(f.probes), f.profile))
    print(report(results[-1:], bandwidth).split("\n", 2)[-1], flush=True)
  text = report(results, bandwidth)
  print(text)
  if f.out:
    bench_report.write(f.out, "bench_tpu_decode", {
        "device": str(jax.devices()[0].device_kind),
        "read_bandwidth": dataclasses.asdict(bandwidth), "results": results}, text)


if __name__ == "__main__":
  flags.DEFINE_list("rows", ["decode_p16", "decode_p64", "fixed_t1", "fixed_t4"],
                    f"Rows to run, of {list(ROWS) + list(FIXED_ROWS)}.")
  flags.DEFINE_integer("repeats", 5, "Timed calls per figure (the median is kept).")
  flags.DEFINE_string("out", None, "A folder for bench_tpu_decode.json (None: print only).")
  flags.DEFINE_list("block_keys", [], "Also time ours at these keys a grid step (a tuning "
                    "run; the kernel's BLOCK_KEYS otherwise).")
  flags.DEFINE_list("probes", [], f"Also time the paged kernel with only one part of its work, "
                    f"of {list(decode_probes.PROBES)} (a diagnosis).")
  flags.DEFINE_bool("profile", False, "Also trace the paged step and keep its device "
                    "operations' time a call, in microseconds (`ops_us`, the largest first).")
  flags.DEFINE_bool("smoke", False, "Tiny rows in interpret mode, no peer (a CPU check).")
  app.run(main)
