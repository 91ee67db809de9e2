"""Score objects: additive biases on the scaled logits, computed per block from positions.

Each is a pytree (its arrays leaves: gradients reach them) whose `scores(q_pos,
kv_pos, head)` gives the bias of any block of (query, key) pairs, so no [T, S]
array exists unless the user gave one (`Dense`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from splash_hk import config
from splash_hk.masks._objects import DIFFERENTIATED
from splash_hk.nodes import Shaped, array_field
from splash_hk.scores._score import ArrayLike, Score


def _floating(x: Any, name: str, shape: tuple[int, ...], layout: str) -> None:
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise ValueError(f"`{name}` must be a float array {layout}, got {type(x).__name__}.")
  if tuple(x.shape) != shape or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"`{name}` must be a float array {layout} = {list(shape)}, got "
                     f"{x.dtype}{list(x.shape)}.")


def _by_heads(a: ArrayLike, head: ArrayLike) -> ArrayLike:
  """[..., Hq] per-head values -> [1, Hkv, G, 1, 1] (the layout of `head`); leading dims kept
  in front: [*lead, Hkv, G, 1, 1]."""
  return a.reshape(*a.shape[:-1], *head.shape[1:3], 1, 1)


@dataclasses.dataclass(frozen=True)
class Dense(Score):
  """A dense bias [B|1, Hq|1, T|1, S|1] (float), broadcast over the axes of size 1 (as
  `jax.nn.dot_product_attention` broadcasts its bias)."""

  bias: Shaped = array_field("qk")

  def scores(self, q_pos: ArrayLike, kv_pos: ArrayLike, head: ArrayLike) -> ArrayLike:
    b = jnp.asarray(self.bias, jnp.float32)  # [B|1, Hq|1, T, S], cut to the block by the caller
    heads = (1, 1) if b.shape[1] == 1 else head.shape[1:3]
    return b.reshape(b.shape[0], *heads, *b.shape[2:])  # [B|1, Hkv|1, G|1, T, S]

  def filled(self, query_len: int, kv_len: int) -> Dense:
    """This bias with its query and key axes of size 1 broadcast to T and S (what a kernel cuts
    into blocks); their gradients sum back over the broadcast axes."""
    b = self.bias
    shape = (*b.shape[:2], query_len, kv_len)
    if tuple(b.shape) == shape:
      return self
    if isinstance(b, jax.ShapeDtypeStruct):
      return Dense(jax.ShapeDtypeStruct(shape, b.dtype))
    return Dense(jnp.broadcast_to(b, shape))

  def check(self, batch: int, num_heads: int, query_len: int, kv_len: int) -> None:
    b = self.bias
    fits = (hasattr(b, "shape") and len(b.shape) == 4 and b.shape[0] in (1, batch)
            and b.shape[1] in (1, num_heads) and b.shape[2] in (1, query_len)
            and b.shape[3] in (1, kv_len))
    if not fits or not jnp.issubdtype(b.dtype, jnp.floating):
      got = f"{b.dtype}{list(b.shape)}" if hasattr(b, "shape") else type(b).__name__
      raise ValueError(f"`bias` must be a float array [batch or 1, num_heads or 1, query_len or "
                       f"1, kv_len or 1] = [{batch} or 1, {num_heads} or 1, {query_len} or 1, "
                       f"{kv_len} or 1] (axes of size 1 broadcast), got {got}.")


def alibi_slopes(num_heads: int) -> jax.Array:
  """ALiBi's slopes [num_heads] (Press et al.): 2 ** (-8 (h + 1) / n) for n a power of two;
  otherwise those of the closest lower power of two, then every other slope of twice that."""
  config.require_int("num_heads", num_heads)

  def powers(n: int) -> list[float]:
    return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

  def slopes(n: int) -> list[float]:
    if math.log2(n).is_integer():
      return powers(n)
    lower = 2 ** math.floor(math.log2(n))
    return powers(lower) + slopes(2 * lower)[0::2][:n - lower]

  return jnp.asarray(slopes(num_heads), jnp.float32)


@dataclasses.dataclass(frozen=True)
class Alibi(Score):
  """ALiBi: `-slopes[h] * |q_pos - kv_pos|`; slopes [Hq] (`alibi_slopes(Hq)`, or learnable)."""

  slopes: Shaped = array_field("head", axis=0)

  def scores(self, q_pos: ArrayLike, kv_pos: ArrayLike, head: ArrayLike) -> ArrayLike:
    distance = jnp.abs(q_pos - kv_pos).astype(jnp.float32)  # [B, 1, 1, T, S]
    return -_by_heads(jnp.asarray(self.slopes, jnp.float32), head) * distance

  def check(self, batch: int, num_heads: int, query_len: int, kv_len: int) -> None:
    _floating(self.slopes, "Alibi.slopes", (num_heads,), "[num_heads]")


def t5_least_max_distance(num_buckets: int, bidirectional: bool) -> int:
  """The least `max_distance` T5's buckets are defined for: one past the exact buckets (the
  logarithmic ones divide by `log(max_distance / exact)`)."""
  return (num_buckets // 2 if bidirectional else num_buckets) // 2 + 1


def _check_t5(num_buckets: int, max_distance: int, bidirectional: bool, owner: str) -> None:
  """ValueError naming the argument when T5's bucket formula is undefined or not monotone."""
  least_buckets = 4 if bidirectional else 2
  if not isinstance(num_buckets, int) or num_buckets < least_buckets:
    raise ValueError(f"`{owner}num_buckets` must be an int >= {least_buckets} "
                     f"(bidirectional={bidirectional}), got {num_buckets!r}.")
  least = t5_least_max_distance(num_buckets, bidirectional)
  if not isinstance(max_distance, int) or max_distance < least:
    exact = least - 1
    raise ValueError(
        f"`{owner}max_distance` must exceed the {exact} exact buckets of {num_buckets} "
        f"{'bidirectional ' if bidirectional else ''}buckets (T5's logarithmic buckets divide "
        f"by log(max_distance / {exact})), got {max_distance!r}: pass max_distance >= {least} "
        f"(T5 uses 128), or fewer buckets.")


