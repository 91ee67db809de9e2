"""Cascade (`RaggedBatch.prefix`): each group's shared prefix attended once for all its members'
rows and merged with their own pages equals the float64 oracle over each sequence's history,
and the same step without the grouping; misuse of the grouping is the misuse rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
import splash_hk as sh
from splash_hk import ragged

PAGE, HQ, HKV, D = 4, 4, 2, 16


def _step(seed, groups=((12, 3), (8, 2)), lone=(5,), q_len=(1, 3, 1, 2, 1, 4), dv=D):
  """Sequences in groups (prefix tokens, members) and alone, shuffled pages, NaN in every slot no
  sequence holds: (q, k, v, cache, grouped batch, plain batch, histories, rows)."""
  rng = np.random.default_rng(seed)
  pool = 64
  key = np.full((pool, PAGE, HKV, D), np.nan, np.float32)
  value = np.full((pool, PAGE, HKV, dv), np.nan, np.float32)
  free = list(rng.permutation(pool))
  max_seqs, width = 8, 10
  table = np.full((max_seqs, width), -1, np.int32)
  prefix_pages = np.full((3, 4), -1, np.int32)
  lens, group = np.zeros(3, np.int32), np.full(max_seqs, -1, np.int32)
  seqs = []  # (group or -1, prefix tokens, own cached tokens)
  for g, (tokens, members) in enumerate(groups):
    lens[g] = tokens
    prefix_pages[g, :tokens // PAGE] = [free.pop() for _ in range(tokens // PAGE)]
    seqs += [(g, tokens, int(rng.integers(0, 7))) for _ in range(members)]
  seqs += [(-1, 0, n) for n in lone]
  shared = {g: (rng.normal(size=(t, HKV, D)), rng.normal(size=(t, HKV, dv)))
            for g, (t, _) in enumerate(groups)}
  hist, qs, ks, vs, cu, kv = [], [], [], [], [0], []
  for s, (g, tokens, own) in enumerate(seqs):
    ql = q_len[s % len(q_len)]
    hk = rng.normal(size=(tokens + own + ql, HKV, D))
    hv = rng.normal(size=(tokens + own + ql, HKV, dv))
    if g >= 0:
      hk[:tokens], hv[:tokens] = shared[g]
      table[s, :tokens // PAGE] = prefix_pages[g, :tokens // PAGE]
      group[s] = g
    for p in range(tokens // PAGE, -(-(tokens + own + ql) // PAGE)):
      table[s, p] = free.pop()
    for t in range(tokens + own):
      key[table[s, t // PAGE], t % PAGE], value[table[s, t // PAGE], t % PAGE] = hk[t], hv[t]
    hist.append((hk.astype(np.float32), hv.astype(np.float32)))
    qs.append(rng.normal(size=(ql, HQ, D)))
    ks.append(hk[tokens + own:])
    vs.append(hv[tokens + own:])
    cu.append(cu[-1] + ql)
    kv.append(tokens + own)
  n = len(seqs)
  cu = np.array(cu + [cu[-1]] * (max_seqs - n), np.int32)
  kv = np.array(kv + [0] * (max_seqs - n), np.int32)
  f32 = lambda parts, extra: np.concatenate(parts + [np.zeros((2, *extra), np.float32)]).astype(
      np.float32)
  q, k, v = f32(qs, (HQ, D)), f32(ks, (HKV, D)), f32(vs, (HKV, dv))
  plain = sh.RaggedBatch(cu, kv, table, np.int32(n))
  grouped = sh.RaggedBatch(cu, kv, table, np.int32(n),
                           prefix=sh.SharedPrefix(prefix_pages, lens, group))
  cache = sh.PagedKVCache.from_token_major(jnp.asarray(key), jnp.asarray(value))
  return q, k, v, cache, grouped, plain, hist, cu


RULES = {
    "causal": (sh.AttentionConfig(), None, dict()),
    "window": (sh.AttentionConfig(sliding_window=(6, 0)), None, dict(window=(6, 0))),
    "chunk": (sh.AttentionConfig(chunk_size=8), None, dict(chunk=8)),
    "mask_object": (sh.AttentionConfig(), sh.masks.SlidingWindow((9, 0)) | sh.masks.MaskFn(
        lambda q, k: k < 2), "fn"),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_the_cascade_equals_the_oracle_and_the_plain_step(rule):
  config, mask, words = RULES[rule]
  q, k, v, cache, grouped, plain, hist, cu = _step(1, dv=24)
  sinks = np.random.default_rng(2).normal(size=(HQ, 2)).astype(np.float32)
  slopes = np.asarray(sh.scores.alibi_slopes(HQ))
  bias = sh.scores.Alibi(slopes)
  run = lambda batch: jax.jit(lambda c, b: sh.paged_attention(
      q, k, v, c, b, config=config, mask=mask, bias=bias, softmax_aux=sinks,
      return_residuals=True))(cache, batch)
  out, pool, lse = run(grouped)
  out_plain, pool_plain, lse_plain = run(plain)
  np.testing.assert_allclose(out, out_plain, **harness.tol())
  np.testing.assert_allclose(lse, lse_plain, **harness.tol())
  np.testing.assert_array_equal(np.asarray(pool.key), np.asarray(pool_plain.key))
  for s, (hk, hv) in enumerate(hist):
    rows = slice(cu[s], cu[s + 1])
    n, ql = len(hk), cu[s + 1] - cu[s]
    pos = np.arange(n)
    q_pos = pos[n - ql:]
    dense = -slopes[None, :, None, None] * np.abs(q_pos[:, None] - pos[None, :])
    if words == "fn":
      vis = ((q_pos[:, None] - 9 <= pos[None, :]) & (pos[None, :] <= q_pos[:, None])) | (
          pos[None, :] < 2)
      extra = dict(causal=False, mask=vis[None, None])
    else:
      extra = words
    want, _ = oracle.attention(q[None, rows], hk[None], hv[None], sinks=sinks, bias=dense,
                               **extra)
    np.testing.assert_allclose(np.asarray(out[rows]), want[0], err_msg=f"{rule} seq {s}",
                               **harness.tol())
  assert not np.asarray(out[cu[len(hist)]:]).any()  # padding rows


def test_a_grouping_that_disagrees_is_the_misuse_rule():
  q, k, v, cache, grouped, plain, _, cu = _step(3)
  p = grouped.prefix
  bad_pages = np.array(p.pages)
  bad_pages[0, 1] = (bad_pages[0, 1] + 1) % 64  # member tables no longer start with it
  long_prefix = np.array(p.lens)
  long_prefix[1] = 40  # past the members' cached tokens
  cases = {"pages": sh.SharedPrefix(bad_pages, p.lens, p.group),
           "too_long": sh.SharedPrefix(p.pages, long_prefix, p.group),
           "not_whole_pages": sh.SharedPrefix(p.pages, np.array([10, 8, 0], np.int32), p.group)}
  for name, prefix in cases.items():
    batch = sh.RaggedBatch(grouped.cu_q_lens, grouped.kv_lens, grouped.page_table,
                           grouped.num_seqs, prefix=prefix)
    with pytest.raises(ValueError, match=r"`batch.prefix` disagrees with a member"):
      sh.paged_attention(q, k, v, cache, batch)
    out, pool = jax.jit(sh.paged_attention)(q, k, v, cache, batch)
    bad = np.flatnonzero(np.asarray(jax.jit(lambda b: ragged.layout(
        b, q.shape[0], 64, PAGE).misuse.prefix)(batch)))
    assert bad.size, name
    for s in range(int(grouped.num_seqs)):
      rows = np.asarray(out[cu[s]:cu[s + 1]])
      assert np.isnan(rows).all() == (s in bad), (name, s)
    want_plain, _ = sh.paged_attention(q, k, v, cache, plain)
    keep = [r for s in range(int(grouped.num_seqs)) if s not in bad
            for r in range(cu[s], cu[s + 1])]
    np.testing.assert_allclose(np.asarray(out)[keep], np.asarray(want_plain)[keep],
                               **harness.tol())
  with pytest.raises(ValueError, match=r"`batch.prefix.group` must have an integer dtype"):
    sh.paged_attention(q, k, v, cache, sh.RaggedBatch(
        grouped.cu_q_lens, grouped.kv_lens, grouped.page_table, grouped.num_seqs,
        prefix=sh.SharedPrefix(p.pages, p.lens, p.group.astype(np.float32))))
