"""splash_hk.flax: the NNX module and attention_fn against the float64 oracle, Flax and Haiku."""

import functools
import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import splash_hk as sh
from splash_hk import flax as shx
import harness
import oracle

W_INIT = hk.initializers.VarianceScaling(1.0)


def _module(num_heads=4, num_kv_heads=2, num_sinks=0, seed=0, **kw):
  m = shx.MultiHeadAttention(num_heads=num_heads, in_features=12, qkv_features=num_heads * 8,
                             out_features=10, num_kv_heads=num_kv_heads, num_sinks=num_sinks,
                             bias_init=nnx.initializers.normal(0.1), rngs=nnx.Rngs(seed), **kw)
  if num_sinks:
    m.sinks[...] = jnp.linspace(-1.0, 1.0, num_heads * num_sinks).reshape(num_heads, num_sinks)
  return m


def _params(m: shx.MultiHeadAttention) -> dict:
  """The module's parameters as a plain dict of arrays (query/key/value/out kernel and bias)."""
  p = {n: {"kernel": getattr(m, n).kernel[...], "bias": getattr(m, n).bias[...]}
       for n in ("query", "key", "value", "out")}
  if m.sinks is not None:
    p["sinks"] = m.sinks[...]
  return p


def _oracle_mha(p, x, *, xp=np, **rules):
  """float64 MHA from the Flax kernels ([in, H, D] projections, [H, D, out] output)."""
  f64 = lambda a: xp.asarray(a, xp.float64)
  proj = lambda n: xp.einsum("btf,fhd->bthd", f64(x), f64(p[n]["kernel"])) + f64(p[n]["bias"])
  o, _ = oracle.attention(proj("query"), proj("key"), proj("value"), xp=xp,
                          sinks=None if "sinks" not in p else f64(p["sinks"]), **rules)
  return xp.einsum("bthd,hdo->bto", o, f64(p["out"]["kernel"])) + f64(p["out"]["bias"])


