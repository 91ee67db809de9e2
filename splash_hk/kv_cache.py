"""The KV cache: a fixed-capacity pytree, and the one step that appends to it.

A cache never gives a finite wrong answer. Shapes that cannot match the call
are a ValueError naming `kv_cache`. Values that would write past the capacity,
or `lengths` outside [0, T], are a ValueError naming `kv_cache` / `lengths`
when they are concrete (eager Haiku); under `jit` they are only known at run
time, so such a row writes nothing, keeps its length and outputs NaN (see
`Append.failed`), while the other rows proceed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from splash_hk import drafts
from splash_hk import owners
from splash_hk import quant
from splash_hk.config import known_now
from splash_hk.types import Extras


@functools.partial(owners.register, data_fields=("key", "value", "length", "appended",
                                                            "parents"))
@dataclasses.dataclass(frozen=True, eq=False)
class KVCache:
  """A fixed-capacity key/value cache for one attention layer (a pytree).

  Attributes:
    key: [B, S_max, Hkv, D] projected keys; row b's slots >= `length[b]` are
      unused and may hold anything (they are invisible).
    value: [B, S_max, Hkv, Dv] projected values.
    length: [B] int32, how many slots of each row hold tokens (a scalar, as in
      a cache built by hand, means the same length for every row).
    owner: the layer that first wrote this cache (its module name), or None for
      a cache no layer has written yet. Static metadata (part of the pytree's
      structure, so the check costs nothing under `jit`): any other layer given
      this cache raises a ValueError naming both.
    appended: [B] int32, the tokens the last call wrote in each row (what `accept` keeps of),
      or None for a cache built by hand that no call has written.
    parents: [B, S_max] int32: at the slot of each token the last call wrote, its parent among
      that call's tokens (-1: a root; a call without `masks.Tree` is a chain), so `accept` keeps
      only paths of the call's tree; None for a cache built by hand that no call has written.
  """

  key: jax.Array
  value: jax.Array
  length: jax.Array
  owner: str | None = None
  appended: jax.Array | None = None
  parents: jax.Array | None = None

  @classmethod
  def zeros(cls, batch: int, max_len: int, num_kv_heads: int, key_size: int,
            value_size: int | None = None, dtype: Any = jnp.float32,
            owner: str | None = None) -> KVCache:
    """An empty cache (length 0 in every row), built outside any transform.

    `dtype` int8, float8_e4m3fn or float8_e5m2 (or int4) stores `key` and `value` as
    `Quantized` with one float32 scale per (token, kv head), set as each token is written; any
    other non-float dtype is a ValueError naming `dtype`. `owner`: the layer it is for (its
    module name), so it enters a `lax.scan` carry with the structure the layer's write gives
    it; default None (the first layer to write it owns it).
    """
    return cls(
        key=quant.zeros((batch, max_len, num_kv_heads, key_size), dtype),
        value=quant.zeros((batch, max_len, num_kv_heads, value_size or key_size), dtype),
        length=jnp.zeros((batch,), jnp.int32),
        owner=owners.checked(owner),
        appended=jnp.zeros((batch,), jnp.int32),
        parents=jnp.full((batch, max_len), -1, jnp.int32),
    )

  @property
  def max_len(self) -> int:
    """The slots each row holds (S_max)."""
    return self.key.shape[1]

  def lengths(self) -> jax.Array:
    """[B] int32: each row's filled length (a scalar `length` broadcast)."""
    return jnp.broadcast_to(jnp.asarray(self.length, jnp.int32), self.key.shape[:1])

  def room(self) -> jax.Array:
    """[B] int32: the slots each row has left, `max_len - length`."""
    return self.max_len - self.lengths()

  def reset(self, rows: ArrayLike) -> KVCache:
    """This cache with `rows` back to length 0 (their slots become unused); owner kept.

    Args:
      rows: row indices (an int or [n] ints, negative from the end) or a [B]
        bool mask; traced values work under `jit`.
    """
    lengths, batch = self.lengths(), self.key.shape[0]
    rows = jnp.asarray(rows)
    if rows.dtype == jnp.bool_:
      if rows.shape != (batch,):
        raise ValueError(f"`rows` as a mask must be bool [{batch}] (one per row), got "
                         f"{list(rows.shape)}.")
      return self.replace(length=jnp.where(rows, 0, lengths))
    if not jnp.issubdtype(rows.dtype, jnp.integer) or rows.ndim > 1:
      raise ValueError(f"`rows` must be row indices (an int or [n] ints) or a bool mask "
                       f"[{batch}], got {rows.dtype}{list(rows.shape)}.")
    known = known_now(rows)
    if known is not None and known.size and (known.min() < -batch or known.max() >= batch):
      raise ValueError(f"`rows` must be indices in [-{batch}, {batch}) of this cache's {batch} "
                       f"rows, got {known.tolist()}.")
    return self.replace(length=lengths.at[rows].set(0, mode="drop"))

  def rollback(self, n: ArrayLike) -> KVCache:
    """This cache with each row's last `n` tokens dropped (their slots become unused); owner
    kept. For speculative decoding: after verifying k drafted tokens of which m were accepted,
    `cache.rollback(k - m)` (per row: [B] counts) forgets the rejected ones.

    Args:
      n: tokens to drop, an int or [B] ints in [0, length]; traced values work under `jit`.
        Outside that range is a ValueError when concrete; under `jit` such a row is marked
        failed (length -1: its next appends write nothing and output NaN, never a finite
        wrong answer) until `reset`.
    """
    lengths, batch = self.lengths(), self.key.shape[0]
    n = jnp.asarray(n)
    if not jnp.issubdtype(n.dtype, jnp.integer) or n.shape not in ((), (batch,)):
      raise ValueError(f"`n` must be ints of shape [] or [{batch}] (tokens to drop per row), got "
                       f"{n.dtype}{list(n.shape)}.")
    n = jnp.broadcast_to(n.astype(jnp.int32), (batch,))
    known, known_lengths = known_now(n), known_now(lengths)
    if known is not None and known_lengths is not None:
      bad = np.flatnonzero((known < 0) | (known > known_lengths)).tolist()
      if bad:
        raise ValueError(f"`n` must lie in [0, length] for every row: rows {bad} would drop "
                         f"{known[bad].tolist()} of their {known_lengths[bad].tolist()} tokens; "
                         "roll back at most what a row holds (cache.length).")
    left = lengths - n
    return self.replace(length=jnp.where((n < 0) | (left < 0), -1, left))

  def accept(self, path: ArrayLike, path_lens: ArrayLike) -> KVCache:
    """This cache keeping, of the last call's tokens (a call with `sh.masks.Tree`), each row's
    accepted path; owner kept.

    Row b's tokens `path[b, :path_lens[b]]` of that call (root to leaf, indices in the call)
    move to the slots right after its length before the call, and its length becomes that
    plus `path_lens[b]`; the rest of the call's slots become unused.

    Args:
      path: [B, L] ints, each in [0, the row's tokens in that call); entries past
        `path_lens[b]` are not read.
      path_lens: [B] ints in [0, min(L, the row's tokens in that call)].
    A path or length outside those is a ValueError when concrete; under `jit` the row is
    marked failed (length -1, as `rollback` marks it) until `reset`.
    """
    return _accept(self, path, path_lens)

  def append(self, key: jax.Array, value: jax.Array, lengths: jax.Array, layer: str) -> Append:
    """Row b's first `lengths[b]` keys/values written at `length[b]` (see `Cache.append`)."""
    return _append(self, key, value, lengths, layer)

  def replace(self, **changes: Any) -> KVCache:
    """This cache with the given fields replaced."""
    return dataclasses.replace(self, **changes)

  _replace = replace  # the NamedTuple spelling of earlier releases


