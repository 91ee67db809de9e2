"""paged_attention against the float64 oracle: mixed steps over shuffled, shared pages."""

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import paged_cases
import oracle
import splash_hk as sh
from splash_hk import paged
from splash_hk import ragged
from splash_hk.fallback import selector

HQ, HKV, D, PAGE = paged_cases.HQ, paged_cases.HKV, paged_cases.D, paged_cases.PAGE
RULES = paged_cases.RULES
_step, _oracle = paged_cases.step, paged_cases.attend


_check_cache = paged_cases.check_written


# The reference path (a dense gather into the reference attend, which every attention test
# holds to the oracle) on two rules; the xla path on every rule.
@pytest.mark.parametrize("platform,rule", [("xla", r) for r in RULES] +
                         [("reference", "causal"), ("reference", "soft_cap")] +
                         [("splash", r) for r in RULES])
def test_mixed_step_matches_the_oracle_and_writes_only_its_tokens(platform, rule):
  config, rules = RULES[rule]
  step = _step(seed=1)
  config = dataclasses.replace(config, platform=platform, allow_fallback=False,
                               interpret=platform == "splash")  # splash: the block-list kernel
  out, cache = jax.jit(lambda *a: sh.paged_attention(*a, config=config))(
      step.q, step.k, step.v, step.cache, step.batch)
  np.testing.assert_allclose(np.asarray(out), _oracle(step, **rules), **harness.tol())
  _check_cache(step, cache)


@pytest.mark.parametrize("platform,kind", [("xla", "alibi"), ("xla", "t5_uni"), ("xla", "fn"),
                                           ("reference", "t5_uni")])
def test_sinks_gqa_value_size_and_position_bias(platform, kind):
  step = _step(seed=2, value_dim=24)
  sinks = np.random.default_rng(3).normal(size=(HKV, 2)).astype(np.float32)  # kv-head sinks
  params, dense = harness.score_case(kind, np.arange(40)[None], np.arange(40)[None], HQ)
  bias = lambda ql, s: np.asarray(dense(params))[:, :, s - ql:s, :s]  # end-aligned rows
  config = sh.AttentionConfig(platform=platform, allow_fallback=False, logits_soft_cap=3.0)
  out, _ = jax.jit(lambda *a, s, b: sh.paged_attention(*a, config=config, softmax_aux=s, bias=b))(
      step.q, step.k, step.v, step.cache, step.batch, s=sinks, b=harness.score_object(kind, params))
  want = _oracle(step, sinks=np.repeat(sinks, HQ // HKV, 0), bias=bias, soft_cap=3.0)
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())


@pytest.mark.parametrize("platform", ["xla", "reference", "splash"])
def test_mask_objects_over_positions(platform):
  step = _step(seed=4)
  rule = (sh.masks.Causal() & sh.masks.MaskFn(lambda q, kv: (q - kv) % 3 != 1)) | sh.masks.MaskFn(
      lambda q, kv: kv < 2)
  config = sh.AttentionConfig(platform=platform, allow_fallback=False,
                              interpret=platform == "splash")
  out, _ = jax.jit(lambda *a: sh.paged_attention(*a, config=config, mask=rule))(
      step.q, step.k, step.v, step.cache, step.batch)
  def dense(ql, s):
    qp, kp = np.arange(s - ql, s)[:, None], np.arange(s)[None]
    return (((kp <= qp) & ((qp - kp) % 3 != 1)) | (kp < 2))[None, None]
  want = _oracle(step, mask=None, bias=lambda ql, s: np.where(dense(ql, s), 0.0, -np.inf),
                 causal=False)
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())


def _late_and_causal(q_pos, kv_pos):
  return (q_pos >= 8) & (kv_pos <= q_pos)


