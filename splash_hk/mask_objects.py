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
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad

from splash_hk import config
from splash_hk.mask_blocks import ArrayLike, Blocks, blocks, ranges

# Tracers of a value being differentiated (jax.grad, jvp, linearize): a mask's fn may not
# close over one (it is static, and a mask has no gradient).
DIFFERENTIATED = (ad.JVPTracer, ad.LinearizeTracer)

Window = tuple[int, int]


def _q_side(a):  # per query block [B, nq] -> [B, nq, 1], to meet key blocks
  return a[:, :, None]


def _kv_side(a):  # per key block [B, nk] -> [B, 1, nk]
  return a[:, None, :]


def array_field(side: str, default: Any = dataclasses.MISSING) -> Any:
  """A mask object's array field, a pytree leaf of `side`: "q" ([B, T], with the queries),
  "kv" ([B, S], with the keys) or "qk" ([B|1, 1|Hq, T, S], with both)."""
  return dataclasses.field(default=default, metadata={"side": side})


def part_field() -> Any:
  """A field holding another mask object (of `&` and `|`): a pytree child."""
  return dataclasses.field(metadata={"part": True})


@dataclasses.dataclass(frozen=True)
class Mask:
  """The base of every mask object: `&`, `|`, and the walks over array leaves and parts.

  A subclass is a frozen dataclass; its fields are static (the pytree's structure:
  hashable, compared by value) unless declared with `array_field` (leaves) or
  `part_field` (mask objects it combines). Subclasses register as pytrees themselves.
  """

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    jax.tree_util.register_pytree_node(cls, _flatten, functools.partial(_unflatten, cls))

  def __and__(self, other: Mask) -> Mask:
    return And(self, _as_mask(other, "&"))

  def __or__(self, other: Mask) -> Mask:
    return Or(self, _as_mask(other, "|"))

  def visible(self, q_pos: ArrayLike, kv_pos: ArrayLike) -> ArrayLike:
    """[B, 1|H, T, S] bool from positions q [B, 1, T, 1] and kv [B, 1, 1, S] (and own arrays)."""
    raise NotImplementedError

  def classify(self, blocks: Blocks) -> tuple[ArrayLike, ArrayLike]:
    """(may, full) [B|1, nq, nk] of every block pair (see the module docstring)."""
    raise NotImplementedError

  def is_static(self) -> bool:
    """Whether the rule is known at trace time: a function of positions alone (no arrays, no
    traced values), which NumPy can evaluate when a kernel or plan is built."""
    return not _fields(self, "side") and all(p.is_static() for p in self._children())

  def config_rules(self) -> dict[str, Any] | None:
    """This object as AttentionConfig rule keywords ({"causal": True}, {"window": (l, r)},
    {"chunk_size": c}, merged over `&`), or None when the config cannot say it."""
    return None

  def _children(self) -> tuple[Mask, ...]:
    return tuple(getattr(self, f.name) for f in _fields(self, "part"))

  def map_arrays(self, f: Callable[[str, Any], Any]) -> Mask:
    """This mask with each array leaf `a` of side `side` replaced by `f(side, a)`."""
    changes = {field.name: f(field.metadata["side"], getattr(self, field.name))
               for field in _fields(self, "side") if getattr(self, field.name) is not None}
    changes.update({field.name: getattr(self, field.name).map_arrays(f)
                    for field in _fields(self, "part")})
    return dataclasses.replace(self, **changes)

  def parts(self) -> Iterator[Mask]:
    """The objects this mask combines (itself for a leaf object)."""
    children = self._children()
    if not children:
      yield self
    for child in children:
      yield from child.parts()

  def map_parts(self, f: Callable[[Mask], Mask]) -> Mask:
    """This mask with each object it combines replaced by `f(object)`."""
    if not _fields(self, "part"):
      return f(self)
    return dataclasses.replace(self, **{field.name: getattr(self, field.name).map_parts(f)
                                        for field in _fields(self, "part")})


def _fields(mask: Mask | type[Mask], kind: str) -> tuple[dataclasses.Field, ...]:
  """The dataclass fields of `mask` whose metadata has `kind` ("side" or "part")."""
  return tuple(f for f in dataclasses.fields(mask) if kind in f.metadata)


def _flatten(mask: Mask) -> tuple[tuple, tuple]:
  dynamic = [f.name for f in dataclasses.fields(mask) if f.metadata]
  static = tuple((f.name, getattr(mask, f.name)) for f in dataclasses.fields(mask)
                 if not f.metadata)
  return tuple(getattr(mask, n) for n in dynamic), (tuple(dynamic), static)


def _unflatten(cls: type[Mask], aux: tuple, children: tuple) -> Mask:
  names, static = aux
  mask = object.__new__(cls)  # no __post_init__: the fields were checked when first built
  for name, value in (*zip(names, children), *static):
    object.__setattr__(mask, name, value)
  return mask


