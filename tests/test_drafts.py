"""Draft trees (speculative decoding, DESIGN's "Draft trees"): the tree rule in a paged call and
over a fixed cache, `sh.accept_drafts` and `KVCache.accept`, each against the float64 oracle
(each row over its sequence's cached keys and its ancestors, at positions by depth)."""

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
from harness import tol
import oracle
import paged_cases
import splash_hk as sh
from splash_hk import drafts
from splash_hk import layer as layer_lib

# Trees over the default step's sequences (rows 1, 7, 3, 1; kv_lens 5, 0, 12, 3).
TREES = {
    "branches": [[-1], [-1, 0, 0, 1, 1, 2, 2], [-1, 0, 0], [-1]],
    "forest": [[-1], [-1, -1, 1, 0, 2, 4, 3], [-1, -1, 1], [-1]],  # several roots
    "chains": [[-1], [-1, 0, 1, 2, 3, 4, 5], [-1, 0, 1], [-1]],
}
PLATFORMS = ["xla", "reference"] + ([] if harness.NATIVE_MISSING else ["native"])


def ancestry(parents):
  """(depth [T], sees [T, T]: row r sees new row a) of one sequence's tree, by walking it."""
  t = len(parents)
  depth, sees = np.zeros(t, int), np.zeros((t, t), bool)
  for r in range(t):
    a = r
    while a >= 0:
      sees[r, a] = True
      a = parents[a]
    depth[r] = sees[r].sum() - 1
  return depth, sees


def tree_oracle(step, trees, sinks=None, slopes=None, **rules):
  """[N, Hq, Dv] float64: each row over its sequence's cached keys (the rule) and its ancestors,
  positions by depth; padding rows 0."""
  outs, start = [], 0
  for hk, hv, ql, parents in zip(step.history_k, step.history_v, step.q_lens, trees):
    kv = len(hk) - ql
    depth, sees = ancestry(parents)
    q_pos = kv + depth
    kv_pos = np.concatenate([np.arange(kv), kv + depth])
    mask = np.concatenate([np.ones((ql, kv), bool), sees], axis=1)
    bias = None
    if slopes is not None:
      bias = -np.asarray(slopes)[None, :, None, None] * np.abs(q_pos[:, None] - kv_pos[None])
    out, _ = oracle.attention(step.q[start:start + ql][None], hk[None], hv[None], sinks=sinks,
                              q_pos=q_pos[None], kv_pos=kv_pos[None], mask=mask[None, None],
                              bias=bias, **rules)
    outs.append(out[0])
    start += ql
  pad = np.zeros((step.q.shape[0] - start, step.q.shape[1], step.v.shape[-1]))
  return np.concatenate(outs + [pad])


def with_tree(step, trees):
  """The step's batch with `trees` (padding rows: -1)."""
  flat = sum(trees, []) + [-1] * (step.q.shape[0] - sum(step.q_lens))
  return dataclasses.replace(step.batch, tree=jnp.asarray(flat, jnp.int32))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_forest_whose_first_new_key_ends_a_page(platform):
  # Sequence 2's first new key (its first root's) is the last slot of a page: a kernel taking
  # that page as seen whole by every row would show it to the second root and its child.
  step = paged_cases.step(3, kv_lens=(5, 0, 2 * paged_cases.PAGE - 1, 3))
  out, _ = sh.paged_attention(step.q, step.k, step.v, step.cache, with_tree(step, TREES["forest"]),
                              config=sh.AttentionConfig(platform=platform, allow_fallback=False))
  np.testing.assert_allclose(np.asarray(out), tree_oracle(step, TREES["forest"]), **tol())


def test_the_walk_says_ancestry_and_depth_of_any_forest():
  rng = np.random.default_rng(0)
  walk = jax.jit(drafts.walk)
  for _ in range(30):
    n = int(rng.integers(1, 40))
    parents = [-1 if i == 0 or rng.random() < 0.2 else int(rng.integers(0, i)) for i in range(n)]
    w = walk(jnp.asarray(parents + [-1] * (40 - n)))  # one shape: later roots change nothing
    depth, sees = ancestry(parents)
    e, l = np.asarray(w.enter)[:n], np.asarray(w.leave)[:n]
    np.testing.assert_array_equal(drafts.is_ancestor(e[None, :], l[None, :], e[:, None]), sees)
    np.testing.assert_array_equal(np.asarray(w.depth)[:n], depth)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("shape", ["branches", "forest"])
