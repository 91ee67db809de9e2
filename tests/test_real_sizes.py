"""At the sizes users run: default tiles, B >= 2, T in the thousands, against the float64 oracle.

With the default tiles (512 x 256) and H * D >= 32 the xla path runs one batch row per
block step (`xla_plan.PER_ROW_WORK`), so rows packed differently skip different blocks;
caches of 2048 slots hold many key blocks, with garbage in the slots nobody may see.
"""


import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
from splash_hk.backends.tpu import horizon as splash_horizon
import harness
import oracle



def _packed_rows(batch: int, length: int, seed: int, restart: bool):
  """Per-row packing: documents of random lengths, then padding (-1); positions restart per document."""
  rng = np.random.default_rng(seed)
  seg = np.full((batch, length), -1, np.int32)
  pos = np.zeros((batch, length), np.int32)
  for b in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length - 64), size=4 + 3 * b, replace=False))
    bounds = [0, *cuts, length - 40 * (b + 1)]  # row b ends in 40 * (b + 1) padding tokens
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
      seg[b, lo:hi] = i
      pos[b, lo:hi] = np.arange(hi - lo) if restart else np.arange(lo, hi)
  return seg, pos


def _arrays(batch, length, num_heads, num_kv_heads, head_dim, seed):
  rng = np.random.default_rng(seed)
  shape = lambda h: (batch, length, h, head_dim)
  q, k, v, cot = (rng.normal(size=shape(h)).astype(np.float32)
                  for h in (num_heads, num_kv_heads, num_kv_heads, num_heads))
  return q, k, v, cot


def _check_against_oracle(config, q, k, v, cot, oracle_kw, **extras):
  """Forward and dq/dk/dv of sum(out * cot) against the float64 oracle."""
  harness.check_against_oracle(
      lambda q, k, v: sh.attention(q, k, v, config=config, **extras).attention_outputs,
      q, k, v, cot, **oracle_kw)


@pytest.mark.parametrize("restart", [True, False], ids=["restarting_positions", "global_positions"])
def test_packed_rows_with_padding_at_t1536(restart):
  q, k, v, cot = _arrays(2, 1536, 4, 2, 32, seed=1)
  seg, pos = _packed_rows(2, 1536, seed=2, restart=restart)
  positions = dict(q_positions=pos) if restart else {}
  _check_against_oracle(sh.AttentionConfig(platform="xla"), q, k, v, cot,
                        dict(q_seg=seg, q_pos=pos, kv_pos=pos), q_segment_ids=seg, **positions)


def test_window_256_at_t2048_gqa():
  q, k, v, cot = _arrays(2, 2048, 4, 2, 32, seed=3)
  config = sh.AttentionConfig(platform="xla", sliding_window=(256, 0), logits_soft_cap=20.0)
  _check_against_oracle(config, q, k, v, cot, dict(window=(256, 0), soft_cap=20.0))


def test_alibi_plus_t5_buckets_on_packed_rows_at_t1536_default_tiles():
  # Both position objects at once (their sum), on per-row packed documents with restarting
  # positions and padding, GQA: values and the gradients of q, k, v, slopes and the table.
  q, k, v, cot = _arrays(2, 1536, 4, 2, 32, seed=7)
  seg, pos = _packed_rows(2, 1536, seed=8, restart=True)
  slopes = np.asarray(sh.scores.alibi_slopes(4))
  table = np.random.default_rng(9).normal(size=(32, 4)).astype(np.float32)
  dist = np.abs(pos[:, None, :, None] - pos[:, None, None, :])  # [B, 1, T, S]
  bucket = oracle.t5_bucket(pos[:, None, :] - pos[:, :, None], 32, 128, True, np)  # [B, T, S]
  dense = lambda p: -p[0][None, :, None, None] * dist + jnp.moveaxis(p[1][bucket], -1, 1)
  bias = lambda p: sh.scores.Alibi(p[0]) + sh.scores.RelativePosition(p[1])
  f = lambda q, k, v, p: sh.attention(q, k, v, config=sh.AttentionConfig(platform="xla"),
                                      q_segment_ids=seg, q_positions=pos,
                                      bias=bias(p)).attention_outputs
  out, grads = harness.values_and_grads(f, (q, k, v, (slopes, table)), cot)
  want_out, want_grads = oracle.out_and_vjp(q, k, v, cot, bias=dense, bias_params=(slopes, table),
                                            q_seg=seg, q_pos=pos, kv_pos=pos)
  harness.assert_close((out, grads[:3]), (want_out, want_grads[:3]))
  for g, w in zip(grads[3], want_grads[3]):
    harness.assert_near(g, w, "grad")


# The KV cache at 2048 slots: rows at lengths 0, 1 and capacity - 1, NaN in every unused slot.
CAPACITY, HEADS, KV_HEADS, KEY, MODEL = 2048, 4, 2, 16, 32


def _mha(causal: bool):
  return hk.without_apply_rng(hk.transform(
      lambda x, cache, lengths: sh.MultiHeadAttention(
          HEADS, KEY, num_kv_heads=KV_HEADS, model_size=MODEL,
          w_init=hk.initializers.VarianceScaling(1.0), config=sh.AttentionConfig(causal=causal))(
              x, kv_cache=cache, lengths=lengths)))


