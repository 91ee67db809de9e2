"""The native backend (the C++ decode kernel through the XLA FFI) against the float64 oracle:
paged steps at real lengths and page edges over float, bfloat16 and quantized pools, NaN in
free pages and past lengths, the rules, sinks, soft cap, GQA, the log-sum-exp; a fixed cache
through the Haiku module; misuse under jit; vmap, jit and shard_map; gradients (xla's); and a
machine without a compiler (the backend unavailable, nothing else changed)."""

import dataclasses
import subprocess
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
import paged_cases
import processes
import splash_hk as sh
from splash_hk import layer
from splash_hk.backends.native import backend as native

NATIVE = sh.AttentionConfig(platform="native", allow_fallback=False)
# Five sequences at page edges and real lengths (pages of 16): a short one, one ending a page,
# one a page past it, two long ones (one a 3-row verification run), over a pool with NaN in
# every slot no sequence holds.
REAL = dict(kv_lens=(15, 16, 1000, 2047, 0), q_lens=(1, 1, 1, 3, 1), max_seqs=6, pad_rows=2,
            pages_per_seq=130, num_pages=300, page=16, d=64, hq=8, hkv=2, shared_prefix=False)


def _native(config: sh.AttentionConfig) -> sh.AttentionConfig:
  return dataclasses.replace(config, platform="native", allow_fallback=False)


def _run(step, config, **kwargs):
  fn = jax.jit(lambda *a: sh.paged_attention(*a, config=config, **kwargs))
  return fn(step.q, step.k, step.v, step.cache, step.batch)


@harness.needs_native
@pytest.mark.parametrize("rule", ["causal", "window", "chunk", "bidirectional", "soft_cap"])
def test_a_paged_decode_at_real_lengths_matches_the_oracle(rule):
  config, rules = paged_cases.RULES[rule]
  step = paged_cases.step(seed=3, **REAL)
  out, _ = _run(step, _native(config))
  np.testing.assert_allclose(np.asarray(out), paged_cases.attend(step, **rules), **harness.tol())


@harness.needs_native
@pytest.mark.parametrize("level", native.SIMD_LEVELS)
def test_every_simd_level_matches_the_oracle(level, monkeypatch):
  # The kernel's code for each SIMD level (the CPU's best runs where it has no lower ask; a
  # level the CPU lacks runs its best below): head sizes with tails of every width (72: 64 +
  # 8, 20: 16 + 4) and groups of 3 query heads (vectors left over from fours), under a window
  # (blocks seen in part) and over pools of every storage type, and a fixed cache with ALiBi.
  monkeypatch.setenv(native.SIMD_ENV, level)  # read when the calls below are traced
  config, rules = paged_cases.RULES["window"]
  for d, kind in ((72, "float32"), (72, "bfloat16"), (24, "float16"), (20, "int8"),
                  (24, "fp8_e4m3"), (40, "fp8_e5m2")):
    case = {**REAL, "d": d, "hq": 6, "hkv": 2}
    step = (paged_cases.step(seed=14, dtype=getattr(jnp, kind), **case) if "float" in kind
            else paged_cases.quantized_step(kind, 14, **case))
    out, _ = _run(step, _native(config))
    tol = harness.tol(dtype=jnp.bfloat16 if kind in ("bfloat16", "float16") else jnp.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32), paged_cases.attend(step, **rules),
                               **tol)
  cache, q, k, v, lens = _cache_case(15, heads=6, size=72)
  slopes = np.linspace(0.05, 0.3, 6).astype(np.float32)
  settings = layer.Settings(NATIVE, None, sh.MeshAxes(), "layer")
  out, _ = jax.jit(lambda q, k, v, c, a: layer.attend(
      q, k, v, layer.Call(kv_cache=c, bias=sh.scores.Alibi(a)), settings))(q, k, v, cache, slopes)
  bias = lambda s: (-slopes[None, :, None, None] *
                    np.abs(np.arange(s - 2, s)[:, None] - np.arange(s)[None, :]))
  want = [oracle.attention(q[b:b + 1], *(np.concatenate([np.asarray(c[b, :n]), new[b]])[None]
                                         for c, new in ((cache.key, k), (cache.value, v))),
                           bias=bias(n + 2))[0][0] for b, n in enumerate(lens)]
  np.testing.assert_allclose(np.asarray(out), np.stack(want), **harness.tol())


def test_a_simd_level_that_is_not_one_is_refused_by_name(monkeypatch):
  monkeypatch.setenv(native.SIMD_ENV, "sse9")
  with pytest.raises(ValueError, match="SPLASH_HK_NATIVE_SIMD.*portable, avx2, avx512"):
    native.simd()