def test_each_row_sees_its_cache_and_its_ancestors_at_positions_by_depth(platform, shape):
  step = paged_cases.step(3)
  sinks = np.array([0.5, -1.0, 0.0, 2.0], np.float32)
  slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
  out, _ = sh.paged_attention(step.q, step.k, step.v, step.cache, with_tree(step, TREES[shape]),
                              config=sh.AttentionConfig(platform=platform), softmax_aux=sinks,
                              bias=sh.scores.Alibi(jnp.asarray(slopes)))
  want = tree_oracle(step, TREES[shape], sinks=sinks, slopes=slopes)
  np.testing.assert_allclose(np.asarray(out), want, **tol())


@pytest.mark.parametrize("rule", ["window", "chunk", "bidirectional"])
def test_the_rules_speak_of_positions_by_depth(rule):
  config, rules = paged_cases.RULES[rule]
  step = paged_cases.step(4)
  out, _ = sh.paged_attention(step.q, step.k, step.v, step.cache,
                              with_tree(step, TREES["branches"]), config=config)
  np.testing.assert_allclose(np.asarray(out), tree_oracle(step, TREES["branches"], **rules),
                             **tol())
  decision = sh.explain_paged(step.q, step.k, step.v, step.cache,
                             with_tree(step, TREES["branches"]), config=config)
  if rule != "bidirectional":  # the native kernel bounds keys by slot: a tree's window is xla's
    assert decision.backend == "xla" and "draft trees" in decision.reason, decision


def test_a_chain_as_a_tree_is_the_call_without_one():
  step = paged_cases.step(5)
  chained, _ = sh.paged_attention(step.q, step.k, step.v, step.cache,
                                  with_tree(step, TREES["chains"]))
  plain, _ = sh.paged_attention(step.q, step.k, step.v, step.cache, step.batch)
  want = paged_cases.attend(step)
  np.testing.assert_allclose(np.asarray(chained), want, **tol())
  np.testing.assert_allclose(np.asarray(plain), want, **tol())


def test_a_wide_tree_reads_its_cache_whole_and_its_siblings_never():
  """650 rows under one root beside a cache of 700: tiles of 256 rows read the cached pages
  as whole runs without a mask, and never their siblings' new keys (the runs stop there)."""
  step = paged_cases.step(6, kv_lens=(700, 2), q_lens=(650, 1), max_seqs=2, pad_rows=0,
                          pages_per_seq=85, num_pages=90, shared_prefix=False, page=16, hq=2,
                          hkv=1, d=8, value_dim=8)
  trees = [[-1] + [0] * 649, [-1]]
  out, _ = sh.paged_attention(step.q, step.k, step.v, step.cache, with_tree(step, trees),
                              config=sh.AttentionConfig(platform="xla"))
  np.testing.assert_allclose(np.asarray(out), tree_oracle(step, trees), **tol())


def test_a_parent_not_earlier_is_misuse_eagerly_and_nan_under_jit():
  step = paged_cases.step(7)
  bad = [[-1], [-1, 0, 2, 1, 1, 2, 2], [-1, 0, 0], [-1]]  # row 2's parent is itself
  with pytest.raises(ValueError, match=r"`batch.tree` gives a row a parent .* \(sequences \[1\]\)"):
    sh.paged_attention(step.q, step.k, step.v, step.cache, with_tree(step, bad))
  out, _ = jax.jit(sh.paged_attention)(step.q, step.k, step.v, step.cache, with_tree(step, bad))
  out = np.asarray(out)
  assert np.isnan(out[1:8]).all()
  good = tree_oracle(step, TREES["branches"])
  np.testing.assert_allclose(out[[0, 8, 9, 10, 11]], good[[0, 8, 9, 10, 11]], **tol())
  with pytest.raises(ValueError, match=r"`batch.tree` must be \[num_tokens\] = \[14\]"):
    sh.paged_attention(step.q, step.k, step.v, step.cache,
                       dataclasses.replace(step.batch, tree=jnp.zeros((3,), jnp.int32)))


