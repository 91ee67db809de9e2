"""Quantized keys and values: `sh.quantize`'s definition, `attention` over `sh.Quantized` and
`qwix.QArray` inputs, int8/fp8 fixed and paged caches, against the float64 oracle run on the
dequantized values (values * scale, computed here in NumPy)."""

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness
import oracle
import splash_hk as sh
import paged_cases
from paged_cases import FORMATS, np_quantize as _np_quantize, quantized_step as _quantized_step

B, T, HQ, HKV, D = 2, 300, 4, 2, 64  # T crosses a block boundary at the default tiles
def _full_scale(q):
  """A Quantized's scale [..., 1 | tiles | D] over its channels (a tile's scale on each of its)."""
  scale, channels = np.asarray(q.scale, np.float64), np.shape(q.values)[-1]
  if scale.ndim and scale.shape[-1] not in (1, channels):
    scale = np.repeat(scale, channels // scale.shape[-1], axis=-1)
  return scale


def _dequantized(q):
  """values * scale in float64 (the value a `Quantized` stands for)."""
  return np.asarray(q.values).astype(np.float64) * _full_scale(q)


def _scale_grad(q, d_dequantized):
  """d scale = sum(d dequantized * values) over the scale's broadcast (and a tile's channels),
  in float64: the chain rule through values * scale."""
  product = np.asarray(d_dequantized, np.float64) * np.asarray(q.values).astype(np.float64)
  shape = np.shape(q.scale)
  if not shape:
    return product.sum()
  if shape[-1] not in (1, product.shape[-1]):
    product = product.reshape(*product.shape[:-1], shape[-1], -1).sum(-1)
  axes = tuple(a for a, n in enumerate(shape) if n == 1 and product.shape[a] != 1)
  return product.sum(axis=axes, keepdims=True)


@pytest.mark.parametrize("kind", list(FORMATS))
def test_quantize_follows_its_definition(kind):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 5, 2, 16)).astype(np.float32) * 3
  x[0, 0, 0] = 0  # an all-zero slice: scale 1
  x[1, 0, 0, :2] = [127, 0.5]  # int8: exactly half a step
  for axis in (-1, (1, 3)):
    got = sh.quantize(x, getattr(jnp, np.dtype(FORMATS[kind][0]).name), axis=axis)
    scale = _np_quantize(x, kind, axis)[1]
    np.testing.assert_allclose(np.asarray(got.scale), scale, rtol=2 ** -23, atol=0)
    values, scale = _np_quantize(x, kind, axis, scale=np.asarray(got.scale))
    assert got.values.dtype == values.dtype and got.scale.shape == scale.shape
    np.testing.assert_array_equal(np.asarray(got.values).astype(np.float32),
                                  values.astype(np.float32))
  assert float(sh.quantize(x, jnp.int8).scale[0, 0, 0, 0]) == 1.0


def test_quantize_refuses_a_dtype_it_cannot_hold():
  with pytest.raises(ValueError, match="`dtype` must be a quantized dtype"):
    sh.quantize(np.ones((2, 4)), jnp.int16)


SCALES = ("tensor", "token", "head", "channel", "token_head", "sub_channel")  # DESIGN's forms


def _scale_shape(form, length, dim):
  """The scale's shape for values [B, length, Hkv, dim]: the values' rank (broadcast axes of
  size 1), or () for one scale per tensor; sub_channel: a scale per tile of 16 channels."""
  return {"tensor": (), "token": (B, length, 1, 1), "head": (1, 1, HKV, 1),
          "channel": (1, 1, 1, dim), "token_head": (B, length, HKV, 1),
          "sub_channel": (B, length, HKV, dim // 16)}[form]


def _quantized(rng, shape, kind, scale_shape):
  """Random values of `kind` with random positive scales of `scale_shape` (tokamax's cases)."""
  dtype, largest = FORMATS[kind]
  values = rng.uniform(-largest, largest, size=shape)
  values = (np.round(values) if kind.startswith("int") else values).astype(dtype)
  scale = rng.uniform(0.5, 1.5, size=scale_shape).astype(np.float32) / largest
  return sh.Quantized(jnp.asarray(values), jnp.asarray(scale))


def _inputs(seed, kind="int8", scale="token_head", length=T, value_dim=D):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, length, HQ, D)).astype(np.float32)
  k = _quantized(rng, (B, length, HKV, D), kind, _scale_shape(scale, length, D))
  v = _quantized(rng, (B, length, HKV, value_dim), kind, _scale_shape(scale, length, value_dim))
  cot = rng.normal(size=(B, length, HQ, value_dim)).astype(np.float32)
  return q, k, v, cot


