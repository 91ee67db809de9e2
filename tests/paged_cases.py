"""A ragged paged step for the tests (test_paged, test_quant, test_native): sequences at different
stages over shuffled, shared pages with NaN in every slot no sequence holds, the float64 oracle
over each sequence's whole history, and the same step over a quantized pool (DESIGN's rule in
NumPy)."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import harness
import oracle
import splash_hk as sh

HQ, HKV, D = 4, 2, 16
PAGE = 4


@dataclasses.dataclass
class Step:
  """One ragged step over a pool, with every sequence's whole history (for the oracle)."""

  q: np.ndarray  # [N, Hq, D]
  k: np.ndarray  # [N, Hkv, D]
  v: np.ndarray  # [N, Hkv, Dv]
  cache: sh.PagedKVCache
  batch: sh.RaggedBatch
  history_k: list  # per sequence [kv_len + q_len, Hkv, D]
  history_v: list
  q_lens: list


def step(seed, kv_lens=(5, 0, 12, 3), q_lens=(1, 7, 3, 1), max_seqs=5, pad_rows=2,
          pages_per_seq=6, num_pages=40, value_dim=D, shared_prefix=True, dtype=np.float32,
          hq=HQ, hkv=HKV, page=PAGE, d=D, in_order=False):
  """Sequences at different stages (a decode, a prefill, a chunked prefill, ...), pages shuffled
  through the pool (`in_order`: handed out in order, each sequence's consecutive), NaN in every
  slot no sequence holds; sequences 0 and 2 share their first page (their histories agree
  there) when it lies below both their lengths."""
  rng = np.random.default_rng(seed)
  n_seqs, n = len(kv_lens), sum(q_lens) + pad_rows
  key = np.full((num_pages, page, hkv, d), np.nan, dtype)
  value = np.full((num_pages, page, hkv, value_dim), np.nan, dtype)
  free = list(rng.permutation(num_pages))
  free = sorted(free, reverse=True) if in_order else free  # pop() hands out 0, 1, 2, ...
  table = np.full((max_seqs, pages_per_seq), -1, np.int32)
  history_k, history_v = [], []
  for s, (kv, ql) in enumerate(zip(kv_lens, q_lens)):
    hk = rng.normal(size=(kv + ql, hkv, d)).astype(dtype)
    hv = rng.normal(size=(kv + ql, hkv, value_dim)).astype(dtype)
    for p in range(-(-(kv + ql) // page)):
      if shared_prefix and s == 2 and p == 0 and min(kv_lens[0], kv_lens[2]) >= page:
        table[s, p] = table[0, 0]  # the page below both lengths: the same tokens
        hk[:page], hv[:page] = history_k[0][:page], history_v[0][:page]
        continue
      table[s, p] = free.pop()
    for t in range(kv):
      key[table[s, t // page], t % page] = hk[t]
      value[table[s, t // page], t % page] = hv[t]
    history_k.append(hk)
    history_v.append(hv)
  cu = np.zeros(max_seqs + 1, np.int32)
  cu[1:n_seqs + 1] = np.cumsum(q_lens)
  cu[n_seqs + 1:] = cu[n_seqs]
  lens = np.zeros(max_seqs, np.int32)
  lens[:n_seqs] = kv_lens
  new = lambda h: np.concatenate([hh[kv:] for hh, kv in zip(h, kv_lens)] +
                                 [np.full((pad_rows, *h[0].shape[1:]), np.nan, dtype)])
  q = rng.normal(size=(n, hq, d)).astype(dtype)
  q[sum(q_lens):] = np.nan
  batch = sh.RaggedBatch(jnp.asarray(cu), jnp.asarray(lens), jnp.asarray(table),
                         jnp.asarray(n_seqs, jnp.int32))
  return Step(q, new(history_k), new(history_v), sh.PagedKVCache.from_token_major(
              jnp.asarray(key), jnp.asarray(value)), batch, history_k, history_v, list(q_lens))


def attend(step, sinks=None, bias=None, **rules):
  """[N, Hq, Dv] float64: each sequence's rows against its whole history; padding rows 0."""
  outs = []
  start = 0
  for hk, hv, ql in zip(step.history_k, step.history_v, step.q_lens):
    q = step.q[start:start + ql][None]
    dense = None if bias is None else bias(ql, len(hk))
    out, _ = oracle.attention(q, hk[None], hv[None], sinks=sinks, bias=dense, **rules)
    outs.append(out[0])
    start += ql
  pad = np.zeros((step.q.shape[0] - start, step.q.shape[1], step.v.shape[-1]))
  return np.concatenate(outs + [pad])


RUNS_WINDOW = (700, 0)


def runs_of_pages(chosen, page, kv_lens, q_lens=(1, 40, 3, 1), dtype=np.float32,
                  window=RUNS_WINDOW, kind=None, in_order=False):
  """A step over long histories (several of the paged kernel's runs of pages), the batch (with
  `chosen`: each kv head of each sequence reads a random two thirds of its pages, in any
  order) and the float64 oracle of its live rows, causal under `window` (None: none); `kind`:
  the pool quantized so (`quantized`); `in_order`: each sequence's pages consecutive (`step`)."""
  longest = max(kv + q for kv, q in zip(kv_lens, q_lens))
  width = -(-longest // page)
  step_ = step(seed=3, kv_lens=kv_lens, q_lens=q_lens, pages_per_seq=width,
               num_pages=2 * width * len(kv_lens), page=page, dtype=dtype, in_order=in_order)
  step_ = step_ if kind is None else quantized(step_, kind)
  batch, pages, counts = step_.batch, None, None
  if chosen:
    rng = np.random.default_rng(4)
    pages = np.zeros((5, HKV, width), np.int32)
    counts = np.zeros((5, HKV), np.int32)
    for s, n in enumerate(kv + q for kv, q in zip(kv_lens, q_lens)):
      for kv in range(HKV):
        picked = rng.permutation(-(-n // page))[:-(-n // page) * 2 // 3]
        pages[s, kv, :len(picked)], counts[s, kv] = picked, len(picked)
    batch = dataclasses.replace(batch, selection=sh.PageSelection(jnp.asarray(pages),
                                                                  jnp.asarray(counts)))
  outs, start = [], 0
  for s, (hk, hv, ql) in enumerate(zip(step_.history_k, step_.history_v, q_lens)):
    seen = None
    if chosen:  # [1, Hq, 1, S]: a key seen only where its page is chosen for the kv head
      page_of = np.arange(len(hk)) // page
      seen = np.stack([np.isin(page_of, pages[s, kv, :counts[s, kv]]) for kv in range(HKV)])
      seen = np.repeat(seen, HQ // HKV, 0)[None, :, None, :]
    want, _ = oracle.attention(step_.q[start:start + ql][None].astype(np.float64),
                               hk[None].astype(np.float64), hv[None].astype(np.float64),
                               mask=seen, window=window)
    outs.append(want[0])
    start += ql
  return step_, batch, np.concatenate(outs)


RULES = {
    "causal": (sh.AttentionConfig(), dict()),
    "window": (sh.AttentionConfig(sliding_window=(3, 0)), dict(window=(3, 0))),
    "chunk": (sh.AttentionConfig(chunk_size=5), dict(chunk=5)),
    "bidirectional": (sh.AttentionConfig(causal=False), dict(causal=False)),
    "soft_cap": (sh.AttentionConfig(logits_soft_cap=2.0), dict(soft_cap=2.0)),
}


FORMATS = {"int8": (np.int8, 127), "int4": (ml_dtypes.int4, 7),
           "fp8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "fp8_e5m2": (ml_dtypes.float8_e5m2,
                                                                      57344.0)}


def np_quantize(x, kind, axis=-1, scale=None):
  """DESIGN's rule in NumPy: (values, scale) with scale = absmax / largest (1 for all-zero), or
  the values for a given `scale` (XLA divides by a constant as a product with its reciprocal:
  the library's scales may differ from these in the last bit)."""
  dtype, largest = FORMATS[kind]
  x = np.asarray(x, np.float32)
  absmax = np.max(np.abs(x), axis=axis, keepdims=True)
  if scale is None:
    scale = np.where(absmax == 0, np.float32(1), absmax / np.float32(largest)).astype(np.float32)
  scaled = x / scale
  if kind.startswith("int"):
    scaled = np.clip(np.round(scaled), -largest, largest)  # np.round: half to even
  with np.errstate(invalid="ignore"):  # NaN slots (garbage pages) cast to anything
    return scaled.astype(dtype), scale


def quantized_step(kind, seed, **kwargs):
  """`step`'s mixed step over a quantized pool of `kind`; the oracle's histories as stored."""
  return quantized(step(seed=seed, **kwargs), kind)


def quantized(case, kind):
  """`case` (a `Step`) with its pool quantized to `kind` (a scale per token and kv head, NaN
  slots' scales NaN) and the oracle's histories as stored (new tokens are quantized so too)."""
  dtype = getattr(jnp, np.dtype(FORMATS[kind][0]).name)
  pool = lambda a: sh.Quantized(*(jnp.asarray(t) for t in np_quantize(a, kind)))
  case.cache = sh.PagedKVCache(pool(case.cache.key), pool(case.cache.value))
  as_stored = lambda h: np.asarray(np_quantize(h, kind)[0], np.float64) * np_quantize(h, kind)[1]
  case.history_k = [as_stored(h) for h in case.history_k]
  case.history_v = [as_stored(h) for h in case.history_v]
  assert case.cache.key.values.dtype == dtype
  return case


def check_written(step: Step, cache: sh.PagedKVCache) -> None:
  """The new tokens at their slots; every other slot bit for bit as before (NaN included)."""
  key, value = (np.array(a) for a in step.cache.token_major())
  page = step.cache.page_size
  table, kv_lens = np.asarray(step.batch.page_table), np.asarray(step.batch.kv_lens)
  for s, (hk, hv, ql) in enumerate(zip(step.history_k, step.history_v, step.q_lens)):
    for t in range(kv_lens[s], kv_lens[s] + ql):
      key[table[s, t // page], t % page] = hk[t]
      value[table[s, t // page], t % page] = hv[t]
  np.testing.assert_array_equal(np.asarray(cache.token_major()[0]), key)
  np.testing.assert_array_equal(np.asarray(cache.token_major()[1]), value)


def check_new_nan(config: sh.AttentionConfig, new_rows: int) -> None:
  """A prefill row's new value holds NaN: its own and later rows of the sequence (one tile)
  output NaN in that column of its kv head's group; the rows before it match the oracle. With
  9 new rows the NaN's page lies wholly below the length (a block the TPU kernel reads without
  its guard where every row of the tile sees it: not the tile of the rows before the NaN)."""
  case = step(seed=7, q_lens=(1, new_rows, 3, 1))
  seq, at = 1, 4  # sequence 1 (kv_len 0, new rows from position 0): its row at position 4
  row = sum(case.q_lens[:seq]) + at
  case.v[row, 0, 0] = np.nan
  out, _ = jax.jit(lambda *a: sh.paged_attention(*a, config=config))(
      case.q, case.k, case.v, case.cache, case.batch)
  out = np.asarray(out)
  first, last = sum(case.q_lens[:seq]), sum(case.q_lens[:seq + 1])
  groups = HQ // HKV
  assert np.isnan(out[row:last, :groups, 0]).all()
  assert np.isfinite(out[row:last, :, 1:]).all() and np.isfinite(out[row:last, groups:]).all()
  case.history_v[seq] = np.nan_to_num(case.history_v[seq])
  want = attend(dataclasses.replace(case, v=np.nan_to_num(case.v)))
  np.testing.assert_allclose(out[first:row], want[first:row], **harness.tol())
  np.testing.assert_allclose(out[last:], want[last:], **harness.tol())


def written_rows(buf, page, slot, rows):
  """NumPy's write of `rows` [N, Hkv, X] into pages `buf` [P, Hkv, page, X], row by row in order
  (a page or slot past the pool: nothing; a negative one from the end, as `.at`)."""
  out = np.array(buf)
  for n in range(len(page)):
    p, s = int(page[n]), int(slot[n])
    p, s = p + out.shape[0] if p < 0 else p, s + out.shape[2] if s < 0 else s
    if 0 <= p < out.shape[0] and 0 <= s < out.shape[2]:
      out[p, :, s] = rows[n]
  return out


# A step's writes: a prompt chunk of 70 rows from slot 30 of page 3 on (its run crosses into
# page 1), beside decode rows into pages 3, 6 and 0 (groups the chunk's rows share)
# and a row past the pool (of 24 pages: the groups read are under half of it).
WRITE_PAGES = np.asarray([3] * 34 + [1] * 36 + [3, 6, 0, 24], np.int32)
WRITE_SLOTS = np.asarray(list(range(30, 64)) + list(range(36)) + [2, 40, 63, 0], np.int32)
WRITE_RUNS = 5
# A ragged step's writes: the same chunk, decode rows into pages of their own (6, 0 and 2), a
# row past the pool: no two runs in one page (`disjoint`: `pool.put_runs` on a TPU).
DISJOINT_PAGES = np.asarray([3] * 34 + [1] * 36 + [6, 0, 2, 24], np.int32)
DISJOINT_SLOTS = WRITE_SLOTS
# A long prompt's writes: 700 rows from slot 30 of page 3 over eleven more pages, beside the same
# decode rows (enough rows for windows of whole pages: `pool.run_group`).
LONG_PAGES = np.asarray([[3, 1, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14][(30 + i) // 64]
                         for i in range(700)] + [6, 0, 2, 24], np.int32)
LONG_SLOTS = np.asarray([(30 + i) % 64 for i in range(700)] + [2, 40, 63, 0], np.int32)
WRITES = {"shared_groups": (WRITE_PAGES, WRITE_SLOTS, False),
          "disjoint": (DISJOINT_PAGES, DISJOINT_SLOTS, True),
          "whole_pages": (LONG_PAGES, LONG_SLOTS, True)}


def check_a_write(kind, writes="shared_groups"):
  """`pool.write` of one of `WRITES` (pages, slots, whether their runs are disjoint) into a pool
  of 24 pages of 64 (`kind`: "bf16" or "int8", 2 kv heads of D 128) under jit on this host's
  default device: every row's codes and scales at its slot (the oracle's quantization of it),
  every other slot unchanged."""
  from splash_hk import pool  # pylint: disable=import-outside-toplevel
  pages, slots, disjoint = WRITES[writes]
  rng = np.random.default_rng(3)
  shape, n = (24, 2, 64, 128), len(pages)
  old = rng.normal(size=shape).astype(np.float32)
  k, v = (rng.normal(size=(n, 2, 128)).astype(np.float32) for _ in range(2))
  if kind == "int8":
    held = lambda a: sh.quantize(jnp.asarray(a), jnp.int8)
    cache = sh.PagedKVCache(held(old), held(old))
  else:
    held = lambda a: jnp.asarray(a, jnp.bfloat16)
    cache = sh.PagedKVCache(held(old), held(old))
  write = jax.jit(lambda c, k, v, p, s: pool.write(c, k, v, p, s, runs=WRITE_RUNS,
                                                   disjoint=disjoint))
  out = write(cache, k, v, pages, slots)
  for got, was, new in ((out.key, cache.key, k), (out.value, cache.value, v)):
    parts = ((got.values, was.values, held(new).values), (got.scale, was.scale,
             held(new).scale)) if kind == "int8" else ((got, was, held(new)),)
    for g, w, r in parts:
      want = written_rows(np.asarray(w), pages, slots, np.asarray(r))
      np.testing.assert_array_equal(np.asarray(g), want)