def test_accepted_rows_move_down_and_the_next_step_reads_them():
  step = paged_cases.step(8)
  batch = with_tree(step, TREES["branches"])
  _, pool = sh.paged_attention(step.q, step.k, step.v, step.cache, batch)
  keep = ([0], [0, 2, 6], [0, 1], [])  # sequence 1: root, its second child, that one's child
  path, lens = np.zeros((5, 3), np.int32), np.zeros(5, np.int32)
  for s, rows in enumerate(keep):
    path[s, :len(rows)], lens[s] = rows, len(rows)
  kept = sh.accept_drafts(pool, batch, path, lens)
  kv_before = np.asarray(step.batch.kv_lens)
  kv_lens = kv_before + lens  # the caller adds path_lens
  history = [np.concatenate([h[:kv], h[kv:][rows]]) for h, kv, rows in
             zip(step.history_k, kv_before, keep)]
  values = [np.concatenate([h[:kv], h[kv:][rows]]) for h, kv, rows in
            zip(step.history_v, kv_before, keep)]
  rng = np.random.default_rng(1)
  q = rng.normal(size=(4, 4, 16)).astype(np.float32)
  k = rng.normal(size=(4, 2, 16)).astype(np.float32)
  v = rng.normal(size=(4, 2, 16)).astype(np.float32)
  cu = np.array([0, 1, 2, 3, 4, 4], np.int32)
  nxt = sh.RaggedBatch(jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32), step.batch.page_table,
                       jnp.asarray(4, jnp.int32))
  out, _ = sh.paged_attention(q, k, v, kept, nxt)
  for s in range(4):
    hk = np.concatenate([history[s], k[s:s + 1]])
    hv = np.concatenate([values[s], v[s:s + 1]])
    want, _ = oracle.attention(q[s:s + 1][None], hk[None], hv[None])
    np.testing.assert_allclose(np.asarray(out[s]), want[0, 0], **tol())


def test_a_path_that_is_not_the_trees_is_misuse():
  step = paged_cases.step(9)
  batch = with_tree(step, TREES["branches"])
  _, pool = sh.paged_attention(step.q, step.k, step.v, step.cache, batch)
  path, lens = np.zeros((5, 3), np.int32), np.zeros(5, np.int32)
  path[1], lens[1] = [0, 2, 3], 3  # row 3's parent is 1, not 2
  with pytest.raises(ValueError, match=r"`path` is not a root-to-leaf path .* \(sequences \[1\]\)"):
    sh.accept_drafts(pool, batch, path, lens)
  moved = jax.jit(sh.accept_drafts)(pool, batch, path, lens)  # under jit: it moves nothing
  np.testing.assert_array_equal(np.asarray(moved.key), np.asarray(pool.key))
  lens[1] = 4
  with pytest.raises(ValueError, match=r"`path_lens` is outside"):
    sh.accept_drafts(pool, batch, path, lens)


def _cache_case(seed, lens=(7, 12), parents=((-1, 0, 0, 1, 1), (-1, 0, 1, -1, 3))):
  rng = np.random.default_rng(seed)
  b, s, t = len(lens), 24, len(parents[0])
  f = lambda *shape: rng.normal(size=shape).astype(np.float32)
  cache = sh.KVCache.zeros(b, s, 2, 8).replace(key=jnp.asarray(f(b, s, 2, 8)),
                                               value=jnp.asarray(f(b, s, 2, 8)),
                                               length=jnp.asarray(lens, jnp.int32))
  return cache, f(b, t, 4, 8), f(b, t, 2, 8), f(b, t, 2, 8), np.asarray(parents)


