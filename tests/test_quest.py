"""Pages chosen by data (Quest): page summaries kept as tokens are written, `top_k_pages`
against a NumPy loop oracle of its rule, and a paged step over the chosen pages against the
float64 oracle (each row sees only its sequence's chosen pages, per kv head)."""

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
import splash_hk as sh
from splash_hk.backends.native import build as native_build

HQ, HKV, D, PAGE, PAGES_PER_SEQ, NUM_PAGES = 4, 2, 16, 4, 24, 80
LENS = (37, 5, 60)  # cached tokens of each sequence (mid-page ends)


def _prefilled(seed, dtype=jnp.float32):
  """A pool with page summaries holding each sequence's history, written by one paged prefill
  step over shuffled pages (a page reused from a dead sequence first: its summary resets)."""
  rng = np.random.default_rng(seed)
  free = list(rng.permutation(NUM_PAGES))
  table = np.full((len(LENS) + 1, PAGES_PER_SEQ), -1, np.int32)
  for s, n in enumerate(LENS):
    table[s, :-(-(n + 12) // PAGE)] = [free.pop() for _ in range(-(-(n + 12) // PAGE))]
  hist = [rng.normal(size=(n, HKV, D)).astype(np.float32) for n in LENS]
  pool = sh.PagedKVCache.zeros(NUM_PAGES, PAGE, HKV, D, dtype=dtype, page_summaries=True)
  stale = sh.RaggedBatch(np.array([0, 8, 8, 8, 8], np.int32), np.zeros(4, np.int32), table,
                         np.int32(1))  # a dead sequence's 8 tokens in sequence 0's first pages
  k = (100 * rng.normal(size=(8, HKV, D))).astype(np.float32)
  _, pool = sh.paged_attention(np.zeros((8, HQ, D), np.float32), k, k, pool, stale)
  cu = np.concatenate([[0], np.cumsum(LENS), [sum(LENS)]]).astype(np.int32)
  batch = sh.RaggedBatch(cu, np.zeros(4, np.int32), table, np.int32(len(LENS)))
  new = np.concatenate(hist)
  _, pool = sh.paged_attention(np.zeros((len(new), HQ, D), np.float32), new, new, pool, batch)
  return pool, table, hist, rng


def test_page_summaries_are_the_bounds_of_each_pages_written_keys():
  pool, table, hist, _ = _prefilled(1)
  key_min, key_max = np.asarray(pool.key_min), np.asarray(pool.key_max)
  for s, h in enumerate(hist):
    for p in range(-(-len(h) // PAGE)):
      tokens = h[p * PAGE:(p + 1) * PAGE]  # [<=page, Hkv, D]: a reused page holds only these
      np.testing.assert_array_equal(key_min[table[s, p]], tokens.min(axis=0))
      np.testing.assert_array_equal(key_max[table[s, p]], tokens.max(axis=0))


def test_page_summaries_of_a_quantized_pool_bound_the_stored_keys():
  pool, table, hist, _ = _prefilled(2, dtype=jnp.int8)
  stored, _ = pool.token_major()
  stored = np.asarray(stored.dequantize())  # [P, page, Hkv, D]
  for s, h in enumerate(hist):
    for p in range(-(-len(h) // PAGE)):
      tokens = stored[table[s, p], :min(PAGE, len(h) - p * PAGE)]
      np.testing.assert_array_equal(np.asarray(pool.key_min)[table[s, p]], tokens.min(axis=0))


def _decode_step(rng, table, q_lens=(1, 2, 1)):
  """A step of `q_lens` new rows per sequence after LENS cached tokens."""
  n = sum(q_lens)
  cu = np.concatenate([[0], np.cumsum(q_lens), [n]]).astype(np.int32)
  batch = sh.RaggedBatch(cu, np.array([*LENS, 0], np.int32), table, np.int32(len(LENS)))
  q = rng.normal(size=(n, HQ, D)).astype(np.float32)
  k = rng.normal(size=(n, HKV, D)).astype(np.float32)
  v = rng.normal(size=(n, HKV, D)).astype(np.float32)
  return q, k, v, batch, q_lens


def _choice(q, hist, q_lens, top_k, local):
  """NumPy loop oracle of DESIGN's rule: per sequence and kv head, the pages the step writes and
  the `local` last pages after the step, then the top_k cached other pages by max over rows and
  group heads of sum_d max(q_d * min_d, q_d * max_d), ties to the lower index."""
  out, start = [], 0
  for s, h in enumerate(hist):
    rows = q[start:start + q_lens[s]].reshape(q_lens[s], HKV, HQ // HKV, D)
    start += q_lens[s]
    after = -(-(len(h) + q_lens[s]) // PAGE)
    written = range(len(h) // PAGE, after) if q_lens[s] else []
    own = {p for p in range(after - local, after) if p >= 0} | set(written)
    heads = []
    for kv in range(HKV):
      scored = []
      for p in range(-(-len(h) // PAGE)):
        if p in own:
          continue
        lo, hi = h[p * PAGE:(p + 1) * PAGE, kv].min(0), h[p * PAGE:(p + 1) * PAGE, kv].max(0)
        bound = np.max(np.maximum(rows[:, kv] * lo, rows[:, kv] * hi).sum(-1))
        scored.append((-bound, p))
      heads.append(set(own) | {p for _, p in sorted(scored)[:top_k]})
    out.append(heads)
  return out


@pytest.mark.parametrize("bounds", ["native", "native_portable", "xla"])
@pytest.mark.parametrize("top_k,local", [(3, 1), (2, 3), (40, 1)])
def test_top_k_pages_chooses_as_the_rule_says(top_k, local, bounds, monkeypatch):
  """The page bounds of the native kernel (CPU, where it is built; its SIMD code and its
  portable code) and of XLA (elsewhere)."""
  if bounds.startswith("native") and harness.NATIVE_MISSING:
    pytest.skip(f"the native kernel is unavailable: {harness.NATIVE_MISSING}")
  if bounds == "native_portable":
    monkeypatch.setenv("SPLASH_HK_NATIVE_SIMD", "portable")
  if bounds == "xla":
    monkeypatch.setattr(native_build, "unavailable", lambda: "XLA's page bounds asked for")
  pool, table, hist, rng = _prefilled(3)
  q, _, _, batch, q_lens = _decode_step(rng, table)
  chosen = jax.jit(lambda *a: sh.sparse.top_k_pages(*a, top_k=top_k, local=local))(q, pool, batch)
  most_written = -(-(sum(q_lens) - 1) // PAGE) + 1  # the most pages one sequence's rows write
  assert chosen.pages.shape == (4, HKV, min(top_k, PAGES_PER_SEQ) + max(local, most_written))
  pages, counts = np.asarray(chosen.pages), np.asarray(chosen.counts)
  for s, heads in enumerate(_choice(q, hist, q_lens, top_k, local)):
    for kv, want in enumerate(heads):
      assert counts[s, kv] == len(want)
      assert set(pages[s, kv, :counts[s, kv]].tolist()) == want
  assert (counts[3] == 0).all()  # a padding sequence chooses nothing


def _oracle(q, k, v, hist_k, hist_v, q_lens, chosen, **rules):
  """[N, Hq, D] float64: each sequence's rows against its history and new tokens, a key seen
  only if its page is chosen for the row's kv head (and the rule)."""
  outs, start = [], 0
  for s, (hk, hv) in enumerate(zip(hist_k, hist_v)):
    ql = q_lens[s]
    keys = np.concatenate([hk, k[start:start + ql]])[None]
    values = np.concatenate([hv, v[start:start + ql]])[None]
    page_of = np.arange(keys.shape[1]) // PAGE
    mask = np.stack([np.isin(page_of, sorted(chosen[s][kv])) for kv in range(HKV)])  # [Hkv, S]
    mask = np.repeat(mask, HQ // HKV, 0)[None, :, None, :]  # [1, Hq, 1, S]
    out, _ = oracle.attention(q[start:start + ql][None], keys, values, mask=mask, **rules)
    outs.append(out[0])
    start += ql
  return np.concatenate(outs)


# Decodes beside a 2-row chain; a 9-row prefill chunk over three pages (pages of 4) beside them:
# with `local=1` its rows lost their own keys on the first two (seen failing: 0 or 0.5 off).
@pytest.mark.parametrize("q_lens", [(1, 2, 1), (9, 3, 1)], ids=["decode", "chunk"])
@pytest.mark.parametrize("platform", ["xla", "reference", "splash"])
def test_a_step_over_the_chosen_pages_matches_the_oracle(platform, q_lens):
  pool, table, hist, rng = _prefilled(4)
  q, k, v, batch, q_lens = _decode_step(rng, table, q_lens)
  config = sh.AttentionConfig(platform=platform, allow_fallback=False, logits_soft_cap=5.0,
                              interpret=True)  # splash: the TPU kernel, interpreted

  @jax.jit
  def step(q, k, v, pool, batch):
    chosen = sh.sparse.top_k_pages(q, pool, batch, top_k=2)
    return sh.paged_attention(q, k, v, pool, dataclasses.replace(batch, selection=chosen),
                              config=config), chosen

  (out, _), _ = step(q, k, v, pool, batch)
  sets = _choice(q, hist, q_lens, top_k=2, local=1)  # DESIGN's rule, not the returned choice
  assert any(len(h) < -(-(n + 1) // PAGE) for h, n in zip(sets[2], LENS[2:]))  # it skips pages
  want = _oracle(q, k, v, hist, hist, q_lens, sets, soft_cap=5.0)  # values written = keys
  np.testing.assert_allclose(np.asarray(out)[:sum(q_lens)], want, **harness.tol())


def test_a_bad_selection_is_the_misuse_rule():
  pool, table, hist, rng = _prefilled(5)
  q, k, v, batch, q_lens = _decode_step(rng, table)
  pages = np.zeros((4, HKV, 3), np.int32)
  pages[:, :, 0], pages[:, :, 1] = 0, 1
  counts = np.full((4, HKV), 2, np.int32)
  twice = pages.copy()
  twice[1, 0, 1] = 0  # sequence 1 lists page 0 twice for kv head 0
  bad = dataclasses.replace(batch, selection=sh.PageSelection(twice, counts))
  with pytest.raises(ValueError, match="batch.selection.*sequences \\[1\\]"):
    sh.paged_attention(q, k, v, pool, bad)
  out, written = jax.jit(sh.paged_attention)(q, k, v, pool, bad)
  rows = np.asarray(out)
  assert np.isnan(rows[1:3]).all() and np.isfinite(rows[[0, 3]]).all()
  good = dataclasses.replace(batch, selection=sh.PageSelection(pages, counts))
  want, _ = sh.paged_attention(q, k, v, pool, good)
  np.testing.assert_array_equal(rows[[0, 3]], np.asarray(want)[[0, 3]])
  key, _ = written.token_major()
  before, _ = pool.token_major()
  np.testing.assert_array_equal(np.asarray(key)[table[1]], np.asarray(before)[table[1]])


def test_a_new_pool_with_summaries_can_be_donated():
  pool = sh.PagedKVCache.zeros(8, PAGE, HKV, D, page_summaries=True)
  batch = sh.RaggedBatch(np.array([0, 3], np.int32), np.array([0], np.int32),
                         np.arange(2, dtype=np.int32)[None], np.int32(1))
  x = np.ones((3, HKV, D), np.float32)
  step = jax.jit(sh.paged_attention, donate_argnums=3)
  _, pool = step(np.ones((3, HQ, D), np.float32), x, x, pool, batch)  # each leaf its own buffer
  np.testing.assert_array_equal(np.asarray(pool.key_max)[0], 1.0)


def test_top_k_pages_refuses_a_pool_without_summaries():
  pool = sh.PagedKVCache.zeros(8, PAGE, HKV, D)
  batch = sh.RaggedBatch(np.array([0, 1], np.int32), np.array([3], np.int32),
                         np.zeros((1, 2), np.int32), np.int32(1))
  with pytest.raises(ValueError, match="`cache`.*page_summaries=True"):
    sh.sparse.top_k_pages(np.zeros((1, HQ, D), np.float32), pool, batch, top_k=2)


def test_a_chosen_step_exported_for_tpu_holds_the_paged_kernel():
  pool = sh.PagedKVCache.zeros(64, 16, 2, 128, dtype=jnp.bfloat16, page_summaries=True)
  batch = sh.RaggedBatch(jnp.asarray([0, 1, 2, 3], jnp.int32), jnp.asarray([300, 900, 40]),
                         jnp.zeros((3, 64), jnp.int32), jnp.asarray(3, jnp.int32))
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  q = jax.ShapeDtypeStruct((3, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((3, 2, 128), jnp.bfloat16)
  selection = sh.PageSelection(jax.ShapeDtypeStruct((3, 2, 5), jnp.int32),
                               jax.ShapeDtypeStruct((3, 2), jnp.int32))
  chosen = dataclasses.replace(batch, selection=selection)
  args = (q, kv, kv, jax.tree.map(spec, pool), jax.tree.map(spec, chosen))
  assert sh.explain_paged(*args, for_platform="tpu").backend == "splash"

  def step(q, k, v, pool, batch):
    picked = sh.sparse.top_k_pages(q, pool, batch, top_k=4)
    return sh.paged_attention(q, k, v, pool, dataclasses.replace(batch, selection=picked),
                              config=sh.AttentionConfig(allow_fallback=False))

  args = (q, kv, kv, jax.tree.map(spec, pool), jax.tree.map(spec, batch))
  exported = jax.export.export(jax.jit(step), platforms=["tpu"])(*args)
  assert exported.mlir_module().count("tpu_custom_call") == 1


def _quest_mask(params, x, top_k, local, heads=HQ, kv_heads=HKV, size=8):
  """[1, Hq, T, T] bool: the last row of x [T, in] sees the keys of its `local` last pages and
  the `top_k` other pages its projected query bounds highest (per kv head); other rows: all."""
  p = {k: {n: np.asarray(a, np.float64) for n, a in v.items()} for k, v in params.items()}
  lin = lambda m: x @ p[f"multi_head_attention/{m}"]["w"] + p[f"multi_head_attention/{m}"]["b"]
  t = len(x)
  q = lin("query").reshape(t, kv_heads, heads // kv_heads, size)[-1]  # [Hkv, G, D]
  k = lin("key").reshape(t, kv_heads, size)[:-1]  # the cached keys
  pages = -(-t // PAGE)
  own = set(range(max(pages - local, 0), pages))
  mask = np.ones((1, heads, t, t), bool)
  for kv in range(kv_heads):
    bounds = []
    for page in sorted(set(range(-(-(t - 1) // PAGE))) - own):
      lo, hi = k[page * PAGE:(page + 1) * PAGE, kv].min(0), k[page * PAGE:(page + 1) * PAGE, kv].max(0)
      bounds.append((-np.max(np.maximum(q[kv] * lo, q[kv] * hi).sum(-1)), page))
    chosen = own | {page for _, page in sorted(bounds)[:top_k]}
    seen = np.isin(np.arange(t) // PAGE, sorted(chosen))
    mask[0, kv * (heads // kv_heads):(kv + 1) * (heads // kv_heads), -1] = seen
  return mask


def test_the_haiku_module_reads_the_pages_its_queries_choose():
  mha = lambda: sh.MultiHeadAttention(HQ, 8, num_kv_heads=HKV,
                                      w_init=hk.initializers.VarianceScaling(1.0),
                                      b_init=hk.initializers.RandomNormal(0.5))
  f = hk.without_apply_rng(hk.transform(
      lambda x, c, b: mha()(x, kv_cache=c, batch=b, page_top_k=2)))
  rng = np.random.default_rng(6)
  xs = [rng.normal(size=(n, 16)).astype(np.float32) for n in (38, 23)]
  table = np.arange(24, dtype=np.int32).reshape(2, 12)[:, ::-1].copy()  # pages in reverse
  prefill = sh.RaggedBatch(np.array([0, 37, 59], np.int32), np.zeros(2, np.int32), table,
                           np.int32(2))
  decode = sh.RaggedBatch(np.array([0, 1, 2], np.int32), np.array([37, 22], np.int32), table,
                          np.int32(2))
  pool = sh.PagedKVCache.zeros(24, PAGE, HKV, 8, page_summaries=True)
  params = f.init(jax.random.PRNGKey(0), np.concatenate([xs[0][:37], xs[1][:22]]), pool, prefill)
  step = jax.jit(f.apply)
  out, pool = step(params, np.concatenate([xs[0][:37], xs[1][:22]]), pool, prefill)
  start = 0
  for x, n in zip(xs, (37, 22)):  # a prefill step's rows see their whole chunk: no choice
    want = oracle.mha(params, x[None, :n], num_heads=HQ, num_kv_heads=HKV, key_size=8,
                      value_size=8)[0]
    np.testing.assert_allclose(np.asarray(out[start:start + n]), want, **harness.tol())
    start += n
  out, _ = step(params, np.stack([xs[0][37], xs[1][22]]), pool, decode)
  for s, x in enumerate(xs):  # each decode row: its last page and the 2 it bounds highest
    mask = _quest_mask(params, x, top_k=2, local=1)
    assert not mask.all()
    want = oracle.mha(params, x[None], num_heads=HQ, num_kv_heads=HKV, key_size=8,
                      value_size=8, mask=mask)[0, -1]
    np.testing.assert_allclose(np.asarray(out[s]), want, **harness.tol())


def test_page_top_k_without_a_paged_cache_is_refused_naming_it():
  """It was ignored (every key read) by the modules with a fixed KVCache or no cache."""
  x = np.zeros((2, 4, 16), np.float32)
  for cache in (None, sh.KVCache.zeros(2, 8, HKV, 8)):
    f = hk.without_apply_rng(hk.transform(lambda x: sh.MultiHeadAttention(
        HQ, 8, num_kv_heads=HKV, w_init=hk.initializers.VarianceScaling(1.0))(
            x, kv_cache=cache, page_top_k=2)))
    with pytest.raises(ValueError, match=r"`page_top_k=2` chooses pages of a paged cache"):
      f.init(jax.random.PRNGKey(0), x)