def _as_mask(x: Any, op: str) -> Mask:
  if not isinstance(x, Mask):
    raise ValueError(f"`{op}` combines mask objects (splash_hk.masks.Causal(), ...), got "
                     f"{type(x).__name__}; wrap a dense bool array as splash_hk.masks.Dense(array).")
  return x


@dataclasses.dataclass(frozen=True)
class Causal(Mask):
  """Key j is visible to query i when kv_pos[j] <= q_pos[i]."""

  def visible(self, q_pos, kv_pos):
    return kv_pos <= q_pos

  def config_rules(self):
    return {"causal": True}

  def classify(self, b):
    return (_kv_side(b.kv.pos_min) <= _q_side(b.q.pos_max),
            _kv_side(b.kv.pos_max) <= _q_side(b.q.pos_min))


@dataclasses.dataclass(frozen=True)
class SlidingWindow(Mask):
  """q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right; an int w means (w, w)."""

  window: Any  # int or (left, right)

  def __post_init__(self):
    pair = config.window_pair(self.window, "SlidingWindow.window", allow_none=False)
    object.__setattr__(self, "window", pair)

  def config_rules(self):
    return {"window": self.window}

  def visible(self, q_pos, kv_pos):
    left, right = self.window
    return (kv_pos >= q_pos - left) & (kv_pos <= q_pos + right)

  def classify(self, b):
    (left, right), q, kv = self.window, b.q, b.kv
    may = ((_kv_side(kv.pos_max) >= _q_side(q.pos_min) - left)
           & (_kv_side(kv.pos_min) <= _q_side(q.pos_max) + right))
    full = ((_kv_side(kv.pos_min) >= _q_side(q.pos_max) - left)
            & (_kv_side(kv.pos_max) <= _q_side(q.pos_min) + right))
    return may, full


@dataclasses.dataclass(frozen=True)
class Chunked(Mask):
  """Chunked attention (Llama-4): q_pos[i] // size == kv_pos[j] // size."""

  size: int

  def __post_init__(self):
    size = config.static("Chunked.size", self.size)
    config.require_int("Chunked.size", size)
    object.__setattr__(self, "size", size)

  def visible(self, q_pos, kv_pos):
    return q_pos // self.size == kv_pos // self.size

  def config_rules(self):
    return {"chunk_size": self.size}

  def classify(self, b):
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

  q_ids: Any = array_field("q")
  kv_ids: Any = array_field("kv", None)

  @property
  def keys(self) -> Any:
    """The key side's ids (q_ids where kv_ids default, S == T)."""
    return self.q_ids if self.kv_ids is None else self.kv_ids

  def visible(self, q_pos, kv_pos):
    q, kv = self.q_ids[:, None, :, None], self.keys[:, None, None, :]
    return (q == kv) & (q >= 0)

  def map_arrays(self, f):
    """As `Mask.map_arrays`, with kv_ids = q_ids where they default (S == T, validated)."""
    return Bidirectional(f("q", self.q_ids), f("kv", self.keys))

  def classify(self, b):
    xp = b.xp
    q_ids, kv_ids = blocks(self.q_ids, b.block_q, -1, xp), blocks(self.keys, b.block_kv, -1, xp)
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

  fn: Callable[[Any, Any], Any]
  ranges: Callable[..., Any] | None = None

  def visible(self, q_pos, kv_pos):
    return self.fn(q_pos, kv_pos)

  def is_static(self):
    return not traced_constants(self.fn)

  @property
  def name(self) -> str:
    """`MaskFn(fn's name)`, as messages name it."""
    return f"MaskFn({getattr(self.fn, '__name__', 'fn')})"

  def classify(self, b):
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

  mask: Any = array_field("qk")

  def visible(self, q_pos, kv_pos):
    return self.mask

  def classify(self, b):
    return b.reduce(self.mask)


@dataclasses.dataclass(frozen=True)
class And(Mask):
  """Visible when both are: `a & b`."""

  a: Mask = part_field()
  b: Mask = part_field()

  def visible(self, q_pos, kv_pos):
    return self.a.visible(q_pos, kv_pos) & self.b.visible(q_pos, kv_pos)

  def config_rules(self):
    a, b = self.a.config_rules(), self.b.config_rules()
    return None if a is None or b is None or set(a) & set(b) else {**a, **b}

  def classify(self, blocks):
    (may_a, full_a), (may_b, full_b) = self.a.classify(blocks), self.b.classify(blocks)
    return may_a & may_b, full_a & full_b


@dataclasses.dataclass(frozen=True)
class Or(Mask):
  """Visible when either is: `a | b`."""

  a: Mask = part_field()
  b: Mask = part_field()

  def visible(self, q_pos, kv_pos):
    return self.a.visible(q_pos, kv_pos) | self.b.visible(q_pos, kv_pos)

  def classify(self, blocks):
    (may_a, full_a), (may_b, full_b) = self.a.classify(blocks), self.b.classify(blocks)
    return may_a | may_b, full_a | full_b


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


def skeleton(rule: Mask | None) -> Mask | None:
  """`rule` with its arrays as ShapeDtypeStructs: hashable and static (for `Facts`)."""
  if rule is None:
    return None
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), rule)