def _cache_oracle(cache, q, k, v, parents, slopes=None, **rules):
  outs = []
  for b, length in enumerate(np.asarray(cache.length)):
    depth, sees = ancestry(list(parents[b]))
    hk = np.concatenate([np.asarray(cache.key)[b, :length], k[b]])
    hv = np.concatenate([np.asarray(cache.value)[b, :length], v[b]])
    q_pos, kv_pos = length + depth, np.concatenate([np.arange(length), length + depth])
    mask = np.concatenate([np.ones((len(depth), length), bool), sees], axis=1)
    bias = None if slopes is None else (
        -np.asarray(slopes)[None, :, None, None] * np.abs(q_pos[:, None] - kv_pos[None]))
    out, _ = oracle.attention(q[b][None], hk[None], hv[None], q_pos=q_pos[None],
                              kv_pos=kv_pos[None], mask=mask[None, None], bias=bias,
                              causal=False, **rules)
    outs.append(out[0])
  return np.stack(outs)


@pytest.mark.parametrize("platform", ["xla", "reference", "xla_blocks_of_4"])
def test_a_tree_over_a_fixed_cache_sees_the_cache_and_its_ancestors(platform):
  cache, q, k, v, parents = _cache_case(10)
  config = (sh.AttentionConfig(platform="xla", block_sizes=sh.BlockSizes(4, 4))  # blocks of
            if platform == "xla_blocks_of_4"  # cached keys alone are whole; of new keys, not
            else sh.AttentionConfig(platform=platform))
  settings = layer_lib.Settings(config, None, sh.MeshAxes(), "mha")
  slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
  for mask, rules, bias in ((sh.masks.Tree(parents), {}, None),
                            (sh.masks.Tree(parents) & sh.masks.SlidingWindow((2, 0)),
                             dict(window=(2, 0)), None),
                            (sh.masks.Tree(parents), {}, slopes)):
    call = layer_lib.Call(mask=mask, kv_cache=cache,
                          bias=None if bias is None else sh.scores.Alibi(jnp.asarray(bias)))
    out, after = layer_lib.attend(q, k, v, call, settings)
    np.testing.assert_allclose(np.asarray(out), _cache_oracle(cache, q, k, v, parents, bias,
                                                              **rules), **tol())
  np.testing.assert_array_equal(after.length, [12, 17])
  np.testing.assert_array_equal(after.appended, [5, 5])


def test_a_haiku_module_takes_the_tree_with_its_cache_and_accept_keeps_the_path():
  cache, _, _, _, parents = _cache_case(11)
  x = np.random.default_rng(2).normal(size=(2, 5, 16)).astype(np.float32)

  def layer(x, cache, mask):
    return sh.MultiHeadAttention(num_heads=4, key_size=8, num_kv_heads=2, with_bias=True,
                                 w_init=hk.initializers.VarianceScaling(1.0),
                                 b_init=hk.initializers.RandomNormal(0.1))(x, kv_cache=cache,
                                                                           mask=mask)

  f = hk.without_apply_rng(hk.transform(layer))
  params = f.init(jax.random.PRNGKey(0), x, cache, sh.masks.Tree(parents))
  w = {name: params[f"multi_head_attention/{name}"] for name in ("query", "key", "value",
                                                                 "linear")}
  proj = lambda name, heads: (x @ np.asarray(w[name]["w"]) + np.asarray(w[name]["b"])).reshape(
      2, 5, heads, 8)
  q, k, v = proj("query", 4), proj("key", 2), proj("value", 2)
  (out, after) = jax.jit(f.apply)(params, x, cache, sh.masks.Tree(parents))
  heads = _cache_oracle(cache, q, k, v, parents).reshape(2, 5, 32)
  want = heads @ np.asarray(w["linear"]["w"]) + np.asarray(w["linear"]["b"])
  np.testing.assert_allclose(np.asarray(out), want, **tol())
  kept = after.accept(np.array([[0, 1, 3], [0, 1, 2]]), np.array([3, 2]))
  np.testing.assert_array_equal(kept.length, [10, 14])
  np.testing.assert_allclose(np.asarray(kept.key)[0, 7:10], k[0, [0, 1, 3]], **tol())
  np.testing.assert_allclose(np.asarray(kept.value)[1, 12:14], v[1, [0, 1]], **tol())
  with pytest.raises(ValueError, match=r"`path`/`path_lens` name tokens outside .* rows \[1\]"):
    after.accept(np.array([[0, 1, 3], [0, 5, 2]]), np.array([3, 2]))
  failed = jax.jit(lambda c, p, n: c.accept(p, n))(after, np.array([[0, 1, 3], [0, 5, 2]]),
                                                    np.array([3, 2]))
  np.testing.assert_array_equal(failed.length, [10, -1])
  with pytest.raises(ValueError, match=r"no record of a call"):
    cache.replace(appended=None).accept(np.zeros((2, 1), np.int32), np.zeros(2, np.int32))


