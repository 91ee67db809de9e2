"""Mask objects: a call's position rule as values, combined with `&` and `|`, per pair and per block.

Each object answers two questions (`splash_hk.masks` adds segments and padding,
which always apply):
- per pair, `visible(q_pos, kv_pos)`: which queries see which keys, from both
  sides' positions [B, 1, T, 1] / [B, 1, 1, S] (and the object's own arrays,
  which the caller slices with `map_arrays` as it slices positions) ->
  [B, 1|H, T, S] bool; objects without arrays take any broadcasting shapes;
- per block pair, `classify(blocks)` -> (may, full), [B|1, nq, nk] bool, from
  per-block summaries in O(blocks) (`MaskFn` and `Dense` excepted: they are
  read whole): `may` is never a false "no" (some pair in the block may see),
  `full` never a false "yes" (every pair sees). `&` and `|` combine the answers.

Objects are pytrees (structure static, arrays leaves), so they pass through
`jit`, `shard_map` and Haiku modules. Array leaves carry a side: "q" ([B, T],
with the queries), "kv" ([B, S], with the keys) or "qk" ([B|1, 1|H, T, S]).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad

from splash_hk import config
from splash_hk.masks._blocks import ArrayLike, Blocks, blocks, ranges
from splash_hk.masks._mask import And, Mask, Or, Shaped, array_field, skeleton

__all__ = ("And", "Bidirectional", "Causal", "Chunked", "DIFFERENTIATED", "Dense", "Mask",
           "MaskFn", "Or", "SlidingWindow", "as_rules", "causal_or_spans", "from_rules",
           "skeleton", "traced_constants")

# Tracers of a value being differentiated (jax.grad, jvp, linearize): a mask's fn may not
# close over one (it is static, and a mask has no gradient).
DIFFERENTIATED = (ad.JVPTracer, ad.LinearizeTracer)

Window = tuple[int, int]


def _q_side(a):  # per query block [B, nq] -> [B, nq, 1], to meet key blocks
  return a[:, :, None]


def _kv_side(a):  # per key block [B, nk] -> [B, 1, nk]
  return a[:, None, :]


@dataclasses.dataclass(frozen=True)
class Causal(Mask):
  """Key j is visible to query i when kv_pos[j] <= q_pos[i]."""

  def visible(self, q_pos: ArrayLike, kv_pos: ArrayLike) -> ArrayLike:
    return kv_pos <= q_pos

  def config_rules(self) -> dict[str, Any] | None:
    return {"causal": True}

  def classify(self, b: Blocks) -> tuple[ArrayLike, ArrayLike]:
    return (_kv_side(b.kv.pos_min) <= _q_side(b.q.pos_max),
            _kv_side(b.kv.pos_max) <= _q_side(b.q.pos_min))


@dataclasses.dataclass(frozen=True)
class SlidingWindow(Mask):
  """q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right; an int w means (w, w)."""

  window: int | tuple[int, int]  # stored as (left, right)

  def __post_init__(self) -> None:
    pair = config.window_pair(self.window, "SlidingWindow.window", allow_none=False)
    object.__setattr__(self, "window", pair)

  @property
  def bounds(self) -> tuple[int, int]:
    """The window as stored, (left, right)."""
    window = self.window
    return (window, window) if isinstance(window, int) else window

  def config_rules(self) -> dict[str, Any] | None:
    return {"window": self.bounds}

  def visible(self, q_pos: ArrayLike, kv_pos: ArrayLike) -> ArrayLike:
    left, right = self.bounds
    return (kv_pos >= q_pos - left) & (kv_pos <= q_pos + right)

  def classify(self, b: Blocks) -> tuple[ArrayLike, ArrayLike]:
    (left, right), q, kv = self.bounds, b.q, b.kv
    may = ((_kv_side(kv.pos_max) >= _q_side(q.pos_min) - left)
           & (_kv_side(kv.pos_min) <= _q_side(q.pos_max) + right))
    full = ((_kv_side(kv.pos_min) >= _q_side(q.pos_max) - left)
            & (_kv_side(kv.pos_max) <= _q_side(q.pos_min) + right))
    return may, full


def _floor_div(a: ArrayLike, size: int) -> ArrayLike:
  """a // size (size > 0) without `jnp.floor_divide`, whose `sign` Mosaic lowers only where it
  knows the TPU's version (never when a TPU program is lowered on another host)."""
  if not isinstance(a, jax.Array):
    return a // size
  return jnp.where(a >= 0, jax.lax.div(a, size), -jax.lax.div(size - 1 - a, size))


