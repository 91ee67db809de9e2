"""The TPU programs of the benches, compiled for a v5e on this CPU host (no chip): what XLA puts
around the kernels, before any chip time is spent.

  make tpu-aot TPU_AOT="--rows=int8_p64,mixed_p64,own8_128_16k"
  (= PYTHONPATH=.libtpu python -m benchmarks.tpu_programs --rows=...; `make tpu-aot` installs
  libtpu, the TPU compiler, into .libtpu first)

libtpu compiles for a TPU topology without one (`jax.experimental.topologies`: a v5e 2x2, one
chip used): the whole program, Mosaic kernels included, so a kernel Mosaic refuses (a block
shape, VMEM) fails here as on the chip. The library traces as on a TPU (`jax.default_backend`
reads "tpu" while tracing). Each program's operations are listed with XLA's estimated cycles
(its cost model's, not a measurement: the chip's trace, `--profile` of the TPU benches, is the
measure): the copies and fusions XLA adds around the kernels (a layout change of a pool or of
q, k, v is a copy of all of it), the largest first. Rows: `bench_tpu_decode`'s steps and
fixed-cache rows, `bench_tpu_blocks`' chosen-block rows (forward and forward+backward).
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Iterator

from absl import app
from absl import flags

# libtpu on a host without a TPU: no metadata server, one worker, a v5e's accelerator type.
for _name, _value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", "v5litepod-4"),
                      ("TPU_WORKER_HOSTNAMES", "localhost")):
  os.environ.setdefault(_name, _value)

import jax  # pylint: disable=wrong-import-position

TOPOLOGY = "v5e:2x2"  # libtpu's smallest v5e topology on one host; the programs use one chip
DEVICE_KIND = "TPU v5 lite"  # what a v5e names itself (Pallas reads it for the chip's facts)
_OP = re.compile(r"\s*(?:ROOT )?%(\S+) = (.+?) ([\w-]+)\((.*)$")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def operations(hlo: str) -> Iterator[tuple[str, str, str, int]]:
  """(kind, name, shape, estimated cycles or 0) of each operation of the entry computation of
  compiled HLO text: copies, fusions, custom calls (kind "custom-call:<target>"), loops."""
  entry = hlo[hlo.index("ENTRY"):]
  for line in entry.splitlines():
    match = _OP.match(line)
    if not match:
      continue
    name, shape, kind, rest = match.groups()
    if kind not in ("copy", "fusion", "custom-call", "while", "conditional"):
      continue
    if kind == "custom-call":
      target = _TARGET.search(rest)
      kind = f"custom-call:{target.group(1) if target else '?'}"
    cycles = _CYCLES.search(rest)
    yield kind, name, shape.split("{")[0], int(cycles.group(1)) if cycles else 0


def summary(hlo: str, top: int) -> list[str]:
  """Lines: the program's kernels and copies counted, then its `top` operations by estimated
  cycles."""
  ops = list(operations(hlo))
  kernels = sum(kind == "custom-call:tpu_custom_call" for kind, *_ in ops)
  copies = [op for op in ops if op[0] == "copy"]
  lines = [f"  {kernels} Mosaic kernels, {len(copies)} copies "
           f"({sum(op[3] for op in copies)} estimated cycles)"]
  for kind, name, shape, cycles in sorted(ops, key=lambda op: -op[3])[:top]:
    lines.append(f"  {cycles:>10} {kind:<26} {name:<34} {shape}")
  return lines


def _as_on_a_tpu() -> Any:
  """A v5e device of the topology; the library and Pallas then trace as on that chip."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  from jax._src.pallas.mosaic import tpu_info  # pylint: disable=import-outside-toplevel
  device = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGY).devices[0]
  jax.default_backend = lambda: "tpu"
  tpu_info.get_device_kind = lambda: DEVICE_KIND
  tpu_info.get_num_device_cores = lambda: 1
  return device


def compiled(fn: Callable[..., Any], args: tuple[Any, ...], device: Any,
             **jit: Any) -> str:
  """`jax.jit(fn, **jit)` compiled for `device` on `args`' shapes: its HLO text."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
  return jax.jit(fn, **jit).lower(*jax.tree.map(spec, args)).compile().as_text()


def programs(name: str) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]:
  """A bench row's programs: name -> (function, arguments, jit options)."""
  # pylint: disable=import-outside-toplevel
  from benchmarks import bench_tpu_blocks, bench_tpu_decode, decode_steps
  import splash_hk as sh
  if name in bench_tpu_decode.FIXED_ROWS:
    row = bench_tpu_decode.FIXED_ROWS[name]
    q = jax.ShapeDtypeStruct((row.batch, row.rows, row.heads, row.head_dim), jax.numpy.bfloat16)
    k = jax.ShapeDtypeStruct((row.batch, row.keys, row.kv_heads, row.head_dim), q.dtype)
    return {"call": (lambda q, k, v: sh.attention(q, k, v).attention_outputs, (q, k, k), {})}
  if name in decode_steps.ROWS:
    step = decode_steps.make_step(decode_steps.ROWS[name])
    config = sh.AttentionConfig(platform=step.platform, allow_fallback=False)
    fn = lambda q, k, v, pool, batch: sh.paged_attention(q, k, v, pool, batch, config=config)
    return {"step": (fn, (step.q, step.k, step.v, step.pool, step.batch),
                     {"donate_argnums": 3})}
  row = bench_tpu_blocks.ROWS[name]
  q, k, v, cot = bench_tpu_blocks.inputs(row)
  choice = sh.sparse.top_k_blocks(q, k, row.top_k, row.block)
  _, chosen = bench_tpu_blocks.calls(row, interpret=False)
  return {what: (fn, (q, k, v, choice.kv_blocks, choice.counts), {})
          for what, fn in bench_tpu_blocks.programs(chosen, cot).items()}


def main(argv: list[str]) -> None:
  del argv
  device = _as_on_a_tpu()
  for name in flags.FLAGS.rows:
    for what, (fn, args, jit) in programs(name).items():
      print(f"{name} {what}:")
      print("\n".join(summary(compiled(fn, args, device, **jit), flags.FLAGS.top)), flush=True)


if __name__ == "__main__":
  flags.DEFINE_list("rows", ["decode_p64", "int8_p64"],
                    "Rows of bench_tpu_decode (decode_steps.ROWS, FIXED_ROWS) or "
                    "bench_tpu_blocks.")
  flags.DEFINE_integer("top", 12, "Operations listed a program, by estimated cycles.")
  app.run(main)