@harness.needs_native
def test_a_value_one_row_sees_reaches_that_row_alone():
  # The 3-row run of sequence 3 (positions 2047..2049) under a window of (3, 0): the value at
  # 2044 is seen by its first row only; a NaN there is that row's (in its column), no other's.
  step = paged_cases.step(seed=3, **REAL)
  page, slot = int(step.batch.page_table[3, 2044 // 16]), 2044 % 16
  step.cache = step.cache.replace(value=step.cache.value.at[page, 0, slot, 5].set(jnp.nan))
  step.history_v[3][2044, 0, 5] = np.nan
  config, rules = paged_cases.RULES["window"]
  out = np.asarray(_run(step, _native(config))[0])
  want = paged_cases.attend(step, **rules)
  np.testing.assert_allclose(out, want, **harness.tol())  # NaN where the oracle has NaN only
  rows = np.cumsum([0, *step.q_lens])[3]
  assert np.isnan(out[rows, :4, 5]).all() and not np.isnan(out[rows + 1:rows + 3]).any()


@harness.needs_native
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_narrow_float_pool_matches_the_oracle(dtype):
  step = paged_cases.step(seed=4, dtype=dtype, **REAL)
  out, _ = _run(step, NATIVE)
  want = paged_cases.attend(step)
  # The output comes back in the pool's dtype; float16 rounds finer than bfloat16 (its bound).
  np.testing.assert_allclose(np.asarray(out, np.float32), want, **harness.tol(dtype=jnp.bfloat16))


@harness.needs_native
@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_a_quantized_pool_matches_the_oracle_of_its_stored_values(kind):
  step = paged_cases.quantized_step(kind, 5, **REAL)
  config, rules = paged_cases.RULES["window" if kind == "int8" else "causal"]
  out, _ = _run(step, _native(config))
  np.testing.assert_allclose(np.asarray(out), paged_cases.attend(step, **rules), **harness.tol())


@harness.needs_native
def test_sinks_gqa_and_the_log_sum_exp_match_the_oracle():
  step = paged_cases.step(seed=6, **{**REAL, "hq": 8, "hkv": 1})  # MQA: 8 heads on one kv head
  sinks = np.random.default_rng(0).normal(size=(8, 2)).astype(np.float32)
  out, _, lse = _run(step, NATIVE, softmax_aux=jnp.asarray(sinks), return_residuals=True)
  np.testing.assert_allclose(np.asarray(out), paged_cases.attend(step, sinks=sinks),
                             **harness.tol())
  start = 0
  for hk_, hv, ql in zip(step.history_k, step.history_v, step.q_lens):
    _, _, want = oracle.attention(step.q[start:start + ql][None], hk_[None], hv[None],
                                  sinks=sinks, with_lse=True)
    np.testing.assert_allclose(np.asarray(lse[start:start + ql]), want[0], **harness.tol())
    start += ql
  assert np.all(np.asarray(lse[start:]) == -np.inf)  # padding rows


@harness.needs_native
def test_alibi_over_the_pool_and_over_a_fixed_cache_matches_the_oracle():
  step = paged_cases.step(seed=12, **REAL)
  slopes, dense = harness.score_case("alibi", np.arange(2100)[None], np.arange(2100)[None], 8)
  alibi = sh.scores.Alibi(jnp.asarray(slopes))
  out, _ = _run(step, NATIVE.replace(logits_soft_cap=3.0), bias=alibi)
  bias = lambda ql, s: np.asarray(dense(slopes))[:, :, s - ql:s, :s]  # end-aligned rows
  want = paged_cases.attend(step, bias=bias, soft_cap=3.0)
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())
  cache, q, k, v, lens = _cache_case(13)
  settings = layer.Settings(NATIVE, None, sh.MeshAxes(), "layer")
  out, _ = jax.jit(lambda q, k, v, c, a: layer.attend(
      q, k, v, layer.Call(kv_cache=c, bias=sh.scores.Alibi(a)), settings))(q, k, v, cache, slopes)
  want = [oracle.attention(q[b:b + 1], *(np.concatenate([np.asarray(c[b, :n]), new[b]])[None]
                                         for c, new in ((cache.key, k), (cache.value, v))),
                           bias=bias(q.shape[1], n + q.shape[1]))[0][0]
          for b, n in enumerate(lens)]
  np.testing.assert_allclose(np.asarray(out), np.stack(want), **harness.tol())


@harness.needs_native
def test_a_misusing_sequence_outputs_nan_under_jit_and_the_others_proceed():
  step = paged_cases.step(seed=7, **REAL)
  bad = step.batch.kv_lens.at[2].set(-3)  # a negative length: the misuse rule
  batch = dataclasses.replace(step.batch, kv_lens=bad)
  out, cache = jax.jit(lambda *a: sh.paged_attention(*a, config=NATIVE))(
      step.q, step.k, step.v, step.cache, batch)
  out, want = np.asarray(out), paged_cases.attend(step)
  rows = np.cumsum([0, *step.q_lens])
  assert np.isnan(out[rows[2]:rows[3]]).all()
  keep = np.r_[0:rows[2], rows[3]:out.shape[0]]
  np.testing.assert_allclose(out[keep], want[keep], **harness.tol())


def _cache_case(seed, batch=3, max_len=300, heads=8, kv_heads=2, size=64, new=2):
  """A fixed cache of rows filled to different lengths (NaN past them), and `new` rows to
  append: (cache, q, k, v, filled lengths)."""
  rng = np.random.default_rng(seed)
  lens = np.array([0, 17, 281][:batch], np.int32)
  key = rng.normal(size=(batch, max_len, kv_heads, size)).astype(np.float32)
  value = rng.normal(size=(batch, max_len, kv_heads, size)).astype(np.float32)
  slots = np.arange(max_len)[None, :, None, None] >= lens[:, None, None, None]
  key[np.broadcast_to(slots, key.shape)] = np.nan
  value[np.broadcast_to(slots, value.shape)] = np.nan
  cache = sh.KVCache(jnp.asarray(key), jnp.asarray(value), jnp.asarray(lens))
  q = rng.normal(size=(batch, new, heads, size)).astype(np.float32)
  k = rng.normal(size=(batch, new, kv_heads, size)).astype(np.float32)
  v = rng.normal(size=(batch, new, kv_heads, size)).astype(np.float32)
  return cache, q, k, v, lens


def _cache_oracle(cache, q, k, v, lens, **rules):
  outs = []
  for b, n in enumerate(lens):
    hk_ = np.concatenate([np.asarray(cache.key[b, :n]), k[b]])[None]
    hv = np.concatenate([np.asarray(cache.value[b, :n]), v[b]])[None]
    outs.append(oracle.attention(q[b:b + 1], hk_, hv, **rules)[0][0])
  return np.stack(outs)


@harness.needs_native
@pytest.mark.parametrize("rule", ["causal", "window", "soft_cap"])
def test_the_fixed_cache_through_the_layer_matches_the_oracle(rule):
  config, rules = paged_cases.RULES[rule]
  cache, q, k, v, lens = _cache_case(8)
  settings = layer.Settings(_native(config), None, sh.MeshAxes(), "layer")
  out, _ = jax.jit(lambda q, k, v, cache: layer.attend(q, k, v, layer.Call(kv_cache=cache),
                                                       settings))(q, k, v, cache)
  np.testing.assert_allclose(np.asarray(out), _cache_oracle(cache, q, k, v, lens, **rules),
                             **harness.tol())


@harness.needs_native
def test_the_haiku_module_decodes_over_an_int8_cache_on_the_native_kernel():
  batch, heads, kv_heads, size, prefill, decode = 2, 8, 2, 32, 5, 3
  x = np.random.default_rng(9).normal(size=(batch, prefill + decode, 32)).astype(np.float32)

  @hk.transform
  def run(x):
    mha = sh.MultiHeadAttention(heads, size, num_kv_heads=kv_heads, model_size=32,
                                w_init=hk.initializers.VarianceScaling(1.0), config=NATIVE)
    cache = mha.init_cache(batch, 40, dtype=jnp.int8)
    outs = []
    for start, stop in [(0, prefill)] + [(t, t + 1) for t in range(prefill, prefill + decode)]:
      out, cache = mha(x[:, start:stop], kv_cache=cache)
      outs.append(out)
    return jnp.concatenate(outs, axis=1), cache

  params = run.init(jax.random.key(0), x)
  out, cache = jax.jit(run.apply)(params, None, x)
  p = {n: {w: np.asarray(a, np.float64) for w, a in m.items()} for n, m in params.items()}
  lin = lambda a, m: a @ p[f"multi_head_attention/{m}"]["w"] + p[f"multi_head_attention/{m}"]["b"]
  n = prefill + decode
  q = lin(x, "query").reshape(batch, n, heads, size)
  stored = lambda c: np.asarray(c.values, np.float64) * np.asarray(c.scale)
  attended, _ = oracle.attention(q, stored(cache.key)[:, :n], stored(cache.value)[:, :n])
  want = lin(attended.reshape(batch, n, -1), "linear")
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())


