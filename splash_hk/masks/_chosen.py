"""Key blocks chosen by the data (NSA's selection, MoBA's gate): the `Blocks` mask object.

Key j is visible to query i when `j // bk` is one of `kv_blocks[b, h, i // bq, :counts[b, h,
i // bq]]`, i the query's index in the call and j the key's index along S (a cache's slot).
The lists may be traced (chosen inside `jit`); only their shapes are static.

As the user writes it, a `Blocks` holds its lists (`kv_blocks`, `counts`: whole on every
device). The call's normal form (`for_call`) adds what kernels read, sliced as the call's
arrays are: `chosen` [B|1, Hq, nq, nk] bool (the lists as a map over block pairs, one row per
query head: sharded with the heads), `q_index` [B, T] (`b * T + i`: the global batch row and
query index, sliced with the queries) and `kv_index` [B, S] (j, sliced with the keys), and
`misuse` [B|1, Hq, nq] bool: the rows whose lists break the rules (they output NaN).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk.masks._blocks import ArrayLike, blocks, ranges
from splash_hk.masks._blocks import Blocks as Summaries
from splash_hk.masks._mask import Mask, Shaped, array_field
from splash_hk.masks._objects import Causal

__all__ = ("Blocks", "CallIndex", "misused_rows")


@dataclasses.dataclass(frozen=True)
class CallIndex:
  """What a mask object's normal form may read of its call: shapes and token indices."""

  batch: int
  query_len: int  # T
  kv_len: int  # S
  num_heads: int  # Hq
  num_kv_heads: int  # Hkv
  q_index: ArrayLike  # [B, T] int32: each query's index in the call (its original one)
  kv_index: ArrayLike  # [B, S] int32: each key's index along S


def _xp(*arrays: Any) -> Any:
  return np if all(isinstance(a, np.ndarray) for a in arrays) else jnp