@pytest.mark.parametrize("platform", ["xla", "splash"])  # splash: the block-list kernel
def test_a_visible_nan_value_shows_and_a_row_seeing_nothing_outputs_0(platform):
  # Rows before position 8 see nothing (0); sequence 2's rows (positions 12..14) see a NaN in
  # value column 0 of its cached token 5 (not the shared page): NaN there, finite elsewhere.
  step = _step(seed=21)
  table = np.asarray(step.batch.page_table)
  key, value = (np.array(a) for a in step.cache.token_major())
  value[table[2, 5 // PAGE], 5 % PAGE, 0, 0] = np.nan
  step.history_v[2][5, 0, 0] = np.nan
  step.cache = sh.PagedKVCache.from_token_major(key, jnp.asarray(value))
  config = sh.AttentionConfig(platform=platform, interpret=True, allow_fallback=False)
  out, _ = jax.jit(lambda *a: sh.paged_attention(*a, mask=sh.masks.MaskFn(_late_and_causal),
                                                 config=config))(
      step.q, step.k, step.v, step.cache, step.batch)

  def dense(ql, s):
    qp, kp = np.arange(s - ql, s)[:, None], np.arange(s)[None]
    return _late_and_causal(qp, kp)[None, None]

  want = _oracle(step, bias=lambda ql, s: np.where(dense(ql, s), 0.0, -np.inf), causal=False)
  out = np.asarray(out)
  rows_2 = slice(sum(step.q_lens[:2]), sum(step.q_lens[:3]))
  assert np.isnan(out[rows_2, :2, 0]).all() and np.isfinite(out[rows_2, :, 1:]).all()
  assert np.isfinite(out[rows_2, 2:]).all()  # query heads of the other kv head
  assert (out[:rows_2.start] == 0).all() and (out[rows_2.stop:] == 0).all()
  np.testing.assert_allclose(out, want, **harness.tol())


def test_long_prefill_chunk_beside_decodes_at_a_real_size():
  # 300 prefill rows after 77 cached tokens (its rows' pages: thousands of loop items, many loop
  # steps) beside three decodes; pages of 4 over a pool of 400.
  step = _step(seed=5, kv_lens=(77, 130, 30, 250), q_lens=(300, 1, 1, 1), pages_per_seq=100,
               num_pages=400, pad_rows=3)
  config = sh.AttentionConfig(platform="xla", allow_fallback=False, sliding_window=(200, 0))
  out, cache = jax.jit(lambda *a: sh.paged_attention(*a, config=config))(
      step.q, step.k, step.v, step.cache, step.batch)
  np.testing.assert_allclose(np.asarray(out), _oracle(step, window=(200, 0)), **harness.tol())
  _check_cache(step, cache)


def _misuse(kind, step):
  """(batch with one misuse, the sequences it involves, the words the error names)."""
  b = step.batch
  cu, lens, table = (np.array(a) for a in (b.cu_q_lens, b.kv_lens, b.page_table))
  num_seqs = b.num_seqs
  if kind == "cu_q_lens":
    cu[2] = cu[1] - 1
    involved, words = [0, 1, 2, 3], "`batch.cu_q_lens` decreases"
  elif kind == "num_seqs":
    num_seqs, involved, words = jnp.asarray(9, jnp.int32), [0, 1, 2, 3], "`batch.num_seqs`"
  elif kind == "kv_lens":
    lens[3] = -2
    involved, words = [3], "`batch.kv_lens` is negative (sequences [3])"
  elif kind == "capacity":
    table[1, :] = table[1, 0]  # a full table (one page repeated is read only below 0 + 7 ...)
    lens[1] = table.shape[1] * PAGE - 3  # ... but 7 new rows grow past the table
    involved, words = [1], "grows past pages_per_seq * page_size = 24 tokens (sequences [1])"
  elif kind == "page_range":
    table[3, 0] = 40
    involved, words = [3], "lists a page outside [0, 40) (sequences [3])"
  else:  # shared_write: sequence 3 writes into a page sequence 1 lists
    table[3, 0] = table[1, 0]
    involved, words = [1, 3], "also listed elsewhere"
  batch = sh.RaggedBatch(jnp.asarray(cu), jnp.asarray(lens), jnp.asarray(table), num_seqs)
  return batch, involved, words


@pytest.mark.parametrize("kind", ["cu_q_lens", "num_seqs", "kv_lens", "capacity", "page_range",
                                  "shared_write"])
def test_misuse_is_an_error_eagerly_and_nan_under_jit(kind):
  step = _step(seed=6)
  batch, involved, words = _misuse(kind, step)
  with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(
      ")", r"\)").replace("*", r"\*")):
    sh.paged_attention(step.q, step.k, step.v, step.cache, batch)
  out, cache = jax.jit(sh.paged_attention)(step.q, step.k, step.v, step.cache, batch)
  out = np.asarray(out)
  want = _oracle(step)
  cu = np.asarray(step.batch.cu_q_lens)
  for s in range(4):
    rows = slice(cu[s], cu[s + 1])
    if s in involved:
      assert np.isnan(out[rows]).all(), (kind, s)
    else:
      np.testing.assert_allclose(out[rows], want[rows], **harness.tol())
  # Padding rows: 0, unless num_seqs itself is wrong (then which rows are padding is unknown).
  np.testing.assert_array_equal(out[cu[4]:], np.nan if kind == "num_seqs" else 0)
  # The involved sequences wrote nothing: the cache is as if only the others had run.
  healthy = [s for s in range(4) if s not in involved]
  expected = dataclasses.replace(step, history_k=[step.history_k[s] for s in healthy],
                                 history_v=[step.history_v[s] for s in healthy],
                                 q_lens=[step.q_lens[s] for s in healthy])
  kept = np.array(healthy, int)
  expected.batch = sh.RaggedBatch(step.batch.cu_q_lens, step.batch.kv_lens[kept],
                                  step.batch.page_table[kept], step.batch.num_seqs)
  _check_cache(expected, cache)


def test_decode_loop_equals_the_oracle_over_the_whole_history():
  # Three prompts prefilled together, then decoded together step by step, a fourth admitted
  # mid-stream (its prefill in the same step as the others' decodes); pages handed out from a
  # shuffled free list as sequences grow. Every step's rows equal the oracle over each
  # sequence's whole history.
  rng = np.random.default_rng(7)
  pages_per_seq, max_seqs, config = 12, 4, sh.AttentionConfig(platform="xla")
  cache = sh.PagedKVCache.zeros(48, PAGE, HKV, D)
  free, table = list(rng.permutation(48)), np.full((max_seqs, pages_per_seq), -1, np.int32)
  hist_k, hist_v, lens = [], [], []
  step_fn = jax.jit(lambda q, k, v, c, b: sh.paged_attention(q, k, v, c, b, config=config),
                    donate_argnums=3)
  for t in range(14):
    new = [10, 3, 17] if t == 0 else [1] * len(lens) + ([6] if t == 5 else [])
    for s, n in enumerate(new):
      if s == len(lens):
        lens.append(0)
        hist_k.append(np.zeros((0, HKV, D), np.float32))
        hist_v.append(np.zeros((0, HKV, D), np.float32))
      while (table[s] >= 0).sum() * PAGE < lens[s] + n:
        table[s, (table[s] >= 0).sum()] = free.pop()
    q = rng.normal(size=(sum(new), HQ, D)).astype(np.float32)
    k = rng.normal(size=(sum(new), HKV, D)).astype(np.float32)
    v = rng.normal(size=(sum(new), HKV, D)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(new), np.full(max_seqs - len(new), sum(new))])
    kv_lens = np.array(lens + [0] * (max_seqs - len(lens)), np.int32)
    batch = sh.RaggedBatch(jnp.asarray(cu, jnp.int32), jnp.asarray(kv_lens),
                           jnp.asarray(table), jnp.asarray(len(new), jnp.int32))
    out, cache = step_fn(q, k, v, cache, batch)
    start = 0
    for s, n in enumerate(new):
      hist_k[s] = np.concatenate([hist_k[s], k[start:start + n]])
      hist_v[s] = np.concatenate([hist_v[s], v[start:start + n]])
      want, _ = oracle.attention(q[None, start:start + n], hist_k[s][None], hist_v[s][None])
      np.testing.assert_allclose(np.asarray(out[start:start + n]), want[0], **harness.tol(),
                                 err_msg=f"step {t}, sequence {s}")
      lens[s] += n
      start += n


