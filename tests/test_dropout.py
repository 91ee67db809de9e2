"""Attention dropout: one hash of the key and each pair's global coordinates.

Values and gradients against the float64 oracle given the same dense mask
(`sh.dropout_mask`); the mask's bits read back from the kernels themselves (values that are
one-hot in the key index) under two block sizes, meshes, the ring, Ulysses, splash's
fallback and a KV-cache decode step; the keep rate; the errors; rate 0 is the program of a
call without dropout; the modules and the training binary.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
import harness
import oracle
import processes

TILES = sh.BlockSizes(16, 8, 8, 16)  # T = 72: partial blocks at both ends
KEY = jax.random.key(11)


def _inputs(seed, batch=2, length=72, hq=4, hkv=2, head_dim=16, value_dim=24):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(batch, length, hq, head_dim)).astype(np.float32)
  k = rng.normal(size=(batch, length, hkv, head_dim)).astype(np.float32)
  v = rng.normal(size=(batch, length, hkv, value_dim)).astype(np.float32)
  cot = rng.normal(size=(batch, length, hq, value_dim))
  return q, k, v, rng.normal(size=(hq, 2)).astype(np.float32), cot, rng


CASES = {  # config words -> oracle words
    "causal": (dict(), dict()),
    "window_softcap": (dict(sliding_window=(20, 5), logits_soft_cap=5.0),
                       dict(window=(20, 5), soft_cap=5.0)),
    "chunk": (dict(chunk_size=24), dict(chunk=24)),
    "bidirectional": (dict(causal=False), dict(causal=False)),
}


@pytest.mark.parametrize("platform", ["xla", "reference"])
@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_match_the_oracle_given_the_same_mask(case, platform):
  """q, k, v, sinks and a dense bias's gradients, GQA, every rule, rate 0.3."""
  words, rules = CASES[case]
  q, k, v, sinks, cot, rng = _inputs(1)
  bias = rng.normal(size=(2, 4, 72, 72)).astype(np.float32)
  config = sh.AttentionConfig(platform=platform, allow_fallback=False, block_sizes=TILES,
                              dropout_rate=0.3, **words)
  f = lambda q, k, v, s, b: sh.attention(q, k, v, config=config, softmax_aux=s, bias=b,
                                         dropout_rng=KEY).attention_outputs
  out, grads = harness.values_and_grads(f, (q, k, v, sinks, bias), cot)
  keep = np.asarray(sh.dropout_mask(KEY, 0.3, batch=2, num_heads=4, query_len=72, kv_len=72))
  want_out, want_grads = oracle.out_and_vjp(q, k, v, cot, sinks=sinks, bias=bias,
                                            dropout=(keep, 0.3), **rules)
  harness.assert_close((out, grads[:4]), (want_out, want_grads[:4]))
  harness.assert_near(grads[4], want_grads[4], "grad", err_msg="dbias")


def test_at_a_real_size_with_default_tiles():
  q, k, v, _, cot, _ = _inputs(2, length=1536, hq=4, hkv=2, head_dim=32, value_dim=32)
  config = sh.AttentionConfig(dropout_rate=0.1, sliding_window=(512, 0))
  f = lambda q, k, v: sh.attention(q, k, v, config=config, dropout_rng=KEY).attention_outputs
  keep = np.asarray(sh.dropout_mask(KEY, 0.1, batch=2, num_heads=4, query_len=1536, kv_len=1536))
  harness.check_against_oracle(f, q, k, v, cot, window=(512, 0), dropout=(keep, 0.1))


def _drawn(f, q, length):
  """The keep mask a call applied, read back through values that are one-hot in the key index
  (Dv = S): out[b, t, h, j] = w * keep / (1 - p) is > 0 exactly where the pair was kept."""
  v = np.broadcast_to(np.eye(length, dtype=np.float32)[None, :, None, :],
                      (q.shape[0], length, 2, length))
  k = np.zeros((q.shape[0], length, 2, q.shape[-1]), np.float32)  # every visible w > 0
  out = np.asarray(f(q, k, v))  # [B, T, Hq, S]
  return np.moveaxis(out > 0, 2, 1)  # [B, Hq, T, S]


