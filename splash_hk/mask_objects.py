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
from typing import Any, Callable, ClassVar, Iterator

import jax

from splash_hk.mask_blocks import ArrayLike, Blocks, blocks, ranges

Window = tuple[int, int]


def _q_side(a):  # per query block [B, nq] -> [B, nq, 1], to meet key blocks
  return a[:, :, None]


def _kv_side(a):  # per key block [B, nk] -> [B, 1, nk]
  return a[:, None, :]


class Mask:
  """The base of every mask object: `&`, `|`, and the walks over leaves and parts."""

  sides: ClassVar[tuple[str, ...]] = ()  # the side of each array field, in field order

  def __and__(self, other: Mask) -> Mask:
    return And(self, _as_mask(other, "&"))

  def __or__(self, other: Mask) -> Mask:
    return Or(self, _as_mask(other, "|"))

  def visible(self, q_pos: ArrayLike, kv_pos: ArrayLike) -> ArrayLike:
    raise NotImplementedError

  def classify(self, blocks: Blocks) -> tuple[ArrayLike, ArrayLike]:
    raise NotImplementedError

  def arrays(self) -> tuple:
    fields = dataclasses.fields(self)
    return tuple(getattr(self, f.name) for f in fields[:len(self.sides)])

  def map_arrays(self, f: Callable[[str, Any], Any]) -> Mask:
    """This mask with each array leaf `a` of side `side` replaced by `f(side, a)`."""
    names = [field.name for field in dataclasses.fields(self)][:len(self.sides)]
    return dataclasses.replace(self, **{n: f(s, getattr(self, n))
                                        for n, s in zip(names, self.sides)})

  def parts(self) -> Iterator[Mask]:
    """The objects this mask combines (itself for a leaf object)."""
    yield self

  def map_parts(self, f: Callable[[Mask], Mask]) -> Mask:
    """This mask with each object it combines replaced by `f(object)`."""
    return f(self)

  def tree_flatten(self):
    statics = tuple(getattr(self, f.name) for f in dataclasses.fields(self)[len(self.sides):])
    return self.arrays(), statics

  @classmethod
  def tree_unflatten(cls, statics, arrays):
    return cls(*arrays, *statics)


def _as_mask(x: Any, op: str) -> Mask:
  if not isinstance(x, Mask):
    raise ValueError(f"`{op}` combines mask objects (splash_hk.masks.Causal(), ...), got "
                     f"{type(x).__name__}; wrap a dense bool array as splash_hk.masks.Dense(array).")
  return x


def _register(cls):
  return jax.tree_util.register_pytree_node_class(dataclasses.dataclass(frozen=True)(cls))


@_register
class Causal(Mask):
  """Key j is visible to query i when kv_pos[j] <= q_pos[i]."""

  def visible(self, q_pos, kv_pos):
    return kv_pos <= q_pos

  def classify(self, b):
    return (_kv_side(b.kv.pos_min) <= _q_side(b.q.pos_max),
            _kv_side(b.kv.pos_max) <= _q_side(b.q.pos_min))


@_register
class SlidingWindow(Mask):
  """q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right; an int w means (w, w)."""

  window: Any  # int or (left, right)

  def __post_init__(self):
    pair = (self.window,) * 2 if isinstance(self.window, int) else tuple(self.window)
    if len(pair) != 2 or not all(isinstance(w, int) and w >= 0 for w in pair):
      raise ValueError(f"SlidingWindow(window) takes an int w >= 0 or (left, right), "
                       f"got {self.window!r}.")
    object.__setattr__(self, "window", pair)

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