CASES = {
    "causal": (dict(), dict()),
    "window_sinks": (dict(config=sh.AttentionConfig(sliding_window=(3, 0)), num_sinks=2),
                     dict(window=(3, 0))),
    "dense_mask": (dict(config=sh.AttentionConfig(causal=False)), dict(causal=False)),
    "prefix_object": (dict(), dict()),
    "alibi": (dict(num_kv_heads=4), dict()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_module_values_and_parameter_grads_against_oracle(case):
  kw, rules = CASES[case]
  m = _module(**kw)
  x = np.random.default_rng(1).normal(size=(2, 11, 12)).astype(np.float32)
  call, rules = {}, dict(rules)
  if case == "dense_mask":
    mask = np.random.default_rng(2).random((2, 1, 11, 11)) < 0.6
    call["mask"] = mask.astype(np.float32)  # Haiku's and Flax's meaning: nonzero = attend
    rules["mask"] = mask
  if case == "prefix_object":
    ids = np.where(np.arange(11) < np.array([[4], [7]]), 0, -1).astype(np.int32)  # [2, 11]
    call["mask"] = sh.masks.Causal() | sh.masks.Bidirectional(ids)
    rules.update(causal=False, mask=(np.tril(np.ones((11, 11), bool))
                                     | ((ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)))
                 [:, None])
  if case == "alibi":
    pos = jnp.arange(11)[None]  # [1, T]
    slopes, dense = harness.score_case("alibi", pos, pos, 4)
    call["bias"] = harness.score_object("alibi", slopes)
    with jax.enable_x64(True):
      rules["bias"] = np.asarray(dense(jnp.asarray(slopes, jnp.float64)))  # [1, H, T, S]
  _check_against_oracle(m, x, call, rules)


def test_module_at_a_real_size_with_the_default_tiles():
  # B = 2, T = 1536: three query blocks of the xla path's default 512 rows, six key blocks of
  # 256; 8 heads of 64 over 2 kv heads, a 384-token window (blocks skipped, blocks cut) and sinks.
  m = shx.MultiHeadAttention(num_heads=8, in_features=64, qkv_features=512, out_features=64,
                             num_kv_heads=2, num_sinks=1, rngs=nnx.Rngs(4),
                             config=sh.AttentionConfig(sliding_window=(384, 0)),
                             bias_init=nnx.initializers.normal(0.1))
  m.sinks[...] = jnp.linspace(-1.0, 1.0, 8).reshape(8, 1)
  x = np.random.default_rng(5).normal(size=(2, 1536, 64)).astype(np.float32)
  _check_against_oracle(m, x, {}, dict(window=(384, 0)))


def _check_against_oracle(m, x, call, rules):
  """The module's output and parameter gradients (of sum(y ** 2)) against the float64 oracle."""

  @nnx.jit
  def loss(m, x):
    y = m(x, **call)
    return jnp.sum(y ** 2), y

  (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(m, x)
  np.testing.assert_allclose(np.asarray(y), _oracle_mha(_params(m), x, **rules), **harness.tol())
  with jax.enable_x64(True):
    want = jax.grad(lambda p: jnp.sum(_oracle_mha(p, x, xp=jnp, **rules) ** 2))(
        jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), _params(m)))
  got = {n: {"kernel": grads[n]["kernel"][...], "bias": grads[n]["bias"][...]}
         for n in ("query", "key", "value", "out")}
  if m.sinks is not None:
    got["sinks"] = grads["sinks"][...]
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    harness.assert_near(np.asarray(g), np.asarray(w), "grad", err_msg=str(path))


def _haiku(num_heads=4, num_kv_heads=2, num_sinks=0, with_bias=True, name="attn"):
  return hk.transform(lambda x, **kw: sh.MultiHeadAttention(
      num_heads, 8, num_kv_heads=num_kv_heads, model_size=10, w_init=W_INIT,
      with_bias=with_bias, b_init=hk.initializers.RandomNormal(0.1), num_sinks=num_sinks,
      name=name)(x, **kw))


@pytest.mark.parametrize("num_sinks,use_bias,lead", [(0, True, (2,)), (2, False, (2, 3))])
def test_haiku_params_round_trip_with_the_same_numbers(num_sinks, use_bias, lead):
  x = np.random.default_rng(3).normal(size=(*lead, 9, 12)).astype(np.float32)
  f = _haiku(num_sinks=num_sinks, with_bias=use_bias)
  params = hk.data_structures.to_mutable_dict(f.init(jax.random.PRNGKey(0), x))
  if num_sinks:
    params["attn/~/splash_attention"]["sinks"] = jnp.full((4, num_sinks), 0.5)
  m = shx.from_haiku({"other/linear": {"w": 0}, **params},
                     _module(num_sinks=num_sinks, use_bias=use_bias, seed=9))
  np.testing.assert_allclose(np.asarray(m(x)), np.asarray(f.apply(params, None, x)),
                             **harness.tol())
  back = shx.to_haiku(m, name="attn")
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for g, w in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_from_haiku_says_what_does_not_fit():
  x = np.zeros((1, 4, 12), np.float32)
  params = _haiku(name="a").init(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match=r"`a/query/w` has shape \(12, 32\).*expects \(12, 2, 8\)"):
    shx.from_haiku(params, _module(num_heads=2, num_kv_heads=2))
  with pytest.raises(ValueError, match="one Haiku MultiHeadAttention.*found 2"):
    shx.from_haiku({**params, **_haiku(name="b").init(jax.random.PRNGKey(0), x)}, _module())
  with pytest.raises(ValueError, match="0 sinks and the Flax module 1"):
    shx.from_haiku(params, _module(num_sinks=1))
  with pytest.raises(ValueError, match="use_bias=False"):
    shx.from_haiku(params, _module(use_bias=False))


@pytest.mark.parametrize("word,default,value,needle", [
    ("decode", False, True, "decode=True.*kv_cache=mha.init_cache"),
    ("normalize_qk", False, True, "normalize_qk=True"),
    ("attention_fn", nnx.dot_product_attention, lambda *a, **k: None,
     "attention_fn=.*nnx.MultiHeadAttention itself"),
    ("qkv_dot_general", None, jax.lax.dot_general, "qkv_dot_general=.*custom matmuls"),
])
def test_flax_words_it_cannot_serve_are_refused_with_what_to_use(word, default, value, needle):
  _module(**{word: default})  # Flax's defaults (values that change nothing here) are accepted
  with pytest.raises(ValueError, match=needle):
    _module(**{word: value})


def test_flax_call_words_and_readable_layer_names():
  m, x = _module(), np.ones((1, 3, 12), np.float32)
  np.testing.assert_array_equal(m(x), m(x, deterministic=True, rngs=nnx.Rngs(1)))
  with pytest.raises(ValueError, match=r"`sow_weights=True`.*return_weights=True"):
    m(x, sow_weights=True)
  with pytest.raises(ValueError, match=r"`is_causal=True`.*AttentionConfig\(causal=...\)"):
    m(x, is_causal=True)
  first, second = _module(), _module(name="decoder/layer_1")
  assert re.fullmatch(r"multi_head_attention_\d+", first.name), first.name
  cache = first.init_cache(1, 8)
  _, cache = first(x, kv_cache=cache)
  with pytest.raises(ValueError, match=rf"belongs to layer '{first.name}'.*layer 'decoder/layer_1'"):
    second(x, kv_cache=cache)


def test_unknown_word_and_bad_sizes():
  with pytest.raises(TypeError, match="unexpected keyword `atention_fn`.*not a word of"):
    _module(atention_fn=shx.attention_fn)
  with pytest.raises(ValueError, match="num_kv_heads"):
    _module(num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match=r"^`qkv_features` \(30\) must be a multiple of `num_heads` "
                     r"\(4\).*qkv_features=28"):
    shx.MultiHeadAttention(num_heads=4, in_features=12, qkv_features=30, num_kv_heads=2,
                           rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="config"):
    _module(config={"causal": True})


def test_cache_prefill_with_lengths_then_decode_equals_full_forward():
  m = _module(num_sinks=1)
  x = np.random.default_rng(4).normal(size=(2, 7, 12)).astype(np.float32)
  full = np.asarray(m(x))
  step = nnx.jit(lambda m, x, c, n: m(x, kv_cache=c, lengths=n))
  # Row 0 prefills 4 tokens, row 1 only 2 (its other rows are padding), then both decode.
  out, cache = step(m, x[:, :4], m.init_cache(2, 16), jnp.array([4, 2]))
  np.testing.assert_allclose(np.asarray(out[0]), full[0, :4], **harness.tol())
  np.testing.assert_allclose(np.asarray(out[1, :2]), full[1, :2], **harness.tol())
  _, cache = step(m, x[1:, 2:4][[0, 0]], cache, jnp.array([0, 2]))  # row 1 catches up
  for t in range(4, 7):
    out, cache = step(m, x[:, t:t + 1], cache, jnp.array([1, 1]))
    np.testing.assert_allclose(np.asarray(out[:, 0]), full[:, t], **harness.tol())
  other = _module()
  with pytest.raises(ValueError, match="kv_cache"):
    other(x[:, :1], kv_cache=cache)


def test_an_int8_cache_decodes_as_the_oracle_attends_over_its_stored_keys():
  m = _module(num_sinks=1)
  x = np.random.default_rng(5).normal(size=(2, 7, 12)).astype(np.float32)
  step = nnx.jit(lambda m, x, c: m(x, kv_cache=c))
  out, cache = step(m, x[:, :4], m.init_cache(2, 16, dtype=jnp.int8))
  outs = [out]
  for t in range(4, 7):
    out, cache = step(m, x[:, t:t + 1], cache)
    outs.append(out)
  assert cache.key.values.dtype == jnp.int8 and cache.key.scale.shape == (2, 16, 2, 1)
  p = _params(m)
  stored = lambda q: (np.asarray(q.values, np.float64) * np.asarray(q.scale, np.float64))[:, :7]
  proj = lambda n: np.einsum("btf,fhd->bthd", x.astype(np.float64), np.asarray(
      p[n]["kernel"], np.float64)) + np.asarray(p[n]["bias"], np.float64)
  o, _ = oracle.attention(proj("query"), stored(cache.key), stored(cache.value),
                          sinks=np.asarray(p["sinks"], np.float64))
  want = np.einsum("bthd,hdo->bto", o, np.asarray(p["out"]["kernel"], np.float64)) + np.asarray(
      p["out"]["bias"], np.float64)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, axis=1)), want, **harness.tol())


