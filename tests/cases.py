"""Named attention cases shared by the test files: inputs, config and oracle keywords."""

from __future__ import annotations

import dataclasses

import numpy as np

import splash_hk as sh
import block_oracle
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
    stated = {} if self.causal else {"causal": False}  # the default: causal, not stated
    return sh.AttentionConfig(sliding_window=self.window, chunk_size=self.chunk,
                              logits_soft_cap=self.soft_cap, softmax_scale=self.scale, **stated)

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


def random_choice(rng, batch, heads, t, s, block_size, most, causal=True):
  """Lists [B|1, H, nq, K] (garbage past each count, any order) and counts [B|1, H, nq]."""
  bq, bk = block_size
  nq, nk = -(-t // bq), -(-s // bk)
  lists = rng.integers(-5, 50, size=(batch, heads, nq, most)).astype(np.int32)
  counts = np.zeros((batch, heads, nq), np.int32)
  for idx in np.ndindex(batch, heads, nq):
    last = (s - t + min((idx[2] + 1) * bq, t) - 1) // bk if causal else nk - 1
    pool = np.arange(max(0, min(last, nk - 1) + 1))
    n = int(rng.integers(0, min(most, len(pool)) + 1)) if len(pool) else 0
    lists[idx][:n] = rng.permutation(pool)[:n]
    counts[idx] = n
  return lists, counts


def blocks_case(case, seed=0):
  """Inputs of a chosen-blocks case (B, T, S, Hq, Hkv, D, Dv, list heads, block_size, K, rest,
  extras): ((q, k, v, sinks), the mask, attention keywords, soft cap, oracle keywords)."""
  b, t, s, hq, hkv, d, dv, h, size, most, rest, extras = case
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
  k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
  v = rng.standard_normal((b, s, hkv, dv)).astype(np.float32)
  lists, counts = random_choice(rng, b, h, t, s, size, most, causal=rest is not None)
  allowed = oracle.chosen_blocks(lists, counts, size, b, hq, t, s)
  mask = sh.masks.Blocks(lists, counts, size)
  rules = dict(causal=False, mask=allowed)
  if rest == "causal":
    mask, rules["causal"] = mask & sh.masks.Causal(), True
  elif rest == "window":
    mask, rules["window"] = mask & sh.masks.SlidingWindow((64, 0)), (64, 0)
  kwargs = {}
  if extras.get("packed"):
    seg = np.repeat(np.array([0, 1, 1, -1]), t // 4)[None].astype(np.int32)
    kwargs.update(q_segment_ids=seg)
    rules.update(q_seg=seg, kv_seg=seg)
  sinks = rng.standard_normal(hq).astype(np.float32) if extras.get("sinks") else None
  cap = extras.get("cap")
  rules["soft_cap"] = cap
  return (q, k, v, sinks), mask, kwargs, cap, rules


# The TPU splash path's cases (interpret mode against the oracle; lowered to Mosaic).
SPLASH_CASES = [
    Case("causal_128", batch=1, query_len=128, kv_len=128, head_dim=32),
    Case("causal_256_gqa2", batch=1, query_len=256, kv_len=256, num_kv_heads=2, head_dim=32),
    Case("causal_200_mqa_padded", batch=2, query_len=200, kv_len=200, num_kv_heads=1, head_dim=32),
    Case("window_1000_padded", batch=1, query_len=1000, kv_len=1000, num_heads=2, num_kv_heads=1,
         head_dim=32, window=(100, 0)),
    Case("window_pair_bidirectional", batch=1, query_len=256, kv_len=256, head_dim=32,
         causal=False, window=(20, 30)),
    Case("chunk", batch=1, query_len=256, kv_len=256, head_dim=32, chunk=64),
    Case("chunk_bidirectional_gqa", batch=1, query_len=200, kv_len=200, num_kv_heads=2,
         head_dim=32, causal=False, chunk=96),
    Case("segments_padding", batch=2, query_len=256, kv_len=256, num_kv_heads=2, head_dim=32,
         segments="packed"),
    Case("sinks_heads_n", batch=1, query_len=128, kv_len=128, head_dim=32, sinks="heads_n"),
    Case("sinks_kv_n_gqa", batch=1, query_len=128, kv_len=128, num_kv_heads=2, head_dim=32,
         sinks="kv_n"),
    Case("soft_cap_scale", batch=1, query_len=128, kv_len=128, head_dim=32, soft_cap=1.5, scale=0.5),
    Case("prefill", batch=1, query_len=128, kv_len=384, num_kv_heads=2, head_dim=32, window=(200, 0)),
    Case("prefill_segments", batch=2, query_len=200, kv_len=320, head_dim=32, segments="packed"),
    Case("value_dim", batch=1, query_len=128, kv_len=128, num_kv_heads=2, head_dim=32, value_dim=16),
    Case("everything", batch=2, query_len=200, kv_len=200, num_kv_heads=2, head_dim=32,
         window=(60, 4), soft_cap=3.0, sinks="heads_n", segments="packed", value_dim=16),
]
GRAD_CASES = {"causal_200_mqa_padded", "window_1000_padded", "chunk", "segments_padding",
              "sinks_kv_n_gqa", "soft_cap_scale", "prefill", "everything"}


# The block-list kernel's cases (test_block_list_kernel.py; compiled on a TPU: test_tpu.py).
LIST_CASES = {  # name: (B, T, S, Hq, Hkv, D, Dv, list heads, block_size, K, rest, extras)
    "gqa_shared_partial_blocks": (2, 320, 320, 4, 2, 64, 64, 2, (64, 128), 2, "causal",
                                  dict(sinks=True)),
    "per_head_mqa_dv_cap_sinks": (1, 256, 384, 4, 1, 32, 48, 4, (32, 128), 2, "causal",
                                  dict(cap=5.0, sinks=True)),
    "one_choice_packed_no_rule": (1, 256, 256, 2, 2, 32, 32, 1, (128, 128), 2, None,
                                  dict(packed=True)),
    "decode_rows_against_a_cache": (2, 8, 640, 4, 2, 32, 32, 2, (8, 128), 5, "causal", {}),
    "window_beside_the_choice": (1, 512, 512, 2, 1, 32, 32, 1, (128, 128), 3, "window", {}),
}


def list_case(name, seed=0):
  """A block-list kernel case: ((q, k, v, sinks), mask, kwargs, oracle rules)."""
  (q, k, v, sinks), mask, kwargs, _, rules = blocks_case(LIST_CASES[name], seed)
  return (q, k, v, sinks), mask, kwargs, rules


def list_attention(config, mask, kwargs):
  """f(q, k, v, *sinks) -> attention outputs under `config` and the chosen `mask`."""
  def f(q, k, v, *sinks):
    return sh.attention(q, k, v, config=config, mask=mask, softmax_aux=sinks[0] if sinks else None,
                        **kwargs).attention_outputs
  return f


def moba_case(length, block, top_k, seed=0, heads=8, kv_heads=2, dim=128):
  """MoBA's choice at a real size (`sh.sparse.top_k_blocks`: own + top_k key blocks a query
  tile, one choice a GQA group) over f32 q, k, v with sinks, segment ids (two documents, then
  padding) and NaN keys and values in every key block no list of its kv head names (kv head 0's
  lists drop block 1, so there is one): ((q, k, v, sinks), segments, lists, counts), the lists
  concrete."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((1, length, heads, dim)).astype(np.float32)
  k, v = (rng.standard_normal((1, length, kv_heads, dim)).astype(np.float32) for _ in range(2))
  at = np.arange(length)
  seg = np.where(at < length * 3 // 8, 0, np.where(at < length - block[0] // 2, 1, -1))[None]
  seg = seg.astype(np.int32)  # [1, T]
  choice = sh.sparse.top_k_blocks(q, k, top_k, block, q_segment_ids=seg, kv_segment_ids=seg)
  lists, counts = np.array(choice.kv_blocks), np.array(choice.counts)  # [1, Hkv, nq, K]
  for r in range(lists.shape[2]):  # kv head 0's lists never keep key block 1
    kept = [c for c in lists[0, 0, r, :counts[0, 0, r]] if c != 1]
    lists[0, 0, r, :len(kept)], counts[0, 0, r] = kept, len(kept)
  for hk in range(kv_heads):
    named = {int(c) for r in range(lists.shape[2]) for c in lists[0, hk, r, :counts[0, hk, r]]}
    for c in set(range(-(-length // block[1]))) - named:
      k[0, c * block[1]:(c + 1) * block[1], hk] = np.nan
      v[0, c * block[1]:(c + 1) * block[1], hk] = np.nan
  sinks = rng.standard_normal(heads).astype(np.float32)
  return (q, k, v, sinks), seg, lists, counts


def check_moba(config, length, block, top_k, seed=0):
  """`moba_case`'s values and q, k, v gradients under `config` against the block oracle
  (`block_oracle.chosen_attention`, float64 over each tile's chosen keys); the unnamed blocks'
  NaN never read, their dK / dV exactly 0."""
  (q, k, v, sinks), seg, lists, counts = moba_case(length, block, top_k, seed)
  mask = sh.masks.Blocks(lists, counts, block) & sh.masks.Causal()
  f = lambda q, k, v, s: sh.attention(q, k, v, mask=mask, config=config, softmax_aux=s,
                                      q_segment_ids=seg).attention_outputs
  cot = np.random.default_rng(seed + 1).standard_normal((*q.shape[:3], v.shape[-1]))
  out, grads = harness.values_and_grads(f, (q, k, v, sinks), cot.astype(np.float32))
  want, want_grads = block_oracle.chosen_attention(q, k, v, cot, lists, counts, block, sinks,
                                                   seg)
  np.testing.assert_allclose(out, want, **harness.tol())
  for got, wanted in zip(grads[:3], want_grads):
    harness.assert_near(got, wanted)
  for got, where in ((grads[1], np.isnan(k)), (grads[2], np.isnan(v))):
    assert not np.asarray(got)[where].any()  # 0, not NaN: no key there is seen
