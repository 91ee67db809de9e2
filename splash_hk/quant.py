"""Quantized keys and values: `Quantized` (8- or 4-bit values with float32 scales) and `quantize`.

`Quantized(values, scale)` stands for `values * scale` in float32; the scale broadcasts over the
values (per tensor, token, head or channel). The kernels never build that product for a whole
cache or K/V: the xla backend takes block slices of values and scales and multiplies them per
tile (`cut`, `tile`), the paged kernel multiplies a page's logits and probabilities by its
per-token scales. A `qwix.QArray` (symmetric) is read as a `Quantized` (`as_quantized`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable

import jax
import jax.numpy as jnp

VALUE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.int4), jnp.dtype(jnp.float8_e4m3fn),
                jnp.dtype(jnp.float8_e5m2))
NAMES = "int8, int4, float8_e4m3fn or float8_e5m2"


@functools.partial(jax.tree_util.register_dataclass, data_fields=("values", "scale"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class Quantized:
  """Quantized values and their scales (a pytree): the array `values * scale` in float32.

  Attributes:
    values: [...] int8, int4, float8_e4m3fn or float8_e5m2.
    scale: float32 broadcastable to `values` (one per tensor, token, head or channel).
  """

  values: jax.Array
  scale: jax.Array

  shape = property(lambda self: tuple(self.values.shape))
  ndim = property(lambda self: len(self.values.shape))
  dtype = property(lambda self: jnp.dtype(self.scale.dtype))  # what it dequantizes to

  def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
    """`values * scale` in float32, then cast to `dtype`."""
    scale = expanded(self.scale.astype(jnp.float32), self.values.shape[-1])
    return (self.values.astype(jnp.float32) * scale).astype(dtype)


def _largest(dtype: Any) -> float:
  """The largest magnitude a symmetric quantization maps to (int8: 127, fp8: the finite max)."""
  dtype = jnp.dtype(dtype)
  return float(jnp.iinfo(dtype).max if jnp.issubdtype(dtype, jnp.integer) else
               jnp.finfo(dtype).max)


def check_dtype(dtype: Any, name: str) -> jnp.dtype:
  """`dtype` as a quantized values dtype, or a ValueError naming `name`."""
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype not in VALUE_DTYPES:
    raise ValueError(f"`{name}` must be a quantized dtype ({NAMES}), got {dtype}.")
  return dtype


def quantize(x: Any, dtype: Any, axis: int | tuple[int, ...] = -1) -> Quantized:
  """`x` quantized symmetrically with one float32 scale per slice along `axis` (absmax).

  int8 (and int4): `scale = absmax / 127` (7), values rounded half to even and clipped to
  [-127, 127]; fp8: `scale = absmax / finfo(dtype).max`, values rounded by the cast; an all-zero
  slice gets scale 1. The scale keeps `x`'s rank (size 1 along `axis`).
  """
  dtype = check_dtype(dtype, "dtype")
  x = jnp.asarray(x, jnp.float32)
  largest = _largest(dtype)
  absmax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  scale = jnp.where(absmax == 0, 1.0, absmax / largest)
  scaled = x / scale
  if jnp.issubdtype(dtype, jnp.integer):
    scaled = jnp.clip(jnp.round(scaled), -largest, largest)
  return Quantized(scaled.astype(dtype), scale.astype(jnp.float32))


def is_quantized(x: Any) -> bool:
  """A `Quantized` or a `qwix.QArray` (read by its fields: qwix stays an optional extra)."""
  return isinstance(x, Quantized) or (hasattr(x, "qvalue") and hasattr(x, "scale"))


def as_quantized(x: Any, name: str) -> Any:
  """`x` as a `Quantized` whose scale has the values' rank (a `qwix.QArray` converted), or `x`
  unchanged when it is not quantized. Bad values or scales are a ValueError naming `name`."""
  if not is_quantized(x):
    return x
  if not isinstance(x, Quantized):
    if getattr(x, "zero_point", None) is not None:
      raise ValueError(f"`{name}` is a qwix.QArray with a zero_point (asymmetric): pass a "
                       "symmetric one (zero_point None), or sh.quantize(x, dtype).")
    if getattr(x, "qtype", None) is not None and jnp.dtype(x.qtype) != jnp.dtype(x.qvalue.dtype):
      raise ValueError(f"`{name}` is a qwix.QArray of qtype {x.qtype} stored as "
                       f"{x.qvalue.dtype}: pass one stored in its own dtype ({NAMES}).")
    x = Quantized(x.qvalue, x.scale)
  check_dtype(x.values.dtype, f"{name}.values")
  values, scale = x.values, x.scale
  if not jnp.issubdtype(scale.dtype, jnp.floating):
    raise ValueError(f"`{name}.scale` must be floating (float32), got {scale.dtype}.")
  _check_scale_shape(tuple(values.shape), tuple(scale.shape), name)
  if not scale.shape:  # one scale for the whole tensor: the one shape of lower rank that is clear
    scale = jnp.reshape(scale, (1,) * values.ndim)
  return Quantized(values, scale)


def _check_scale_shape(shape: tuple[int, ...], scale: tuple[int, ...], name: str) -> None:
  """A scale of the values' rank (or 0-d: per tensor) whose axes are 1 or the values' size; the
  last may be a divisor of it (a scale per tile of channels, qwix's sub-channel); else a
  ValueError naming `name` and the shapes that are meant."""
  if scale and len(scale) < len(shape):
    meant = [m for m in _placements(scale, len(shape)) if _broadcasts(shape, m)]
    said = " or ".join(str(m) for m in dict.fromkeys(meant)) or "a shape of its rank"
    raise ValueError(
        f"`{name}.scale` {scale} has fewer axes than its values {shape}: which axes it spans is "
        f"ambiguous. Write every axis, broadcast ones as size 1: {said} (sh.quantize gives "
        "scales of the values' rank).")
  if len(scale) > len(shape):
    raise ValueError(f"`{name}.scale` {scale} has more axes than its values {shape}.")
  if scale and not _broadcasts(shape, scale):
    raise ValueError(
        f"`{name}.scale` {scale} must broadcast to its values {shape}: each axis 1 or the values' "
        "size (one scale per tensor, token, head or channel), the last axis also a divisor of "
        "the channels (one scale per tile of channels).")


def _placements(scale: tuple[int, ...], rank: int) -> list[tuple[int, ...]]:
  """Every shape of `rank` holding `scale`'s axes in order, the others 1 (what it may mean)."""
  shapes = []
  for axes in itertools.combinations(range(rank), len(scale)):
    shape = [1] * rank
    for axis, n in zip(axes, scale):
      shape[axis] = n
    shapes.append(tuple(shape))
  return shapes


def _broadcasts(shape: tuple[int, ...], scale: tuple[int, ...]) -> bool:
  """Whether a scale of the values' rank applies to them (the last axis may tile channels)."""
  *lead, last = scale
  return (all(s in (1, v) for s, v in zip(lead, shape)) and last > 0 and shape[-1] % last == 0)


def expanded(scale: jax.Array, channels: int) -> jax.Array:
  """A scale with its last axis over `channels`: a scale per tile of channels repeated over its
  tile, any other unchanged (1 or already `channels`)."""
  tiles = scale.shape[-1]
  return scale if tiles in (1, channels) else jnp.repeat(scale, channels // tiles, axis=-1)


def storage(x: Any) -> str:
  """How `x` is stored, in words a kernel's limits read: its dtype ("float32"), or for a
  quantized one its values' dtype and what its scale covers ("int8/token": one scale per
  slice of the last axis or coarser; "int8/channel": a scale along the last axis)."""
  if not is_quantized(x):
    dtype = getattr(x, "dtype", None)  # not an array: validation names it
    return type(x).__name__ if dtype is None else str(jnp.dtype(dtype))
  values, scale = (x.values, x.scale) if isinstance(x, Quantized) else (x.qvalue, x.scale)
  covers = "token" if not scale.shape or scale.shape[-1] == 1 else "channel"
  return f"{jnp.dtype(values.dtype)}/{covers}"


def checked(x: Any, name: str) -> Any:
  """A call's argument as a kernel takes it: `as_quantized`, its codes held constant
  (`codes_constant`; anything not quantized unchanged)."""
  return codes_constant(as_quantized(x, name))


def shaped(x: Any, name: str, dtype: Any = None) -> Any:
  """A quantized argument (checked, naming `name`) as the shape and float dtype it stands for
  (`dtype`, else the scale's): what shape and dtype checks read. Anything else unchanged."""
  if not is_quantized(x):
    return x
  x = as_quantized(x, name)
  return jax.ShapeDtypeStruct(x.shape, x.dtype if dtype is None else dtype)


def spread(x: Quantized, axes: tuple[int, ...]) -> Quantized:
  """`x` with its scale broadcast along `axes` (so it splits and travels like its values)."""
  shape = tuple(v if a in axes else s for a, (s, v) in enumerate(zip(x.scale.shape, x.shape)))
  return Quantized(x.values, jnp.broadcast_to(x.scale, shape))


def cut(a: Any, axis: int, fn: Callable[[jax.Array], jax.Array]) -> Any:
  """`fn` (a slice or gather along `axis`) of an array, or of a `Quantized`'s values and of its
  scale where the scale is not broadcast along `axis`."""
  if not isinstance(a, Quantized):
    return fn(a)
  return Quantized(fn(a.values), a.scale if a.scale.shape[axis] == 1 else fn(a.scale))


def tile(a: Any, dtype: Any) -> jax.Array:
  """A block (array or `Quantized` slice) as `dtype` values: the scale applied on the tile."""
  if not isinstance(a, Quantized):
    return a
  return a.dequantize(dtype)


def per_key(a: Any) -> tuple[jax.Array, jax.Array, bool]:
  """(values, scales [..., keys] float32 or a dummy [1], quantized) of keys or values [..., keys,
  X] whose scale covers a token or more (`storage` "<dtype>/token"): a coarser scale broadcast
  to one per key (small: 1/X of the values), as the decode kernels read them."""
  if not is_quantized(a):
    return a, jnp.zeros((1,), jnp.float32), False
  a = as_quantized(a, "cache")
  scale = jnp.broadcast_to(a.scale.astype(jnp.float32), (*a.values.shape[:-1], 1))
  return a.values, scale[..., 0], True


def zeros(shape: tuple[int, ...], dtype: Any) -> Any:
  """A zeroed buffer of `shape`: floats, or for a quantized `dtype` a `Quantized` with one
  scale per (..., last axis but one) (a cache's: per token and head). Any other `dtype` (an
  integer that is not a quantized one, bool) is a ValueError naming `dtype`."""
  try:
    kind = jnp.dtype(dtype)
  except TypeError:
    kind = None
  if kind is None or (kind not in VALUE_DTYPES and not jnp.issubdtype(kind, jnp.floating)):
    raise ValueError(f"`dtype` of a cache must be floating (float32, bfloat16, float16) or a "
                     f"quantized dtype ({NAMES}), got {repr(dtype) if kind is None else kind}.")
  if kind not in VALUE_DTYPES:
    return jnp.zeros(shape, dtype)
  return Quantized(jnp.zeros(shape, dtype), jnp.ones((*shape[:-1], 1), jnp.float32))


def write(buf: Any, index: Any, new: Any, name: str) -> Any:
  """`buf.at[index].set(new, mode="drop")` for an array, or for a `Quantized` buffer: `new`
  (floats, or quantized: dequantized first; `name` names it in errors) quantized along its last
  axis as it is written."""
  return put(buf, index, as_held(buf, new, name))


def put(buf: Any, index: Any, held: Any) -> Any:
  """`buf.at[index].set(held, mode="drop")` of rows already as `buf` holds them (`as_held`):
  for a `Quantized` buffer, its codes and its scales."""
  if not isinstance(buf, Quantized):
    return buf.at[index].set(held, mode="drop")
  return Quantized(buf.values.at[index].set(held.values, mode="drop"),
                   buf.scale.at[index].set(held.scale, mode="drop"))


def as_held(buf: Any, new: Any, name: str) -> Any:
  """`new` as `write` stores it in `buf`: cast to its dtype, or quantized as it (a `Quantized`);
  `tile(as_held(...), float32)` is what a read of the written rows gives, without reading
  `buf` (a gather from a pool can cost a copy of all of it)."""
  new = as_quantized(new, name)
  new = new.dequantize() if isinstance(new, Quantized) else jnp.asarray(new)
  if not isinstance(buf, Quantized):
    return new.astype(buf.dtype)
  return quantize(new, buf.values.dtype)


def cotangent(primal: Any, grad: jax.Array) -> Any:
  """A custom VJP's cotangent for an input from the gradient of what it stands for (`grad`, its
  dequantized shape): for a `Quantized` one, its scale's (`d scale = sum(grad * values)` over
  the scale's broadcast axes; its values are codes and get none), else `grad`."""
  if not isinstance(primal, Quantized):
    return grad
  return Quantized(None, scale_cotangent(primal, grad))  # type: ignore[arg-type]


def scale_cotangent(x: Quantized, grad: jax.Array) -> jax.Array:
  """d scale of `x` from d(values * scale) = `grad`, summed over the scale's broadcast axes (and
  over each tile of channels a sub-channel scale spans), float32 like the scale."""
  product = grad.astype(jnp.float32) * x.values.astype(jnp.float32)  # [..., D]
  shape, channels = tuple(x.scale.shape), x.values.shape[-1]
  if shape[-1] not in (1, channels):  # a scale per tile of channels: [..., tiles, D / tiles]
    product = product.reshape(*product.shape[:-1], shape[-1], channels // shape[-1]).sum(-1)
  axes = tuple(a for a, (s, v) in enumerate(zip(shape, product.shape)) if s == 1 and v != 1)
  return jnp.sum(product, axis=axes, keepdims=True).astype(x.scale.dtype)


def codes_constant(x: Any) -> Any:
  """`x` as a kernel takes it: a `Quantized`'s values (integers, or fp8 codes) get no gradient
  (`stop_gradient`, as JAX gives integers none); its scale stays differentiable."""
  if not isinstance(x, Quantized):
    return x
  return Quantized(jax.lax.stop_gradient(x.values), x.scale)
