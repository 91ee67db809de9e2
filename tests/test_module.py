"""Haiku modules and chex variants (jit, no jit, pmap) against the float64 oracle."""


import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import splash_hk as sh
from splash_hk.fallback import selector
import harness
import oracle
from cases import CASES_BY_NAME

W_INIT = hk.initializers.VarianceScaling(1.0)


class AttentionVariantsTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  @parameterized.parameters("everything", "decode_window_sinks", "sinks_kv_n_gqa", "prefill")
  def test_attention_forward_and_grad(self, name):
    case = CASES_BY_NAME[name]
    q, k, v, extras = case.arrays(seed=5)
    sinks = extras.pop("softmax_aux", None)
    cot = np.random.default_rng(6).normal(
        size=(case.batch, case.query_len, case.num_heads, case.value_dim or case.head_dim))

    def loss(q, k, v, sinks):
      out = sh.attention(q, k, v, config=case.config, softmax_aux=sinks, **extras)
      return jnp.sum(out.attention_outputs * cot.astype(np.float32)), out.attention_outputs

    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    fn = self.variant(jax.grad(loss, argnums=argnums, has_aux=True))
    grads, out = fn(q, k, v, sinks)
    with_sinks = dict(extras, softmax_aux=sinks) if sinks is not None else extras
    np.testing.assert_allclose(np.asarray(out), case.oracle(q, k, v, with_sinks)[0], **harness.tol())
    with jax.enable_x64(True):
      f64 = lambda a: None if a is None else jnp.asarray(a, jnp.float64)
      want = jax.jit(jax.grad(lambda *a: jnp.sum(case.oracle(
          *a[:3], dict(extras, softmax_aux=a[3]) if sinks is not None else extras,
          xp=jnp)[0] * cot), argnums=argnums))(f64(q), f64(k), f64(v), f64(sinks))
    for g, w in zip(grads, want):
      harness.assert_near(np.asarray(g), np.asarray(w), "grad")

  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  @parameterized.parameters((4, 4, 0), (4, 1, 2))  # MHA; MQA with sinks (GQA: test_flax)
  def test_transformed_mha_forward_and_grad(self, num_heads, num_kv_heads, num_sinks):
    key_size, value_size = 8, 6
    config = sh.AttentionConfig(sliding_window=(5, 0))
    f = hk.transform(lambda x: sh.MultiHeadAttention(
        num_heads, key_size, num_kv_heads=num_kv_heads, value_size=value_size, model_size=12,
        w_init=W_INIT, b_init=hk.initializers.RandomNormal(0.1), config=config,
        num_sinks=num_sinks)(x))
    x = np.random.default_rng(7).normal(size=(2, 10, 12)).astype(np.float32)
    params = jax.jit(f.init)(jax.random.PRNGKey(0), x)
    if num_sinks:
      sink_name = "multi_head_attention/~/splash_attention"
      params = hk.data_structures.to_mutable_dict(params)
      params[sink_name]["sinks"] = jnp.linspace(-1, 1, num_heads * num_sinks).reshape(num_heads, -1)
    out = self.variant(lambda p, x: f.apply(p, None, x))(params, x)
    sinks = params[sink_name]["sinks"] if num_sinks else None
    want = oracle.mha(params, x, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       key_size=key_size, value_size=value_size, window=(5, 0), sinks=sinks)
    np.testing.assert_allclose(np.asarray(out), want, **harness.tol())
    grads = self.variant(jax.grad(lambda p, x: jnp.sum(f.apply(p, None, x) ** 2)))(params, x)
    with jax.enable_x64(True):
      p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), hk.data_structures.to_mutable_dict(params))

      def oracle_loss(p):
        lin = lambda x, m: x @ p[f"multi_head_attention/{m}"]["w"] + p[f"multi_head_attention/{m}"]["b"]
        b, t, _ = x.shape
        q = lin(x, "query").reshape(b, t, num_heads, key_size)
        k = lin(x, "key").reshape(b, t, num_kv_heads, key_size)
        v = lin(x, "value").reshape(b, t, num_kv_heads, value_size)
        s = p[sink_name]["sinks"] if num_sinks else None
        o, _ = oracle.attention(q, k, v, window=(5, 0), sinks=s, xp=jnp)
        return jnp.sum(lin(o.reshape(b, t, -1), "linear") ** 2)

      want_grads = jax.jit(jax.grad(oracle_loss))(p64)  # one program, not one per operation
    for g, w in zip(jax.tree.leaves(hk.data_structures.to_mutable_dict(grads)), jax.tree.leaves(want_grads)):
      harness.assert_near(np.asarray(g), np.asarray(w), "grad")


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("lead", [(2,), (2, 3)])
def test_loads_haiku_mha_params(with_mask, lead):
  num_heads, key_size, t = 4, 8, 7
  x = np.random.default_rng(8).normal(size=(*lead, t, 16)).astype(np.float32)
  mask = None
  if with_mask:  # Haiku's example style: a float 0/1 mask [..., 1, T, T], causal
    mask = np.tril(np.ones((t, t), np.float32)).reshape(1, t, t)
    mask = np.broadcast_to(mask, (*lead, 1, t, t))
  theirs = hk.transform(lambda x, m: hk.MultiHeadAttention(num_heads, key_size, w_init=W_INIT)(x, x, x, m))
  ours = hk.transform(lambda x, m: sh.MultiHeadAttention(
      num_heads, key_size, w_init=W_INIT, config=sh.AttentionConfig(causal=False))(x, mask=m))
  params = theirs.init(jax.random.PRNGKey(1), x, mask)
  assert jax.tree.map(jnp.shape, ours.init(jax.random.PRNGKey(1), x, mask)) == \
      jax.tree.map(jnp.shape, params)
  np.testing.assert_allclose(np.asarray(ours.apply(params, None, x, mask)),
                             np.asarray(theirs.apply(params, None, x, mask)), **harness.tol())