def test_module_serves_paged_steps_as_the_oracle_attends():
  m = shx.MultiHeadAttention(num_heads=4, in_features=16, qkv_features=32, num_kv_heads=2,
                             num_sinks=1, bias_init=nnx.initializers.normal(0.1),
                             rngs=nnx.Rngs(3))
  m.sinks[...] = jnp.full((4, 1), 0.5)
  xs, steps = harness.paged_module_steps()
  cache = sh.PagedKVCache.zeros(16, 4, 2, 8)
  step = nnx.jit(lambda m, x, c, b: m(x, kv_cache=c, batch=b))
  for x, batch, rows in steps:
    out, cache = step(m, x, cache, batch)  # [N, 16]
    start = 0
    for name, t, k in rows:
      want = _oracle_mha(_params(m), xs[name][None, :t + k])[0, t:]
      np.testing.assert_allclose(np.asarray(out[start:start + k]), want, err_msg=name,
                                 **harness.tol())
      start += k


def _flax_mha(attention_fn, **kw):
  return nnx.MultiHeadAttention(num_heads=4, in_features=12, qkv_features=32, num_kv_heads=2,
                                decode=False, attention_fn=attention_fn, rngs=nnx.Rngs(0), **kw)


def test_attention_fn_equals_flax_default_on_random_masks_and_bias():
  ours, flax_own = _flax_mha(shx.attention_fn), _flax_mha(nnx.dot_product_attention)
  rng = np.random.default_rng(5)
  x = rng.normal(size=(2, 3, 10, 12)).astype(np.float32)  # two leading batch dims
  mask = rng.random((2, 3, 4, 10, 10)) < 0.3
  mask[..., 0, :] = False  # a row that sees nothing: 0 here, mean(v) in Flax
  for kw in (dict(), dict(is_causal=True), dict(mask=mask), dict(mask=mask, is_causal=True)):
    got, want = np.asarray(ours(x, **kw)), np.asarray(flax_own(x, **kw))
    vis = mask if "mask" in kw else np.ones_like(mask)
    vis = vis & np.tril(np.ones((10, 10), bool)) if "is_causal" in kw else vis
    seen, none = vis.any(-1).all(-2), ~vis.any(-1).any(-2)  # [2, 3, T]: every head / no head
    np.testing.assert_allclose(got[seen], want[seen], **harness.tol())
    # A row no head sees anything from is the out projection's bias: attention gave 0.
    np.testing.assert_allclose(got[none], np.broadcast_to(ours.out.bias[...], got[none].shape),
                               atol=1e-6)
    assert none.any() == ("mask" in kw)
  bias = rng.normal(size=(1, 3, 4, 10, 10)).astype(np.float32)  # broadcast over the first dim
  got = nnx.jit(lambda m, x: m.attention_fn(m.query(x), m.key(x), m.value(x), bias=bias))(ours, x)
  want = nnx.dot_product_attention(ours.query(x), ours.key(x)[..., [0, 0, 1, 1], :],
                                   ours.value(x)[..., [0, 0, 1, 1], :],
                                   bias=np.broadcast_to(bias, (2, 3, 4, 10, 10)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **harness.tol())


def test_attention_fn_in_flax_decode_equals_flax_default():
  x = np.random.default_rng(6).normal(size=(2, 9, 12)).astype(np.float32)
  outs = []
  for fn in (shx.attention_fn, nnx.dot_product_attention):
    m = _flax_mha(fn)
    m.init_cache(x.shape)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    outs.append(np.concatenate([np.asarray(step(m, x[:, t:t + 1])) for t in range(9)], axis=1))
  np.testing.assert_allclose(outs[0], outs[1], **harness.tol())
  np.testing.assert_allclose(outs[0], np.asarray(m(x, mask=nnx.make_causal_mask(x[..., 0]))),
                             **harness.tol())


def test_attention_fn_config_and_object_and_refusals():
  rng = np.random.default_rng(7)
  q, k, v = (rng.normal(size=(2, 8, 4, 8)).astype(np.float32) for _ in range(3))
  windowed = functools.partial(shx.attention_fn, config=sh.AttentionConfig(causal=False,
                                                                           sliding_window=2))
  want, _ = oracle.attention(q, k, v, causal=False, window=(2, 2))
  np.testing.assert_allclose(np.asarray(windowed(q, k, v)), want, **harness.tol())
  got = shx.attention_fn(q, k, v, mask=sh.masks.SlidingWindow(2), is_causal=True)
  want, _ = oracle.attention(q, k, v, causal=True, window=(2, 2))
  np.testing.assert_allclose(np.asarray(got), want, **harness.tol())
  # is_causal with T != S is top-left, as Flax's: query i sees keys 0..i.
  got = shx.attention_fn(q[:, :3], k, v, is_causal=True)
  want, _ = oracle.attention(q[:, :3], k, v, causal=True, q_pos=np.arange(3)[None],
                             kv_pos=np.arange(8)[None])
  np.testing.assert_allclose(np.asarray(got), want, **harness.tol())
  with pytest.raises(ValueError, match="deterministic=True"):
    shx.attention_fn(q, k, v, dropout_rate=0.1)
  shx.attention_fn(q, k, v, dropout_rate=0.1, deterministic=True)
  with pytest.raises(ValueError, match="sow_weights"):
    _flax_mha(shx.attention_fn)(rng.normal(size=(1, 4, 12)), sow_weights=True)


@pytest.mark.parametrize("mesh_name,axes", [
    ("2x4", sh.MeshAxes()),  # batch over dp, heads over tp
    ("dp2_sp4", sh.MeshAxes(heads=None, sequence="sp", sequence_strategy="ring")),
])
def test_module_under_nnx_jit_on_a_mesh(mesh_name, axes):
  mesh = harness.mesh(mesh_name, explicit=mesh_name == "2x4")
  x = np.random.default_rng(8).normal(size=(4, 16, 12)).astype(np.float32)
  plain = _module(num_heads=8, num_kv_heads=4, num_sinks=1)
  sharded = _module(num_heads=8, num_kv_heads=4, num_sinks=1, mesh=mesh, axes=axes)
  nnx.update(sharded, nnx.state(plain))
  got = nnx.jit(lambda m, x: m(x))(sharded, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(plain(x)), **harness.tol())
  np.testing.assert_allclose(np.asarray(got), _oracle_mha(_params(plain), x), **harness.tol())


VOCAB, WIDTH = 16, 32


class FlaxLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.attn = shx.MultiHeadAttention(num_heads=4, in_features=WIDTH, num_kv_heads=2, rngs=rngs)
    self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)  # [B, T, W]
    return self.head(h + self.attn(h))  # [B, T, V]