def _check_q_grads(f, q, k, v, cot, **rules):
  """out and d/dq of f(q) (k, v quantized) against the oracle on the dequantized k, v."""
  got = harness.values_and_grads(f, (q,), cot)
  want_out, want_grads = harness.oracle_values_and_grads(q, _dequantized(k), _dequantized(v),
                                                         cot, **rules)
  harness.assert_close(got, (want_out, want_grads[:1]), names=("dq",))


@pytest.mark.parametrize("platform", ["xla", "reference"])
@pytest.mark.parametrize("kind,scale", [("int8", "token_head"), ("int8", "tensor"),
                                        ("int4", "channel"), ("fp8_e4m3", "token"),
                                        ("fp8_e5m2", "head"), ("int4", "sub_channel")])
def test_values_and_query_gradients_match_the_oracle_on_the_dequantized_values(platform, kind,
                                                                               scale):
  q, k, v, cot = _inputs(1, kind, scale)
  config = sh.AttentionConfig(platform=platform, allow_fallback=False)
  f = lambda q: sh.attention(q, k, v, config=config).attention_outputs
  _check_q_grads(f, q, k, v, cot)


RULES = {
    "window": (sh.AttentionConfig(sliding_window=(70, 0)), dict(window=(70, 0))),
    "chunk": (sh.AttentionConfig(chunk_size=128), dict(chunk=128)),
    "bidirectional_soft_cap": (sh.AttentionConfig(causal=False, logits_soft_cap=5.0),
                               dict(causal=False, soft_cap=5.0)),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_every_rule_with_sinks_a_bias_and_value_size(rule):
  config, rules = RULES[rule]
  q, k, v, cot = _inputs(2, "int8", "token_head", value_dim=48)
  rng = np.random.default_rng(3)
  sinks = rng.normal(size=(HQ,)).astype(np.float32)
  bias = rng.normal(size=(1, HQ, T, T)).astype(np.float32)
  config = dataclasses.replace(config, platform="xla", allow_fallback=False)
  out = sh.attention(q, k, v, config=config, softmax_aux=sinks, bias=bias).attention_outputs
  want, _ = oracle.attention(q, _dequantized(k), _dequantized(v), sinks=sinks, bias=bias, **rules)
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())


def test_a_quantized_query_and_a_decode_step_of_a_long_cache():
  rng = np.random.default_rng(4)
  q = sh.quantize(rng.normal(size=(B, 1, HQ, D)), jnp.int8)
  k = _quantized(rng, (B, 2048, HKV, D), "int8", (B, 2048, HKV, 1))
  v = _quantized(rng, (B, 2048, HKV, D), "int8", (B, 2048, HKV, 1))
  out = sh.attention(q, k, v).attention_outputs
  want, _ = oracle.attention(_dequantized(q), _dequantized(k), _dequantized(v))
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())


@pytest.mark.parametrize("mesh_name,axes", [
    ("2x4", sh.MeshAxes(batch="dp", heads="tp")),
    ("sp4", sh.MeshAxes(batch=None, heads=None, sequence="sp", sequence_strategy="ring")),
    ("sp2", sh.MeshAxes(batch=None, heads=None, sequence="sp", sequence_strategy="ulysses")),
])
def test_meshes_ring_and_ulysses(mesh_name, axes):
  q, k, v, cot = _inputs(5, "int8", "tensor", length=256)
  config = sh.AttentionConfig(platform="xla", allow_fallback=False)
  mesh = harness.mesh(mesh_name)
  f = lambda q: sh.attention(q, k, v, config=config, mesh=mesh, axes=axes).attention_outputs
  got = harness.values_and_grads(f, (q,), cot)
  want_out, want_grads = harness.oracle_values_and_grads(q, _dequantized(k), _dequantized(v), cot)
  harness.assert_close(got, (want_out, want_grads[:1]), grad="sharded_grad", names=("dq",))


@pytest.mark.parametrize("platform", ["xla", "reference"])
@pytest.mark.parametrize("kind,scale", [("int8", "token_head"), ("int8", "tensor"),
                                        ("fp8_e4m3", "channel"), ("int4", "sub_channel"),
                                        ("fp8_e5m2", "head")])