def _toy_model(vocab, num_layers, num_heads, num_kv_heads, key_size, window):
  config = sh.AttentionConfig(causal=True, sliding_window=window)

  def layers():
    return [sh.MultiHeadAttention(num_heads, key_size, num_kv_heads=num_kv_heads, w_init=W_INIT,
                                  config=config, name=f"attn_{i}") for i in range(num_layers)]

  def forward(tokens, caches=None, lengths=None):
    h = hk.Embed(vocab, num_heads * key_size)(tokens)  # [B, T, D]
    new_caches = []
    for i, attn in enumerate(layers()):
      if caches is None:
        a = attn(h)
      else:
        a, c = attn(h, kv_cache=caches[i], lengths=lengths)
        new_caches.append(c)
      h = h + a
      h = h + hk.nets.MLP([32, num_heads * key_size], name=f"mlp_{i}")(jax.nn.gelu(h))
    logits = hk.Linear(vocab, name="unembed")(h)  # [B, T, vocab]
    return logits if caches is None else (logits, new_caches)

  def init_caches(batch, max_len):
    return [attn.init_cache(batch, max_len) for attn in layers()]

  return hk.without_apply_rng(hk.transform(forward)), hk.without_apply_rng(hk.transform(init_caches))


def _toy_oracle(params, tokens, num_layers, num_heads, num_kv_heads, key_size, window):
  """float64 NumPy forward of `_toy_model` over whole sequences (no cache): tokens [B, T]."""
  w = lambda m, n: np.asarray(params[m][n], np.float64)
  lin = lambda x, m: x @ w(m, "w") + w(m, "b")
  gelu = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
  h = w("embed", "embeddings")[np.asarray(tokens)]  # [B, T, D]
  for i in range(num_layers):
    h = h + oracle.mha(params, h, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        key_size=key_size, value_size=key_size, window=window, name=f"attn_{i}")
    h = h + lin(np.maximum(lin(gelu(h), f"mlp_{i}/~/linear_0"), 0), f"mlp_{i}/~/linear_1")
  return lin(h, "unembed")  # [B, T, vocab]