@harness.needs_native
def test_vmap_jit_and_shard_map():
  cache, q, _, _, lens = _cache_case(10, new=1)
  k_all, v_all = np.array(cache.key), np.array(cache.value)
  kv_seg = np.where(np.arange(k_all.shape[1])[None] < lens[:, None], 0, -1).astype(np.int32)
  q_seg = np.zeros(q.shape[:2], np.int32)
  config = NATIVE.replace(causal=False)
  call = lambda q, k, v, kv_seg: sh.attention(q, k, v, config=config, q_segment_ids=q_seg,
                                              kv_segment_ids=kv_seg).attention_outputs
  want = np.stack([oracle.attention(q[b:b + 1], k_all[b:b + 1, :n], v_all[b:b + 1, :n],
                                    causal=False)[0][0] if n else np.zeros(q.shape[1:])
                   for b, n in enumerate(lens)])  # NaN past the lengths: never read
  got = jax.jit(call)(q, k_all, v_all, kv_seg)
  np.testing.assert_allclose(np.asarray(got), want, **harness.tol())
  stacked = jax.vmap(call)(*(np.stack([a, a]) for a in (q, k_all, v_all, kv_seg)))
  np.testing.assert_allclose(np.asarray(stacked[1]), want, **harness.tol())
  mesh = harness.mesh("1x8")  # heads over tp (2 kv heads: repeated to its 8 shards)
  sharded = jax.jit(lambda *a: sh.attention(
      *a[:3], config=config, q_segment_ids=q_seg, kv_segment_ids=a[3], mesh=mesh,
      axes=sh.MeshAxes(batch=None, heads="tp")).attention_outputs)(q, k_all, v_all, kv_seg)
  np.testing.assert_allclose(np.asarray(sharded), want, **harness.tol())