def _haiku_lm(tokens):
  h = hk.Embed(VOCAB, WIDTH, name="embed")(tokens)  # [B, T, W]
  h = h + sh.MultiHeadAttention(4, WIDTH // 4, num_kv_heads=2, w_init=W_INIT, name="attn")(h)
  return hk.Linear(VOCAB, name="head")(h)  # [B, T, V]


def test_flax_and_haiku_language_models_train_alike_for_20_steps():
  tokens = np.random.default_rng(9).integers(0, VOCAB, size=(4, 24)).astype(np.int32)
  xent = lambda logits: optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], tokens[:, 1:]).mean()
  flax_lm = FlaxLM(nnx.Rngs(0))
  hk_lm = hk.transform(_haiku_lm)
  params = {**shx.to_haiku(flax_lm.attn, "attn"),
            "embed": {"embeddings": flax_lm.embed.embedding[...]},
            "head": {"w": flax_lm.head.kernel[...], "b": flax_lm.head.bias[...]}}
  assert jax.tree.structure(params) == jax.tree.structure(
      hk.data_structures.to_mutable_dict(hk_lm.init(jax.random.PRNGKey(0), tokens)))
  opt = optax.adam(1e-2)
  flax_opt = nnx.Optimizer(flax_lm, opt, wrt=nnx.Param)

  @nnx.jit
  def flax_step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: xent(m(tokens)))(model)
    optimizer.update(model, grads)
    return loss

  @jax.jit
  def hk_step(params, state):
    loss, grads = jax.value_and_grad(lambda p: xent(hk_lm.apply(p, None, tokens)))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state, flax_losses, hk_losses = opt.init(params), [], []
  for _ in range(20):
    flax_losses.append(float(flax_step(flax_lm, flax_opt)))
    params, state, loss = hk_step(params, state)
    hk_losses.append(float(loss))
  assert flax_losses[-1] < 0.8 * flax_losses[0]  # it trains
  np.testing.assert_allclose(flax_losses, hk_losses, rtol=2e-5)