def _cache(lengths, seed):
  """A cache whose filled slots hold random keys/values and whose unused slots hold NaN."""
  rng = np.random.default_rng(seed)
  shape = (len(lengths), CAPACITY, KV_HEADS, KEY)
  filled = np.arange(CAPACITY)[None, :, None, None] < np.asarray(lengths)[:, None, None, None]
  key, value = (np.where(filled, rng.normal(size=shape), np.nan).astype(np.float32)
                for _ in range(2))
  return sh.KVCache(jnp.asarray(key), jnp.asarray(value), jnp.asarray(lengths, jnp.int32))


def _cache_oracle(params, cache, x, lengths, causal):
  """float64 outputs of row b's first lengths[b] new tokens attending to its cache and themselves."""
  p = {m: {n: np.asarray(a, np.float64) for n, a in w.items()} for m, w in params.items()}
  lin = lambda a, m: a @ p[f"multi_head_attention/{m}"]["w"] + p[f"multi_head_attention/{m}"]["b"]
  rows = []
  for b, (start, n) in enumerate(zip(np.asarray(cache.length), lengths)):
    new = x[b, :n].astype(np.float64)
    q = lin(new, "query").reshape(1, n, HEADS, KEY)
    keys = np.concatenate([np.asarray(cache.key[b, :start]), lin(new, "key").reshape(n, KV_HEADS, KEY)])
    vals = np.concatenate([np.asarray(cache.value[b, :start]),
                           lin(new, "value").reshape(n, KV_HEADS, KEY)])
    out, _ = oracle.attention(q, keys[None], vals[None], causal=causal,
                              q_pos=start + np.arange(n)[None], kv_pos=np.arange(start + n)[None])
    rows.append(lin(out.reshape(n, HEADS * KEY), "linear"))
  return rows


@pytest.mark.parametrize("query_len,lengths,causal", [
    (1, [1, 1, 1], True), (1, [1, 1, 1], False), (64, [64, 17, 1], True), (64, [64, 17, 1], False)],
    ids=["decode", "decode_bidirectional", "ragged_prefill", "ragged_prefill_bidirectional"])
def test_cache_of_2048_slots_with_rows_at_0_1_and_capacity_minus_1(query_len, lengths, causal):
  # Without the causal rule only the cache's own padding keeps a row off its unused slots.
  mha = _mha(causal)
  cache = _cache([0, 1, CAPACITY - 1], seed=4)
  x = np.random.default_rng(5).normal(size=(3, query_len, MODEL)).astype(np.float32)
  params = mha.init(jax.random.PRNGKey(6), x, cache, jnp.asarray(lengths))
  out, new_cache = jax.jit(mha.apply)(params, x, cache, jnp.asarray(lengths))
  np.testing.assert_array_equal(new_cache.length, [lengths[0], 1 + lengths[1], CAPACITY])
  for b, want in enumerate(_cache_oracle(params, cache, x, lengths, causal)):
    np.testing.assert_allclose(np.asarray(out[b, :lengths[b]]), want, **harness.tol(), err_msg=f"row {b}")
  assert np.all(np.isfinite(np.asarray(out)))


def test_splash_interpret_packed_rows_with_padding_at_t1536():
  # Splash serves segment ids at default positions; its own tiles (128), padding masked.
  q, k, v, cot = _arrays(2, 1536, 4, 2, 32, seed=7)
  seg, pos = _packed_rows(2, 1536, seed=8, restart=False)
  config = sh.AttentionConfig(platform="splash", interpret=True, allow_fallback=False)
  assert sh.explain(q, k, v, config=config, q_segment_ids=seg).backend == "splash"
  _check_against_oracle(config, q, k, v, cot, dict(q_seg=seg), q_segment_ids=seg)


def test_splash_interpret_window_256_at_t2048_gqa():
  q, k, v, cot = _arrays(2, 2048, 4, 2, 32, seed=9)
  config = sh.AttentionConfig(platform="splash", interpret=True, allow_fallback=False,
                              sliding_window=(256, 0), logits_soft_cap=20.0)
  assert sh.explain(q, k, v, config=config).backend == "splash"
  _check_against_oracle(config, q, k, v, cot, dict(window=(256, 0), soft_cap=20.0))


def test_splash_interpret_prefix_lm_per_row_at_t1500_gqa():
  # Causal | Bidirectional with each row's own prefix (traced ids): splash's per-example plan
  # (backends/tpu/horizon.py), default tiles, a partial last block, prefixes over block edges.
  q, k, v, cot = _arrays(2, 1500, 4, 2, 32, seed=10)
  pos = np.arange(1500)
  ids = np.where(pos < np.array([[700], [131]]), 0, -1).astype(np.int32)  # [B, T]
  mask = sh.masks.Causal() | sh.masks.Bidirectional(ids)
  config = sh.AttentionConfig(platform="splash", interpret=True, allow_fallback=False)
  assert sh.explain(q, k, v, config=config, mask=mask).backend == "splash"
  assert splash_horizon.horizon(mask, 1500, 1500)[1]  # exact: the kernel runs, not the xla path
  same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
  dense = ((pos[None, None, :] <= pos[None, :, None]) | same)[:, None]  # [B, 1, T, T]
  _check_against_oracle(config, q, k, v, cot, dict(causal=False, mask=dense), mask=mask)