@pytest.mark.parametrize("num_kv_heads", [4, 2])
@pytest.mark.parametrize("window", [None, 3])
def test_prefill_then_decode_equals_full_forward(monkeypatch, num_kv_heads, window):
  vocab, b, t, prompt = 11, 2, 9, 4
  model, caches_fn = _toy_model(vocab, 2, 4, num_kv_heads, 8, window)
  tokens = np.random.default_rng(9).integers(0, vocab, size=(b, t))
  params = model.init(jax.random.PRNGKey(2), tokens)
  full = _toy_oracle(params, tokens, 2, 4, num_kv_heads, 8, window)  # float64
  modes = []
  real = selector.select
  monkeypatch.setattr(selector, "select", lambda facts, *a: modes.append(facts.mode) or real(
      facts, *a))
  caches = caches_fn.apply({}, b, t)
  step = jax.jit(model.apply)
  logits, caches = step(params, tokens[:, :prompt], caches)  # prefill
  pieces = [logits]
  for i in range(prompt, t):  # decode one token at a time
    logits, caches = step(params, tokens[:, i:i + 1], caches)
    pieces.append(logits)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, axis=1)), full, atol=2e-5,
                             rtol=2e-5)
  assert sh.Mode.PREFILL in modes and sh.Mode.DECODE in modes
  np.testing.assert_array_equal(caches[0].length, [t] * b)


def test_rows_of_different_lengths_prefill_and_decode_together():
  # Right-padded prompts of lengths 3, 0 and 6 (capacity 6: the last row fills its cache),
  # then one decode step in which the full row appends nothing.
  vocab, prompt_lens, max_len = 11, np.array([3, 0, 6]), 6
  model, caches_fn = _toy_model(vocab, 2, 4, 2, 8, 3)
  tokens = np.random.default_rng(12).integers(0, vocab, size=(3, max_len))
  params = model.init(jax.random.PRNGKey(3), tokens)
  step = jax.jit(lambda p, t, c, n: model.apply(p, t, c, n))
  caches = caches_fn.apply({}, 3, max_len)
  prefill, caches = step(params, tokens, caches, jnp.asarray(prompt_lens))
  np.testing.assert_array_equal(caches[0].length, prompt_lens)
  nxt = tokens[:, :1]
  decode, caches = step(params, nxt, caches, jnp.asarray([1, 1, 0]))
  np.testing.assert_array_equal(caches[-1].length, [4, 1, 6])
  for row, n in enumerate(prompt_lens):
    alone = _toy_oracle(params, np.concatenate([tokens[row, :n], nxt[row]])[None], 2, 4, 2, 8, 3)
    np.testing.assert_allclose(prefill[row, :n], alone[0, :n], atol=2e-5, rtol=2e-5)
    if n < max_len:
      np.testing.assert_allclose(decode[row, 0], alone[0, n], atol=2e-5, rtol=2e-5)
  assert np.all(np.isfinite(np.asarray(prefill))) and np.all(np.isfinite(np.asarray(decode)))


def test_transform_with_state_remat_layer_stack_and_vmap():
  x = np.random.default_rng(10).normal(size=(2, 6, 8)).astype(np.float32)
  mha = lambda name=None: sh.MultiHeadAttention(2, 4, num_kv_heads=1, w_init=W_INIT, name=name)
  plain = hk.transform(lambda x: mha()(x))
  params = plain.init(jax.random.PRNGKey(3), x)
  want = jax.jit(plain.apply)(params, None, x)

  with_state = hk.transform_with_state(lambda x: mha()(x) + 0 * hk.get_state(
      "count", [], init=jnp.zeros))
  out, _ = jax.jit(with_state.apply)(params, with_state.init(jax.random.PRNGKey(3), x)[1], None,
                                     x)
  np.testing.assert_allclose(out, want, atol=1e-6)

  remat = hk.transform(lambda x: hk.remat(lambda y: mha()(y))(x))
  np.testing.assert_allclose(jax.jit(remat.apply)(params, None, x), want, atol=1e-6)
  g1 = jax.jit(jax.grad(lambda p: remat.apply(p, None, x).sum()))(params)
  g2 = jax.jit(jax.grad(lambda p: plain.apply(p, None, x).sum()))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **harness.tol()), g1, g2)

  vmapped = hk.transform(lambda x: hk.vmap(lambda y: mha()(y), split_rng=False)(x))
  np.testing.assert_allclose(jax.jit(vmapped.apply)(params, None, x), want, **harness.tol())

  def stacked(x):
    layer = lambda h: h + sh.MultiHeadAttention(2, 4, model_size=8, w_init=W_INIT)(h)
    return hk.layer_stack(3)(layer)(x)

  stack = hk.transform(stacked)
  sp = stack.init(jax.random.PRNGKey(4), x)
  prefix = "__layer_stack_no_per_layer/"
  assert sp[prefix + "multi_head_attention/query"]["w"].shape == (3, 8, 8)
  out = jax.jit(stack.apply)(sp, None, x)
  unrolled = x
  single = hk.transform(lambda h: sh.MultiHeadAttention(2, 4, model_size=8, w_init=W_INIT)(h))
  apply_single = jax.jit(single.apply)
  for i in range(3):
    layer_params = {k.removeprefix(prefix): jax.tree.map(lambda a: a[i], v) for k, v in sp.items()}
    unrolled = unrolled + apply_single(layer_params, None, unrolled)
  np.testing.assert_allclose(out, unrolled, **harness.tol())