def test_scales_get_the_oracles_gradient_and_codes_none(platform, kind, scale):
  q, k, v, cot = _inputs(6, kind, scale)
  config = sh.AttentionConfig(platform=platform, allow_fallback=False)
  f = lambda q, ks, vs, kc, vc: sh.attention(q, sh.Quantized(kc, ks), sh.Quantized(vc, vs),
                                             config=config).attention_outputs
  codes = (k.values, v.values) if kind.startswith("fp8") else ()  # JAX differentiates floats
  g = f if codes else lambda q, ks, vs: f(q, ks, vs, k.values, v.values)
  (out, grads) = harness.values_and_grads(g, (q, k.scale, v.scale, *codes), cot)
  want_out, (dq, dk, dv) = harness.oracle_values_and_grads(q, _dequantized(k), _dequantized(v),
                                                           cot)
  harness.assert_close((out, grads[:3]), (want_out, [dq, _scale_grad(k, dk), _scale_grad(v, dv)]),
                       names=("dq", "dk_scale", "dv_scale"))
  if codes:  # float codes: JAX would differentiate them; they get none
    assert not np.any(grads[3]) and not np.any(grads[4])


def test_a_quantization_inside_the_differentiated_function_reaches_its_input():
  # tokamax's case: the key quantized inside jax.vjp, so its scale (absmax / 127 per token and
  # head) carries the tangent back to the float key; the codes carry none (stop_gradient).
  rng = np.random.default_rng(16)
  q = rng.normal(size=(B, T, HQ, D)).astype(np.float32)
  k = rng.normal(size=(B, T, HKV, D)).astype(np.float32)
  v = rng.normal(size=(B, T, HKV, D)).astype(np.float32)
  cot = rng.normal(size=(B, T, HQ, D)).astype(np.float32)
  f = lambda k: sh.attention(q, sh.quantize(k, jnp.int8), v).attention_outputs
  out, vjp = jax.vjp(f, jnp.asarray(k))
  (got,) = vjp(jnp.asarray(cot))
  k8 = sh.quantize(k, jnp.int8)
  want_out, (_, dk, _) = harness.oracle_values_and_grads(q, _dequantized(k8), v, cot)
  d_scale = _scale_grad(k8, dk)  # [B, T, Hkv, 1]
  top = np.argmax(np.abs(k), axis=-1)[..., None]  # where absmax comes from (no ties: normal k)
  want = np.zeros_like(k, np.float64)
  np.put_along_axis(want, top, d_scale * np.sign(np.take_along_axis(k, top, -1)) / 127, -1)
  np.testing.assert_allclose(np.asarray(out), want_out, **harness.tol())
  harness.assert_near(got, want, "grad", err_msg="dk through the scale")


def test_a_scale_tiling_an_axis_other_than_the_channels_is_refused_naming_it():
  """What the quantized guide says: only the channel axis may be tiled."""
  k = jnp.ones((2, 64, 2, 16), jnp.int8)
  for scale, ok in (((2, 64, 2, 4), True), ((2, 32, 2, 1), False)):
    quantized = sh.Quantized(k, jnp.ones(scale, jnp.float32))
    call = lambda: sh.attention(jnp.ones((2, 64, 2, 16)), quantized, quantized)
    if ok:
      call()
    else:
      with pytest.raises(ValueError, match=r"`key.scale` \(2, 32, 2, 1\) must broadcast"):
        call()


@pytest.mark.parametrize("scale,meant", [((B, 64), r"\(2, 64, 1, 1\)"), ((64,), r"\(1, 64, 1, 1\)")])
def test_a_scale_of_lower_rank_than_its_values_is_refused_with_the_shapes_meant(scale, meant):
  # S == D: a [B, S] or [S] per-token scale would broadcast as a per-channel one.
  rng = np.random.default_rng(17)
  q = rng.normal(size=(B, 64, HQ, 64)).astype(np.float32)
  k = _quantized(rng, (B, 64, HKV, 64), "int8", (B, 64, 1, 1))
  v = _quantized(rng, (B, 64, HKV, 64), "int8", (B, 64, 1, 1))
  lower = sh.Quantized(k.values, jnp.ones(scale, jnp.float32))
  with pytest.raises(ValueError, match=r"`key.scale` .* has fewer axes than its values .*" + meant):
    sh.attention(q, lower, v)
  with pytest.raises(ValueError, match=r"`value.scale`"):
    sh.attention(q, k, sh.Quantized(v.values, jnp.ones(scale, jnp.float32)))