def test_a_draft_tree_with_a_cache_attends_as_the_oracle_at_positions_by_depth():
  m = _module(num_sinks=1)
  x = np.random.default_rng(6).normal(size=(2, 8, 12)).astype(np.float32)
  parents = np.array([[-1, 0, 0, 1, 2], [-1, -1, 1, 2, 0]])  # after 3 cached tokens
  _, cache = m(x[:, :3], kv_cache=m.init_cache(2, 16))
  slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
  alibi = sh.scores.Alibi(jnp.asarray(slopes))
  out, cache = nnx.jit(lambda m, x, c, t: m(x, kv_cache=c, mask=sh.masks.Tree(t), bias=alibi))(
      m, x[:, 3:], cache, parents)
  p = _params(m)
  proj = lambda n: np.einsum("btf,fhd->bthd", x.astype(np.float64), np.asarray(
      p[n]["kernel"], np.float64)) + np.asarray(p[n]["bias"], np.float64)
  want = []
  for b in range(2):
    depth = np.zeros(5, int)
    sees = np.eye(5, dtype=bool)
    for r in range(5):
      a = parents[b, r]
      depth[r] = 0 if a < 0 else depth[a] + 1
      sees[r] |= sees[a] if a >= 0 else False
    mask = np.concatenate([np.ones((5, 3), bool), sees], axis=1)[None, None]
    q_pos, kv_pos = 3 + depth, np.concatenate([np.arange(3), 3 + depth])
    bias = -slopes[None, :, None, None] * np.abs(q_pos[:, None] - kv_pos[None])
    o, _ = oracle.attention(proj("query")[b:b + 1, 3:], proj("key")[b:b + 1],
                            proj("value")[b:b + 1], q_pos=q_pos[None], kv_pos=kv_pos[None],
                            mask=mask, bias=bias, causal=False,
                            sinks=np.asarray(p["sinks"], np.float64))
    want.append(np.einsum("bthd,hdo->bto", o, np.asarray(p["out"]["kernel"], np.float64))[0]
                + np.asarray(p["out"]["bias"], np.float64))
  np.testing.assert_allclose(np.asarray(out), np.stack(want), **harness.tol())
  np.testing.assert_array_equal(cache.length, [8, 8])
