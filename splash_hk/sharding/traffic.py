"""What a compiled SPMD program costs each device: bytes it sends, and its peak memory.

Read from the compiled program itself (its HLO and XLA's memory analysis), not
from a formula, so a strategy's real collectives are counted: the reshards
`shard_map` adds at its edges, the all-to-alls of Ulysses, the ring's
collective-permutes times its loop's trip count.

  traffic = sh.sharding.traffic.measure(jax.jit(step), q, k, v)
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, NamedTuple

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
COLLECTIVES = ("all-to-all", "all-gather", "collective-permute", "all-reduce", "reduce-scatter")
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) ([a-z][\w-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_CALLED = re.compile(r"\b(body|to_apply|calls|true_computation|false_computation)=%([\w.-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


class Traffic(NamedTuple):
  """Per device: bytes sent by collectives in one run, and argument + temp bytes."""

  sent_bytes: int
  memory_bytes: int


def measure(jitted: Any, *args: Any) -> Traffic:
  """Compiles `jitted` (a `jax.jit` function) for `args` (arrays or ShapeDtypeStructs)."""
  compiled = jitted.lower(*args).compile()
  memory = compiled.memory_analysis()
  return Traffic(sent_bytes(compiled.as_text()),
                 memory.argument_size_in_bytes + memory.temp_size_in_bytes)


def sent_bytes(hlo: str) -> int:
  """Bytes one device sends in one run of a compiled (per-device) HLO module.

  all-to-all and all-gather: the (g - 1) / g of the result that comes from the
  g - 1 other devices of the group (what each device sends, by symmetry);
  collective-permute: its result; all-reduce: 2 (g - 1) / g of it (a ring);
  reduce-scatter: (g - 1) times its result. A while loop's collectives count
  its known trip count times, a conditional's its costliest branch.

  Raises:
    ValueError: for an async collective, or a loop with collectives and no known trip count.
  """
  computations = _computations(hlo)
  found = re.search(r"^ENTRY %(\S+) ", hlo, re.M)
  if found is None:
    raise ValueError("`hlo` has no ENTRY computation: pass a compiled program's text.")
  entry = found.group(1)

  @functools.lru_cache(maxsize=None)
  def total(name: str) -> float:
    count = 0.0
    for line in computations[name]:
      count += _own_bytes(line)
      trips = _TRIP_COUNT.search(line)
      for kind, called in _CALLED.findall(line):
        sub = total(called)
        if kind == "body" and sub:
          if trips is None:
            raise ValueError(f"a loop sends {sub:.0f} bytes per trip but has no known trip "
                             f"count: {line.strip()[:120]}")
          sub *= int(trips.group(1))
        count += sub
      branches = _BRANCHES.search(line)
      if branches:
        count += max(total(b.strip().lstrip("%")) for b in branches.group(1).split(","))
    return count

  return round(total(entry))


def _computations(hlo: str) -> dict[str, list[str]]:
  """{computation name: its instruction lines}."""
  out: dict[str, list[str]] = {}
  current = None
  for line in hlo.splitlines():
    start = _COMPUTATION.match(line)
    if start:
      current = out.setdefault(start.group(1), [])
    elif line.startswith("}"):
      current = None
    elif current is not None:
      current.append(line)
  return out


def _own_bytes(line: str) -> float:
  """Bytes this instruction sends, if it is a collective (see `sent_bytes`)."""
  match = _INSTRUCTION.match(line)
  if match is None:
    return 0.0
  result, op = match.group(1), match.group(2)
  if op.endswith("-start") and op[:-len("-start")] in COLLECTIVES:
    raise ValueError(f"async collective {op}: its bytes are not counted; {line.strip()[:120]}")
  if op not in COLLECTIVES:
    return 0.0
  size = sum(DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
             for dtype, dims in _ARRAY.findall(result))
  if op == "collective-permute":
    return float(size)
  g = _group_size(line)
  return {"all-to-all": size * (g - 1) / g, "all-gather": size * (g - 1) / g,
          "all-reduce": 2 * size * (g - 1) / g, "reduce-scatter": size * (g - 1)}[op]


def _group_size(line: str) -> int:
  """Devices per replica group: `{{0,1,..},..}`, `[groups,size]<=[..]` or `mesh[..] {axes}`."""
  listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  if listed:
    return len(listed.group(1).split(","))
  iota = re.search(r"replica_groups=\[[\d,]*?(\d+)\]<=", line)
  if iota:
    return int(iota.group(1))
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if mesh:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", mesh.group(2)))
  raise ValueError(f"cannot read the replica groups of: {line.strip()[:160]}")
