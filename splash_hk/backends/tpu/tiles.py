"""The dense TPU kernel's tiles: measured on the chip, looked up once per static shape.

A call's tiles (the `BlockSizes` fields and `AttentionConfig.fused_backward` its caller left
unset) come from the first of:
1. the tuning cache: what `python -m splash_hk.tune` measured on this machine
   (`SPLASH_HK_TILE_CACHE`, default `~/.cache/splash_hk/tiles.json`);
2. the shipped table: that command's output on the chips we were lent (`tiles_*.json` beside
   this file; today a v5e);
3. the rule, for chips and shapes neither holds (`rule`).
Entries are keyed by `Key` (chip generation, dtype, head dim, length band, mask kind); a key
not measured takes the entry of the nearest measured band of the same chip, dtype, head dim
and mask kind, its tiles cut to the call's length. The tiles never change numbers beyond the
dtype's tolerance, only speed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Any

from jax.extend import backend as jax_backend

from splash_hk.backends import base
from splash_hk.config import AttentionConfig, BlockSizes
from splash_hk.masks import _objects
from splash_hk.types import Facts

LANE = 128  # every splash tile is a multiple of this
BANDS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)  # length bands (upper ends)
CACHE_ENV = "SPLASH_HK_TILE_CACHE"
SHIPPED = tuple(sorted(Path(__file__).parent.glob("tiles_*.json")))


@dataclasses.dataclass(frozen=True)
class Key:
  """What tiles are chosen by."""

  chip: str  # the device kind ("TPU v5 lite"), or "" when lowered off the chip
  dtype: str  # the kernel's input dtype ("bfloat16")
  head_dim: int
  band: int  # the smallest of BANDS holding max(T, S) (the largest for longer calls)
  mask: str  # "causal", "window", "chunk", "segments", "full" or "other"


@dataclasses.dataclass(frozen=True)
class Tiles:
  """The tiles of one call, and where they came from (what `explain` says)."""

  block_q: int
  block_kv: int
  block_kv_compute: int
  block_q_bwd: int
  block_kv_bwd: int
  block_kv_compute_bwd: int
  fused_backward: bool
  source: str = "rule"

  @property
  def blocks(self) -> tuple[int, int, int, int]:
    """(block_q, block_kv, block_q_bwd, block_kv_bwd): what the masks are planned over."""
    return self.block_q, self.block_kv, self.block_q_bwd, self.block_kv_bwd

  def words(self) -> str:
    back = "fused" if self.fused_backward else "dq and dK/dV apart"
    return (f"tiles {self.block_q}/{self.block_kv}/{self.block_kv_compute}, backward "
            f"{self.block_q_bwd}/{self.block_kv_bwd}/{self.block_kv_compute_bwd} {back} "
            f"({self.source})")


def band(length: int) -> int:
  return next((b for b in BANDS if length <= b), BANDS[-1])


def rule(length: int) -> Tiles:
  """Tiles for a shape no table holds: 512-row query tiles over 1024 keys computed 512 at a
  time, the fused backward (the v5e's measured choice for D 128 from 4k to 16k tokens), cut to
  the length; short sequences take one tile."""
  q = min(512, longest_tile(length))
  kv = min(1024, longest_tile(length))
  return Tiles(q, kv, min(512, kv), q, kv, min(512, kv), True, "rule")


def longest_tile(length: int) -> int:
  """The largest power-of-two multiple of LANE not above the padded length."""
  padded = -(-length // LANE) * LANE
  tile = LANE
  while tile * 2 <= padded:
    tile *= 2
  return tile


def _parse(entries: list[dict[str, Any]], source: str) -> dict[Key, Tiles]:
  table = {}
  for entry in entries:
    tiles = {k: v for k, v in entry["tiles"].items() if k in Tiles.__dataclass_fields__}
    table[Key(**entry["key"])] = Tiles(**{**tiles, "source": source})
  return table


@functools.cache
def _shipped() -> dict[Key, Tiles]:
  table: dict[Key, Tiles] = {}
  for path in SHIPPED:
    table.update(_parse(json.loads(path.read_text())["entries"], f"table {path.name}"))
  return table


def cache_path() -> Path:
  return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "splash_hk" / "tiles.json")


@functools.cache
def _tuned(path: Path, stamp: float) -> dict[Key, Tiles]:
  del stamp  # re-read when the file changes
  return _parse(json.loads(path.read_text())["entries"], f"tuned {path}")


def _cached() -> dict[Key, Tiles]:
  path = cache_path()
  try:
    return _tuned(path, path.stat().st_mtime)
  except (OSError, ValueError, KeyError, TypeError):
    return {}


def lookup(key: Key, length: int) -> Tiles:
  """The tiles of `key`: the tuning cache's, the shipped table's (exact band, else the nearest
  measured band), else the rule's; cut to `length`."""
  for table in (_cached(), _shipped()):
    if key in table:
      return _fit(table[key], length)
  for table in (_cached(), _shipped()):
    near = [k for k in table if dataclasses.replace(k, band=key.band) == key]
    if near:
      nearest = min(near, key=lambda k: (abs(BANDS.index(k.band) - BANDS.index(key.band)),
                                         -k.band))
      found = table[nearest]
      return _fit(dataclasses.replace(found, source=f"{found.source}, band {nearest.band}"),
                  length)
  return rule(length)


def _fit(t: Tiles, length: int) -> Tiles:
  """`t` with no tile longer than the call's padded length (a short call: one tile)."""
  most = longest_tile(length)
  q, kv, q_b, kv_b = (min(a, most) for a in (t.block_q, t.block_kv, t.block_q_bwd, t.block_kv_bwd))
  return dataclasses.replace(t, block_q=q, block_kv=kv, block_kv_compute=min(t.block_kv_compute, kv),
                             block_q_bwd=q_b, block_kv_bwd=kv_b,
                             block_kv_compute_bwd=min(t.block_kv_compute_bwd, kv_b))


def resolve(config: AttentionConfig, key: Key, query_len: int, kv_len: int) -> Tiles:
  """The call's tiles: what its `BlockSizes` and `fused_backward` say, the rest looked up."""
  found = lookup(key, max(query_len, kv_len))
  given: BlockSizes = config.block_sizes
  said = {f.name: getattr(given, f.name) for f in dataclasses.fields(given)
          if getattr(given, f.name) is not None}
  if config.fused_backward is not None:
    said["fused_backward"] = config.fused_backward
  if not said:
    return found
  # An unset backward tile follows its forward tile when that is set (BlockSizes.resolve).
  for fwd, bwd in (("block_q", "block_q_bwd"), ("block_kv", "block_kv_bwd"),
                   ("block_kv_compute", "block_kv_compute_bwd")):
    if fwd in said and bwd not in said:
      said[bwd] = said[fwd]
  tiles = dataclasses.replace(found, **said, source=f"given, the rest from {found.source}")
  return dataclasses.replace(tiles, block_kv_compute=min(tiles.block_kv_compute, tiles.block_kv),
                             block_kv_compute_bwd=min(tiles.block_kv_compute_bwd,
                                                      tiles.block_kv_bwd))


def refusal(given: BlockSizes) -> str | None:
  """Why tiles a caller gave cannot be the TPU kernel's, or None: multiples of LANE, and a
  compute run dividing its tile where both are given."""
  sizes = {f.name: getattr(given, f.name) for f in dataclasses.fields(given)}
  bad = {n: v for n, v in sizes.items() if v is not None and v % LANE}
  if bad:
    return f"splash block sizes must be multiples of {LANE}, got {bad}"
  for compute, tile in (("block_kv_compute", "block_kv"), ("block_kv_compute_bwd", "block_kv_bwd")):
    if sizes[compute] and sizes[tile] and sizes[tile] % sizes[compute]:
      return (f"BlockSizes.{compute} = {sizes[compute]} must divide {tile} = {sizes[tile]} (the "
              "kernel computes a tile's keys in runs of it)")
  return None


def chip() -> str:
  """The TPU this process runs on (its device kind, "TPU v5 lite"), or "" off the chip (a
  call lowered for TPU on another host gets the rule's tiles or the shipped table's nearest)."""
  try:
    devices = jax_backend.get_backend("tpu").devices()
  except RuntimeError:
    return ""
  return devices[0].device_kind if devices else ""


def mask_kind(facts: Facts) -> str:
  """The mask's kind as the table keys it: segments (packed documents, padding) over the rule."""
  if facts.segments:
    return "segments"
  rules = _objects.as_rules(facts.rule) if facts.rule is not None else {}
  if rules is None:
    return "other"
  if rules.get("window"):
    return "window"
  if rules.get("chunk_size"):
    return "chunk"
  return "causal" if rules.get("causal") else "full"


def key_of(facts: Facts, dtype: str = "") -> Key:
  return Key(chip(), dtype or facts.dtype, facts.key_shape[3], band(max(facts.query_len,
                                                                        facts.kv_len)),
             mask_kind(facts))


@functools.lru_cache(maxsize=256)
def for_call(facts: Facts, dtype: str = "") -> Tiles:
  """The tiles of a call with these facts (its kernel's dtype `dtype`, else `facts.dtype`)."""
  return resolve(facts.config, key_of(facts, dtype), facts.query_len, facts.kv_len)


@functools.lru_cache(maxsize=64)
def padded_layout(query_len: int, kv_len: int,
                  t: Tiles) -> tuple[Tiles, int, int]:
  """The tiles clamped to the (padded) lengths (a compute run that no longer divides its tile:
  the whole tile), and the padded lengths."""
  q_cap, kv_cap = base.round_up(query_len, LANE), base.round_up(kv_len, LANE)
  bq, bq_bwd = min(t.block_q, q_cap), min(t.block_q_bwd, q_cap)
  bkv, bkv_bwd = min(t.block_kv, kv_cap), min(t.block_kv_bwd, kv_cap)
  run = lambda c, kv: c if kv % c == 0 else kv
  t = dataclasses.replace(t, block_q=bq, block_kv=bkv, block_q_bwd=bq_bwd, block_kv_bwd=bkv_bwd,
                          block_kv_compute=run(t.block_kv_compute, bkv),
                          block_kv_compute_bwd=run(t.block_kv_compute_bwd, bkv_bwd))
  return (t, base.round_up(query_len, math.lcm(bq, bq_bwd)),
          base.round_up(kv_len, math.lcm(bkv, bkv_bwd)))