def t5_buckets(relative_position: ArrayLike, num_buckets: int = 32, max_distance: int = 128,
               bidirectional: bool = True) -> jax.Array:
  """T5's relative-position bucket (its `_relative_position_bucket`) of each entry of
  `relative_position = kv_pos - q_pos` (ints): exact buckets for small distances, logarithmic
  up to `max_distance` (in float32, as T5 computes it), the last bucket beyond; bidirectional:
  keys after the query take the upper half of the buckets. Returns int32 of the same shape.

  `max_distance` must exceed the exact buckets (`num_buckets // 2`, or `// 4` bidirectional):
  below that T5's formula divides by log(<= 1); a ValueError names the least value that works.
  """
  _check_t5(num_buckets, max_distance, bidirectional, "")
  relative = jnp.asarray(relative_position)
  if not jnp.issubdtype(relative.dtype, jnp.integer):
    raise ValueError(f"`relative_position` must be ints (kv_pos - q_pos), got {relative.dtype}.")
  return _t5_buckets(relative.astype(jnp.int32), num_buckets, max_distance, bidirectional, jnp)


def _t5_buckets(relative: ArrayLike, num_buckets: int, max_distance: int, bidirectional: bool,
                xp: Any) -> ArrayLike:
  """`t5_buckets` without its checks, in NumPy or jnp (`xp`)."""
  n = -relative
  bucket = xp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    bucket = xp.where(n < 0, num_buckets, 0)
    n = xp.abs(n)
  else:
    n = xp.maximum(n, 0)
  exact = num_buckets // 2
  scaled = (xp.log(xp.maximum(n, 1).astype(np.float32) / np.float32(exact))
            / np.float32(math.log(max_distance / exact)))
  large = xp.minimum(exact + (scaled * (num_buckets - exact)).astype(np.int32), num_buckets - 1)
  return (bucket + xp.where(n < exact, n, large)).astype(np.int32)


@functools.lru_cache(maxsize=64)
def _bucket_table(num_buckets: int, max_distance: int, bidirectional: bool) -> np.ndarray:
  """T5's bucket of every relative position in [-max_distance, max_distance] (NumPy, static)."""
  _check_t5(num_buckets, max_distance, bidirectional, "RelativePosition.")
  relative = np.arange(-max_distance, max_distance + 1, dtype=np.int32)
  return np.asarray(_t5_buckets(relative, num_buckets, max_distance, bidirectional, np))