def test_splash_and_triton_fall_back_naming_the_quantized_arguments():
  q, k, v, _ = _inputs(7)
  for platform in ("splash", "triton"):
    config = sh.AttentionConfig(platform=platform, interpret=True)
    decision = sh.explain(q, k, v, config=config)
    assert decision.backend == "xla" and "`key` and `value` are quantized" in decision.reason
    with pytest.raises(ValueError, match="`key` and `value` are quantized"):
      sh.explain(q, k, v, config=dataclasses.replace(config, allow_fallback=False))
  assert "`value` is quantized" in sh.explain(q, _dequantized(k).astype(np.float32), v,
                                              config=config).reason


def test_qwix_qarrays_round_trip_tiled_ones_serve_and_asymmetric_ones_are_refused():
  qarray = pytest.importorskip("qwix._src.core.qarray")
  rng = np.random.default_rng(8)
  q = rng.normal(size=(B, 64, HQ, D)).astype(np.float32)
  kv = rng.normal(size=(2, B, 64, HKV, D)).astype(np.float32)
  per_token = qarray.HowToQuantize(qtype=jnp.int8, channelwise_axes=(0, 1, 2))
  k, v = (qarray.quantize(jnp.asarray(a), per_token) for a in kv)
  out = sh.attention(q, k, v).attention_outputs
  dq = lambda a: np.asarray(a.qvalue, np.float64) * np.asarray(a.scale, np.float64)
  np.testing.assert_allclose(np.asarray(out), oracle.attention(q, dq(k), dq(v))[0],
                             **harness.tol())
  for qtype in (jnp.int8, jnp.int4):  # sub-channel: a scale per tile of 16 channels
    tiled = qarray.quantize(jnp.asarray(kv[0]), qarray.HowToQuantize(
        qtype=qtype, channelwise_axes=(0, 1, 2), tiled_axes={3: 16}))
    assert tiled.scale.shape == (B, 64, HKV, D // 16)
    out = sh.attention(q, tiled, v).attention_outputs
    np.testing.assert_allclose(np.asarray(out), oracle.attention(
        q, np.asarray(qarray.dequantize(tiled), np.float64), dq(v))[0], **harness.tol())
  odd = sh.Quantized(k.qvalue, jnp.ones((B, 64, HKV, 5), jnp.float32))  # 5 does not tile 64
  with pytest.raises(ValueError, match="`key.scale` .* must broadcast to its values"):
    sh.attention(q, odd, v)
  shifted = dataclasses.replace(k, zero_point=jnp.zeros_like(k.scale))
  with pytest.raises(ValueError, match="`key` is a qwix.QArray with a zero_point"):
    sh.attention(q, shifted, v)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_a_quantized_cache_in_the_haiku_module_decodes_as_the_oracle_attends(kind):
  heads, kv_heads, size, batch, prefill, decode = 4, 2, 16, 2, 9, 4
  dtype = getattr(jnp, np.dtype(FORMATS[kind][0]).name)
  x = np.random.default_rng(9).normal(size=(batch, prefill + decode, 32)).astype(np.float32)

  @hk.transform
  def run(x):
    mha = sh.MultiHeadAttention(heads, size, num_kv_heads=kv_heads, model_size=32,
                                w_init=hk.initializers.VarianceScaling(1.0))
    cache = mha.init_cache(batch, 16, dtype=dtype)
    outs = []
    for start, stop in [(0, prefill)] + [(t, t + 1) for t in range(prefill, prefill + decode)]:
      out, cache = mha(x[:, start:stop], kv_cache=cache)
      outs.append(out)
    return jnp.concatenate(outs, axis=1), cache

  params = run.init(jax.random.key(0), x)
  out, cache = jax.jit(run.apply)(params, None, x)
  assert cache.key.values.dtype == dtype and cache.key.scale.shape == (batch, 16, kv_heads, 1)
  p = {n: {w: np.asarray(a, np.float64) for w, a in m.items()} for n, m in params.items()}
  lin = lambda a, m: a @ p[f"multi_head_attention/{m}"]["w"] + p[f"multi_head_attention/{m}"]["b"]
  n = prefill + decode
  q = lin(x, "query").reshape(batch, n, heads, size)
  k = lin(x, "key").reshape(batch, n, kv_heads, size)
  stored = _dequantized(cache.key)[:, :n]
  np.testing.assert_array_equal(np.asarray(cache.key.values)[:, :n].astype(np.float32),
                                _np_quantize(stored, kind)[0].astype(np.float32))
  assert np.max(np.abs(stored - k)) <= np.max(np.abs(k)) / FORMATS[kind][1] * 16
  attended, _ = oracle.attention(q, stored, _dequantized(cache.value)[:, :n])
  want = lin(attended.reshape(batch, n, -1), "linear")
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("rule", ["causal", "window", "soft_cap"])
@pytest.mark.parametrize("platform", ["xla", "splash"])
def test_a_paged_step_over_a_quantized_pool_matches_the_oracle_and_writes_its_tokens(
    platform, kind, rule):
  """xla's tiles and the TPU paged kernel (interpret mode; int8 codes, fp8 ones fall back to
  xla naming their storage): codes dequantized on the tile or in VMEM, scales per token and kv
  head; NaN codes and scales in every free slot."""
  config, rules = paged_cases.RULES[rule]
  page = 32 if platform == "splash" else 4  # the TPU kernel's int8 pages: whole tiles of codes
  step = _quantized_step(kind, 1, page=page)
  fp8_on_tpu = platform == "splash" and kind != "int8"
  config = dataclasses.replace(config, platform=platform, allow_fallback=fp8_on_tpu,
                               interpret=platform == "splash")
  decision = sh.explain_paged(step.q, step.k, step.v, step.cache, step.batch, config=config)
  assert (decision.backend == "xla") == (platform == "xla" or fp8_on_tpu), decision
  if fp8_on_tpu:
    assert f"{np.dtype(FORMATS[kind][0]).name}/token" in decision.reason, decision
  out, cache = jax.jit(lambda *a: sh.paged_attention(*a, config=config))(
      step.q, step.k, step.v, step.cache, step.batch)
  np.testing.assert_allclose(np.asarray(out), paged_cases.attend(step, **rules), **harness.tol())
  table, kv_lens = np.asarray(step.batch.page_table), np.asarray(step.batch.kv_lens)
  slots = [(table[s, t // page], t % page) for s, ql in enumerate(step.q_lens)
           for t in range(kv_lens[s], kv_lens[s] + ql)]  # where each new row is written
  pools = zip((step.k, step.v), cache.token_major(), step.cache.token_major())
  for new, got, want in pools:  # the new tokens quantized as written ([P, page, Hkv, .])
    want = jax.tree.map(np.array, want)
    got_scale = np.asarray(got.scale)
    for row, slot in enumerate(slots):
      want.scale[slot] = _np_quantize(new[row], kind)[1]
      want.values[slot] = _np_quantize(new[row], kind, scale=got_scale[slot])[0]
    np.testing.assert_allclose(got_scale, want.scale, rtol=2 ** -23, atol=0)
    np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8),
                                  want.values.view(np.uint8))  # bit for bit, NaN pages too


@pytest.mark.parametrize("platform", ["xla", "splash"])
def test_a_new_nan_value_in_a_quantized_pool_shows_in_every_column_of_the_rows_that_see_it(
    platform):
  """A new value row holding NaN is written with a NaN scale (its absmax): the rows that see it
  (its own and later rows of its sequence) output NaN in every column of its kv head's query
  heads, as the oracle on the dequantized values; the rows before it and the other kv heads
  match the oracle."""
  case = _quantized_step("int8", 7, q_lens=(1, 9, 3, 1), page=32)
  seq, at = 1, 4  # sequence 1 (kv_len 0): its new row at position 4
  row = sum(case.q_lens[:seq]) + at
  case.v[row, 0, 0] = np.nan
  config = sh.AttentionConfig(platform=platform, interpret=True, allow_fallback=False)
  out, _ = jax.jit(lambda *a: sh.paged_attention(*a, config=config))(
      case.q, case.k, case.v, case.cache, case.batch)
  out = np.asarray(out)
  first, last = sum(case.q_lens[:seq]), sum(case.q_lens[:seq + 1])
  groups = paged_cases.HQ // paged_cases.HKV
  assert np.isnan(out[row:last, :groups]).all() and np.isfinite(out[row:last, groups:]).all()
  want = paged_cases.attend(case)  # its history holds the row as stored: NaN, kv head 0 only
  np.testing.assert_allclose(out[first:row], want[first:row], **harness.tol())
  np.testing.assert_allclose(out[row:last, groups:], want[row:last, groups:], **harness.tol())
  np.testing.assert_allclose(out[last:], want[last:], **harness.tol())


def test_int8_pages_that_are_not_whole_tiles_of_codes_stay_on_xla_naming_why():
  step = _quantized_step("int8", 1, page=16)
  decision = sh.explain_paged(step.q, step.k, step.v, step.cache, step.batch,
                              config=sh.AttentionConfig(platform="splash", interpret=True))
  assert decision.backend == "xla" and "int8 pages of 16 slots" in decision.reason, decision


@pytest.mark.parametrize("chosen", [False, True], ids=["table", "selection"])
def test_the_tpu_paged_kernel_reads_runs_of_int8_pages(chosen):
  """Pages of 32 one byte a code: the TPU paged kernel (interpret mode) reads 16 pages a grid
  step with their scales a block beside them (per kv head for a selection); histories of
  700-1100 tokens, causal (whole blocks unguarded) and the free slots' codes and scales NaN."""
  step, batch, want = paged_cases.runs_of_pages(chosen, page=32, kv_lens=(700, 0, 1100, 37),
                                                window=None, kind="int8")
  config = sh.AttentionConfig(platform="splash", interpret=True, allow_fallback=False)
  out, _ = jax.jit(lambda *a: sh.paged_attention(*a, config=config))(
      step.q, step.k, step.v, step.cache, batch)
  np.testing.assert_allclose(np.asarray(out)[:len(want)], want, **harness.tol())


def test_a_long_prefill_chunk_beside_decodes_over_an_int8_pool_at_a_real_size():
  # 300 prefill rows after 77 cached tokens (thousands of loop items) beside three decodes.
  step = _quantized_step("int8", 5, kv_lens=(77, 130, 30, 250), q_lens=(300, 1, 1, 1),
                         pages_per_seq=100, num_pages=400, pad_rows=3)
  config = sh.AttentionConfig(platform="xla", allow_fallback=False, sliding_window=(200, 0))
  out, _ = jax.jit(lambda *a: sh.paged_attention(*a, config=config))(
      step.q, step.k, step.v, step.cache, step.batch)
  np.testing.assert_allclose(np.asarray(out), paged_cases.attend(step, window=(200, 0)),
                             **harness.tol())


def test_a_paged_steps_new_tokens_and_queries_may_come_quantized():
  step = _quantized_step("int8", 4)
  q8 = sh.quantize(step.q, jnp.int8)  # padding rows' NaN stays in their rows
  k8, v8 = (sh.quantize(a, jnp.int8) for a in (step.k, step.v))
  out, cache = jax.jit(sh.paged_attention)(q8, k8, v8, step.cache, step.batch)
  step.q = _dequantized(q8)
  np.testing.assert_allclose(np.asarray(out), paged_cases.attend(step), **harness.tol())



@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_quantized_new_tokens_go_into_every_float_pool_and_cache(dtype):
  """Dequantized and cast as written: a bf16 / f16 pool refused them before (seen failing:
  "`key` is float32 and the cache holds bfloat16")."""
  step = paged_cases.step(seed=6, dtype=dtype)
  k8, v8 = (sh.quantize(jnp.asarray(a, jnp.float32), jnp.int8) for a in (step.k, step.v))
  stored = lambda x: np.asarray(jnp.asarray(_dequantized(x), dtype), np.float64)  # as written
  start = 0
  for s, (hk, hv, ql) in enumerate(zip(step.history_k, step.history_v, step.q_lens)):
    kv = len(hk) - ql  # each sequence's new rows as the pool holds them
    hk[kv:], hv[kv:] = stored(k8)[start:start + ql], stored(v8)[start:start + ql]
    start += ql
  out, cache = jax.jit(sh.paged_attention)(jnp.asarray(step.q), k8, v8, step.cache, step.batch)
  assert cache.key.dtype == dtype and out.dtype == dtype
  np.testing.assert_allclose(np.asarray(out, np.float32), paged_cases.attend(step),
                             **harness.tol(dtype=jnp.float32 if dtype == jnp.float32
                                           else jnp.bfloat16))
  fixed = sh.KVCache.zeros(2, 8, HKV, paged_cases.D, dtype=dtype)
  rows = lambda x: sh.Quantized(x.values[None, :3].repeat(2, 0), x.scale[None, :3].repeat(2, 0))
  appended = fixed.append(rows(k8), rows(v8), jnp.array([3, 2]), "layer")
  np.testing.assert_array_equal(np.asarray(appended.key[1, :2], np.float64), stored(k8)[:2])


def test_paged_sinks_gqa_bias_and_the_cascade_over_an_int8_pool():
  step = _quantized_step("int8", 2, value_dim=24)
  sinks = np.random.default_rng(3).normal(size=(HKV, 2)).astype(np.float32)
  params, dense = harness.score_case("alibi", np.arange(40)[None], np.arange(40)[None],
                                     paged_cases.HQ)
  bias = lambda ql, s: np.asarray(dense(params))[:, :, s - ql:s, :s]
  config = sh.AttentionConfig(platform="xla", allow_fallback=False)
  call = jax.jit(lambda *a, s, b: sh.paged_attention(*a, config=config, softmax_aux=s, bias=b))
  want = paged_cases.attend(step, sinks=sinks, bias=bias)
  out, _ = call(step.q, step.k, step.v, step.cache, step.batch, s=sinks,
                b=harness.score_object("alibi", params))
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())
  table = np.asarray(step.batch.page_table)
  prefix = sh.SharedPrefix(jnp.asarray(table[:1, :1]), jnp.asarray([4], jnp.int32),
                           jnp.asarray([0, -1, 0, -1, -1], jnp.int32))
  grouped = dataclasses.replace(step.batch, prefix=prefix)
  out, _ = call(step.q, step.k, step.v, step.cache, grouped, s=sinks,
                b=harness.score_object("alibi", params))
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())


