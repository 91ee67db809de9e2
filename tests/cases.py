"""Named attention cases shared by the test files: inputs, config and oracle keywords."""

from __future__ import annotations

import dataclasses

import numpy as np

import splash_hk as sh
import harness
import oracle


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  batch: int = 2
  query_len: int = 16
  kv_len: int = 16
  num_heads: int = 4
  num_kv_heads: int = 4
  head_dim: int = 16
  value_dim: int | None = None
  causal: bool = True
  window: int | tuple[int, int] | None = None
  chunk: int | None = None
  soft_cap: float | None = None
  scale: float | None = None
  segments: str | None = None  # None, "packed" (with padding)
  positions: bool = False  # explicit, shuffled-gap positions
  mask: str | None = None  # None, "shared" [B,1,T,S], "heads" [B,Hq,T,S]
  sinks: str | None = None  # None, "heads" [Hq], "heads_n" [Hq,3], "kv_n" [Hkv,2]

  @property
  def config(self) -> sh.AttentionConfig:
    return sh.AttentionConfig(causal=self.causal, sliding_window=self.window,
                              chunk_size=self.chunk, logits_soft_cap=self.soft_cap,
                              softmax_scale=self.scale)

  def arrays(self, seed: int = 0, dtype=np.float32):
    """(q, k, v, extras) with extras the keyword arrays of sh.attention."""
    rng = np.random.default_rng(seed)
    b, t, s, hq, hkv, d = (self.batch, self.query_len, self.kv_len, self.num_heads,
                           self.num_kv_heads, self.head_dim)
    dv = self.value_dim or d
    q = rng.normal(size=(b, t, hq, d)).astype(dtype)
    k = rng.normal(size=(b, s, hkv, d)).astype(dtype)
    v = rng.normal(size=(b, s, hkv, dv)).astype(dtype)
    extras = {}
    if self.segments == "packed":
      def packed(n):
        ids = np.zeros((b, n), np.int32)
        for row in range(b):
          cuts = np.sort(rng.integers(1, n + 1, size=2))
          ids[row, cuts[0]:] = 1
          ids[row, cuts[1]:] = 2
          ids[row, max(0, n - 1 - row):] = -1  # trailing padding, longer on later rows
        return ids
      extras["q_segment_ids"] = packed(t)
      if t != s:
        extras["kv_segment_ids"] = packed(s)
    if self.positions:
      extras["kv_positions"] = np.sort(rng.integers(0, 3 * s, size=(b, s)), axis=1).astype(np.int32)
      extras["q_positions"] = np.sort(rng.integers(0, 3 * s, size=(b, t)), axis=1).astype(np.int32)
    if self.mask is not None:
      heads = 1 if self.mask == "shared" else hq
      extras["mask"] = rng.random((b, heads, t, s)) < 0.7
    if self.sinks == "heads":
      extras["softmax_aux"] = rng.normal(size=(hq,)).astype(dtype)
    elif self.sinks == "heads_n":
      extras["softmax_aux"] = rng.normal(size=(hq, 3)).astype(dtype)
    elif self.sinks == "kv_n":
      extras["softmax_aux"] = rng.normal(size=(hkv, 2)).astype(dtype)
    return q, k, v, extras

  def oracle(self, q, k, v, extras, xp=np):
    """The float64 oracle's (out, weights) for this case's config and `extras`."""
    rules = harness.oracle_rules(self.config, **extras)
    return oracle.attention(q, k, v, sinks=extras.get("softmax_aux"), xp=xp, **rules)


CASES = [
    Case("mha_causal"),
    Case("gqa_causal", num_kv_heads=2),
    Case("mqa_causal", num_kv_heads=1),
    Case("full", causal=False),
    Case("window_int", window=3),
    Case("window_pair_bidirectional", causal=False, window=(4, 1)),
    Case("chunk", chunk=5),
    Case("chunk_bidirectional_gqa", causal=False, chunk=4, num_kv_heads=2),
    Case("segments_padding", segments="packed"),
    Case("segments_padding_bidirectional", causal=False, segments="packed", num_kv_heads=2),
    Case("mask_shared", mask="shared"),
    Case("mask_per_head", causal=False, mask="heads"),
    Case("soft_cap", soft_cap=2.0),
    Case("sinks_heads", sinks="heads"),
    Case("sinks_heads_n", sinks="heads_n"),
    Case("sinks_kv_n_gqa", num_kv_heads=2, sinks="kv_n"),
    Case("custom_scale", scale=0.3),
    Case("decode", query_len=1, num_kv_heads=2),
    Case("decode_window_sinks", query_len=1, window=5, sinks="heads"),
    Case("prefill", query_len=5, window=6, num_kv_heads=2),
    Case("prefill_segments", query_len=6, segments="packed"),
    Case("value_dim", value_dim=8, num_kv_heads=2),
    Case("explicit_positions", positions=True, window=(9, 0)),
    Case("everything", num_kv_heads=2, window=(6, 2), soft_cap=3.0, sinks="heads_n",
         segments="packed", scale=0.2, mask="shared", value_dim=24),
]
CASES_BY_NAME = {c.name: c for c in CASES}
