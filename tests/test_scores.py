"""Scores you can write (`bias=`): every score object against the float64 oracle, values and the
gradients of q, k, v and the bias's leaves; invisible means absent; determinism; the memory
of position objects; bad biases named.

The oracle gets each bias as a dense float64 array from its own formula, written here and in
`oracle.t5_bucket` from DESIGN.md (ALiBi, T5's buckets after T5's reference code), not from the
library.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
import harness
import oracle

S = sh.scores
TILES = sh.BlockSizes(16, 8, 8, 16)  # T = 72: partial blocks at both ends


def _inputs(seed, batch=2, length=72, hq=4, hkv=2, head_dim=16, value_dim=24):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(batch, length, hq, head_dim)).astype(np.float32)
  k = rng.normal(size=(batch, length, hkv, head_dim)).astype(np.float32)
  v = rng.normal(size=(batch, length, hkv, value_dim)).astype(np.float32)
  seg = np.repeat(np.arange(2), [length // 2 + 3, length - length // 2 - 3])[None].repeat(batch, 0)
  seg[:, -5:] = -1
  sinks = rng.normal(size=(hq, 2)).astype(np.float32)
  cot = rng.normal(size=(batch, length, hq, value_dim))
  return q, k, v, seg.astype(np.int32), sinks, cot


@pytest.mark.parametrize("kind,platform", [
    ("alibi", "xla"), ("t5_bi", "xla"), ("t5_uni", "xla"), ("fn", "xla"),
    ("alibi", "reference"), ("t5_bi", "reference"), ("fn", "reference")])
def test_each_score_object_matches_the_oracle(kind, platform):
  q, k, v, seg, sinks, cot = _inputs(1)
  pos = np.arange(q.shape[1])[None].repeat(q.shape[0], 0)
  params, dense = harness.score_case(kind, pos, pos, q.shape[2])
  config = sh.AttentionConfig(platform=platform, allow_fallback=False, block_sizes=TILES,
                              sliding_window=(30, 0), logits_soft_cap=6.0)

  def f(q, k, v, s, p):
    return sh.attention(q, k, v, config=config, q_segment_ids=seg, softmax_aux=s,
                        bias=harness.score_object(kind, p)).attention_outputs

  got = harness.values_and_grads(f, (q, k, v, sinks, params), cot)
  want = oracle.out_and_vjp(q, k, v, cot, sinks=sinks, bias=dense, bias_params=params,
                            window=(30, 0), soft_cap=6.0, q_seg=seg)
  out, grads = got
  want_out, want_grads = want[0], list(want[1])
  harness.assert_close((out, grads[:4]), (want_out, want_grads[:4]))
  for g, w in zip(jax.tree.leaves(grads[4]), jax.tree.leaves(want_grads[4])):
    harness.assert_near(np.asarray(g), w, "grad", err_msg=kind)


@pytest.mark.parametrize("platform", ["xla", "reference"])
@pytest.mark.parametrize("shape", ["heads", "batch"])
def test_dense_plus_alibi_reads_only_visible_pairs(shape, platform):
  """A dense bias (broadcast over batch or heads) plus ALiBi: NaN where no query may look (the
  causal future, padding) changes nothing and gets gradient 0; a visible -inf removes its
  pair, and a row left with none outputs 0 (soft cap or not)."""
  q, k, v, seg, sinks, cot = _inputs(2)
  batch, length, hq = q.shape[:3]
  rng = np.random.default_rng(3)
  dense = rng.normal(size=(1, hq, length, length) if shape == "heads" else
                     (batch, 1, length, length)).astype(np.float32)
  seen = oracle.visible(batch, length, length, hq, q_seg=seg)  # [B, Hq, T, S]
  seen_here = seen.any(axis=0, keepdims=True) if shape == "heads" else seen[:, :1]
  dense[0, 0, 10, :] = -np.inf  # row 10 (segment 0) sees nothing but removed pairs
  dense[0, 0, 20, 3] = -np.inf  # one pair removed
  dirty = np.where(np.broadcast_to(seen_here, dense.shape) if shape == "heads"
                   else seen_here.any(axis=1, keepdims=True), dense, np.nan).astype(np.float32)
  slopes = np.asarray(S.alibi_slopes(hq))
  pos = np.arange(length)[None].repeat(batch, 0)
  _, alibi = harness.score_case("alibi", pos, pos, hq)
  config = sh.AttentionConfig(platform=platform, allow_fallback=False, block_sizes=TILES,
                              logits_soft_cap=6.0)

  def f(q, k, v, d, s):
    return sh.attention(q, k, v, config=config, q_segment_ids=seg,
                        bias=S.Dense(d) + S.Alibi(s)).attention_outputs

  out, grads = harness.values_and_grads(f, (q, k, v, dirty, slopes), cot)
  want_out, want_grads = oracle.out_and_vjp(
      q, k, v, cot, bias=lambda p: p[0] + alibi(p[1]), bias_params=(dense, slopes * 1.0),
      soft_cap=6.0, q_seg=seg)
  assert np.all(np.isfinite(out)) and np.all(out[0, 10, 0] == 0)
  harness.assert_close((out, grads[:3]), (want_out, want_grads[:3]))
  d_dense, d_slopes = grads[3], grads[4]
  w_dense, w_slopes = want_grads[3]
  invisible = ~np.isfinite(dirty)
  assert np.all(d_dense[invisible] == 0), "an invisible bias gets no gradient"
  harness.assert_near(d_dense, np.where(invisible, 0, w_dense), "grad")
  harness.assert_near(d_slopes, w_slopes, "grad")


def test_gradients_are_the_same_bits_every_run():
  q, k, v, seg, sinks, cot = _inputs(4)
  table = np.random.default_rng(6).normal(size=(32, 4)).astype(np.float32)
  dense = np.random.default_rng(7).normal(size=(2, 4, 72, 72)).astype(np.float32)
  config = sh.AttentionConfig(block_sizes=TILES)
  f = lambda q, k, v, t, d: sh.attention(q, k, v, config=config, q_segment_ids=seg,
                                         bias=S.RelativePosition(t) + S.Dense(d)).attention_outputs
  first = harness.values_and_grads(f, (q, k, v, table, dense), cot)
  for _ in range(2):
    again = harness.values_and_grads(f, (q, k, v, table, dense), cot)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bias,needle", [
    (np.zeros((2, 4, 72)), r"`bias` must be a float array \[batch or 1, num_heads or 1, "
     r"query_len or 1, kv_len or 1\] = \[2 or 1, 4 or 1, 72 or 1, 72 or 1\] \(axes of size 1 "
     r"broadcast\), got float64\[2, 4, 72\]"),
    (np.zeros((2, 4, 3, 72), np.float32), r"`bias` must be .* got float32\[2, 4, 3, 72\]"),
    (np.zeros((2, 3, 72, 72), np.float32), r"`bias` must be .* got float32\[2, 3, 72, 72\]"),
    (np.zeros((2, 4, 72, 72), np.int32), r"`bias` must be a float array"),
    (S.Alibi(np.zeros(3, np.float32)), r"`Alibi.slopes` must be a float array \[num_heads\] = \[4\]"),
    (S.RelativePosition(np.zeros((2, 4), np.float32)), r"`RelativePosition.table` .*num_buckets >= 4"),
    (S.ScoreFn(lambda p, q, k, h: q - k), r"`bias`: ScoreFn\(<lambda>\) must return floats"),
], ids=["rank", "query_len", "heads", "dtype", "slopes", "table", "fn_ints"])
def test_a_bad_bias_is_named_with_the_shape_it_expects(bias, needle):
  q, k, v, *_ = _inputs(0)
  with pytest.raises(ValueError, match=needle):
    sh.attention(q, k, v, bias=bias)
  with pytest.raises(ValueError, match=needle):
    sh.explain(q, k, v, bias=bias)
  with pytest.raises(ValueError, match="adds score objects"):
    S.Alibi(np.zeros(4, np.float32)) + np.zeros(3)


def test_kernels_without_a_bias_fall_back_naming_it():
  spec = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32)
  alibi = S.Alibi(jax.ShapeDtypeStruct((2,), jnp.float32))
  splash = sh.explain(spec, spec, spec, bias=alibi,
                      config=sh.AttentionConfig(platform="splash", interpret=True))
  assert splash.backend == "xla" and splash.fallback
  assert "`bias` was given, and JAX's splash kernel takes no bias" in splash.reason
  triton = sh.fallback.select_backend(sh.AttentionConfig(platform="triton"), query_shape=(1, 256, 2, 64),
                                      key_shape=(1, 256, 2, 64), hardware="gpu")
  assert triton.backend in ("triton", "xla")  # without a bias: its own limits only
  with pytest.raises(ValueError, match="`bias` was given"):
    sh.explain(spec, spec, spec, bias=alibi,
               config=sh.AttentionConfig(platform="splash", interpret=True, allow_fallback=False))


def test_alibi_slopes_are_the_papers():
  np.testing.assert_allclose(S.alibi_slopes(8), [2.0 ** (-(h + 1)) for h in range(8)], rtol=1e-6)
  # 6 heads: the 4 of a power of two, then every other slope of 8 (ALiBi's reference code).
  four = [2.0 ** (-2 * (h + 1)) for h in range(4)]
  eight = [2.0 ** (-(h + 1)) for h in range(8)]
  np.testing.assert_allclose(S.alibi_slopes(6), four + eight[0::2][:2], rtol=1e-6)


@pytest.mark.parametrize("strategy,mesh_name,kinds,balanced", [
    ("all_gather", "2x4", ("alibi", "dense"), False),
    ("ring", "dp2_sp2_tp2", ("t5_bi", "fn"), False),
    ("ring", "sp4", ("alibi", "t5_uni"), True),
    ("ulysses", "dp2_sp2_tp2", ("alibi", "dense"), False),
], ids=["tp", "ring", "ring_load_balanced", "ulysses"])
def test_sharded_bias_matches_the_oracle(strategy, mesh_name, kinds, balanced):
  """Under a mesh: dense biases sharded like dense masks, per-head arrays with their heads,
  ScoreFn params whole; the ring with position objects (a dense bias keeps all_gather, saying
  why), Ulysses; values and every gradient against the oracle."""
  q, k, v, seg, sinks, cot = _inputs(8, length=32, hq=8, hkv=2)
  batch, length, hq = q.shape[:3]
  pos = np.arange(length)[None].repeat(batch, 0)
  rng = np.random.default_rng(9)
  terms, oracles, params = [], [], []
  for kind in kinds:
    if kind == "dense":
      p, fn = rng.normal(size=(batch, hq, length, length)).astype(np.float32), (lambda d: d)
      terms.append(S.Dense)
    else:
      p, fn = harness.score_case(kind, pos, pos, hq)
      terms.append(lambda p, kind=kind: harness.score_object(kind, p))
    params.append(p)
    oracles.append(fn)
  axes = sh.MeshAxes(batch="dp", heads="tp", sequence="sp" if "sp" in mesh_name else None,
                     sequence_strategy=strategy, load_balanced=balanced)
  mesh = harness.mesh(mesh_name, explicit=True)
  n = harness.axis_size(mesh_name, "sp")
  order = (lambda a: sh.sharding.load_balance(a, n)) if balanced else (lambda a: a)
  restore = (lambda a: sh.sharding.restore_order(a, n)) if balanced else (lambda a: a)
  config = sh.AttentionConfig(sliding_window=(20, 0), logits_soft_cap=6.0)
  bias = lambda ps: terms[0](ps[0]) + terms[1](ps[1])
  decision = sh.explain(order(q), order(k), order(v), config=config, mesh=mesh, axes=axes,
                        q_segment_ids=order(seg), bias=bias(params))
  assert not decision.fallback and decision.ring == (strategy == "ring"), decision

  def f(q, k, v, s, ps):
    return restore(sh.attention(order(q), order(k), order(v), config=config, mesh=mesh,
                                axes=axes, q_segment_ids=order(seg), softmax_aux=s,
                                bias=bias(ps)).attention_outputs)

  out, grads = harness.values_and_grads(f, (q, k, v, sinks, tuple(params)), cot)
  want_out, want_grads = oracle.out_and_vjp(
      q, k, v, cot, sinks=sinks, bias=lambda ps: oracles[0](ps[0]) + oracles[1](ps[1]),
      bias_params=tuple(params), window=(20, 0), soft_cap=6.0, q_seg=seg)
  harness.assert_close((out, grads[:4]), (want_out, want_grads[:4]), grad="sharded_grad")
  for g, w in zip(jax.tree.leaves(grads[4]), jax.tree.leaves(want_grads[4])):
    harness.assert_near(np.asarray(g), w, "sharded_grad")
  if strategy == "ring":  # a dense bias cannot travel: all_gather, and the reason says so
    dense = sh.explain(q, k, v, config=config, mesh=mesh, axes=axes,
                       bias=S.Dense(np.zeros((batch, hq, length, length), np.float32)))
    assert dense.fallback and not dense.ring and "dense `bias`" in dense.reason


def test_decode_with_alibi_through_the_kv_cache():
  """ALiBi over a cache's slot positions, and a dense bias over the cache's slots: a prefill of
  two rows of different lengths, then decode steps, against the oracle over the whole history."""
  import haiku as hk  # pylint: disable=g-import-not-at-top
  heads, kv_heads, size, model, max_len = 4, 2, 8, 16, 12
  slopes = np.asarray(S.alibi_slopes(heads))
  extra = np.random.default_rng(2).normal(size=(1, heads, 1, max_len)).astype(np.float32)

  def layer(x, cache, lengths=None, dense=None):
    mha = sh.MultiHeadAttention(heads, size, num_kv_heads=kv_heads, model_size=model,
                                w_init=hk.initializers.VarianceScaling(1.0))
    bias = S.Alibi(slopes) if dense is None else S.Alibi(slopes) + S.Dense(dense)
    return mha(x, kv_cache=cache, lengths=lengths, bias=bias)

  model_fn = hk.without_apply_rng(hk.transform(layer))
  x = np.random.default_rng(1).normal(size=(2, 10, model)).astype(np.float32)
  cache = sh.KVCache.zeros(2, max_len, kv_heads, size)
  params = model_fn.init(jax.random.PRNGKey(0), x[:, :6], cache)
  step = jax.jit(model_fn.apply)
  lengths = np.array([6, 3])
  out, cache = step(params, x[:, :6], cache, lengths)
  outs = [out]
  for t in range(2):  # decode: row 0 at positions 6, 7; row 1 at 3, 4
    new = np.stack([x[0, 6 + t], x[1, 3 + t]])[:, None]
    d = np.broadcast_to(extra[:, :, :1], (1, heads, 1, max_len))
    out, cache = step(params, new, cache, None, d)
    outs.append(out)
  for row, n in ((0, 8), (1, 5)):
    tokens = np.concatenate([x[row, :lengths[row]], x[row, lengths[row]:n]])[None]
    pos = np.arange(n)
    dense = -slopes[None, :, None, None] * np.abs(pos[:, None] - pos[None, :])
    dense[:, :, lengths[row]:, :] += extra[:, :, :, :n]  # the decode steps' dense term
    want = oracle.mha(params, tokens, num_heads=heads, num_kv_heads=kv_heads, key_size=size,
                      value_size=size, bias=dense)[0]
    got = np.concatenate([outs[0][row, :lengths[row]], outs[1][row], outs[2][row]])
    np.testing.assert_allclose(got, want, **harness.tol())


@pytest.mark.parametrize("kind", ["alibi", "t5_bi"])
def test_position_objects_hold_no_t_by_s_buffer(kind):
  """The compiled forward+backward at T = 16384 (causal, f32): no array of the program (its HLO)
  has T * S elements, and its memory (XLA's analysis: arguments + temporaries) is far below
  one such f32 buffer; the gradient of the object's leaf comes out of the same program."""
  length, heads = 16384, 8
  spec = jax.ShapeDtypeStruct((1, length, heads, 64), jnp.float32)
  params = (jax.ShapeDtypeStruct((heads,), jnp.float32) if kind == "alibi"
            else jax.ShapeDtypeStruct((32, heads), jnp.float32))

  def loss(q, k, v, p):
    return jnp.sum(sh.attention(q, k, v, bias=harness.score_object(kind, p)).attention_outputs)

  program = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  compiled = program.lower(spec, spec, spec, params).compile()
  sizes = [math.prod(int(n) for n in dims.split(",") if n)
           for _, dims in sh.sharding.traffic._ARRAY.findall(compiled.as_text())]  # pylint: disable=protected-access
  assert max(sizes) < length * length // 16, max(sizes)  # the largest: q, k, v and their grads
  memory = sh.sharding.traffic.measure(program, spec, spec, spec, params).memory_bytes
  assert memory < length * length * 4 // 4, memory


def test_a_bias_with_a_mask_object_and_a_cache_free_prefill():
  """ALiBi + T5 buckets under a prefix-LM mask object (Causal() | Bidirectional(ids)) with
  explicit (restarting) positions on xla: the object's rule and the bias read the same positions."""
  q, k, v, seg, sinks, cot = _inputs(12, length=40)
  batch, length, hq = q.shape[:3]
  ids = np.where(np.arange(length) < 13, 0, -1)[None].repeat(batch, 0).astype(np.int32)
  pos = np.where(np.arange(length) < 23, np.arange(length), np.arange(length) - 23)
  pos = pos[None].repeat(batch, 0).astype(np.int32)
  slopes, alibi = harness.score_case("alibi", pos, pos, hq)
  table, t5 = harness.score_case("t5_bi", pos, pos, hq)
  rule = (pos[:, None, None, :] <= pos[:, None, :, None]) | (
      (ids[:, None, :, None] == ids[:, None, None, :]) & (ids[:, None, :, None] >= 0))
  config = sh.AttentionConfig(block_sizes=TILES, allow_fallback=False, platform="xla")
  mask = sh.masks.Causal() | sh.masks.Bidirectional(ids)
  f = lambda q, k, v, p: sh.attention(
      q, k, v, config=config, mask=mask, q_positions=pos, q_segment_ids=seg,
      bias=S.Alibi(p[0]) + harness.score_object("t5_bi", p[1])).attention_outputs
  out, grads = harness.values_and_grads(f, (q, k, v, (slopes, table)), cot)
  want_out, want_grads = oracle.out_and_vjp(
      q, k, v, cot, bias=lambda p: alibi(p[0]) + t5(p[1]), bias_params=(slopes, table),
      causal=False, mask=rule, q_pos=pos, kv_pos=pos, q_seg=seg)
  harness.assert_close((out, grads[:3]), (want_out, want_grads[:3]))
  for g, w in zip(grads[3], want_grads[3]):
    harness.assert_near(g, w, "grad")


@pytest.mark.parametrize("num_buckets,max_distance,bidirectional", [
    (32, 128, True), (32, 128, False), (32, 20, True), (8, 5, False), (64, 17, True)])
def test_t5_buckets_are_t5s_own(num_buckets, max_distance, bidirectional):
  relative = np.arange(-300, 301, dtype=np.int32)[:, None] + np.zeros((1, 3), np.int32)
  want = oracle.t5_bucket(relative, num_buckets, max_distance, bidirectional, np)
  got = S.t5_buckets(relative, num_buckets, max_distance, bidirectional)
  assert got.dtype == jnp.int32 and got.shape == relative.shape
  np.testing.assert_array_equal(np.asarray(got), want)
  far = np.asarray(S.t5_buckets(np.arange(0, -400, -1), num_buckets, max_distance, bidirectional))
  assert (np.diff(far) >= 0).all() and far.max() < (num_buckets // (2 if bidirectional else 1))


@pytest.mark.parametrize("num_buckets,max_distance,bidirectional,least", [
    (32, 16, False, 17), (32, 4, False, 17), (32, 8, True, 9), (4, 1, True, 2)])
def test_a_max_distance_t5_cannot_serve_is_named_with_the_least_that_works(
    num_buckets, max_distance, bidirectional, least):
  """T5's log buckets divide by log(max_distance / exact): at or below the exact buckets the
  formula is undefined (numpy's 'divide by zero') or non-monotone; refused, no warning leaks."""
  q, k, v, *_ = _inputs(0, hq=4)
  table = np.zeros((num_buckets, 4), np.float32)
  needle = rf"`RelativePosition.max_distance` must exceed .* pass max_distance >= {least}"
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no numpy warning from inside the library
    with pytest.raises(ValueError, match=needle):
      S.RelativePosition(table, max_distance=max_distance, bidirectional=bidirectional)
    with pytest.raises(ValueError, match=rf"^`max_distance` must exceed.*>= {least}"):
      S.t5_buckets(np.arange(-9, 9), num_buckets, max_distance, bidirectional)
    ok = S.RelativePosition(table, max_distance=least, bidirectional=bidirectional)
    np.asarray(sh.attention(q, k, v, bias=ok).attention_outputs)


BROADCAST = {  # a dense bias with axes of size 1, as jax.nn.dot_product_attention takes it
    "query_len_1": (2, 4, 1, 72), "kv_len_1": (2, 4, 72, 1), "scalar_like": (1, 1, 1, 1),
    "rows_only": (2, 1, 72, 1)}


@pytest.mark.parametrize("platform", ["xla", "reference"])
@pytest.mark.parametrize("shape", list(BROADCAST))
def test_a_dense_bias_broadcasts_over_every_axis_of_size_1(shape, platform):
  q, k, v, seg, sinks, cot = _inputs(11)
  bias = np.random.default_rng(12).normal(size=BROADCAST[shape]).astype(np.float32)
  config = sh.AttentionConfig(platform=platform, allow_fallback=False, block_sizes=TILES,
                              logits_soft_cap=6.0)
  f = lambda q, k, v, b: sh.attention(q, k, v, config=config, q_segment_ids=seg,
                                      bias=b).attention_outputs
  out, grads = harness.values_and_grads(f, (q, k, v, bias), cot)
  full = lambda b: jnp.broadcast_to(b, (2, 4, 72, 72))
  want_out, want_grads = oracle.out_and_vjp(q, k, v, cot, bias=full, bias_params=bias,
                                            soft_cap=6.0, q_seg=seg)
  harness.assert_close((out, grads[:3]), (want_out, want_grads[:3]))
  assert grads[3].shape == bias.shape  # summed over the broadcast axes
  harness.assert_near(grads[3], want_grads[3], "grad")


def test_a_broadcast_bias_through_a_mesh_the_cache_and_flax_attention_fn():
  """The same broadcasting on the other paths: sharded over a 2x4 mesh, over a KV cache's
  slots (decode: [B, H, 1, max_len] and [1, H, T, 1]), and Flax's attention_fn (a [T, S] bias,
  as Flax broadcasts it)."""
  from splash_hk import flax as shx  # pylint: disable=g-import-not-at-top
  from splash_hk import layer  # pylint: disable=g-import-not-at-top
  q, k, v, seg, _, cot = _inputs(13, length=32, hq=8, hkv=2)
  rng = np.random.default_rng(14)
  bias = rng.normal(size=(2, 8, 1, 32)).astype(np.float32)
  mesh = harness.mesh("2x4", explicit=True)
  f = lambda q, k, v, b: sh.attention(q, k, v, mesh=mesh, axes=sh.MeshAxes(batch="dp",
                                      heads="tp"), q_segment_ids=seg, bias=b).attention_outputs
  out, grads = harness.values_and_grads(f, (q, k, v, bias), cot)
  want_out, want_grads = oracle.out_and_vjp(
      q, k, v, cot, bias=lambda b: jnp.broadcast_to(b, (2, 8, 32, 32)), bias_params=bias,
      q_seg=seg)
  harness.assert_close((out, grads[:3]), (want_out, want_grads[:3]), grad="sharded_grad")
  harness.assert_near(grads[3], want_grads[3], "sharded_grad")

  cache = sh.KVCache(jnp.asarray(k), jnp.asarray(v), jnp.asarray([20, 32], jnp.int32))
  for bias_shape, query_len in (((2, 8, 1, 32), 1), ((1, 8, 3, 1), 3)):
    b = rng.normal(size=bias_shape).astype(np.float32)
    start = np.array([20, 29])
    cache = cache.replace(length=jnp.asarray(start, jnp.int32))
    new_q = q[:, :query_len]
    new_k, new_v = k[:, 32 - query_len:], v[:, 32 - query_len:]
    out, _ = jax.jit(lambda c, b: layer.attend(
        jnp.asarray(new_q), jnp.asarray(new_k), jnp.asarray(new_v),
        layer.Call(kv_cache=c, bias=b), layer.Settings(sh.AttentionConfig(), None,
                                                             sh.MeshAxes(), "l")))(cache, b)
    for row in range(2):
      keys = np.concatenate([k[row, :start[row]], new_k[row]])[None]
      values = np.concatenate([v[row, :start[row]], new_v[row]])[None]
      n = keys.shape[1]
      dense = np.broadcast_to(b[row if b.shape[0] > 1 else 0], (8, query_len, 32))[None, :, :, :n]
      want, _ = oracle.attention(new_q[row:row + 1], keys, values, bias=dense)
      np.testing.assert_allclose(np.asarray(out[row]), want[0], **harness.tol())

  pair = rng.normal(size=(32, 32)).astype(np.float32)
  out = shx.attention_fn(q, k, v, bias=pair, is_causal=True)
  want, _ = oracle.attention(q, k, v, bias=np.broadcast_to(pair, (2, 8, 32, 32)))
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())