def test_explain_paged_names_the_backend_and_the_refusals():
  step = _step(seed=8)
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  args = jax.tree.map(spec, (step.q, step.k, step.v, step.cache, step.batch))
  decision = sh.explain_paged(*args)  # a decode step on CPU: the native kernel (if it builds)
  assert decision.backend == ("native" if harness.NATIVE_MISSING is None else "xla")
  assert "paged" in decision.reason, decision
  decision = sh.explain_paged(*args, config=sh.AttentionConfig(platform="reference"))
  assert decision == sh.Decision("reference", "reference is the requested (paged)")
  splash = sh.explain_paged(*args, config=sh.AttentionConfig(platform="splash", interpret=True))
  assert splash == sh.Decision("splash", "splash is the requested (paged)"), splash
  tpu = sh.explain_paged(*args, for_platform="tpu")  # the choice on a TPU, from this host
  assert tpu == sh.Decision("splash", "splash is the first choice on tpu (paged)"), tpu
  here = sh.explain_paged(*args, config=sh.AttentionConfig(platform="splash"))
  assert here.backend == "xla" and "splash: the block-list kernel is a Pallas TPU" in here.reason
  gpu = selector.select_paged(
      paged.paged_facts(*args, config=sh.AttentionConfig(), mask=None, bias=None, softmax_aux=None),
      hardware="gpu")
  assert gpu.backend == "xla" and "triton: no GPU paged kernel" in gpu.reason, gpu
  with pytest.raises(ValueError, match="forbids fallbacks"):
    sh.explain_paged(*args, config=sh.AttentionConfig(platform="triton", allow_fallback=False))