class Append(NamedTuple):
  """What one call appends: the buffers to attend to, their masks, the new cache."""

  key: Any  # [B, S_max, Hkv, D] with the new keys written (an array or `Quantized`)
  value: Any  # [B, S_max, Hkv, Dv]
  extras: Extras  # positions and segment ids of queries [B, T] and slots [B, S_max]
  cache: Any  # the cache after this call (of the kind given)
  failed: jax.Array  # [B] bool: rows that wrote nothing; their outputs must be NaN


@typing.runtime_checkable
class Cache(Protocol):
  """What an attention layer needs of a KV cache (a pytree): append a call's keys and values,
  and say what the call attends to (`Append`). `KVCache` is one kind."""

  def append(self, key: jax.Array, value: jax.Array, lengths: jax.Array, layer: str) -> Append:
    """Writes row b's first `lengths[b]` of key [B, T, Hkv, D] / value [B, T, Hkv, Dv] for
    `layer` (a cache another layer wrote is a ValueError naming `kv_cache` and both)."""
    ...


def append_to(cache: Any, key: jax.Array, value: jax.Array, lengths: jax.Array,
              layer: str) -> Append:
  """`cache.append(...)` for anything that is a `Cache`; anything else is a ValueError naming
  `kv_cache`."""
  if not isinstance(cache, Cache):
    raise ValueError(f"`kv_cache` must be a splash_hk.KVCache, got {type(cache).__name__}; build "
                     "one with KVCache.zeros(batch, max_len, num_kv_heads, key_size, value_size).")
  return cache.append(key, value, lengths, layer)