@harness.needs_native
def test_a_differentiated_call_runs_xla_and_matches_the_oracle_gradients():
  rng = np.random.default_rng(11)
  q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((2, 2, 4, 16), (2, 40, 2, 16),
                                                               (2, 40, 2, 16)))
  cot = rng.normal(size=(2, 2, 4, 16)).astype(np.float32)
  got = harness.values_and_grads(
      lambda q, k, v: sh.attention(q, k, v, config=NATIVE).attention_outputs, (q, k, v), cot)
  harness.assert_close(got, harness.oracle_values_and_grads(q, k, v, cot))


@harness.needs_native
def test_explain_names_native_for_decode_and_its_refusal_for_a_prefill():
  q, k = jax.ShapeDtypeStruct((2, 1, 8, 64), jnp.float32), jax.ShapeDtypeStruct(
      (2, 512, 2, 64), jnp.float32)
  assert sh.explain(q, k, k).backend == "native"
  long_q = jax.ShapeDtypeStruct((2, 64, 8, 64), jnp.float32)
  decision = sh.explain(long_q, k, k)
  assert decision.backend == "xla" and "native: query_len 64 is more than" in decision.reason
  assert sh.explain(q, k, k, for_platform="tpu").backend != "native"


@harness.needs_native
def test_keys_and_values_stored_differently_run_on_xla_and_match_the_oracle():
  rng = np.random.default_rng(14)
  q = rng.normal(size=(2, 1, 8, 64)).astype(np.float32)
  k, v = (rng.normal(size=(2, 300, 2, 64)).astype(np.float32) for _ in range(2))
  key = sh.quantize(k, jnp.int8)  # one scale per (token, kv head); the values stay float32
  decision = sh.explain(q, key, v)
  assert decision.backend == "xla" and not decision.fallback, decision
  assert "not native: keys and values are stored differently" in decision.reason
  stored = np.asarray(key.values, np.float64) * np.asarray(key.scale)
  out = sh.attention(q, key, v).attention_outputs
  np.testing.assert_allclose(np.asarray(out), oracle.attention(q, stored, v)[0], **harness.tol())


NO_COMPILER = """
import jax, jax.numpy as jnp, numpy as np, splash_hk as sh
q = np.ones((1, 1, 2, 8), np.float32); k = np.ones((1, 5, 2, 8), np.float32)
decision = sh.explain(q, k, k)
out = sh.attention(q, k, k).attention_outputs
print(decision.backend, "|", decision.reason, "|", float(out.sum()))
"""


def test_without_a_compiler_the_backend_is_unavailable_and_nothing_else_changes(tmp_path):
  env = processes.env()
  env.update(CXX=str(tmp_path / "no-such-compiler"), SPLASH_HK_NATIVE_CACHE=str(tmp_path))
  done = subprocess.run([sys.executable, "-c", NO_COMPILER], env=env, capture_output=True,
                        text=True, timeout=300, check=True)
  backend, reason, total = done.stdout.strip().splitlines()[-1].split(" | ")
  assert backend == "xla", done.stdout
  assert "native: the native kernel is unavailable" in reason and "no C++ compiler" in reason
  assert float(total) == pytest.approx(16.0)