def test_the_same_bits_on_every_tile_mesh_strategy_and_backend():
  length, rate = 64, 0.25
  q = np.random.default_rng(3).normal(size=(2, length, 8, 16)).astype(np.float32)
  want = np.asarray(sh.dropout_mask(KEY, rate, batch=2, num_heads=8, query_len=length,
                                    kv_len=length)) & np.tril(np.ones((length, length), bool))
  mesh = harness.mesh("dp2_sp2_tp2")
  runs = {
      "xla 16x8": dict(config=sh.AttentionConfig(dropout_rate=rate, block_sizes=TILES)),
      "xla 64x32": dict(config=sh.AttentionConfig(dropout_rate=rate,
                                                  block_sizes=sh.BlockSizes(64, 32, 32, 64))),
      "reference": dict(config=sh.AttentionConfig(dropout_rate=rate, platform="reference")),
      "splash interpret": dict(config=sh.AttentionConfig(dropout_rate=rate, platform="splash",
                                                         interpret=True)),
      "2x4 mesh": dict(config=sh.AttentionConfig(dropout_rate=rate),
                       mesh=harness.mesh("2x4"), axes=sh.MeshAxes(batch="dp", heads="tp")),
  }
  for strategy in ("all_gather", "ring", "ulysses"):
    runs[strategy] = dict(config=sh.AttentionConfig(dropout_rate=rate), mesh=mesh, axes=sh.MeshAxes(
        batch="dp", heads="tp", sequence="sp", sequence_strategy=strategy))
  balanced = sh.MeshAxes(sequence="sp", sequence_strategy="ring", load_balanced=True)
  lb, back = (lambda a: sh.sharding.load_balance(a, 4)), (lambda a: sh.sharding.restore_order(a, 4))
  got = _drawn(lambda q, k, v: back(sh.attention(
      lb(q), lb(k), lb(v), config=sh.AttentionConfig(dropout_rate=rate), mesh=harness.mesh("sp4"),
      axes=balanced, dropout_rng=KEY).attention_outputs), q, length)
  np.testing.assert_array_equal(got, want, err_msg="load-balanced ring")  # bits go with tokens
  for name, kw in runs.items():
    decision = sh.explain(q, q, q, dropout_rng=KEY, **kw)
    assert decision.ring == (name == "ring") and decision.ulysses == (name == "ulysses"), name
    if name == "splash interpret":
      assert decision.fallback and "dropout" in decision.reason, decision
    got = _drawn(lambda q, k, v: sh.attention(q, k, v, dropout_rng=KEY, **kw).attention_outputs,
                 q, length)
    np.testing.assert_array_equal(got, want, err_msg=name)


def test_a_decode_step_against_the_cache_draws_the_full_forwards_mask():
  """Row b's new token at slot length[b]: its keys' bits are those of the full forward's row."""
  length, rate = 32, 0.5
  q = np.random.default_rng(4).normal(size=(2, length, 8, 16)).astype(np.float32)
  full = _drawn(lambda q, k, v: sh.attention(q, k, v, config=sh.AttentionConfig(
      dropout_rate=rate), dropout_rng=KEY).attention_outputs, q, length)  # [B, Hq, T, S]
  from splash_hk import layer  # pylint: disable=g-import-not-at-top
  lengths = np.array([20, 9])
  v = np.broadcast_to(np.eye(length, dtype=np.float32)[None, :, None, :], (2, length, 2, length))
  cache = sh.KVCache(jnp.zeros((2, length, 2, 16)), jnp.asarray(v), jnp.asarray(lengths))
  step = np.stack([q[0, 20:21], q[1, 9:10]])  # [B, 1, Hq, D]
  settings = layer.Settings(sh.AttentionConfig(dropout_rate=rate), None, sh.MeshAxes(), "l")
  out, _ = layer.attend(jnp.asarray(step), jnp.zeros((2, 1, 2, 16)),
                        jnp.asarray(np.stack([v[0, 20:21], v[1, 9:10]])),
                        layer.Call(kv_cache=cache, dropout_rng=KEY), settings)
  got = np.moveaxis(np.asarray(out) > 0, 2, 1)[:, :, 0]  # [B, Hq, S]
  np.testing.assert_array_equal(got[0], full[0, :, 20])
  np.testing.assert_array_equal(got[1], full[1, :, 9])


