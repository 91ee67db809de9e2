"""The TPU decode bench: a paged decode step against JAX's ragged paged attention, and a decode
over a fixed cache against jax.nn's xla attention, as a fraction of the read bandwidth measured
in the same run.

A step's floor is reading every cached key and value once. Each row is one decode step (a row
per sequence) of `sh.paged_attention` over a pool of shuffled pages, the pool donated (the step
writes its new tokens, then attends), timed after an untimed call of the same executable; the
peer, JAX's `ragged_paged_attention` (`jax.experimental.pallas.ops.tpu`), reads the same
keys and values in its own layout (k and v heads interleaved, the new tokens already in) at
each of its candidate block sizes, the fastest kept. Bytes: each sequence's keys and values
after the write, once. A fixed-cache row is `sh.attention` of T rows (end-aligned causal)
against B caches of S keys, beside `jax.nn.dot_product_attention(implementation="xla")` of
the same call (its mask the same rule).

    python -m benchmarks.bench_tpu_decode --out=DIR [--rows=...] [--repeats=5]
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

from absl import app
from absl import flags
import jax
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
import jax.numpy as jnp
import numpy as np

from benchmarks import decode_probes
from benchmarks import timing
import splash_hk as sh


@dataclasses.dataclass(frozen=True)
class Row:
  seqs: int
  shortest: int
  longest: int
  page: int
  heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  rows: int = 1  # query rows per sequence (decode: 1)


ROWS = {"decode_p16": Row(32, 1024, 8192, 16), "decode_p64": Row(32, 1024, 8192, 64),
        "decode_p128": Row(32, 1024, 8192, 128),
        "decode64_p16": Row(64, 512, 4096, 16), "long8_p64": Row(8, 32768, 32768, 64),
        "verify4_p64": Row(32, 1024, 8192, 64, rows=4)}
SMOKE_ROWS = {name: dataclasses.replace(r, seqs=3, shortest=40, longest=300, heads=4,
                                        kv_heads=2, head_dim=128) for name, r in ROWS.items()}


@dataclasses.dataclass(frozen=True)
class FixedRow:
  batch: int
  rows: int  # T: 1 a decode, 2-8 a verification of drafts
  keys: int  # S
  heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128


FIXED_ROWS = {"fixed_t1": FixedRow(32, 1, 8192), "fixed_t4": FixedRow(32, 4, 8192)}
SMOKE_FIXED = {name: dataclasses.replace(r, batch=2, keys=300, heads=4, kv_heads=2)
               for name, r in FIXED_ROWS.items()}
PEER_KEYS = (512, 1024)  # the peer's keys a block (its pages a block: these over the page)
PEER_QUERIES = (8, 32)


@dataclasses.dataclass
class Step:
  q: jax.Array  # [N, Hq, D]
  k: jax.Array  # [N, Hkv, D]
  v: jax.Array
  pool: sh.PagedKVCache
  batch: sh.RaggedBatch
  lens: np.ndarray  # [S] lengths after the write

  @property
  def bytes_read(self) -> int:
    k = self.pool.key
    return int(self.lens.sum()) * k.shape[1] * (k.shape[3] + self.pool.value.shape[3]) * (
        k.dtype.itemsize)


def make_step(row: Row, seed: int = 0) -> Step:
  """A decode step over shuffled pages of random bf16 keys and values."""
  rng = np.random.default_rng(seed)
  lens = rng.integers(row.shortest, row.longest + 1, row.seqs).astype(np.int32)  # after
  need = -(-lens // row.page)
  width = int(need.max())
  order = rng.permutation(int(need.sum()) + 1)  # one spare page
  table = np.zeros((row.seqs, width), np.int32)
  at = 0
  for s, n in enumerate(need):
    table[s, :n] = order[at:at + n]
    at += n
  pages = int(need.sum()) + 1
  keys = jax.random.split(jax.random.key(seed), 5)
  shape = (pages, row.kv_heads, row.page, row.head_dim)
  pool = sh.PagedKVCache(jax.random.normal(keys[0], shape, jnp.bfloat16),
                         jax.random.normal(keys[1], shape, jnp.bfloat16))
  n = row.seqs * row.rows
  q = jax.random.normal(keys[2], (n, row.heads, row.head_dim), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (n, row.kv_heads, row.head_dim), jnp.bfloat16)
          for kk in keys[3:])
  cu = np.arange(row.seqs + 1, dtype=np.int32) * row.rows
  batch = sh.RaggedBatch(jnp.asarray(cu), jnp.asarray(lens - row.rows), jnp.asarray(table),
                         jnp.asarray(row.seqs, jnp.int32))
  return Step(q, k, v, pool, batch, lens)


def ours_seconds(step: Step, repeats: int, interpret: bool,
                 keys: int | None = None) -> tuple[float, jax.Array]:
  """The median step time of `sh.paged_attention` with the pool donated (each timed call after
  an untimed one of the same executable; the kernel's `keys` a grid step, `block_keys`), and
  its output."""
  with decode_probes.block_keys(keys):
    return _ours_seconds(step, repeats, interpret)


def _ours_seconds(step: Step, repeats: int, interpret: bool) -> tuple[float, jax.Array]:
  config = sh.AttentionConfig(platform="splash" if interpret else "auto", interpret=interpret,
                              allow_fallback=False)
  run = jax.jit(lambda q, k, v, pool, batch: sh.paged_attention(q, k, v, pool, batch,
                                                                config=config),
                donate_argnums=3)
  pool = jax.tree.map(jnp.copy, step.pool)  # the step's own pool stays for the peer
  out, pool = jax.block_until_ready(run(step.q, step.k, step.v, pool, step.batch))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out, pool = jax.block_until_ready(run(step.q, step.k, step.v, pool, step.batch))
    times.append(time.perf_counter() - start)
  return float(np.median(times)), out


def peer_inputs(step: Step) -> tuple[Any, ...]:
  """JAX's ragged paged attention's arguments for the step: the pool with the new tokens
  written, k and v heads interleaved ([P, page, 2 * Hkv, D]), lengths after the write, the page
  table, row offsets and the sequence count."""
  p, hkv, page, d = step.pool.key.shape
  table = step.batch.page_table
  rows = step.q.shape[0] // table.shape[0]
  seq = jnp.repeat(jnp.arange(table.shape[0]), rows)
  pos = jnp.asarray(step.lens)[seq] - rows + jnp.tile(jnp.arange(rows), table.shape[0])
  write = lambda pool, new: pool.at[table[seq, pos // page], :, pos % page].set(new)
  k, v = write(step.pool.key, step.k), write(step.pool.value, step.v)  # [P, Hkv, page, D]
  kv = jnp.stack([k, v], axis=2).transpose(0, 3, 1, 2, 4).reshape(p, page, 2 * hkv, d)
  return (step.q, kv, jnp.asarray(step.lens), table, step.batch.cu_q_lens,
          jnp.asarray([table.shape[0]], jnp.int32))


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
        seconds = timing.median_seconds(call, repeats=repeats)
      except Exception as failure:  # a candidate it refuses (VMEM): the next
        best.setdefault("refused", []).append(f"{keys}/{queries}: {type(failure).__name__}")
        continue
      if seconds < best["seconds"]:
        best.update(seconds=seconds, blocks=f"{keys} keys / {queries} rows", out=call())
  return best


def run_row(name: str, row: Row, repeats: int, bandwidth: float, interpret: bool,
            peers: bool, tried: tuple[int, ...] = (),
            probes: tuple[str, ...] = ()) -> dict[str, Any]:
  """A row's figures: ours (and at each of `tried` keys a grid step, and each of `probes`'
  kernel parts alone), the peer's best."""
  step = make_step(row)
  decision = sh.explain_paged(step.q, step.k, step.v, step.pool, step.batch,
                              for_platform="tpu", config=sh.AttentionConfig(interpret=interpret))
  seconds, out = ours_seconds(step, repeats, interpret)
  floor = step.bytes_read / bandwidth
  result = {"row": name, "shape": dataclasses.asdict(row), "mean_len": float(step.lens.mean()),
            "decision": f"{decision.backend}: {decision.reason}",
            "bytes_read": step.bytes_read, "ms": round(seconds * 1e3, 4),
            "fraction_of_bandwidth": round(floor / seconds, 3)}
  if peers:
    best = peer_best(step, repeats)
    if np.isfinite(best["seconds"]):
      result["peers"] = {"ragged_paged_attention": {
          "ms": round(best["seconds"] * 1e3, 4), "blocks": best["blocks"],
          "fraction_of_bandwidth": round(floor / best["seconds"], 3),
          "ours_over": round(best["seconds"] / seconds, 3),
          "max_difference": float(jnp.max(jnp.abs(best["out"].astype(jnp.float32)
                                                  - out.astype(jnp.float32))))}}
    result["peer_refused"] = best.get("refused", [])
  result["keys_a_step"] = {keys: round(floor / ours_seconds(step, repeats, interpret, keys)[0], 3)
                           for keys in tried}
  timed = lambda: ours_seconds(step, repeats, interpret)[0]
  result["probes_ms"] = {part: round(decode_probes.seconds(part, step, repeats, timed) * 1e3, 4)
                         for part in probes}
  return result