@dataclasses.dataclass(frozen=True)
class RelativePosition(Score):
  """T5's relative-position bias: `table[t5_buckets(kv_pos - q_pos), h]`; table [buckets, Hq].

  `max_distance` must exceed the exact buckets (`t5_buckets`); a ValueError names the least
  value that works.
  """

  table: Shaped = array_field("head", axis=1)
  max_distance: int = 128
  bidirectional: bool = True

  def __post_init__(self) -> None:
    config.require_int("RelativePosition.max_distance", config.static(
        "RelativePosition.max_distance", self.max_distance))
    if not isinstance(self.bidirectional, bool):
      raise ValueError(f"`RelativePosition.bidirectional` must be a bool, got "
                       f"{self.bidirectional!r}.")
    shape = getattr(self.table, "shape", None)  # a tree's placeholder leaves have none
    if shape is not None and len(shape) == 2 and shape[0] >= (4 if self.bidirectional else 2):
      _check_t5(int(shape[0]), self.max_distance, self.bidirectional, "RelativePosition.")

  def scores(self, q_pos: ArrayLike, kv_pos: ArrayLike, head: ArrayLike) -> ArrayLike:
    # Buckets stop changing past max_distance, so each head's bias is a table over the
    # clipped relative position, gathered once per call (no logarithm per pair).
    reach = self.max_distance
    lut = _bucket_table(self.table.shape[0], reach, self.bidirectional)  # [2 * reach + 1]
    per_head = jnp.asarray(self.table, jnp.float32).T[:, lut]  # [Hq, 2 * reach + 1]
    index = jnp.clip((kv_pos - q_pos)[:, 0, 0], -reach, reach) + reach  # [B, T, S]
    values = per_head[:, index]  # [Hq, B, T, S]
    values = values.reshape(*head.shape[1:3], *values.shape[1:])  # [Hkv, G, B, T, S]
    return jnp.moveaxis(values, 2, 0)  # [B, Hkv, G, T, S]

  def check(self, batch: int, num_heads: int, query_len: int, kv_len: int) -> None:
    least = 4 if self.bidirectional else 2
    buckets = self.table.shape[0] if hasattr(self.table, "shape") and self.table.shape else 0
    _floating(self.table, "RelativePosition.table", (max(buckets, least), num_heads),
              f"[num_buckets >= {least}, num_heads]")
    _check_t5(buckets, self.max_distance, self.bidirectional, "RelativePosition.")


@dataclasses.dataclass(frozen=True)
class ScoreFn(Score):
  """Any elementwise bias `fn(params, q_pos, kv_pos, head) -> float` over broadcast int arrays
  (`head`: the global query-head index), jnp-traceable; `fn` is static (define it once),
  `params` a pytree of float arrays (gradients reach them)."""

  fn: Callable[[Any, Any, Any, Any], Any]
  params: Any = array_field("free", None)

  def scores(self, q_pos: ArrayLike, kv_pos: ArrayLike, head: ArrayLike) -> ArrayLike:
    return jnp.asarray(self.fn(self.params, q_pos, kv_pos, head), jnp.float32)

  @property
  def name(self) -> str:
    return f"ScoreFn({getattr(self.fn, '__name__', 'fn')})"

  def check(self, batch: int, num_heads: int, query_len: int, kv_len: int) -> None:
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    want = (batch, num_heads, 1, query_len, kv_len)
    try:
      closed, out = jax.make_jaxpr(self.fn, return_shape=True)(
          self.params, i32(batch, 1, 1, query_len, 1), i32(batch, 1, 1, 1, kv_len),
          i32(1, num_heads, 1, 1, 1))
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"`bias`: {self.name} failed on (params, q_pos [B, 1, 1, T, 1], kv_pos "
                       f"[B, 1, 1, 1, S], head [1, Hq, 1, 1, 1]): {e}") from e
    if any(isinstance(c, DIFFERENTIATED) for c in closed.consts):
      raise ValueError(f"`bias`: {self.name} closes over a value being differentiated: pass it in "
                       "`params` (gradients reach them), or close over jax.lax.stop_gradient(value).")
    shape = tuple(getattr(out, "shape", ()))
    fits = len(shape) <= 5 and all(n in (1, w) for n, w in zip(shape[::-1], want[::-1]))
    if not (fits and jnp.issubdtype(getattr(out, "dtype", jnp.int32), jnp.floating)):
      raise ValueError(f"`bias`: {self.name} must return floats of the broadcast shape {want}, "
                       f"got {getattr(out, 'dtype', type(out).__name__)}{list(shape)}.")