@pytest.mark.parametrize("change,words", [
    (dict(q=np.zeros((14, 4, 8), np.float32)), "`key` must be"),
    (dict(k=np.zeros((14, 2, 16), np.float16)), "`key` is float16 and the cache holds float32"),
    (dict(cache=sh.KVCache.zeros(1, 8, 2, 16)), "`cache` must be a splash_hk.PagedKVCache"),
    (dict(mask=np.ones((1, 1, 13, 24), bool)), "a dense array has no meaning over a pool"),
    (dict(mask=sh.masks.Causal() | sh.masks.Bidirectional(np.zeros((1, 13), np.int32))),
     "per-token arrays"),
    (dict(mask=sh.masks.Blocks(np.zeros((1, 1, 13, 1), np.int32), np.ones((1, 1, 13), np.int32),
                               (1, 16))),
     "chosen key blocks (Blocks), which paged_attention does not take"),
    (dict(bias=sh.scores.Dense(np.zeros((1, 4, 13, 24), np.float32))), "a dense bias"),
    (dict(bias=sh.scores.Alibi(np.ones(3, np.float32))), "Alibi.slopes"),
    (dict(softmax_aux=np.zeros(3, np.float32)), "`softmax_aux`"),
    (dict(batch=(1, 2)), "`batch` must be a splash_hk.RaggedBatch"),
])
def test_bad_arguments_name_what_to_pass(change, words):
  step = _step(seed=9)
  args = dict(q=step.q, k=step.k, v=step.v, cache=step.cache, batch=step.batch)
  kwargs = {key: change.pop(key) for key in ("mask", "bias", "softmax_aux") if key in change}
  args.update(change)
  with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
    sh.paged_attention(*args.values(), **kwargs)


@pytest.mark.parametrize("mesh_name", ["4x2", "2x4"])
def test_heads_shard_over_the_head_axis(mesh_name):
  # tp = 2 and 4 over 8 query and 4 kv heads (the flat token axis and the pages whole), with
  # kv-head sinks and learnable-per-head ALiBi slopes sharded with their heads.
  step = _step(seed=10, hq=8, hkv=4)
  mesh = harness.mesh(mesh_name)
  sinks = np.random.default_rng(11).normal(size=(4, 1)).astype(np.float32)
  slopes, dense = harness.score_case("alibi", np.arange(40)[None], np.arange(40)[None], 8)
  call = jax.jit(lambda q, k, v, c, b, s, a: sh.paged_attention(
      q, k, v, c, b, softmax_aux=s, bias=sh.scores.Alibi(a), mesh=mesh))
  out, cache = call(step.q, step.k, step.v, step.cache, step.batch, sinks, slopes)
  assert out.sharding.spec[1] == "tp" and cache.key.sharding.spec[1] == "tp"
  bias = lambda ql, s: np.asarray(dense(slopes))[:, :, s - ql:s, :s]
  want = _oracle(step, sinks=np.repeat(sinks, 2, 0), bias=bias)
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())
  _check_cache(step, cache)