def run_fixed_row(name: str, row: FixedRow, repeats: int, bandwidth: float,
                  interpret: bool) -> dict[str, Any]:
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
  floor = 2 * k.size * k.dtype.itemsize / bandwidth
  seconds = timing.median_seconds(ours, q, k, v, repeats=repeats)
  peer = timing.median_seconds(theirs, q, k, v, repeats=repeats)
  difference = jnp.max(jnp.abs(ours(q, k, v).astype(jnp.float32)
                               - theirs(q, k, v).astype(jnp.float32)))
  return {"row": name, "shape": dataclasses.asdict(row), "mean_len": float(row.keys),
          "decision": f"{decision.backend}: {decision.reason}", "ms": round(seconds * 1e3, 4),
          "fraction_of_bandwidth": round(floor / seconds, 3),
          "peers": {"jax_nn_xla": {"ms": round(peer * 1e3, 4), "blocks": "-",
                                   "fraction_of_bandwidth": round(floor / peer, 3),
                                   "ours_over": round(peer / seconds, 3),
                                   "max_difference": float(difference)}}}


def report(results: list[dict[str, Any]], bandwidth: float) -> str:
  lines = [f"read bandwidth measured: {bandwidth / 1e9:.0f} GB/s (jitted sum over 2 GiB)",
           "row | ours ms, fraction of bandwidth | peer: ms, fraction, ours over it, blocks"]
  for r in results:
    cell = f"{r['row']} (mean length {r['mean_len']:.0f}) | {r['ms']:.3f} ms, " \
           f"{r['fraction_of_bandwidth']:.3f}"
    for name, peer in r.get("peers", {}).items():
      cell += (f" | {name}: {peer['ms']:.3f} ms, {peer['fraction_of_bandwidth']:.3f}, "
               f"{peer['ours_over']:.2f}x, {peer['blocks']} "
               f"(max diff {peer['max_difference']:.3g})")
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
  bandwidth = timing.read_bandwidth(0.01 if f.smoke else 2.0, f.repeats)
  results = []
  for name in f.rows:
    results.append(
        run_fixed_row(name, fixed[name], f.repeats, bandwidth, f.smoke) if name in fixed else
        run_row(name, rows[name], f.repeats, bandwidth, f.smoke, not f.smoke,
                tuple(int(k) for k in f.block_keys), tuple(f.probes)))
    print(report(results[-1:], bandwidth).split("\n", 2)[-1], flush=True)
  text = report(results, bandwidth)
  print(text)
  if f.out:
    os.makedirs(f.out, exist_ok=True)
    with open(os.path.join(f.out, "bench_tpu_decode.json"), "w") as out:
      json.dump({"device": str(jax.devices()[0].device_kind), "read_bandwidth": bandwidth,
                 "results": results}, out, indent=1)
    with open(os.path.join(f.out, "bench_tpu_decode.txt"), "w") as out:
      out.write(text + "\n")


if __name__ == "__main__":
  flags.DEFINE_list("rows", ["decode_p16", "decode_p64", "fixed_t1", "fixed_t4"],
                    f"Rows to run, of {list(ROWS) + list(FIXED_ROWS)}.")
  flags.DEFINE_integer("repeats", 5, "Timed calls per figure (the median is kept).")
  flags.DEFINE_string("out", None, "A folder for bench_tpu_decode.json (None: print only).")
  flags.DEFINE_list("block_keys", [], "Also time ours at these keys a grid step (a tuning "
                    "run; the kernel's BLOCK_KEYS otherwise).")
  flags.DEFINE_list("probes", [], f"Also time the paged kernel with only one part of its work, "
                    f"of {list(decode_probes.PROBES)} (a diagnosis).")
  flags.DEFINE_bool("smoke", False, "Tiny rows in interpret mode, no peer (a CPU check).")
  app.run(main)