def row_lengths(lengths: Any, lead: tuple[int, ...], query_len: int) -> jax.Array:
  """`lengths` (None, a scalar or [...] ints) as [B] int32 over the flattened leading dims."""
  batch = math.prod(lead)
  if lengths is None:
    return jnp.full((batch,), query_len, jnp.int32)
  lengths = jnp.asarray(lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer) or lengths.shape not in ((), tuple(lead)):
    raise ValueError(f"`lengths` must be ints of shape [] or {tuple(lead)} (one per row), got "
                     f"{lengths.dtype}{list(lengths.shape)}.")
  known = known_now(lengths)
  if known is not None and (known.min() < 0 or known.max() > query_len):
    raise ValueError(f"`lengths` must lie in [0, T] = [0, {query_len}] (tokens each row appends "
                     f"out of the T it is given), got {known.tolist()}.")
  return jnp.broadcast_to(lengths.astype(jnp.int32), tuple(lead)).reshape(batch)


def _append(cache: KVCache, k: jax.Array, v: jax.Array, lengths: jax.Array,
            layer: str) -> Append:
  """Writes row b's first `lengths[b]` keys/values [T, Hkv, *] at `cache.length[b]`.

  Row b's queries get positions `length[b] + arange(T)`; its query rows past
  `lengths[b]` are padding, and so are its slots past the new length. Slots
  past the capacity are never written (never wrapped). `layer` names the
  writer: a cache another layer wrote first is a ValueError; the new cache is
  `layer`'s.
  """
  start = _check_cache(cache, k, v, layer)  # [B]
  batch, query_len = k.shape[:2]
  max_len = cache.key.shape[1]
  _check_room(start, lengths, max_len)
  failed = (lengths < 0) | (lengths > query_len) | (start < 0) | (start + lengths > max_len)
  new = start[:, None] + jnp.arange(query_len, dtype=jnp.int32)  # [B, T] slots and positions
  target = jnp.where(failed[:, None], max_len, new)  # a failed row writes nothing (dropped)
  rows = jnp.arange(batch)[:, None]
  keys = quant.write(cache.key, (rows, target), k, "key")  # quantized as written, if it is
  values = quant.write(cache.value, (rows, target), v, "value")
  end = jnp.where(failed, start, start + lengths)  # [B]
  slots = jnp.arange(max_len, dtype=jnp.int32)  # [S_max]
  live = (jnp.arange(query_len) < lengths[:, None]) & ~failed[:, None]  # [B, T]
  extras = Extras(
      q_positions=new,
      kv_positions=jnp.broadcast_to(slots, (batch, max_len)),
      q_segment_ids=jnp.where(live, 0, -1),  # [B, T]
      kv_segment_ids=jnp.where(slots < end[:, None], 0, -1),  # [B, S_max]
  )
  written = jnp.where(failed, 0, lengths)  # [B]
  chain = jnp.broadcast_to(jnp.arange(query_len, dtype=jnp.int32) - 1, (batch, query_len))
  parents = record_parents(cache.parents, target, chain, max_len)  # [B, S_max]
  return Append(keys, values, extras, KVCache(keys, values, end, layer, written, parents), failed)


def record_parents(held: jax.Array | None, slots: jax.Array, parents: jax.Array,
                   max_len: int) -> jax.Array:
  """`held` [B, S_max] (None: a cache built by hand) with a call's tokens' parents [B, T]
  (indices among the call's tokens, -1 a root) written at their slots [B, T] (S_max: dropped)."""
  held = jnp.full((slots.shape[0], max_len), -1, jnp.int32) if held is None else held
  return held.at[jnp.arange(slots.shape[0])[:, None], slots].set(parents.astype(jnp.int32),
                                                                 mode="drop")


def _accept(cache: KVCache, path: ArrayLike, path_lens: ArrayLike) -> KVCache:
  """`KVCache.accept`: rows' kept tokens moved down; lengths set (misuse: see there)."""
  batch, max_len = cache.key.shape[:2]
  path, path_lens = jnp.asarray(path), jnp.asarray(path_lens)
  if path.ndim != 2 or path.shape[0] != batch or not jnp.issubdtype(path.dtype, jnp.integer):
    raise ValueError(f"`path` must be ints [B, L] = [{batch}, L] (each row's kept tokens of the "
                     f"last call), got {path.dtype}{list(path.shape)}.")
  if path_lens.shape != (batch,) or not jnp.issubdtype(path_lens.dtype, jnp.integer):
    raise ValueError(f"`path_lens` must be ints [B] = [{batch}], got "
                     f"{path_lens.dtype}{list(path_lens.shape)}.")
  if cache.appended is None:
    raise ValueError("This KVCache has no record of a call (built by hand): `accept` keeps "
                     "tokens of the call that returned the cache; pass that cache.")
  path, kept = path.astype(jnp.int32), path_lens.astype(jnp.int32)
  written = jnp.asarray(cache.appended, jnp.int32)  # [B]
  start = cache.lengths() - written  # [B]: the length before the call
  rows = jnp.arange(batch)[:, None]
  held = cache.parents if cache.parents is not None else jnp.broadcast_to(
      jnp.arange(max_len, dtype=jnp.int32) - start[:, None] - 1, (batch, max_len))  # a chain
  src = jnp.clip(start[:, None] + path, 0, max_len - 1)  # [B, L]
  bad_len, outside, off_tree = drafts.bad_paths(path, kept, written, held[rows, src])
  bad = bad_len | outside | off_tree | (start < 0)  # [B]
  _refuse(bad, off_tree, written)
  used = jnp.arange(path.shape[1])[None, :] < kept[:, None]  # [B, L]
  dst = jnp.where(used & ~bad[:, None], start[:, None] + jnp.arange(path.shape[1]), max_len)
  move = lambda a: a.at[rows, dst].set(a[rows, src], mode="drop")
  length = jnp.where(bad, -1, start + kept)
  return cache.replace(key=jax.tree.map(move, cache.key), value=jax.tree.map(move, cache.value),
                       length=length, appended=jnp.zeros_like(written))