# Each format's error bound on random normal keys and values at T = 4096 (causal, one scale per
# token and kv head, as the caches quantize), stated in docs/guide/quantized.md: the relative
# output error (Frobenius) against the float64 oracle on the unquantized values.
ERROR_BOUNDS = {"int8": 0.01, "fp8_e4m3": 0.04, "fp8_e5m2": 0.08, "int4": 0.16}


def test_each_formats_error_at_4096_tokens_is_within_its_stated_bound():
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=(1, 4096, n, D)).astype(np.float32) for n in (2, 1, 1))
  want, _ = oracle.attention(q, k, v)
  errors = {}
  for kind in ERROR_BOUNDS:
    dtype = getattr(jnp, np.dtype(FORMATS[kind][0]).name)
    out = sh.attention(q, sh.quantize(k, dtype), sh.quantize(v, dtype)).attention_outputs
    errors[kind] = np.linalg.norm(np.asarray(out) - want) / np.linalg.norm(want)
  assert all(errors[kind] < bound for kind, bound in ERROR_BOUNDS.items()), errors
  assert errors["int8"] < errors["fp8_e4m3"] < errors["fp8_e5m2"] < errors["int4"], errors


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_garbage_past_the_padding_changes_nothing_and_a_visible_nan_reaches_only_its_rows(kind):
  q, k, v, _ = _inputs(10, kind, "token_head")
  spoil = lambda a, where: sh.Quantized(a.values, jnp.asarray(a.scale).at[where].set(jnp.nan))
  kv_seg = np.zeros((B, T), np.int32)
  kv_seg[:, 250:] = -1  # padding keys: their scales (so their values) are NaN
  k, v = spoil(k, (slice(None), slice(250, None))), spoil(v, (slice(None), slice(250, None)))
  q_seg = np.zeros((B, T), np.int32)
  q_seg[1, 5] = -1  # a padded query: sees nothing, outputs 0
  rules = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
  out = sh.attention(q, k, v, **rules).attention_outputs
  assert not np.asarray(out[1, 5]).any()
  want, _ = oracle.attention(q, _dequantized(k), _dequantized(v), q_seg=rules["q_segment_ids"],
                             kv_seg=kv_seg)
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())
  out = np.asarray(sh.attention(q, k, spoil(v, (0, 100, 1)), **rules).attention_outputs)
  assert np.isnan(out[0, 100:, 2:]).all()  # the rows that see key 100, query heads of kv head 1
  np.testing.assert_allclose(out[0, :100], want[0, :100], **harness.tol())
  np.testing.assert_allclose(out[:, :, :2], want[:, :, :2], **harness.tol())
  np.testing.assert_allclose(out[1], want[1], **harness.tol())