def test_accept_keeps_only_a_path_of_the_calls_tree():
  """The one path check of `accept_drafts`, on the fixed cache: seen failing when `accept` read
  only the indices' range (it kept [0, 1, 4] of the tree below, whose 4 hangs off 3)."""
  cache, q, k, v, parents = _cache_case(13, parents=((-1, 0, 1, 0, 3), (-1, 0, 1, 2, 3)))
  settings = layer_lib.Settings(sh.AttentionConfig(platform="xla"), None, sh.MeshAxes(), "mha")
  _, after = layer_lib.attend(q, k, v, layer_lib.Call(mask=sh.masks.Tree(parents),
                                                      kv_cache=cache), settings)
  off_tree, lens = np.array([[0, 1, 4], [0, 1, 2]]), np.array([3, 3])
  with pytest.raises(ValueError, match=r"`path` is not a root-to-leaf path .* rows \[0\]"):
    after.accept(off_tree, lens)
  failed = jax.jit(lambda c, p, n: c.accept(p, n))(after, off_tree, lens)
  np.testing.assert_array_equal(failed.length, [-1, 15])
  kept = after.accept(np.array([[0, 3, 4], [0, 1, 2]]), lens)
  np.testing.assert_array_equal(kept.length, [10, 15])
  np.testing.assert_allclose(np.asarray(kept.key)[0, 7:10], k[0, [0, 3, 4]], **tol())
  _, chained = layer_lib.attend(q, k, v, layer_lib.Call(kv_cache=cache), settings)  # no Tree
  with pytest.raises(ValueError, match=r"not a root-to-leaf path .* rows \[1\]"):
    chained.accept(np.array([[0, 1, 2], [0, 2, 3]]), lens)


@pytest.mark.parametrize("platform", ["xla", "reference"])
def test_a_tree_over_more_keys_than_queries_sees_the_earlier_keys_whole(platform):
  """`attention(q [B, T], k [B, S > T], mask=Tree(p))`: a row sees every key before the last T
  and, of the last T, itself and its ancestors (it raised "needs query_len == kv_len")."""
  cache, q, k, v, parents = _cache_case(14, lens=(19, 19))
  keys = lambda c, new: np.concatenate([np.asarray(c)[:, :19], new], axis=1)  # [B, S = 24, ...]
  k_all, v_all = keys(cache.key, k), keys(cache.value, v)
  config = sh.AttentionConfig(platform=platform, allow_fallback=False)
  for jit in (False, True):
    run = lambda q, k, v: sh.attention(q, k, v, mask=sh.masks.Tree(parents),
                                       config=config).attention_outputs
    out = (jax.jit(run) if jit else run)(q, k_all, v_all)
    for b in range(2):
      _, sees = ancestry(list(parents[b]))
      mask = np.concatenate([np.ones((5, 19), bool), sees], axis=1)[None, None]  # [1, 1, T, S]
      want, _ = oracle.attention(q[b][None], k_all[b][None], v_all[b][None], mask=mask,
                                 causal=False)
      np.testing.assert_allclose(np.asarray(out[b]), want[0], **tol())
  with pytest.raises(ValueError, match=r"Tree without a cache needs kv_len >= query_len"):
    sh.attention(k_all[:, :5], q[:, :4, :2], q[:, :4, :2], mask=sh.masks.Tree(parents))