def test_the_keep_rate_at_4096():
  keep = sh.dropout_mask(jax.random.key(5), 0.1, batch=1, num_heads=8, query_len=4096,
                         kv_len=4096)
  assert abs(float(jnp.mean(keep)) - 0.9) < 0.009, float(jnp.mean(keep))
  other = sh.dropout_mask(jax.random.key(6), 0.1, batch=1, num_heads=8, query_len=4096,
                          kv_len=4096)
  assert 0.17 < float(jnp.mean(keep != other)) < 0.19  # independent draws: 2 p (1 - p)


def test_an_explicit_dropout_mask_and_rate_zero():
  q, k, v, _, cot, rng = _inputs(6)
  keep = rng.random((2, 1, 72, 72)) > 0.2  # tokamax's form, one mask for every head
  config = sh.AttentionConfig(dropout_rate=0.2, block_sizes=TILES)
  f = lambda q, k, v: sh.attention(q, k, v, config=config, dropout_mask=keep).attention_outputs
  harness.check_against_oracle(f, q, k, v, cot, dropout=(keep, 0.2))
  plain = lambda q: sh.attention(q, k, v).attention_outputs
  zero = lambda q: sh.attention(q, k, v, config=sh.AttentionConfig(dropout_rate=0.0),
                                dropout_rng=KEY).attention_outputs
  assert str(jax.make_jaxpr(plain)(q)) == str(jax.make_jaxpr(zero)(q))  # the same program


def test_bad_dropout_arguments_say_what_to_pass():
  q, k, v, *_ = _inputs(7)
  for rate in (-0.1, 1.0, float("nan")):
    with pytest.raises(ValueError, match=r"dropout_rate must be a number in \[0, 1\)"):
      sh.AttentionConfig(dropout_rate=rate)
  config = sh.AttentionConfig(dropout_rate=0.1)
  with pytest.raises(ValueError, match=r"dropout_rate=0.1\) needs a key: pass dropout_rng="):
    sh.attention(q, k, v, config=config)
  with pytest.raises(ValueError, match=r"`dropout_mask` was given with dropout_rate=0"):
    sh.attention(q, k, v, dropout_mask=np.ones((2, 1, 72, 72), bool))
  with pytest.raises(ValueError, match=r"`dropout_mask` must be \[batch, 1 or num_heads"):
    sh.attention(q, k, v, config=config, dropout_mask=np.ones((2, 72, 72), bool))
  with pytest.raises(ValueError, match=r"`dropout_rng` must be a jax.random key"):
    sh.attention(q, k, v, config=config, dropout_rng=np.zeros(2, np.float32))
  cache = sh.PagedKVCache.zeros(4, 4, 2, 16)
  batch = sh.RaggedBatch(np.array([0, 1], np.int32), np.zeros(1, np.int32),
                         np.zeros((1, 2), np.int32), np.int32(1))
  with pytest.raises(ValueError, match=r"`config.dropout_rate` is 0.1: .*paged call serves"):
    sh.paged_attention(q[0, :1], k[0, :1], k[0, :1], cache, batch, config=config)


def test_the_haiku_and_flax_modules_drop_out_when_training():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from splash_hk import flax as shx  # pylint: disable=g-import-not-at-top
  x = np.random.default_rng(8).normal(size=(2, 16, 32)).astype(np.float32)
  f = hk.transform(lambda x, t: sh.MultiHeadAttention(
      4, 8, w_init=hk.initializers.VarianceScaling(1.0), dropout_rate=0.5)(x, is_training=t))
  params = f.init(jax.random.PRNGKey(0), x, False)
  plain = f.apply(params, None, x, False)
  first, again = (f.apply(params, jax.random.PRNGKey(1), x, True) for _ in range(2))
  other = f.apply(params, jax.random.PRNGKey(2), x, True)
  np.testing.assert_array_equal(first, again)
  assert np.abs(first - plain).max() > 0.1 and np.abs(first - other).max() > 0.1
  with pytest.raises(ValueError, match="PRNGKey"):
    f.apply(params, None, x, True)
  m = shx.MultiHeadAttention(4, 32, dropout_rate=0.5, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="pass `deterministic`"):
    m(x)
  quiet = m(x, deterministic=True)
  loud = m(x, deterministic=False)
  assert np.abs(loud - quiet).max() > 0.1 and np.abs(loud - m(x, deterministic=False)).max() > 0
  broadcast = shx.MultiHeadAttention(4, 32, dropout_rate=0.5, broadcast_dropout=True,
                                     deterministic=False, rngs=nnx.Rngs(0))
  assert broadcast(x).shape == (2, 16, 32)
  flax_own = nnx.MultiHeadAttention(4, 32, dropout_rate=0.5, decode=False,
                                    attention_fn=shx.attention_fn, rngs=nnx.Rngs(0))
  assert np.abs(flax_own(x, deterministic=False) - flax_own(x, deterministic=True)).max() > 0.1


