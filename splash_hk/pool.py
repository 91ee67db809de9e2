"""The paged KV cache's pool: `PagedKVCache`, its storage layout (spelled once here) and the
write of new tokens into its pages (with the pages' key summaries, when it keeps them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from splash_hk import owners
from splash_hk import quant


# The pool's storage layout, spelled once: head-major pages [P, Hkv, page_size, D], so each kv
# head's page is one contiguous [page_size, D] block. The paged kernels gather a page once per kv
# head; on XLA:CPU a decode read head-major pages 1.1x to 2.2x faster than token-major
# [P, page_size, Hkv, D] (docs/guide/caches.md, "Storage layout").
POOL_AXES = ("page", "kv_head", "slot", "dim")


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


def write(cache: PagedKVCache, key: Any, value: Any, page: jax.Array,
          slot: jax.Array) -> PagedKVCache:
  """Key [N, Hkv, D] / value [N, Hkv, Dv] row n at `slot[n]` of page `page[n]` (a page past the
  pool: nothing written), quantized as written, and each written page's key bounds kept when
  the pool keeps them (reset where slot 0 is written). The bounds take the keys as held from
  the rows themselves and touch only the written pages: no read of the pool (on a TPU a gather
  of the written keys from it cost a copy of the whole pool a step)."""
  at = (page, slice(None), slot)  # each row's [Hkv, X] in [P, Hkv, page, X]
  held = quant.as_held(cache.key, key, "key")  # [N, Hkv, D] as the pool holds them
  written = cache.replace(key=quant.put(cache.key, at, held),
                          value=quant.write(cache.value, at, value, "value"))
  if cache.key_min is None or cache.key_max is None:
    return written
  stored = jnp.asarray(quant.tile(held, jnp.float32), jnp.float32)  # [N, Hkv, D] float32
  fresh = jnp.where(slot == 0, page, cache.num_pages)  # [N]: pages whose slot 0 is written now
  bound = lambda a, empty: a.at[fresh].set(empty, mode="drop")  # emptied first, then kept
  return written.replace(
      key_min=bound(cache.key_min, jnp.inf).at[page].min(stored, mode="drop"),
      key_max=bound(cache.key_max, -jnp.inf).at[page].max(stored, mode="drop"))
