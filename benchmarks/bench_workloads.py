"""The bench's workloads: inputs, config and useful work of each, from a short spec.

  MASK@T            self-attention over T tokens; MASK is causal, full, window:W
                    (causal, W keys back), chunk:C (causal chunks) or packed:N
                    (N causal documents of T/N tokens, as segment ids)
  decode:L/C        one new token after L tokens, in a KV cache of C slots
  prefill:N/C       N new tokens into an empty KV cache of C slots

Mask objects (`sh.masks`), as MASK@T:
  prefix:P          prefix-LM: the first P tokens see each other, the rest causal
                    (Causal() | Bidirectional(ids))
  images:NxL        N images of L tokens, evenly spread, each seen whole by its own
                    tokens, text causal (Causal() | Bidirectional(ids))
  window_first:W+K  W keys back, and the first K tokens always
                    (SlidingWindow((W, 0)) | MaskFn(first K, ranges))
  window_fn:W+K     the same, its MaskFn without ranges (classified pair by pair)

Scores (`sh.scores`), as MASK+bias:B@T (any MASK@T above, plus a bias):
  alibi             ALiBi, the paper's slopes
  t5                T5's relative-position buckets (32, max distance 128, causal)
  dense             a dense [1, Hq, T, S] float bias

Useful work counts only the (query, key) pairs the mask lets through.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

import splash_hk as sh
from splash_hk.masks import _rules


@dataclasses.dataclass(frozen=True)
class Workload:
  """One attention call to measure: shapes, config, extra inputs and useful pairs."""

  name: str
  query_len: int
  kv_len: int
  config: sh.AttentionConfig
  useful_pairs: int  # visible (query, key) pairs per batch row and head
  kind: str = "mask"  # "mask", "packed", "decode" or "prefill"
  documents: int = 1
  filled: int = 0  # cache slots holding tokens before the call
  spans: tuple[int, ...] = ()  # prefix and images: Bidirectional ids per token (-1: none)
  first: int = 0  # window_first: the K first tokens, and the W keys back
  window: int = 0
  ranges: bool = True  # window_first's MaskFn has a range rule (window_fn's has not)
  bias: str | None = None  # "alibi", "t5" or "dense": a score object, made for `num_heads`
  num_heads: int = 8  # query heads the bias is made for (the bench sets its --num_heads)

  def mask(self, batch: int) -> Any:
    """The workload's mask object (NumPy arrays), or None for the config's rules."""
    if self.spans:
      ids = np.tile(np.asarray(self.spans, np.int32), (batch, 1))
      return sh.masks.Causal() | sh.masks.Bidirectional(ids)
    if self.first:
      fn, ranges = first_tokens(self.first)
      return sh.masks.SlidingWindow((self.window, 0)) | sh.masks.MaskFn(
          fn, ranges if self.ranges else None)
    return None

  def score(self) -> Any:
    """The workload's bias (a score object with NumPy arrays), or None."""
    h, t = self.num_heads, self.kv_len
    if self.bias == "alibi":
      return sh.scores.Alibi(np.asarray(sh.scores.alibi_slopes(h)))
    if self.bias == "t5":
      table = np.random.default_rng(0).normal(size=(32, h)).astype(np.float32)
      return sh.scores.RelativePosition(table, max_distance=128, bidirectional=False)
    if self.bias == "dense":
      rng = np.random.default_rng(0)
      return sh.scores.Dense(rng.normal(size=(1, h, self.query_len, t)).astype(np.float32))
    return None

  def bias_rows(self, batch: int, rows: np.ndarray) -> np.ndarray | None:
    """The bias of query rows `rows`: [1, Hq, len(rows), S] float32, or None."""
    score = self.score()
    if score is None:
      return None
    q_pos, kv_pos = self.positions(1)
    score = score.map_arrays(lambda side, a, **_: a[:, :, rows] if side == "qk" else a)
    head = np.arange(self.num_heads).reshape(1, self.num_heads, 1, 1, 1)
    out = score.scores(q_pos[:, None, None, rows, None], kv_pos[:, None, None, None, :], head)
    return np.broadcast_to(np.asarray(out), (1, self.num_heads, 1, len(rows), self.kv_len))[:, :, 0]

  def extras(self, batch: int) -> dict[str, Any]:
    """The keyword arrays of `sh.attention` for this workload."""
    bias = self.score()
    if bias is not None:
      return {**dataclasses.replace(self, bias=None).extras(batch), "bias": bias}
    if self.kind == "packed":
      ids = np.repeat(np.arange(self.documents, dtype=np.int32), self.query_len // self.documents)
      return {"q_segment_ids": np.tile(ids, (batch, 1))}
    if self.kind == "object":
      return {"mask": self.mask(batch)}
    if self.kind in ("decode", "prefill"):
      slots = np.arange(self.kv_len, dtype=np.int32)
      q_pos = self.filled + np.arange(self.query_len, dtype=np.int32)
      return {"q_positions": np.tile(q_pos, (batch, 1)),
              "kv_positions": np.tile(slots, (batch, 1)),
              "q_segment_ids": np.zeros((batch, self.query_len), np.int32),
              "kv_segment_ids": np.tile(np.where(slots < self.filled + self.query_len, 0, -1),
                                        (batch, 1)).astype(np.int32)}
    return {}

  def positions(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(q_positions [B, T], kv_positions [B, S]): the explicit ones, else the defaults."""
    q_pos, kv_pos = _rules.end_aligned_positions(batch, self.query_len, self.kv_len, np)
    e = self.extras(batch)
    return e.get("q_positions", q_pos), e.get("kv_positions", kv_pos)

  def dense_mask(self, batch: int) -> np.ndarray:
    """The same visibility as a dense [B, 1, T, S] mask (for implementations without segments)."""
    return self.mask_rows(batch, np.arange(self.query_len))

  def mask_rows(self, batch: int, rows: np.ndarray) -> np.ndarray:
    """The visibility of query rows `rows` only: [B, 1, len(rows), S] bool."""
    e = self.extras(batch)
    q_pos, kv_pos = self.positions(batch)
    rule = self.mask(batch) or _rules.call_rule(**self.config.rules)
    if rule is not None:
      rule = rule.map_arrays(lambda side, a: a[:, rows] if side == "q" else a)
    mask = np.ones((batch, len(rows), self.kv_len), bool) if rule is None else np.asarray(
        rule.visible(q_pos[:, None, rows, None], kv_pos[:, None, None, :]))[:, 0]
    if "q_segment_ids" in e:
      mask = mask & _rules.segment_mask(e["q_segment_ids"][:, rows],
                                       e.get("kv_segment_ids", e["q_segment_ids"]))
    return mask[:, None]


BIASES = ("alibi", "t5", "dense")


def parse(spec: str) -> Workload:
  """A workload from its spec (see the module docstring); ValueError naming the spec."""
  try:
    if "+bias:" in spec:
      mask, _, rest = spec.partition("+bias:")
      bias, _, length = rest.partition("@")
      if bias not in BIASES:
        raise ValueError(spec)
      return dataclasses.replace(parse(f"{mask}@{length}"), name=spec, bias=bias)
    if "@" in spec:
      return _mask_workload(*spec.split("@"))
    kind, _, sizes = spec.partition(":")
    first, _, capacity = sizes.partition("/")
    first, capacity = int(first), int(capacity)
    if kind == "decode" and 0 < first < capacity:
      return Workload(spec, 1, capacity, sh.AttentionConfig(), first + 1, "decode", filled=first)
    if kind == "prefill" and 0 < first <= capacity:
      return Workload(spec, first, capacity, sh.AttentionConfig(), first * (first + 1) // 2,
                      "prefill")
  except (TypeError, ValueError):
    pass
  raise ValueError(f"unknown workload {spec!r}: use MASK@T (MASK: causal, full, window:W, "
                   "chunk:C, packed:N, prefix:P, images:NxL, window_first:W+K, window_fn:W+K), "
                   "MASK+bias:B@T (B: alibi, t5, dense), decode:L/C or prefill:N/C.")


@functools.lru_cache(maxsize=None)
def first_tokens(k: int) -> tuple:
  """(fn, ranges) of MaskFn for "the first k tokens, always" (once per k: a static mask)."""
  fn = lambda q_pos, kv_pos: (kv_pos < k) & (q_pos >= 0)
  ranges = lambda q_lo, q_hi, kv_lo, kv_hi: (kv_lo < k, (kv_hi < k) & (q_lo >= 0))
  return fn, ranges


def _object_workload(mask: str, kind: str, size: str, length: int) -> Workload:
  """prefix:P, images:NxL or window_first:W+K at `length` tokens."""
  causal = length * (length + 1) // 2
  config = sh.AttentionConfig()
  if kind == "prefix" and 0 < int(size) <= length:
    p = int(size)
    return Workload(f"{mask}@{length}", length, length, config, causal + p * (p - 1) // 2,
                    "object", spans=tuple([0] * p + [-1] * (length - p)))
  if kind == "images":
    n, span = map(int, size.split("x"))
    ids = np.full(length, -1)
    for i in range(n):
      start = (2 * i + 1) * length // (2 * n) - span // 2
      ids[start:start + span] = i
    if n < 1 or span < 1 or (ids >= 0).sum() != n * span:
      raise ValueError(mask)
    return Workload(f"{mask}@{length}", length, length, config,
                    causal + n * span * (span - 1) // 2, "object", spans=tuple(ids.tolist()))
  window, first = map(int, size.split("+"))
  q = np.arange(length)
  useful = int((np.minimum(q, window) + 1).sum() + np.maximum(0, np.minimum(first, q - window)).sum())
  return Workload(f"{mask}@{length}", length, length, config, useful, "object", first=first,
                  window=window, ranges=kind == "window_first")


def _mask_workload(mask: str, length: str) -> Workload:
  kind, _, size = mask.partition(":")
  length = int(length)
  if kind in ("prefix", "images", "window_first", "window_fn"):
    return _object_workload(mask, kind, size, length)
  n = int(size) if size else 0
  config = {"causal": sh.AttentionConfig(), "full": sh.AttentionConfig(causal=False),
            "packed": sh.AttentionConfig(), "window": sh.AttentionConfig(sliding_window=(n, 0)),
            "chunk": sh.AttentionConfig(chunk_size=n) if n else None}.get(kind)
  if config is None or (kind in ("window", "chunk", "packed") and n < 1) or length < 1:
    raise ValueError(mask)
  if kind == "packed":
    if length % n:
      raise ValueError(mask)
    doc = length // n
    return Workload(f"{mask}@{length}", length, length, config, n * doc * (doc + 1) // 2,
                    "packed", documents=n)
  pairs = visible_pairs(length, length, **config.rules)
  return Workload(f"{mask}@{length}", length, length, config, pairs)


def visible_interval(q_pos: np.ndarray, kv_len: int, *, causal: bool,
                     window: tuple[int, int] | None, chunk_size: int | None
                     ) -> tuple[np.ndarray, np.ndarray]:
  """The keys each query may see under the config's rules when `kv_positions = arange(kv_len)`:
  one interval of key positions per row, clipped to the keys (lo > hi: none), inclusive, [T]."""
  q_pos = np.asarray(q_pos, np.int64)
  lo = np.zeros_like(q_pos)
  hi = np.full_like(q_pos, kv_len - 1)
  if causal:
    hi = np.minimum(hi, q_pos)
  if window is not None:
    lo, hi = np.maximum(lo, q_pos - window[0]), np.minimum(hi, q_pos + window[1])
  if chunk_size is not None:
    first = (q_pos // chunk_size) * chunk_size
    lo, hi = np.maximum(lo, first), np.minimum(hi, first + chunk_size - 1)
  return lo, hi


def visible_pairs(query_len: int, kv_len: int, **rules) -> int:
  """How many (query, key) pairs the config's rules let through at default positions: the
  useful work a workload's speed is measured by (O(T), for lengths no dense mask fits)."""
  q_pos = _rules.end_aligned_positions(1, query_len, kv_len, np)[0][0]
  lo, hi = visible_interval(q_pos, kv_len, **rules)
  return int(np.maximum(hi - lo + 1, 0).sum())


def jax_nn_kwargs(workload: Workload, batch: int) -> dict[str, Any]:
  """Keywords of jax.nn.dot_product_attention giving the same visibility (and bias, dense)."""
  if workload.bias is not None:
    rows = np.arange(workload.query_len)
    plain = jax_nn_kwargs(dataclasses.replace(workload, bias=None), batch)
    return {**plain, "bias": workload.bias_rows(batch, rows)}  # [1, Hq, T, S]
  config = workload.config
  if workload.kind == "mask" and config.chunk_size is None:
    kwargs = {"is_causal": config.causal}
    if config.window is not None:
      kwargs["local_window_size"] = config.window
    return kwargs
  return {"mask": workload.dense_mask(batch)}
