"""The paged KV cache's pool: `PagedKVCache`, its storage layout (spelled once here) and the
write of new tokens into its pages (with the pages' key summaries, when it keeps them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from splash_hk import lowering
from splash_hk import owners
from splash_hk import quant


# The pool's storage layout, spelled once: head-major pages [P, Hkv, page_size, D], so each kv
# head's page is one contiguous [page_size, D] block. The paged kernels gather a page once per kv
# head; on XLA:CPU a decode read head-major pages 1.1x to 2.2x faster than token-major
# [P, page_size, Hkv, D] (docs/guide/caches.md, "Storage layout").
POOL_AXES = ("page", "kv_head", "slot", "dim")


COMPARE_LIMIT = 1 << 24  # pairs compared at most where one op can replace a scatter or a search


def search(ends: jax.Array, values: jax.Array) -> jax.Array:
  """`jnp.searchsorted(ends, values, side="right")`: one comparison of all pairs where few (a
  scan's loop costs a TPU microseconds a step), else the scan."""
  method = "compare_all" if ends.size * values.size <= COMPARE_LIMIT else "scan"
  return jnp.searchsorted(ends, values, side="right", method=method)


def take(values: jax.Array, index: jax.Array) -> jax.Array:
  """`values[index]` (values 1-D, every index inside it): on a TPU one comparison of all pairs
  where few (a gather of scalars costs it about 7 ns an index: each row's page of a prompt of
  8192 rows took 60 us), else the gather."""
  if values.size * index.size > COMPARE_LIMIT:
    return values[index]
  compared = lambda args: take_compared(*args)
  gathered = lambda args: args[0][args[1]]
  return lowering.per_platform({"tpu": compared, "cpu": gathered, "gpu": gathered},
                               (values, index))


def take_compared(values: jax.Array, index: jax.Array) -> jax.Array:
  """`take` on a TPU: each index compared with every place of `values`, the one it hits kept."""
  hit = index[..., None] == jnp.arange(values.shape[0], dtype=index.dtype)  # [..., K]
  if values.dtype == jnp.bool_:
    return jnp.any(hit & values, axis=-1)
  return jnp.sum(jnp.where(hit, values, 0), axis=-1, dtype=values.dtype)


def to_pool(pages: Any) -> Any:
  """Token-major pages [P, page_size, Hkv, X] (an array or `Quantized`) in the pool's layout."""
  return quant.cut(pages, 0, lambda a: jnp.swapaxes(a, 1, 2))


def from_pool(pool: Any) -> Any:
  """The pool's pages token-major, [P, page_size, Hkv, X] (the inverse of `to_pool`)."""
  return quant.cut(pool, 0, lambda a: jnp.swapaxes(a, 1, 2))


@functools.partial(owners.register, data_fields=("key", "value", "key_min", "key_max"))
@dataclasses.dataclass(frozen=True, eq=False)
class PagedKVCache:
  """Keys and values in fixed-size pages from one pool (a pytree); sequences own pages through
  a `RaggedBatch`'s page table.

  The storage layout is the library's (`POOL_AXES`: head-major, the layout its kernels read
  fastest): build a pool with `zeros`, or from token-major pages with `from_token_major`.

  Attributes:
    key: [P, Hkv, page_size, D]; slots no sequence has written may hold anything.
    value: [P, Hkv, page_size, Dv].
    key_min: [P, Hkv, D] float32, the elementwise min of each page's written keys
      (dequantized), kept as tokens are written and reset when a page's slot 0 is written
      (Quest's page summaries: `sh.sparse.top_k_pages`), or None (not kept).
    key_max: [P, Hkv, D] float32, their max, or None.
    owner: the layer that first wrote this pool (a module's name, or the `owner` given to
      `paged_attention`), or None for a pool no layer has written yet. Static metadata, as
      `KVCache.owner`: any other layer given this pool raises a ValueError naming both.
  """

  key: jax.Array
  value: jax.Array
  key_min: jax.Array | None = None
  key_max: jax.Array | None = None
  owner: str | None = None

  @classmethod
  def zeros(cls, num_pages: int, page_size: int, num_kv_heads: int, key_size: int,
            value_size: int | None = None, dtype: Any = jnp.float32,
            owner: str | None = None, page_summaries: bool = False) -> PagedKVCache:
    """A pool of zeroed pages (a quantized `dtype` stores `Quantized`, as `KVCache.zeros`;
    `owner` as there); `page_summaries`: also keep each page's key bounds (Quest)."""
    shape = (num_pages, num_kv_heads, page_size)
    bounds = lambda: (jnp.zeros((num_pages, num_kv_heads, key_size), jnp.float32)
                      if page_summaries else None)  # a buffer each: both may be donated
    return cls(key=quant.zeros((*shape, key_size), dtype),
               value=quant.zeros((*shape, value_size or key_size), dtype),
               key_min=bounds(), key_max=bounds(), owner=owners.checked(owner))

  @classmethod
  def from_token_major(cls, key: Any, value: Any, owner: str | None = None) -> PagedKVCache:
    """A pool holding token-major pages key [P, page_size, Hkv, D] and value [P, page_size,
    Hkv, Dv] (arrays or `Quantized`), without page summaries."""
    return cls(key=to_pool(key), value=to_pool(value), owner=owners.checked(owner))

  def token_major(self) -> tuple[Any, Any]:
    """(key [P, page_size, Hkv, D], value [P, page_size, Hkv, Dv]): the pages token-major."""
    return from_pool(self.key), from_pool(self.value)

  @property
  def num_pages(self) -> int:
    return self.key.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.key.shape[1]

  @property
  def page_size(self) -> int:
    return self.key.shape[2]

  @property
  def summarised(self) -> bool:
    """Whether the pool keeps its pages' key bounds (`key_min`, `key_max`)."""
    return self.key_min is not None

  def replace(self, **changes: Any) -> PagedKVCache:
    """This cache with the given fields replaced."""
    return dataclasses.replace(self, **changes)


def tile_slots(dtype: Any) -> int:
  """The slots of a page one TPU tile holds for a pool of `dtype` where a slot is a part of a
  32-bit word (8 rows of words: 16 bfloat16 slots, 32 int8 or fp8, 64 int4), else 1 (a slot is
  whole words)."""
  kind = jnp.dtype(dtype)
  bits = (jnp.iinfo(kind) if jnp.issubdtype(kind, jnp.integer) else jnp.finfo(kind)).bits
  return 8 * 32 // bits if bits < 32 else 1


def put_rows(buf: Any, page: jax.Array, slot: jax.Array, held: Any,
             runs: int | None = None, disjoint: bool = False) -> Any:
  """`buf` [P, Hkv, page, X] (an array or `Quantized`) with row n of `held` [N, Hkv, X] (as
  `buf` holds them) at `slot[n]` of page `page[n]`; a page or slot past the pool: nothing.
  `runs`: the most runs of consecutive slots the rows make (static: a ragged step's sequences),
  or None; `disjoint`: each run is consecutive rows and no two runs write one page (a ragged
  step's sequences: `put_runs`). A quantized pool's scales are set one (row, kv head) at a time
  (`_put_scales`)."""
  if not isinstance(buf, quant.Quantized):
    return _put_slots(buf, page, slot, held, runs, disjoint)
  return quant.Quantized(_put_slots(buf.values, page, slot, held.values, runs, disjoint),
                         _put_scales(buf.scale, page, slot, held.scale))


def _put_slots(buf: jax.Array, page: jax.Array, slot: jax.Array, rows: jax.Array,
               runs: int | None, disjoint: bool = False) -> jax.Array:
  """`put_rows` of an array. Lowered for a TPU, a pool whose slot is part of a 32-bit word is
  written a tile's slots at a time: XLA scatters such rows in a layout of its own, a copy of the
  whole pool out of the kernels' tiling and back each step (compiled for a v5e: 4 copies of
  158 MB in a decode step over an int8 pool at pages of 64, and of 317 MB in a bfloat16 step of
  2 prompt chunks of 512 beside 30 decodes). Disjoint runs go in as windows of rows
  (`put_runs`: no scatter of a row); other rows are scattered into the tiles (`put_tiles`)."""
  plain = lambda a: a[0].at[a[1], :, a[2]].set(a[3], mode="drop")
  n, size = page.shape[0], buf.shape[2]
  tile = min(tile_slots(buf.dtype), size)
  if tile == 1 or size % tile:
    return plain((buf, page, slot, rows))
  if disjoint and runs is not None:
    group = run_group(n, runs, size, tile)
    most = groups_touched(n, group, runs)
    tiled = lambda a: put_runs(a[0], a[1], a[2], a[3], group, most)
  else:
    most = groups_touched(n, tile, runs)
    if 2 * most * tile > buf.shape[0] * size:
      return plain((buf, page, slot, rows))  # (the tiles would read over half the pool)
    tiled = lambda a: put_tiles(a[0], a[1], a[2], a[3], tile, most)
  return lowering.per_platform({"tpu": tiled, "cpu": plain, "gpu": plain},
                               (buf, page, slot, rows))


def run_group(rows: int, runs: int, size: int, tile: int) -> int:
  """The slots a window of `put_runs` covers: the most whole tiles of slots dividing a page of
  `size` slots whose runs' partial windows (two a run) add at most the rows' own slots. A
  window is one index of the pool's scatter, which costs about the same whatever its slots
  (v5e: 514 windows of 16 slots took 250 us, a prompt of 8192 rows)."""
  fits = [g for g in range(tile, size + 1, tile) if size % g == 0 and 2 * runs * g <= rows]
  return max(fits, default=tile)


def put_runs(buf: jax.Array, page: jax.Array, slot: jax.Array, rows: jax.Array, group: int,
             most: int) -> jax.Array:
  """`put_tiles` of rows in disjoint runs (each run consecutive rows at consecutive slots, no
  two runs in one group of `group` slots; `most`: the most groups they fall in), with no
  scatter of a row: each group's rows are one window of `rows` (a slice, read by a gather of
  one index a group), laid over the group as the pool holds it. On a v5e a scatter of 8192 rows
  into a bfloat16 pool took 288 us (and two copies of the pool); its windows, one gather."""
  p, heads, size, x = buf.shape
  n, per = rows.shape[0], size // group
  groups = buf.reshape(p, heads, per, group, x)  # [P, Hkv, page / G, G, X]
  page, slot = (jnp.where(a < 0, a + m, a) for a, m in ((page, p), (slot, size)))  # as `.at`
  ok = (page >= 0) & (page < p) & (slot >= 0) & (slot < size)  # [N]
  key = jnp.where(ok, page * per + slot // group, -1)  # [N] each row's group
  after = lambda a, fill: jnp.concatenate([jnp.full((1,), fill, a.dtype), a[:-1]])
  goes_on = ok & (key == after(key, -1)) & (slot == after(slot, -2) + 1)  # [N]
  lead = ok & ~goes_on  # [N] the first row of its group's window
  first = search(jnp.cumsum(lead), jnp.arange(most, dtype=jnp.int32))  # [M] (N: none)
  stop = jnp.where(goes_on, n, jnp.arange(n, dtype=jnp.int32))  # [N] rows starting a window
  stop = jax.lax.cummin(jnp.concatenate([stop, jnp.full((1,), n, stop.dtype)]), reverse=True)
  at = jnp.minimum(first, n - 1)
  length = jnp.where(first < n, stop[jnp.minimum(first + 1, n)] - first, 0)  # [M] its rows
  start = slot[at] % group  # [M] the slot its first row takes in the group
  where = jnp.where(first < n, key[at], p * per)  # [M] its group (p * per: none)
  window = _windows(rows, jnp.minimum(first, n) - start, group)  # [M, G, Hkv, X]
  mine = jnp.arange(group)[None, :] - start[:, None]  # [M, G]
  mine = (mine >= 0) & (mine < length[:, None])
  target = jnp.where(where < p * per, where // per, p)  # [M] its page (p: none)
  held = groups[jnp.minimum(target, p - 1), :, where % per]  # [M, Hkv, G, X]
  held = jnp.where(mine[:, None, :, None], jnp.swapaxes(window, 1, 2), held)
  if per == 1:  # whole pages: written as the pool's rows (one contiguous copy each)
    return buf.at[target].set(held, mode="drop")
  return groups.at[target, :, where % per].set(held, mode="drop").reshape(buf.shape)


def _windows(rows: jax.Array, begin: jax.Array, size: int) -> jax.Array:
  """[M, size, ...]: rows[begin[m] : begin[m] + size] for each m, rows before 0 or past the end
  zeros (begin in [-size, N]). Windows inside the rows are sliced from them; only those over an
  end are sliced from a copy of that end padded (a pad of all the rows: a copy of them)."""
  n = rows.shape[0]
  if n < size:
    padded = jnp.pad(rows, ((size, size),) + ((0, 0),) * (rows.ndim - 1))
    return _slices(padded, begin + size, size)
  rest = ((0, 0),) * (rows.ndim - 1)
  head = jnp.pad(rows[:size], ((size, 0),) + rest)  # [2 size, ...]: rows -size .. size - 1
  tail = jnp.pad(rows[n - size:], ((0, size),) + rest)  # rows n - size .. n + size - 1
  inside = _slices(rows, jnp.clip(begin, 0, n - size), size)
  low = _slices(head, jnp.clip(begin + size, 0, size), size)
  high = _slices(tail, jnp.clip(begin - (n - size), 0, size), size)
  pick = lambda where, a, b: jnp.where(where.reshape((-1,) + (1,) * (rows.ndim)), a, b)
  return pick(begin < 0, low, pick(begin > n - size, high, inside))


def _slices(rows: jax.Array, begin: jax.Array, size: int) -> jax.Array:
  return jax.vmap(lambda b: jax.lax.dynamic_slice_in_dim(rows, b, size))(begin)


def groups_touched(rows: int, group: int, runs: int | None) -> int:
  """The most groups of `group` slots `rows` rows in `runs` runs of consecutive slots fall in
  (a run of L slots: at most L // group + 2), or `rows` (runs None: no bound)."""
  return rows if runs is None else min(rows, rows // group + 2 * runs)


def put_tiles(buf: jax.Array, page: jax.Array, slot: jax.Array, rows: jax.Array, group: int,
              most: int | None = None) -> jax.Array:
  """`buf` [P, Hkv, page, X] with `rows` [N, Hkv, X] set, whole groups of `group` slots at a
  time: the groups the rows fall in read, every row set in its group's copy, the copies written
  back (a group rows share is written once, with all of them). `most`: the most groups the rows
  may fall in (static; default N), which bounds what is read and written."""
  p, _, size, _ = buf.shape
  n, per = rows.shape[0], size // group
  most = n if most is None else min(n, most)
  groups = buf.reshape(p, buf.shape[1], per, group, buf.shape[3])  # [P, Hkv, page / G, G, X]
  page, slot = (jnp.where(a < 0, a + m, a) for a, m in ((page, p), (slot, size)))  # as `.at`
  ok = (page >= 0) & (page < p) & (slot >= 0) & (slot < size)  # [N]
  key = jnp.where(ok, page * per + slot // group, p * per)  # [N] each row's group (or none)
  first = jnp.full((p * per + 1,), n, jnp.int32).at[key].min(jnp.arange(n, dtype=jnp.int32))
  lead = ok & (first[key] == jnp.arange(n))  # [N] the first row written into its group
  rank = jnp.cumsum(lead) - 1  # [N] a first row's place among the groups
  place = rank[jnp.minimum(first[key], n - 1)]  # [N] each row's group's place
  where = jnp.full((most + 1,), p * per, jnp.int32).at[jnp.where(lead, rank, most)].set(
      key, mode="drop")[:most]  # [M] each place's group (p * per: none)
  at = (jnp.minimum(where // per, p - 1), slice(None), where % per)
  held = groups[at]  # [M, Hkv, G, X] the groups as the pool holds them
  held = held.at[jnp.where(ok, place, most), :, slot % group].set(rows, mode="drop")
  return groups.at[jnp.where(where < p * per, where // per, p), :, at[2]].set(
      held, mode="drop").reshape(buf.shape)


def _put_scales(scale: jax.Array, page: jax.Array, slot: jax.Array,
                rows: jax.Array) -> jax.Array:
  """A pool's scales [P, Hkv, page, 1] with `rows` [N, Hkv, 1] set one element a (row, kv head)
  (a [Hkv] row a token: XLA copies the scales into a layout of its own and back, each copy
  1.4-2x cheaper than for the row's scatter; compiled for a v5e); other scale shapes as
  `.at[...].set`."""
  if scale.ndim != 4 or scale.shape[3] != 1 or scale.shape[1] != rows.shape[1]:
    return scale.at[page, :, slot].set(rows, mode="drop")
  heads = jnp.arange(scale.shape[1])[None, :]  # [1, Hkv]
  return scale.at[page[:, None], heads, slot[:, None], 0].set(rows[..., 0], mode="drop")


def write(cache: PagedKVCache, key: Any, value: Any, page: jax.Array, slot: jax.Array,
          runs: int | None = None, disjoint: bool = False) -> PagedKVCache:
  """Key [N, Hkv, D] / value [N, Hkv, Dv] row n at `slot[n]` of page `page[n]` (a page past the
  pool: nothing written; `runs`, `disjoint`: as `put_rows`), quantized as written, and each
  written page's key bounds kept when the pool keeps them (reset where slot 0 is written). The
  bounds take the keys as held from the rows themselves and touch only the written pages: no
  read of the pool (on a TPU a gather of the written keys from it cost a copy of the whole pool
  a step)."""
  held = quant.as_held(cache.key, key, "key")  # [N, Hkv, D] as the pool holds them
  values = quant.as_held(cache.value, value, "value")  # [N, Hkv, Dv]
  written = cache.replace(key=put_rows(cache.key, page, slot, held, runs, disjoint),
                          value=put_rows(cache.value, page, slot, values, runs, disjoint))
  if cache.key_min is None or cache.key_max is None:
    return written
  stored = jnp.asarray(quant.tile(held, jnp.float32), jnp.float32)  # [N, Hkv, D] float32
  fresh = jnp.where(slot == 0, page, cache.num_pages)  # [N]: pages whose slot 0 is written now
  bound = lambda a, empty: a.at[fresh].set(empty, mode="drop")  # emptied first, then kept
  return written.replace(
      key_min=bound(cache.key_min, jnp.inf).at[page].min(stored, mode="drop"),
      key_max=bound(cache.key_max, -jnp.inf).at[page].max(stored, mode="drop"))