def test_tree_parents_of_another_length_than_the_calls_tokens_are_refused_naming_them():
  cache, q, k, v, _ = _cache_case(15)
  settings = layer_lib.Settings(sh.AttentionConfig(), None, sh.MeshAxes(), "mha")
  call = layer_lib.Call(mask=sh.masks.Tree(np.array([[-1, 0, 1], [-1, 0, 0]])), kv_cache=cache)
  with pytest.raises(ValueError, match=r"Tree.parents must be \[B, T\] = \(2, 5\).*got \(2, 3\)"):
    layer_lib.attend(q, k, v, call, settings)


def test_a_tree_parent_not_earlier_is_refused_naming_the_mask():
  cache, q, k, v, _ = _cache_case(12)
  settings = layer_lib.Settings(sh.AttentionConfig(), None, sh.MeshAxes(), "mha")
  call = layer_lib.Call(mask=sh.masks.Tree(np.array([[-1, 0, 2, 1, 1], [-1, 0, 1, 2, 3]])),
                        kv_cache=cache)
  with pytest.raises(ValueError, match=r"Tree.parents\[0, 2\] is 2"):
    layer_lib.attend(q, k, v, call, settings)
  out, _ = jax.jit(lambda c: layer_lib.attend(q, k, v, c, settings))(call)  # known at run time
  assert np.isnan(np.asarray(out[0])).all() and np.isfinite(np.asarray(out[1])).all()


def test_a_tree_shards_over_the_head_axis():
  step = paged_cases.step(13)
  mesh = harness.mesh("4x2")
  call = jax.jit(lambda q, k, v, c, b: sh.paged_attention(q, k, v, c, b, mesh=mesh))
  out, _ = call(step.q, step.k, step.v, step.cache, with_tree(step, TREES["forest"]))
  assert out.sharding.spec[1] == "tp"
  np.testing.assert_allclose(np.asarray(out), tree_oracle(step, TREES["forest"]), **tol())


def test_a_nan_draft_shows_in_its_own_rows_and_descendants_alone():
  """Row 2 of sequence 1 (parent 0; children 5 and 6 in "branches") holds NaN in its key and
  value: it and its descendants output NaN, its siblings and cousins (who never see it) match
  the oracle, on every backend."""
  step = paged_cases.step(14)
  k, v = step.k.copy(), step.v.copy()
  k[1 + 2], v[1 + 2] = np.nan, np.nan  # sequence 1 starts at row 1
  for platform in PLATFORMS:
    out, _ = sh.paged_attention(step.q, k, v, step.cache, with_tree(step, TREES["branches"]),
                                config=sh.AttentionConfig(platform=platform))
    out = np.asarray(out)
    assert np.isnan(out[[3, 6, 7]]).all(), platform
    clean = [0, 1, 2, 4, 5, 8, 9, 10, 11]
    np.testing.assert_allclose(out[clean], tree_oracle(step, TREES["branches"])[clean],
                               **tol(), err_msg=platform)


def test_a_tree_step_exports_for_tpu_on_xla_and_the_artifact_runs_here():
  """The TPU block-list kernel refuses trees (interpret mode too): on a TPU a tree step is xla's
  tiles, lowered from this CPU host; the two-platform artifact runs here against the oracle."""
  step = paged_cases.step(15)
  batch = with_tree(step, TREES["forest"])
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  args = jax.tree.map(spec, (step.q, step.k, step.v, step.cache, batch))
  decision = sh.explain_paged(*args, for_platform="tpu")
  assert decision.backend == "xla" and "draft trees" in decision.reason, decision
  interpret = sh.explain_paged(*args, config=sh.AttentionConfig(platform="splash",
                                                                interpret=True))
  assert interpret.backend == "xla" and interpret.fallback and "draft trees" in interpret.reason
  xla = sh.AttentionConfig(platform="xla")  # the CPU branch too (the native FFI call is not
  f = jax.jit(lambda *a: sh.paged_attention(*a, config=xla)[0])  # serialisable: DESIGN's trap)
  tpu = jax.export.export(f, platforms=["tpu"])(*args)
  assert "tpu_custom_call" not in tpu.mlir_module()
  both = jax.export.export(f, platforms=["cpu", "tpu"])(*args)
  out = both.call(step.q, step.k, step.v, step.cache, batch)
  np.testing.assert_allclose(np.asarray(out), tree_oracle(step, TREES["forest"]), **tol())