def test_the_haiku_module_serves_paged_steps_as_the_oracle_attends():
  mha = lambda: sh.MultiHeadAttention(HQ, 8, num_kv_heads=HKV, num_sinks=1,
                                      w_init=hk.initializers.VarianceScaling(1.0),
                                      b_init=hk.initializers.RandomNormal(0.1))
  f = hk.without_apply_rng(hk.transform(lambda x, c, b: mha()(x, kv_cache=c, batch=b)))
  xs, steps = harness.paged_module_steps()
  params = hk.data_structures.to_mutable_dict(f.init(jax.random.PRNGKey(0), steps[0][0],
                                                     sh.PagedKVCache.zeros(16, 4, HKV, 8),
                                                     steps[0][1]))
  sinks = params["multi_head_attention/~/splash_attention"]["sinks"] = jnp.full((HQ, 1), 0.5)
  cache = sh.PagedKVCache.zeros(16, 4, HKV, 8)
  step = jax.jit(f.apply)
  for x, batch, rows in steps:
    out, cache = step(params, x, cache, batch)  # [N, 16]
    start = 0
    for name, t, k in rows:
      want = oracle.mha(params, xs[name][None, :t + k], num_heads=HQ, num_kv_heads=HKV,
                        key_size=8, value_size=8, sinks=np.asarray(sinks))[0, t:]
      np.testing.assert_allclose(np.asarray(out[start:start + k]), want, err_msg=name,
                                 **harness.tol())
      start += k
  with pytest.raises(ValueError, match="RaggedBatch"):
    f.apply(params, x, cache, None)
  with pytest.raises(ValueError, match="flat: \\[N, D\\]"):
    f.apply(params, x[None], cache, batch)


def test_a_pool_written_by_one_layer_is_refused_by_another_eager_and_under_jit():
  def model(x, pools, batch):
    new = []
    for i, pool in enumerate(pools):
      mha = sh.MultiHeadAttention(HQ, 8, num_kv_heads=HKV, name=f"layer_{i}",
                                  w_init=hk.initializers.VarianceScaling(1.0))
      x, pool = mha(x, kv_cache=pool, batch=batch)
      new.append(pool)
    return x, new

  f = hk.without_apply_rng(hk.transform(model))
  _, steps = harness.paged_module_steps()
  (x0, b0, _), (x1, b1, _) = steps
  empty = [sh.PagedKVCache.zeros(16, 4, HKV, 8) for _ in range(2)]
  params = f.init(jax.random.PRNGKey(0), x0, empty, b0)
  _, pools = f.apply(params, x0, empty, b0)
  assert [p.owner for p in pools] == ["layer_0", "layer_1"]
  for apply in (f.apply, jax.jit(f.apply)):
    with pytest.raises(ValueError, match=r"`kv_cache` belongs to layer 'layer_1'.*given to layer "
                       r"'layer_0'"):
      apply(params, x1, pools[::-1], b1)  # two layers' pools swapped
    with pytest.raises(ValueError, match=r"`kv_cache` belongs to layer 'layer_0'.*given to layer "
                       r"'layer_1'"):
      apply(params, x1, [pools[0], pools[0]], b1)  # one pool chained through both layers
  out, again = jax.jit(f.apply)(params, x1, pools, b1)  # each its own: served, owners kept
  assert [p.owner for p in again] == [p.owner for p in pools]
  assert np.isfinite(np.asarray(out)[:-1]).all()
  # A direct call names its owner when it wants the check; the pool records it.
  s = _step(3)
  _, pool = sh.paged_attention(s.q, s.k, s.v, s.cache, s.batch, owner="decoder/3")
  assert pool.owner == "decoder/3"
  with pytest.raises(ValueError, match=r"`cache` belongs to layer 'decoder/3'.*'decoder/4'"):
    sh.paged_attention(s.q, s.k, s.v, pool, s.batch, owner="decoder/4")
  with pytest.raises(ValueError, match=r"`cache` belongs to layer 'decoder/3'"):
    sh.explain_paged(s.q, s.k, s.v, pool, s.batch, owner="decoder/4")


def test_a_batch_captured_by_a_jitted_function_is_checked_as_a_concrete_one():
  """A RaggedBatch closed over by the jitted step (a constant, not an argument) is known now:
  it serves as an argument does, and its misuse is the eager ValueError."""
  step = _step(seed=21)
  out, cache = jax.jit(lambda q, k, v, c: sh.paged_attention(q, k, v, c, step.batch))(
      step.q, step.k, step.v, step.cache)
  np.testing.assert_allclose(np.asarray(out), _oracle(step), **harness.tol())
  _check_cache(step, cache)
  batch, _, words = _misuse("page_range", step)
  with pytest.raises(ValueError, match=r"lists a page outside \[0, 40\)"):
    jax.jit(lambda q, k, v, c: sh.paged_attention(q, k, v, c, batch))(
        step.q, step.k, step.v, step.cache)