def test_learnable_sinks_get_gradients_and_change_output():
  f = hk.transform(lambda q, k, v: sh.SplashAttention(num_sinks=2)(q, k, v))
  q, k, v, _ = CASES_BY_NAME["gqa_causal"].arrays()
  params = f.init(jax.random.PRNGKey(0), q, k, v)
  assert params["splash_attention"]["sinks"].shape == (4, 2)
  assert not np.any(params["splash_attention"]["sinks"])
  grads = jax.grad(lambda p: jnp.sum(f.apply(p, None, q, k, v) ** 2))(params)
  assert np.all(np.abs(grads["splash_attention"]["sinks"]) > 0)
  moved = jax.tree.map(lambda p, g: p - g, params, grads)
  assert np.abs(f.apply(moved, None, q, k, v) - f.apply(params, None, q, k, v)).max() > 1e-3


def test_mha_with_mesh_equals_without():
  mesh = harness.mesh("2x4", explicit=True)
  x = np.random.default_rng(11).normal(size=(4, 8, 16)).astype(np.float32)
  make = lambda mesh: hk.transform(lambda x: sh.MultiHeadAttention(
      8, 4, num_kv_heads=2, w_init=W_INIT, mesh=mesh, num_sinks=1)(x))
  params = make(None).init(jax.random.PRNGKey(5), x)
  sharded = jax.jit(make(mesh).apply)(params, None, x)
  np.testing.assert_allclose(sharded, make(None).apply(params, None, x), **harness.tol())


BAD_CONSTRUCTORS = [
    ("num_kv_heads", dict(num_heads=4, key_size=8, num_kv_heads=3, w_init=W_INIT)),
    ("w_init", dict(num_heads=4, key_size=8)),
    ("num_sinks", dict(num_heads=4, key_size=8, w_init=W_INIT, num_sinks=-1)),
    ("num_heads", dict(num_heads=0, key_size=8, w_init=W_INIT)),
    ("key_size", dict(num_heads=4, key_size=2.5, w_init=W_INIT)),
    ("value_size", dict(num_heads=4, key_size=8, value_size=-1, w_init=W_INIT)),
    ("model_size", dict(num_heads=4, key_size=8, model_size=0, w_init=W_INIT)),
    ("config", dict(num_heads=4, key_size=8, w_init=W_INIT, config={"causal": True})),
]


@pytest.mark.parametrize("needle,kwargs", BAD_CONSTRUCTORS, ids=[c[0] for c in BAD_CONSTRUCTORS])
def test_bad_constructor_arguments(needle, kwargs):
  f = hk.transform(lambda: sh.MultiHeadAttention(**kwargs))
  with pytest.raises(ValueError, match=needle):
    f.init(None)


def test_bad_cache_and_mask_arguments():
  x = jnp.ones((2, 3, 8))

  def call(**kw):
    m = sh.MultiHeadAttention(2, 4, w_init=W_INIT)
    return m(x, **kw) if "kv_cache" not in kw else m(x, kv_cache=m.init_cache(2, 8), **{
        k: v for k, v in kw.items() if k != "kv_cache"})

  with pytest.raises(ValueError, match="kv_cache"):
    hk.transform(lambda: call(kv_cache=True, q_positions=jnp.zeros((2, 3), jnp.int32))).init(
        jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="mask"):
    hk.transform(lambda: call(mask=jnp.ones((2, 5, 3, 3)))).init(jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match=r"`mask` of shape \(2, 3, 2\) does not broadcast"):
    hk.transform(lambda: call(mask=jnp.ones((2, 3, 2)))).init(jax.random.PRNGKey(0))