def test_the_training_binary_trains_with_attention_dropout():
  import re  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  proc = subprocess.run([sys.executable, "-m", "examples.train", "--steps=60", "--log_every=20",
                         "--num_layers=1", "--attention_dropout=0.1"], capture_output=True,
                        text=True, env=processes.env(), timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  losses = {int(s): float(l) for s, l in re.findall(r"step=(\d+) loss=([0-9.]+)", proc.stderr)}
  assert losses[60] < losses[20], losses


def test_broadcast_dropout_draws_one_mask_for_every_batch_row_and_head():
  """Flax's broadcast_dropout (through attention_fn, as nnx.MultiHeadAttention calls it): every
  batch row and head keeps the pairs row 0, head 0 of the hash keeps."""
  from splash_hk import flax as shx  # pylint: disable=g-import-not-at-top
  length, rate = 32, 0.4
  q = np.random.default_rng(9).normal(size=(2, length, 4, 16)).astype(np.float32)
  fn = lambda q, k, v: shx.attention_fn(q, k, v, dropout_rate=rate, dropout_rng=KEY,
                                        deterministic=False, broadcast_dropout=True)
  got = _drawn(fn, q, length)  # [B, Hq, T, S]
  first = np.asarray(sh.dropout_mask(KEY, rate, batch=1, num_heads=1, query_len=length,
                                     kv_len=length))  # [1, 1, T, S]
  np.testing.assert_array_equal(got, np.broadcast_to(first, got.shape))
  per_head = _drawn(lambda q, k, v: shx.attention_fn(
      q, k, v, dropout_rate=rate, dropout_rng=KEY, deterministic=False,
      broadcast_dropout=False), q, length)
  assert (per_head[:, 1:] != per_head[:, :1]).any() and (per_head[1:] != per_head[:1]).any()


def test_the_flax_modules_broadcast_dropout_shares_the_mask_across_the_batch():
  """Two equal batch rows give equal outputs exactly when they share their dropout mask."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from splash_hk import flax as shx  # pylint: disable=g-import-not-at-top
  x = np.random.default_rng(10).normal(size=(1, 16, 32)).astype(np.float32)
  x = np.concatenate([x, x])  # [2, 16, 32]: row 1 == row 0
  for broadcast in (True, False):
    m = shx.MultiHeadAttention(4, 32, dropout_rate=0.5, broadcast_dropout=broadcast,
                               deterministic=False, rngs=nnx.Rngs(0))
    y = np.asarray(m(x))
    assert np.array_equal(y[0], y[1]) == broadcast, broadcast


def _oracle_mask(rate, batch, heads, query_len, kv_len):
  return np.asarray(sh.dropout_mask(KEY, rate, batch=batch, num_heads=heads,
                                    query_len=query_len, kv_len=kv_len))


@pytest.mark.parametrize("causal", [False, True])
def test_a_longer_query_than_keys_drops_out_as_the_oracle(causal):
  """Cross-attention with a longer decoder (T > S): query t has index S - T + t (negative for
  the first ones), by the hash or an explicit mask."""
  rng = np.random.default_rng(12)
  q = rng.normal(size=(2, 96, 4, 16)).astype(np.float32)
  k = rng.normal(size=(2, 40, 2, 16)).astype(np.float32)
  v = rng.normal(size=(2, 40, 2, 24)).astype(np.float32)
  cot = rng.normal(size=(2, 96, 4, 24))
  keep = _oracle_mask(0.3, 2, 4, 96, 40)
  config = sh.AttentionConfig(dropout_rate=0.3, causal=causal, block_sizes=TILES)
  hashed = lambda q, k, v: sh.attention(q, k, v, config=config, dropout_rng=KEY).attention_outputs
  harness.check_against_oracle(hashed, q, k, v, cot, causal=causal, dropout=(keep, 0.3))
  given = lambda q, k, v: sh.attention(q, k, v, config=config,
                                       dropout_mask=keep).attention_outputs
  harness.check_against_oracle(given, q, k, v, cot, causal=causal, dropout=(keep, 0.3))


def test_a_longer_query_than_keys_drops_out_in_both_modules_and_attention_fn():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from splash_hk import flax as shx  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(13)
  x, enc = (rng.normal(size=(2, n, 32)).astype(np.float32) for n in (24, 8))
  f = hk.transform(lambda x, e: sh.MultiHeadAttention(
      4, 8, w_init=hk.initializers.VarianceScaling(1.0), dropout_rate=0.5,
      config=sh.AttentionConfig(causal=False))(x, e, e, is_training=True))
  params = f.init(jax.random.PRNGKey(0), x, enc)
  assert f.apply(params, jax.random.PRNGKey(1), x, enc).shape == (2, 24, 32)
  m = shx.MultiHeadAttention(4, 32, dropout_rate=0.5, deterministic=False, rngs=nnx.Rngs(0),
                             config=sh.AttentionConfig(causal=False))
  assert m(x, enc).shape == (2, 24, 32)
  q = rng.normal(size=(2, 24, 4, 8)).astype(np.float32)
  got = _drawn(lambda q, k, v: shx.attention_fn(q, k, v, dropout_rate=0.5, dropout_rng=KEY,
                                                deterministic=False, broadcast_dropout=False),
               q, 8)  # [B, Hq, T, S]
  np.testing.assert_array_equal(got, _oracle_mask(0.5, 2, 4, 24, 8))


def test_two_dropout_rates_in_one_module_are_refused_naming_both():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from splash_hk import flax as shx  # pylint: disable=g-import-not-at-top
  config = sh.AttentionConfig(dropout_rate=0.2)
  both = r"`dropout_rate=0.1` and `config.dropout_rate=0.2` both state"
  f = hk.transform(lambda x: sh.MultiHeadAttention(
      4, 8, w_init=hk.initializers.VarianceScaling(1.0), config=config, dropout_rate=0.1)(x))
  with pytest.raises(ValueError, match=both):
    f.init(jax.random.PRNGKey(0), np.ones((1, 4, 32), np.float32))
  with pytest.raises(ValueError, match=both):
    shx.MultiHeadAttention(4, 32, config=config, dropout_rate=0.1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=both):
    shx.attention_fn(*(np.ones((1, 4, 2, 8), np.float32),) * 3, config=config, dropout_rate=0.1)
  # the config alone states it: the modules use it (the same rate twice is one statement)
  m = shx.MultiHeadAttention(4, 32, config=config, dropout_rate=0.2, rngs=nnx.Rngs(0))
  assert m.dropout_rate == 0.2
  x = np.random.default_rng(14).normal(size=(2, 16, 32)).astype(np.float32)
  g = hk.transform(lambda x, t: sh.MultiHeadAttention(
      4, 8, w_init=hk.initializers.VarianceScaling(1.0), config=config)(x, is_training=t))
  params = g.init(jax.random.PRNGKey(0), x, False)
  assert np.abs(g.apply(params, jax.random.PRNGKey(1), x, True)
                - g.apply(params, None, x, False)).max() > 0.1
  flax_config = shx.MultiHeadAttention(4, 32, config=config, deterministic=False,
                                       rngs=nnx.Rngs(0))
  assert np.abs(flax_config(x) - flax_config(x, deterministic=True)).max() > 0.1


def test_deterministic_and_explain_need_no_key_for_a_dropout_config():
  from splash_hk import flax as shx  # pylint: disable=g-import-not-at-top
  q, k, v, _, cot, _ = _inputs(15)
  config = sh.AttentionConfig(dropout_rate=0.2, causal=False)
  out = shx.attention_fn(q, k, v, config=config, deterministic=True)
  np.testing.assert_allclose(np.asarray(out), oracle.attention(q, k, v, causal=False)[0],
                             **harness.tol())
  assert sh.explain(q, k, v, config=config).backend == "xla"
  with pytest.raises(ValueError, match="needs a key"):
    shx.attention_fn(q, k, v, config=config, deterministic=False)