def test_differentiating_a_paged_call_says_it_serves_inference():
  step = _step(seed=22)
  for argnum in (0, 1, 2):
    loss = lambda *a: jnp.nansum(sh.paged_attention(*a, step.cache, step.batch)[0])
    with pytest.raises(ValueError, match=r"paged_attention serves inference .* sh.attention"):
      jax.grad(loss, argnums=argnum)(step.q, step.k, step.v)
  sinks = np.zeros((HQ,), np.float32)
  with pytest.raises(ValueError, match=r"paged_attention serves inference"):
    jax.grad(lambda s: jnp.nansum(sh.paged_attention(
        step.q, step.k, step.v, step.cache, step.batch, softmax_aux=s)[0]))(sinks)


def test_quantized_new_tokens_into_a_float_pool_are_written_dequantized():
  """K/V take the pool's dtype: quantized new keys and values are dequantized as written (a
  quantized pool re-quantizes them per token), and attended as those values."""
  step = _step(seed=23)
  k8, v8 = (sh.quantize(np.nan_to_num(a), jnp.int8) for a in (step.k, step.v))
  deq = lambda a: np.asarray(a.values, np.float64) * np.asarray(a.scale, np.float64)
  live = sum(step.q_lens)
  history = lambda hs, new: [np.concatenate([h[:len(h) - ql], new[s0:s0 + ql]])
                             for h, ql, s0 in zip(hs, step.q_lens, np.cumsum([0] + step.q_lens))]
  want = dataclasses.replace(step, history_k=history(step.history_k, deq(k8)[:live]),
                             history_v=history(step.history_v, deq(v8)[:live]))
  out, cache = sh.paged_attention(step.q, k8, v8, step.cache, step.batch)
  assert cache.key.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), _oracle(want), **harness.tol())


def _shared_writes_oracle(table, kv, q_len, num_seqs, num_pages, page):
  """NumPy loops over DESIGN's rule: a sequence lists a page some sequence writes this step that
  is listed (below a length, inside the pool) more than once."""
  max_seqs, width = table.shape
  listed = [[s < num_seqs and e < min(-(-(kv[s] + q_len[s]) // page), width)
             for e in range(width)] for s in range(max_seqs)]
  ok = lambda s, e: listed[s][e] and 0 <= table[s, e] < num_pages
  written = {table[s, e] for s in range(max_seqs) for e in range(width)
             if ok(s, e) and q_len[s] > 0 and e >= kv[s] // page}
  count = lambda p: sum(ok(s, e) and table[s, e] == p for s in range(max_seqs)
                        for e in range(width))
  conflict = {p for p in written if count(p) > 1}
  return [any(ok(s, e) and table[s, e] in conflict for e in range(width))
          for s in range(max_seqs)]


@pytest.mark.parametrize("limit", [None, 0], ids=["compared", "scattered"])
def test_shared_writes_are_found_by_comparison_and_by_scatter_alike(monkeypatch, limit):
  """The shared-write rule against loops over its definition, on random tables with repeated,
  negative and out-of-pool pages: the one comparison (small steps) and the scatter (large)."""
  if limit is not None:
    monkeypatch.setattr(ragged, "COMPARE_LIMIT", limit)
  rng = np.random.default_rng(11)
  for _ in range(25):
    max_seqs, width, num_pages, page = 5, 6, 12, 4
    q_len = rng.integers(0, 6, max_seqs)
    kv = rng.integers(0, 12, max_seqs)
    table = rng.integers(-1, num_pages + 2, (max_seqs, width)).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)
    num_seqs = int(rng.integers(1, max_seqs + 1))
    batch = sh.RaggedBatch(jnp.asarray(cu), jnp.asarray(kv, jnp.int32), jnp.asarray(table),
                           jnp.asarray(num_seqs, jnp.int32))
    got = ragged.layout(batch, int(cu[-1]) + 2, num_pages, page).misuse.shared_write
    want = _shared_writes_oracle(table, kv, q_len, num_seqs, num_pages, page)
    assert list(np.asarray(got)) == want, (table, kv, q_len, num_seqs)