@_register
class Chunked(Mask):
  """Chunked attention (Llama-4): q_pos[i] // size == kv_pos[j] // size."""

  size: int

  def __post_init__(self):
    if not isinstance(self.size, int) or self.size < 1:
      raise ValueError(f"Chunked(size) takes a positive int, got {self.size!r}.")

  def visible(self, q_pos, kv_pos):
    return q_pos // self.size == kv_pos // self.size

  def classify(self, b):
    c, q, kv = self.size, b.q, b.kv
    may = ((_kv_side(kv.pos_min) // c <= _q_side(q.pos_max) // c)
           & (_q_side(q.pos_min) // c <= _kv_side(kv.pos_max) // c))
    chunk = _q_side(q.pos_min) // c
    full = ((_q_side(q.pos_max) // c == chunk) & (_kv_side(kv.pos_min) // c == chunk)
            & (_kv_side(kv.pos_max) // c == chunk))
    return may, full


@_register
class Bidirectional(Mask):
  """Query i and key j see each other when q_ids[i] == kv_ids[j] >= 0 (a prefix, an image, a span).

  q_ids [B, T], kv_ids [B, S] int; kv_ids defaults to q_ids when S == T.
  """

  q_ids: Any
  kv_ids: Any = None
  sides: ClassVar[tuple[str, ...]] = ("q", "kv")

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


@_register
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

  def classify(self, b):
    if self.ranges is not None:
      q, kv = b.q, b.kv
      return self.ranges(_q_side(q.pos_min), _q_side(q.pos_max), _kv_side(kv.pos_min),
                         _kv_side(kv.pos_max))
    return b.evaluate(self.fn)


@_register
class Dense(Mask):
  """The dense mask as an object: [B|1, 1|Hq, T, S] bool, True = may attend."""

  mask: Any
  sides: ClassVar[tuple[str, ...]] = ("qk",)

  def visible(self, q_pos, kv_pos):
    return self.mask

  def classify(self, b):
    return b.reduce(self.mask)


class _Combined(Mask):
  """A pair of masks (`&` or `|`); its leaves are its operands' leaves."""

  def arrays(self):
    return (self.a, self.b)

  def map_arrays(self, f):
    return type(self)(self.a.map_arrays(f), self.b.map_arrays(f))

  def parts(self):
    yield from self.a.parts()
    yield from self.b.parts()

  def map_parts(self, f):
    return type(self)(self.a.map_parts(f), self.b.map_parts(f))

  def tree_flatten(self):
    return (self.a, self.b), None

  @classmethod
  def tree_unflatten(cls, _, children):
    return cls(*children)


@_register
class And(_Combined):
  """Visible when both are: `a & b`."""

  a: Mask
  b: Mask

  def visible(self, q_pos, kv_pos):
    return self.a.visible(q_pos, kv_pos) & self.b.visible(q_pos, kv_pos)

  def classify(self, blocks):
    (may_a, full_a), (may_b, full_b) = self.a.classify(blocks), self.b.classify(blocks)
    return may_a & may_b, full_a & full_b


@_register
class Or(_Combined):
  """Visible when either is: `a | b`."""

  a: Mask
  b: Mask

  def visible(self, q_pos, kv_pos):
    return self.a.visible(q_pos, kv_pos) | self.b.visible(q_pos, kv_pos)

  def classify(self, blocks):
    (may_a, full_a), (may_b, full_b) = self.a.classify(blocks), self.b.classify(blocks)
    return may_a | may_b, full_a | full_b


def from_rules(causal: bool, window: Window | None, chunk_size: int | None) -> Mask | None:
  """The config's rules as one object (their AND), or None when there is none."""
  parts = ([Causal()] if causal else []) + ([SlidingWindow(window)] if window else [])
  parts += [Chunked(chunk_size)] if chunk_size else []
  rule = None
  for part in parts:
    rule = part if rule is None else rule & part
  return rule


def as_rules(rule: Mask | None) -> dict[str, Any] | None:
  """The rules of `rule` as config keywords when it is an AND of at most one Causal,
  SlidingWindow and Chunked each (what a static kernel can build), else None."""
  rules = dict(causal=False, window=None, chunk_size=None)
  if rule is None:
    return rules
  if any(isinstance(p, Or) for p in _nodes(rule)):
    return None
  for part in rule.parts():
    key = {Causal: "causal", SlidingWindow: "window", Chunked: "chunk_size"}.get(type(part))
    if key is None or rules[key]:
      return None
    rules[key] = True if key == "causal" else getattr(part, "window", getattr(part, "size", None))
  return rules


def _nodes(rule: Mask) -> Iterator[Mask]:
  yield rule
  if isinstance(rule, _Combined):
    yield from _nodes(rule.a)
    yield from _nodes(rule.b)


def skeleton(rule: Mask | None) -> Mask | None:
  """`rule` with its arrays as ShapeDtypeStructs: hashable and static (for `Facts`)."""
  if rule is None:
    return None
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), rule)
