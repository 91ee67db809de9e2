"""The KV cache never gives a finite wrong answer: errors when values are known, NaN rows under jit."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
import harness
import oracle

W_INIT = hk.initializers.VarianceScaling(1.0)
HEADS, KV_HEADS, KEY_SIZE, MODEL = 2, 1, 4, 8
MHA = hk.without_apply_rng(hk.transform(
    lambda x, cache, lengths=None: sh.MultiHeadAttention(
        HEADS, KEY_SIZE, num_kv_heads=KV_HEADS, w_init=W_INIT)(x, kv_cache=cache, lengths=lengths)))
CALLS = {"eager": MHA.apply, "jit": jax.jit(MHA.apply)}


def _setup(batch=2, max_len=8, seed=0):
  x = np.random.default_rng(seed).normal(size=(batch, 12, MODEL)).astype(np.float32)
  params = MHA.init(jax.random.PRNGKey(seed), x[:, :1], _empty(batch, max_len))
  return params, x


def _empty(batch, max_len):
  return sh.KVCache.zeros(batch, max_len, KV_HEADS, KEY_SIZE)


def _oracle_row(params, tokens, new):
  """float64 outputs of the last `new` of `tokens` [n, D] attending causally to all of them."""
  return oracle.mha(params, tokens[None], num_heads=HEADS, num_kv_heads=KV_HEADS,
                    key_size=KEY_SIZE, value_size=KEY_SIZE)[0, len(tokens) - new:]


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_cache_filled_to_capacity_then_one_more_fails(how):
  params, x = _setup()
  call = CALLS[how]
  out, cache = call(params, x[:, :6], _empty(2, 8))
  for i in (6, 7):  # fills the 8 slots exactly
    out, cache = call(params, x[:, i:i + 1], cache)
  np.testing.assert_allclose(out[0], _oracle_row(params, x[0, :8], 1), **harness.tol())
  np.testing.assert_array_equal(cache.length, [8, 8])
  if how == "eager":
    with pytest.raises(ValueError, match=r"`kv_cache` is full: rows \[0, 1\]"):
      call(params, x[:, 8:9], cache)
    return
  out, after = call(params, x[:, 8:9], cache)
  assert np.isnan(out).all()  # a visible failure, never a finite wrong answer
  np.testing.assert_array_equal(after.length, [8, 8])
  np.testing.assert_array_equal(after.key, cache.key)  # nothing written
  np.testing.assert_array_equal(after.value, cache.value)


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_prefill_longer_than_capacity(how):
  params, x = _setup()
  if how == "eager":
    with pytest.raises(ValueError, match="kv_cache"):
      CALLS[how](params, x[:, :10], _empty(2, 8))
    return
  out, cache = CALLS[how](params, x[:, :10], _empty(2, 8))
  assert np.isnan(out).all()
  np.testing.assert_array_equal(cache.length, [0, 0])
  assert not np.any(cache.key) and not np.any(cache.value)


def test_under_jit_only_the_overflowing_row_fails():
  # Row 0 holds 6 of 8 slots and appends 3 (overflow); row 1 holds 2 and appends 3.
  params, x = _setup()
  call = CALLS["jit"]
  _, cache = call(params, x[:, :6], _empty(2, 8), jnp.asarray([6, 2]))
  new = np.stack([x[0, 6:9], x[1, 2:5]])
  out, after = call(params, new, cache)
  assert np.isnan(out[0]).all()
  np.testing.assert_array_equal(after.length, [6, 5])
  np.testing.assert_array_equal(after.key[0], cache.key[0])
  np.testing.assert_allclose(out[1], _oracle_row(params, x[1, :5], 3), **harness.tol())
  # The failed row is still usable with a step that fits: it kept its 6 tokens.
  out, _ = call(params, x[:, 6:8], after, jnp.asarray([2, 0]))
  np.testing.assert_allclose(out[0], _oracle_row(params, x[0, :8], 2), **harness.tol())


@pytest.mark.parametrize("lengths", [[9, 3], [-1, 3]])
def test_lengths_outside_zero_to_t(lengths):
  params, x = _setup()
  with pytest.raises(ValueError, match=r"`lengths` must lie in \[0, T\] = \[0, 6\]"):
    CALLS["eager"](params, x[:, :6], _empty(2, 8), jnp.asarray(lengths))
  out, cache = CALLS["jit"](params, x[:, :6], _empty(2, 8), jnp.asarray(lengths))
  assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
  np.testing.assert_array_equal(cache.length, [0, 3])
  np.testing.assert_allclose(out[1, :3], _oracle_row(params, x[1, :3], 3), **harness.tol())


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("cache,needle", [
    (sh.KVCache.zeros(3, 8, KV_HEADS, KEY_SIZE), r"`kv_cache.key` must be .* = \[2, max_len"),
    (sh.KVCache.zeros(2, 8, 2, KEY_SIZE), r"`kv_cache.key` must be"),
    (sh.KVCache.zeros(2, 8, KV_HEADS, KEY_SIZE, 3), r"`kv_cache.value` must be"),
    (sh.KVCache(jnp.zeros((2, 8, 1, 4)), jnp.zeros((2, 8, 1, 4)), jnp.zeros(3, jnp.int32)),
     r"`kv_cache.length` must be ints of shape \[\] or \[2\]"),
], ids=["batch", "heads", "value_size", "length_shape"])
def test_a_cache_of_another_batch_or_layer_is_named(how, cache, needle):
  params, x = _setup()
  with pytest.raises(ValueError, match=needle):
    CALLS[how](params, x[:, :3], cache)


def test_hand_built_cache_with_scalar_length():
  params, x = _setup()
  _, full = CALLS["eager"](params, x[:, :5], _empty(2, 8))
  by_hand = sh.KVCache(full.key, full.value, jnp.asarray(5, jnp.int32))
  out, cache = CALLS["eager"](params, x[:, 5:8], by_hand)
  np.testing.assert_array_equal(cache.length, [8, 8])
  for row in range(2):
    np.testing.assert_allclose(out[row], _oracle_row(params, x[row, :8], 3), **harness.tol())
  with pytest.raises(ValueError, match=r"`kv_cache.length` must lie in \[0, max_len\]"):
    CALLS["eager"](params, x[:, :1], sh.KVCache(full.key, full.value, jnp.asarray(9)))


def _two_layers(x, caches, chain=False):
  """Two attention layers, each with its cache, or (chain) one cache through both in turn."""
  new = []
  for i, cache in enumerate(caches):
    layer = sh.MultiHeadAttention(HEADS, KEY_SIZE, num_kv_heads=KV_HEADS, w_init=W_INIT,
                                  model_size=MODEL, name=f"layer_{i}")
    x, cache = layer(x, kv_cache=new[-1] if chain and new else cache)
    new.append(cache)
  return x, new


TWO_LAYERS = hk.without_apply_rng(hk.transform(_two_layers))


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_a_cache_of_another_layer_is_named_even_with_the_same_shape(how):
  x = np.random.default_rng(1).normal(size=(2, 8, MODEL)).astype(np.float32)
  params = TWO_LAYERS.init(jax.random.PRNGKey(0), x, [_empty(2, 16), _empty(2, 16)])
  call = TWO_LAYERS.apply if how == "eager" else jax.jit(TWO_LAYERS.apply, static_argnums=3)
  _, caches = call(params, x, [_empty(2, 16), _empty(2, 16)])
  assert [c.owner for c in caches] == ["layer_0", "layer_1"]
  with pytest.raises(ValueError, match="`kv_cache` belongs to layer 'layer_0'.*layer 'layer_1'"):
    call(params, x, [_empty(2, 16), None], True)  # one cache chained through both layers
  with pytest.raises(ValueError, match="`kv_cache` belongs to layer 'layer_1'.*layer 'layer_0'"):
    call(params, x[:, :1], caches[::-1])  # two layers' caches swapped
  _, again = call(params, x[:, :1], caches)  # each its own: fine, owners kept
  assert [c.owner for c in again] == ["layer_0", "layer_1"]


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_reset_rows_and_room(how):
  params, x = _setup(max_len=10)
  call = CALLS[how]
  _, cache = call(params, x[:, :6], _empty(2, 10), jnp.asarray([6, 3]))
  np.testing.assert_array_equal(cache.room(), [4, 7])
  reset = jax.jit(lambda c, rows: c.reset(rows)) if how == "jit" else (lambda c, r: c.reset(r))
  fresh = reset(cache, jnp.asarray([True, False]))
  np.testing.assert_array_equal(fresh.length, [0, 3])
  np.testing.assert_array_equal(fresh.room(), [10, 7])
  assert fresh.owner == cache.owner == "multi_head_attention"
  np.testing.assert_array_equal(reset(cache, -1).length, [6, 0])
  np.testing.assert_array_equal(reset(cache, jnp.asarray([0, 1])).length, [0, 0])
  # Row 0 starts a new prompt over its old slots (stale keys there are invisible); row 1 goes on.
  prompt = x[0, 6:10]
  out, after = call(params, np.stack([prompt, x[1, 3:7]]), fresh, jnp.asarray([4, 4]))
  np.testing.assert_array_equal(after.length, [4, 7])
  np.testing.assert_allclose(out[0], _oracle_row(params, prompt, 4), **harness.tol())
  np.testing.assert_allclose(out[1], _oracle_row(params, x[1, :7], 4), **harness.tol())


def test_reset_rows_that_are_not_rows():
  cache = _empty(2, 4)
  with pytest.raises(ValueError, match=r"`rows` must be indices in \[-2, 2\)"):
    cache.reset(2)
  with pytest.raises(ValueError, match=r"`rows` as a mask must be bool \[2\]"):
    cache.reset(np.array([True, False, True]))
  with pytest.raises(ValueError, match="`rows` must be row indices"):
    cache.reset(np.array([0.5]))
