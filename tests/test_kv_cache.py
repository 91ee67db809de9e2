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


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_rollback_drops_each_rows_last_tokens_and_refuses_below_zero(how):
  cache = _empty(2, 8).replace(length=jnp.asarray([5, 3], jnp.int32), owner="multi_head_attention")
  roll = (lambda c, n: c.rollback(n)) if how == "eager" else jax.jit(lambda c, n: c.rollback(n))
  np.testing.assert_array_equal(roll(cache, 2).length, [3, 1])
  after = roll(cache, np.array([0, 3]))
  np.testing.assert_array_equal(after.length, [5, 0])
  assert after.owner == "multi_head_attention"
  if how == "eager":
    with pytest.raises(ValueError, match=r"`n` must lie in \[0, length\].*rows \[1\] would drop "
                       r"\[4\] of their \[3\]"):
      cache.rollback(4)
    with pytest.raises(ValueError, match=r"rows \[0\]"):
      cache.rollback(np.array([-1, 0]))
    with pytest.raises(ValueError, match=r"`n` must be ints of shape \[\] or \[2\]"):
      cache.rollback(np.ones(3, np.int32))
    return
  params, x = _setup()
  bad = roll(cache, np.array([4, 4]))  # row 1 holds 3: marked failed, never a wrong answer
  np.testing.assert_array_equal(bad.length, [1, -1])
  out, _ = CALLS["jit"](params, x[:, :1], bad)
  assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()
  with pytest.raises(ValueError, match=r"rows \[1\] are marked failed \(length -1.*"
                                       r"kv_cache.reset\(\[1\]\)"):
    CALLS["eager"](params, x[:, :1], bad)  # the failed row, used eagerly: what -1 means
  out, _ = CALLS["eager"](params, x[:, :1], bad.reset([1]))
  assert np.isfinite(out).all()


VOCAB, LM_HEADS, LM_SIZE, LM_MODEL, LM_LAYERS = 16, 4, 8, 32, 2


def _lm(tokens, caches=None):
  """A 2-layer attention LM: embed, residual MHA layers (KV caches when given), unembed."""
  h = hk.Embed(VOCAB, LM_MODEL, name="embed")(tokens)  # [B, T, D]
  new = []
  for i in range(LM_LAYERS):
    mha = sh.MultiHeadAttention(LM_HEADS, LM_SIZE, num_kv_heads=2, w_init=W_INIT, name=f"mha_{i}")
    if caches is None:
      h = h + mha(h)
    else:
      out, cache = mha(h, kv_cache=caches[i])
      h, new = h + out, new + [cache]
  logits = hk.Linear(VOCAB, name="unembed")(h)  # [B, T, V]
  return logits if caches is None else (logits, new)