@dataclasses.dataclass(frozen=True)
class Chunked(Mask):
  """Chunked attention (Llama-4): q_pos[i] // size == kv_pos[j] // size."""

  size: int

  def __post_init__(self) -> None:
    size = config.static("Chunked.size", self.size)
    config.require_int("Chunked.size", size)
    object.__setattr__(self, "size", size)

  def visible(self, q_pos: ArrayLike, kv_pos: ArrayLike) -> ArrayLike:
    return _floor_div(q_pos, self.size) == _floor_div(kv_pos, self.size)

  def config_rules(self) -> dict[str, Any] | None:
    return {"chunk_size": self.size}

  def classify(self, b: Blocks) -> tuple[ArrayLike, ArrayLike]:
    c, q, kv = self.size, b.q, b.kv
    may = ((_kv_side(kv.pos_min) // c <= _q_side(q.pos_max) // c)
           & (_q_side(q.pos_min) // c <= _kv_side(kv.pos_max) // c))
    chunk = _q_side(q.pos_min) // c
    full = ((_q_side(q.pos_max) // c == chunk) & (_kv_side(kv.pos_min) // c == chunk)
            & (_kv_side(kv.pos_max) // c == chunk))
    return may, full


@dataclasses.dataclass(frozen=True)
class Bidirectional(Mask):
  """Query i and key j see each other when q_ids[i] == kv_ids[j] >= 0 (a prefix, an image, a span).

  q_ids [B, T], kv_ids [B, S] int; kv_ids defaults to q_ids when S == T.
  """

  q_ids: Shaped = array_field("q")  # [B, T] int
  kv_ids: Shaped | None = array_field("kv", None)  # [B, S] int

  @property
  def ids(self) -> tuple[ArrayLike, ArrayLike]:
    """The query side's ids [B, T] and the key side's [B, S] (q_ids where kv_ids default)."""
    return self.q_ids, self.q_ids if self.kv_ids is None else self.kv_ids

  def visible(self, q_pos: ArrayLike, kv_pos: ArrayLike) -> ArrayLike:
    q_ids, kv_ids = self.ids
    q, kv = q_ids[:, None, :, None], kv_ids[:, None, None, :]
    return (q == kv) & (q >= 0)

  def over_slots(self, slots: ArrayLike, kv_len: int) -> Mask:
    """Ids given for the new tokens only: each one's id where it is written, -1 (no span) at
    every other slot."""
    if self.kv_ids is not None:
      return self
    kv_ids = jnp.full((self.q_ids.shape[0], kv_len), -1, self.q_ids.dtype)  # [B, S]
    rows = jnp.arange(self.q_ids.shape[0])[:, None]
    return Bidirectional(self.q_ids, kv_ids.at[rows, slots].set(self.q_ids, mode="drop"))

  def check(self, batch: int, query_len: int, kv_len: int) -> None:
    if self.kv_ids is None and query_len != kv_len:
      raise ValueError(f"Bidirectional(q_ids) needs kv_ids when query_len ({query_len}) != kv_len "
                       f"({kv_len}): ids of one length cannot default to the other.")

  def normal(self) -> Mask:
    """kv_ids = q_ids where they default (S == T, validated): the keys' ids travel with the keys."""
    return self if self.kv_ids is not None else Bidirectional(self.q_ids, self.q_ids)

  def classify(self, b: Blocks) -> tuple[ArrayLike, ArrayLike]:
    xp = b.xp
    q_side, kv_side = self.ids
    q_ids, kv_ids = blocks(q_side, b.block_q, -1, xp), blocks(kv_side, b.block_kv, -1, xp)
    q_in = blocks(b.q_valid, b.block_q, False, xp) & (q_ids >= 0)  # [B, nq, bq]
    kv_in = blocks(b.kv_valid, b.block_kv, False, xp) & (kv_ids >= 0)
    (q_lo, q_hi), (kv_lo, kv_hi) = ranges(q_ids, q_in, xp), ranges(kv_ids, kv_in, xp)
    may = (_kv_side(kv_lo) <= _q_side(q_hi)) & (_q_side(q_lo) <= _kv_side(kv_hi))
    every = lambda inside, count: xp.sum(inside, axis=-1) == count
    full = (_q_side(every(q_in, b.q.count) & (q_lo == q_hi))
            & _kv_side(every(kv_in, b.kv.count) & (kv_lo == kv_hi))
            & (_q_side(q_lo) == _kv_side(kv_lo)))
    return may, full


@dataclasses.dataclass(frozen=True)
class MaskFn(Mask):
  """Any elementwise rule fn(q_pos, kv_pos) -> bool over broadcast int arrays (jnp-traceable).

  `fn` is static: define it once (a fresh lambda per call is a new mask and a new
  compilation). Without `ranges` its blocks are classified by evaluating it on
  every pair, once per call (O(T * S), block by block: `Blocks.evaluate`);
  `ranges(q_lo, q_hi, kv_lo, kv_hi) -> (may,
  full)` classifies them from each block's position ranges instead (O(blocks);
  [B, nq, 1] / [B, 1, nk] int arrays, the same answers' guarantees as every mask's),
  e.g. for "the first 4 tokens": `lambda q_lo, q_hi, kv_lo, kv_hi: (kv_lo < 4, kv_hi < 4)`.
  """

  fn: Callable[[Any, Any], Any]  # (q_pos, kv_pos) int arrays -> bool, elementwise
  ranges: Callable[[Any, Any, Any, Any], tuple[Any, Any]] | None = None

  def visible(self, q_pos: ArrayLike, kv_pos: ArrayLike) -> ArrayLike:
    return self.fn(q_pos, kv_pos)

  def is_static(self) -> bool:
    return not traced_constants(self.fn)

  def evaluated_per_pair(self) -> bool:
    return self.ranges is None

  @property
  def name(self) -> str:
    """`MaskFn(fn's name)`, as messages name it."""
    return f"MaskFn({getattr(self.fn, '__name__', 'fn')})"

  def check(self, batch: int, query_len: int, kv_len: int) -> None:
    """`fn` on the call's int positions: bool of the broadcast shape, and no value being
    differentiated in its closure (a mask has no gradient, and `fn` is static)."""
    want = (batch, 1, query_len, kv_len)
    q = jax.ShapeDtypeStruct((batch, 1, query_len, 1), jnp.int32)
    kv = jax.ShapeDtypeStruct((batch, 1, 1, kv_len), jnp.int32)
    try:
      closed, out = jax.make_jaxpr(self.fn, return_shape=True)(q, kv)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"{self.name} failed on int positions q [B, 1, T, 1], kv [B, 1, 1, S]: "
                       f"{e}") from e
    differentiated = [str(c.aval) for c in closed.consts if isinstance(c, DIFFERENTIATED)]
    if differentiated:
      raise ValueError(
          f"{self.name} closes over a value being differentiated ({', '.join(differentiated)}): "
          "a mask has no gradient, and its fn is static. Close over jax.lax.stop_gradient(value) "
          "instead, or pass the value static (a Python number: a module hyperparameter, or "
          "jax.jit(..., static_argnums=...)).")
    shape = tuple(getattr(out, "shape", ()))
    fits = len(shape) <= 4 and all(n in (1, w) for n, w in zip(shape[::-1], want[::-1]))
    if not (getattr(out, "dtype", None) == jnp.bool_ and fits):
      raise ValueError(f"{self.name} must return bool of the broadcast shape {want} (elementwise "
                       f"over q_pos [B, 1, T, 1] and kv_pos [B, 1, 1, S]), got "
                       f"{getattr(out, 'dtype', type(out).__name__)} {shape}.")

  def classify(self, b: Blocks) -> tuple[ArrayLike, ArrayLike]:
    if self.ranges is not None:
      q, kv = b.q, b.kv
      return self.ranges(_q_side(q.pos_min), _q_side(q.pos_max), _kv_side(kv.pos_min),
                         _kv_side(kv.pos_max))
    return b.evaluate(self.fn)


def traced_constants(fn: Callable[[Any, Any], Any]) -> list[jax.core.Tracer]:
  """The traced values (under jit, vmap, grad, ...) that `fn(q_pos, kv_pos)` closes over."""
  position = jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.int32)
  try:
    closed = jax.make_jaxpr(fn)(position, position)
  except Exception:  # pylint: disable=broad-except  (validation reports fn's own failures)
    return []
  return [c for c in closed.consts if isinstance(c, jax.core.Tracer)]


@dataclasses.dataclass(frozen=True)
class Dense(Mask):
  """The dense mask as an object: [B|1, 1|Hq, T, S] bool, True = may attend."""

  mask: Shaped = array_field("qk")  # [B|1, 1|Hq, T, S] bool

  def visible(self, q_pos: ArrayLike, kv_pos: ArrayLike) -> ArrayLike:
    return self.mask

  def classify(self, b: Blocks) -> tuple[ArrayLike, ArrayLike]:
    return b.reduce(self.mask)


def causal_or_spans(rule: Mask | None) -> Bidirectional | None:
  """The `Bidirectional` of a rule that is `Causal() | Bidirectional(...)` (either order), else
  None: the one rule with arrays that a static kernel serves, from its spans' horizons."""
  if not isinstance(rule, Or):
    return None
  for causal, spans in ((rule.a, rule.b), (rule.b, rule.a)):
    if causal.config_rules() == {"causal": True} and isinstance(spans, Bidirectional):
      return spans
  return None


def from_rules(causal: bool, window: Window | None, chunk_size: int | None) -> Mask | None:
  """The config's rules as one object (their AND), or None when there is none."""
  parts: list[Mask] = ([Causal()] if causal else []) + ([SlidingWindow(window)] if window else [])
  parts += [Chunked(chunk_size)] if chunk_size else []
  rule: Mask | None = None
  for part in parts:
    rule = part if rule is None else rule & part
  return rule


def as_rules(rule: Mask | None) -> dict[str, Any] | None:
  """The rules of `rule` as config keywords (causal, window, chunk_size) when config can say it
  (an AND of at most one Causal, SlidingWindow and Chunked: what a static kernel builds), else None."""
  rules: dict[str, Any] = dict(causal=False, window=None, chunk_size=None)
  said = {} if rule is None else rule.config_rules()
  return None if said is None else {**rules, **said}