@dataclasses.dataclass(frozen=True)
class Blocks(Mask):
  """Key blocks chosen per query block: `kv_blocks` [B|1, H, nq, K] int, `counts` [B|1, H, nq]
  int, `block_size` (bq, bk); H is 1, Hkv (one choice per GQA group) or Hq, nq = ceil(T / bq).
  `causal`: inside the chosen blocks, the causal rule too (`kv_pos <= q_pos`): what a gate that
  chose causally returns (`sparse.top_k_blocks`), the same as `& masks.Causal()`.

  Entries past a row's count are never read. A count outside [0, K], a listed block outside
  [0, ceil(S / bk)) or one listed twice for a query block is misuse: a ValueError naming
  `mask` when the lists are concrete; under `jit` the query rows involved output NaN.
  """

  kv_blocks: Shaped = array_field("free")
  counts: Shaped = array_field("free")
  block_size: tuple[int, int] = (128, 128)
  chosen: ArrayLike = array_field("head", None, axis=1)  # normal form (see the module), else None
  misuse: ArrayLike = array_field("head", None, axis=1)
  q_index: ArrayLike = array_field("q", None)
  kv_index: ArrayLike = array_field("kv", None)
  query_len: int = 0  # normal form: the call's T (q_index holds b * T + i)
  causal: bool = False

  def __post_init__(self) -> None:
    if not isinstance(self.causal, bool):
      raise ValueError(f"Blocks.causal must be a bool, got {self.causal!r}.")
    size = self.block_size
    if (not isinstance(size, tuple) or len(size) != 2 or
        not all(isinstance(n, (int, np.integer)) and n >= 1 for n in size)):
      raise ValueError(f"Blocks.block_size must be (bq, bk), two ints >= 1 (bq may be 1: a "
                       f"choice per token), got {size!r}.")
    object.__setattr__(self, "block_size", (int(size[0]), int(size[1])))

  def check(self, batch: int, query_len: int, kv_len: int) -> None:
    bq, _ = self.block_size
    lists, counts = self.kv_blocks, self.counts
    nq = -(-query_len // bq)
    if len(lists.shape) != 4 or lists.shape[0] not in (1, batch) or lists.shape[2] != nq:
      raise ValueError(
          f"`mask` Blocks.kv_blocks must be [B|1, H, nq, K] with B = {batch} and nq = "
          f"ceil(T / bq) = ceil({query_len} / {bq}) = {nq}, got {tuple(lists.shape)}; a decode "
          "step's choice is one row (nq = 1).")
    if tuple(counts.shape) != tuple(lists.shape[:3]):
      raise ValueError(f"`mask` Blocks.counts must be [B|1, H, nq] = {tuple(lists.shape[:3])} "
                       f"(the lists' leading axes), got {tuple(counts.shape)}.")
    for name, a in (("kv_blocks", lists), ("counts", counts)):
      if not jnp.issubdtype(a.dtype, jnp.integer):
        raise ValueError(f"`mask` Blocks.{name} must be integers, got {a.dtype}.")
    if not any(isinstance(a, (jax.core.Tracer, jax.ShapeDtypeStruct)) for a in (lists, counts)):
      bad = misuse(np.asarray(lists), np.asarray(counts), -(-kv_len // self.block_size[1]), np)
      if bad.any():
        b, h, r = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"`mask` Blocks lists a choice that breaks the rules at [batch {b}, head {h}, query "
            f"block {r}] (counts {int(np.asarray(counts)[b, h, r])}, blocks "
            f"{np.asarray(lists)[b, h, r].tolist()}): each count must be in [0, K = "
            f"{lists.shape[3]}], each listed block in [0, ceil(S / bk) = "
            f"{-(-kv_len // self.block_size[1])}), and no block listed twice for a query block.")

  def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
    h = self.kv_blocks.shape[1]
    if h not in (1, num_kv_heads, num_heads):
      raise ValueError(f"`mask` Blocks.kv_blocks has {h} heads: pass 1 (one choice for every "
                       f"head), Hkv = {num_kv_heads} (one per GQA group) or Hq = {num_heads}.")

  def for_call(self, call: CallIndex) -> Blocks:
    """This choice in normal form for `call` (see the module docstring)."""
    lists, counts = jnp.asarray(self.kv_blocks, jnp.int32), jnp.asarray(self.counts, jnp.int32)
    per_head = lambda a: jnp.repeat(a, call.num_heads // a.shape[1], axis=1)  # [B|1, Hq, ...]
    lists, counts = per_head(lists), per_head(counts)
    nk = -(-call.kv_len // self.block_size[1])
    rows = jnp.arange(call.batch, dtype=jnp.int32)[:, None] * call.query_len
    return dataclasses.replace(
        self, chosen=chosen_map(lists, counts, nk),  # [B|1, Hq, nq, nk]
        misuse=misuse(lists, counts, nk, jnp),  # [B|1, Hq, nq]
        q_index=rows + call.q_index,  # [B, T]
        kv_index=jnp.broadcast_to(call.kv_index, (call.batch, call.kv_len)),  # [B, S]
        query_len=call.query_len)

  def query_rows(self, xp: Any) -> tuple[ArrayLike, ArrayLike]:
    """(global batch row, query block) of each of this shard's queries: [B', T'] each."""
    q_index = self.q_index
    row = q_index // self.query_len if self.chosen.shape[0] > 1 else xp.zeros_like(q_index)
    return row, (q_index % self.query_len) // self.block_size[0]

  def choice(self) -> Blocks:
    """The choice alone (by index), without its causal rule."""
    return dataclasses.replace(self, causal=False)

  def visible(self, q_pos: ArrayLike, kv_pos: ArrayLike) -> ArrayLike:
    xp = _xp(self.chosen, self.q_index, self.kv_index)
    row, r = self.query_rows(xp)
    heads = xp.arange(self.chosen.shape[1])[None, :, None, None]
    c = xp.clip(self.kv_index // self.block_size[1], 0, self.chosen.shape[3] - 1)
    seen = self.chosen[row[:, None, :, None], heads, r[:, None, :, None], c[:, None, None, :]]
    return seen & (kv_pos <= q_pos) if self.causal else seen  # the choice is by index

  def classify(self, b: Summaries) -> tuple[ArrayLike, ArrayLike]:
    """From each plan block's range of chosen rows and key blocks, by prefix sums of the map."""
    may, full = self._classify_choice(b)
    if not self.causal:
      return may, full
    may_c, full_c = Causal().classify(b)
    return may & may_c, full & full_c

  def _classify_choice(self, b: Summaries) -> tuple[ArrayLike, ArrayLike]:
    xp = b.xp
    q = blocks(self.q_index, b.block_q, -1, xp)  # [B, nq', bq']
    kv = blocks(self.kv_index, b.block_kv, -1, xp)  # [B, nk', bk']
    row, r = self.query_rows(xp)
    r_lo, r_hi = ranges(blocks(r, b.block_q, 0, xp), q >= 0, xp)  # [B, nq']
    c_lo, c_hi = ranges(kv // self.block_size[1], kv >= 0, xp)  # [B, nk']
    sums = xp.cumsum(xp.cumsum(self.chosen.astype(np.int32), axis=2), axis=3)
    sums = xp.pad(sums, [(0, 0), (0, 0), (1, 0), (1, 0)])[row[:, 0]]  # [B, Hq, nq + 1, nk + 1]
    nq, nk = self.chosen.shape[2:]
    lo_r, hi_r = (xp.clip(a, 0, nq - 1)[:, None, :, None] for a in (r_lo, r_hi))
    lo_c, hi_c = (xp.clip(a, 0, nk - 1)[:, None, None, :] for a in (c_lo, c_hi))
    count = _rect(sums, lo_r, hi_r + 1, lo_c, hi_c + 1, xp)  # [B, Hq, nq', nk']
    area = (hi_r - lo_r + 1) * (hi_c - lo_c + 1)
    real = (r_lo <= r_hi)[:, None, :, None] & (c_lo <= c_hi)[:, None, None, :]
    return xp.any(real & (count > 0), axis=1), xp.all(real & (count == area), axis=1)


def _rect(sums: ArrayLike, r0, r1, c0, c1, xp) -> ArrayLike:
  """Entries of the map in rows [r0, r1) x columns [c0, c1), from its 2-D prefix sums
  `sums` [B, H, nq + 1, nk + 1]; the corners broadcast to [B, 1, nq', nk']."""
  batch, heads = sums.shape[:2]
  b = xp.arange(batch)[:, None, None, None]
  h = xp.arange(heads)[None, :, None, None]
  corner = lambda r, c: sums[b, h, r, c]
  return corner(r1, c1) - corner(r0, c1) - corner(r1, c0) + corner(r0, c0)


def chosen_map(lists: jax.Array, counts: jax.Array, num_kv_blocks: int) -> jax.Array:
  """[B|1, H, nq, nk] bool: block c is listed in row (b, h, r)'s first counts entries (entries
  out of range are left out: the misuse map says so)."""
  live = jnp.arange(lists.shape[-1]) < counts[..., None]  # [B|1, H, nq, K]
  at = jnp.where(live & (lists >= 0) & (lists < num_kv_blocks), lists, num_kv_blocks)
  batch, heads, rows, _ = lists.shape
  b, h, r = (jnp.arange(n)[:, None] for n in (batch, heads, rows))
  hits = jnp.zeros((batch, heads, rows, num_kv_blocks + 1), jnp.bool_)
  hits = hits.at[b[:, :, None, None], h[None, :, :, None], r[None, None], at].set(True)
  return hits[..., :num_kv_blocks]


def misuse(lists: ArrayLike, counts: ArrayLike, num_kv_blocks: int, xp: Any) -> ArrayLike:
  """[B|1, H, nq] bool: the rows whose count is outside [0, K], or whose listed entries hold a
  block outside [0, nk) or one block twice."""
  k = lists.shape[-1]
  live = xp.arange(k) < counts[..., None]  # [B|1, H, nq, K]
  outside = xp.any(live & ((lists < 0) | (lists >= num_kv_blocks)), axis=-1)
  same = (lists[..., :, None] == lists[..., None, :]) & live[..., :, None] & live[..., None, :]
  twice = xp.any(same & ~xp.eye(k, dtype=bool), axis=(-1, -2))
  return (counts < 0) | (counts > k) | outside | twice


def misused_rows(rule: Mask | None) -> jax.Array | None:
  """[B|1, T, Hq] bool: the queries whose `Blocks` lists break the rules (in normal form), or None
  when the rule holds no choice."""
  found = None
  for part in () if rule is None else rule.parts():
    if isinstance(part, Blocks) and part.misuse is not None:
      row, r = part.query_rows(jnp)  # [B, T] each
      table = jnp.swapaxes(jnp.asarray(part.misuse), 1, 2)  # [B|1, nq, Hq]
      # Each query's row of Hq flags, gathered only where some list is misused: on a TPU a
      # gather of one flag a (query, head) took 2.6 ms at T 16384 Hq 16, most of a forward.
      bad = jax.lax.cond(jnp.any(table), lambda: table[row, r],  # [B, T, Hq]
                         lambda: jnp.zeros((*row.shape, table.shape[-1]), jnp.bool_))
      found = bad if found is None else found | bad
  return found