def _refuse(bad: jax.Array, off_tree: jax.Array, written: jax.Array) -> None:
  """`accept`'s misuse, when concrete, as a ValueError naming `path` / `path_lens`."""
  known, off = known_now(bad), known_now(off_tree)
  if known is None or not known.any():
    return
  bad_rows, wrote = np.flatnonzero(known).tolist(), np.asarray(written)[known].tolist()
  if off is not None and off.any():
    raise ValueError(f"`path` is not a root-to-leaf path of the last call's tree for rows "
                     f"{np.flatnonzero(off).tolist()}: each kept token's parent (its masks.Tree; "
                     "a call without one is a chain) must be the token kept before it, the "
                     "first's a root (-1).")
  raise ValueError(f"`path`/`path_lens` name tokens outside the last call's for rows "
                   f"{bad_rows} (it wrote {wrote} tokens in them): each kept index must lie "
                   "in [0, tokens written) and path_lens in [0, min(L, that)].")


def _check_cache(cache: KVCache, k: jax.Array, v: jax.Array, layer: str) -> jax.Array:
  """Static checks of `kv_cache` against this call's layer and keys/values; returns lengths [B]."""
  owners.check(cache, layer, "kv_cache")
  batch, _, heads, key_size = k.shape
  want = dict(key=(batch, None, heads, key_size), value=(batch, None, heads, v.shape[-1]))
  for name, shape in want.items():
    got = tuple(getattr(cache, name).shape)
    if len(got) != 4 or got[0] != shape[0] or got[2:] != shape[2:] or got[1] != cache.key.shape[1]:
      raise ValueError(
          f"`kv_cache.{name}` must be [batch, max_len, num_kv_heads, size] = [{shape[0]}, max_len, "
          f"{shape[2]}, {shape[3]}] for this call, got {got}; build the cache for this batch and "
          f"layer: KVCache.zeros({batch}, max_len, {heads}, {key_size}, {v.shape[-1]}).")
  length = jnp.asarray(cache.length)
  if not jnp.issubdtype(length.dtype, jnp.integer) or length.shape not in ((), (batch,)):
    raise ValueError(f"`kv_cache.length` must be ints of shape [] or [{batch}], got "
                     f"{length.dtype}{list(length.shape)}.")
  return jnp.broadcast_to(length.astype(jnp.int32), (batch,))


def _check_room(start: jax.Array, lengths: jax.Array, max_len: int) -> None:
  """Where the lengths are concrete: a row that would write past the capacity is a ValueError."""
  known_start = known_now(start)
  if known_start is None:
    return
  failed = np.flatnonzero(known_start < 0).tolist()
  if failed:
    raise ValueError(f"`kv_cache` rows {failed} are marked failed (length -1: a `rollback` or "
                     "`accept` out of range under jit): they write nothing and output NaN until "
                     f"cleared; pass kv_cache.reset({failed}) to start them again at length 0.")
  if known_start.max() > max_len:
    raise ValueError(f"`kv_cache.length` must lie in [0, max_len] = [0, {max_len}], got "
                     f"{known_start.tolist()}.")
  known = known_now(lengths)
  if known is not None and (known_start + known).max() > max_len:
    rows = np.flatnonzero(known_start + known > max_len).tolist()
    raise ValueError(
        f"`kv_cache` is full: rows {rows} would hold {(known_start + known)[rows].tolist()} tokens "
        f"in a cache of max_len {max_len} (length {known_start.tolist()} + lengths "
        f"{known.tolist()}); build a larger cache (KVCache.zeros(..., max_len=...)) or append "
        "fewer tokens (lengths=0 leaves a finished row unchanged).")