def _oracle_logits(params, tokens):
  """float64 logits [T, V] of one row of tokens [T], from the LM's weights."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  h = p["embed"]["embeddings"][tokens][None]
  for i in range(LM_LAYERS):
    h = h + oracle.mha(p, h, num_heads=LM_HEADS, num_kv_heads=2, key_size=LM_SIZE,
                       value_size=LM_SIZE, name=f"mha_{i}")
  return (h @ p["unembed"]["w"] + p["unembed"]["b"])[0]


def test_speculative_decoding_with_rollback_equals_greedy_decoding():
  """Draft k tokens, verify them in one cached call, keep the accepted ones and roll the cache
  back over the rest (per row): the tokens are the greedy decode of the float64 model, and would
  not be if a rejected draft token stayed in the cache."""
  lm = hk.without_apply_rng(hk.transform(_lm))
  rng = np.random.default_rng(5)
  prompts = rng.integers(0, VOCAB, size=(2, 5))
  params = lm.init(jax.random.PRNGKey(3), prompts)
  total, k = 17, 3
  greedy = [list(p) for p in prompts]  # the reference: one float64 full forward per token
  for row in greedy:
    while len(row) < total + k + 1:
      row.append(int(np.argmax(_oracle_logits(params, np.asarray(row))[-1])))
  step = jax.jit(lm.apply)
  caches = [sh.KVCache.zeros(2, 32, 2, LM_SIZE) for _ in range(LM_LAYERS)]
  logits, caches = step(params, jnp.asarray(prompts), caches)
  seqs = [list(p) + [int(t)] for p, t in zip(prompts, np.argmax(logits[:, -1], -1))]
  rejected = 0
  while min(len(s) for s in seqs) < total:
    # The draft: the right continuation with tokens spoiled at random (a weaker model's guess).
    draft = np.array([[greedy[b][len(s) + j] if rng.random() < 0.6 else
                       (greedy[b][len(s) + j] + 1 + rng.integers(VOCAB - 1)) % VOCAB
                       for j in range(k)] for b, s in enumerate(seqs)])
    fed = np.concatenate([np.array([[s[-1]] for s in seqs]), draft], axis=1)  # [B, 1 + k]
    logits, caches = step(params, jnp.asarray(fed), caches)
    target = np.argmax(np.asarray(logits), -1)  # [B, 1 + k]: what the model says after each
    keep = np.zeros(2, np.int32)
    for b in range(2):
      while keep[b] < k and draft[b, keep[b]] == target[b, keep[b]]:
        keep[b] += 1
      seqs[b] += list(draft[b, :keep[b]]) + [int(target[b, keep[b]])]
    rejected += int((k - keep).sum())
    caches = [c.rollback(k - keep) for c in caches]  # the rejected drafts leave the cache
    for c in caches:
      np.testing.assert_array_equal(c.length, [len(s) - 1 for s in seqs])
  assert rejected > 0, "the draft must be wrong sometimes for the rollback to matter"
  for b, s in enumerate(seqs):
    assert s == greedy[b][:len(s)], (b, s, greedy[b])


def test_a_cache_of_another_dtype_names_kv_cache_and_what_to_pass():
  params, x = _setup()
  cache = sh.KVCache.zeros(2, 8, KV_HEADS, KEY_SIZE, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match=r"^`kv_cache` holds bfloat16 keys and values and this layer "
                     r"computes float32 ones.*dtype=jnp.float32.*runtime_dtype=jnp.bfloat16"):
    MHA.apply(params, x[:, :3], cache)


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int32, jnp.bool_])
def test_a_dtype_a_cache_cannot_hold_is_refused_in_zeros_naming_what_works(dtype):
  works = r"`dtype` of a cache must be floating .* or a quantized dtype \(int8, int4"
  with pytest.raises(ValueError, match=works):
    sh.KVCache.zeros(2, 8, 1, 4, dtype=dtype)
  with pytest.raises(ValueError, match=works):
    sh.PagedKVCache.zeros(4, 4, 1, 4, dtype=dtype)


def _scanned(owned: bool):
  """A Haiku layer decoding 5 tokens one per lax.scan step from a cache built before the loop."""
  @hk.transform
  def decode(x):
    mha = sh.MultiHeadAttention(4, 8, num_kv_heads=2, model_size=16,
                                w_init=hk.initializers.VarianceScaling(1.0))
    cache = mha.init_cache(2, 8, owner=mha.module_name if owned else None)

    def body(cache, x_t):  # x_t [B, D]
      out, cache = mha(x_t[:, None], kv_cache=cache)
      return cache, out[:, 0]

    return hk.scan(body, cache, jnp.swapaxes(x, 0, 1))[1]  # [T, B, D']

  return decode


def test_an_unwritten_cache_in_a_scan_says_what_to_do_and_an_owned_one_decodes():
  x = np.random.default_rng(31).normal(size=(2, 5, 16)).astype(np.float32)
  f = _scanned(owned=False)
  params = f.init(jax.random.PRNGKey(0), x)
  with pytest.raises(TypeError, match=r"owner=None, an unwritten cache .* write it once before "
                                      r"the loop, or build it owned: mha.init_cache\(\.\.\., "
                                      r"owner=mha.module_name\)"):
    f.apply(params, None, x)
  got = _scanned(owned=True).apply(params, None, x)  # [T, B, D']
  p = {n: {k: np.asarray(a, np.float64) for k, a in d.items()} for n, d in params.items()}
  want = oracle.mha(p, x, num_heads=4, num_kv_heads=2, key_size=8, value_size=8)  # causal
  np.testing.assert_allclose(np.swapaxes(np.asarray(got), 0, 1), want, **harness.tol())


def test_owner_must_be_a_layer_name():
  with pytest.raises(ValueError, match=r"`owner` must be a layer's name"):
    sh.KVCache.zeros(1, 4, 1, 4, owner=3)
  assert sh.KVCache.zeros(1, 4, 1, 4, owner="attn").owner == "attn"
  assert sh.PagedKVCache.zeros(2, 4, 1, 4, owner="attn").owner == "attn"
  assert sh.KVCache.zeros(1, 4, 1, 4).owner is None
