"""Attention states users can merge: `return_residuals=True` gives the log-sum-exp (values and
gradients against the float64 oracle's, on every backend that serves it and under meshes), and
`merge_attention` over any split of the keys equals the whole call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
import harness
import oracle

TILES = sh.BlockSizes(16, 8, 8, 16)  # T = 72: partial blocks at both ends


def _inputs(seed, batch=2, length=72, hq=4, hkv=2, head_dim=16, value_dim=24):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(batch, length, hq, head_dim)).astype(np.float32)
  k = rng.normal(size=(batch, length, hkv, head_dim)).astype(np.float32)
  v = rng.normal(size=(batch, length, hkv, value_dim)).astype(np.float32)
  seg = np.repeat(np.arange(2), [length // 2 + 3, length - length // 2 - 3])[None].repeat(batch, 0)
  seg[:, -5:] = -1  # padding rows: they see nothing
  sinks = rng.normal(size=(hq, 2)).astype(np.float32)
  return q, k, v, seg.astype(np.int32), sinks, rng


def _oracle_loss_grads(q, k, v, sinks, cot, cot_lse, **rules):
  """float64 (out, lse) and the gradients of sum(out * cot) + sum(lse * cot_lse), lse finite
  rows only (-inf rows have no gradient)."""
  with jax.enable_x64(True):
    f64 = lambda a: None if a is None else jnp.asarray(a, jnp.float64)

    def loss(q, k, v, s):
      out, _, lse = oracle.attention(q, k, v, sinks=s, xp=jnp, with_lse=True, **rules)
      finite = jnp.isfinite(lse)
      return (jnp.sum(out * cot) + jnp.sum(jnp.where(finite, lse, 0.0) * cot_lse)), (out, lse)

    args = (f64(q), f64(k), f64(v), f64(sinks))
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    grads, (out, lse) = jax.grad(loss, argnums=argnums, has_aux=True)(*args)
  return np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]


def _check(f, q, k, v, sinks, rng, grad="grad", **rules):
  """f(q, k, v, sinks) -> AttentionOutput: out and lse values and gradients vs the oracle."""
  cot = rng.normal(size=(*q.shape[:3], v.shape[-1]))
  cot_lse = rng.normal(size=q.shape[:3])

  def loss(*args):
    o = f(*args)
    finite = jnp.isfinite(o.lse)
    return (jnp.sum(o.attention_outputs * cot) + jnp.sum(jnp.where(finite, o.lse, 0.0) * cot_lse),
            (o.attention_outputs, o.lse))

  args = (q, k, v, sinks)
  argnums = tuple(i for i, a in enumerate(args) if a is not None)
  grads, (out, lse) = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(*args)
  want_out, want_lse, want_grads = _oracle_loss_grads(q, k, v, sinks, cot, cot_lse, **rules)
  assert lse.dtype == jnp.float32 and lse.shape == q.shape[:3]
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
  finite = np.isfinite(want_lse)
  np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], **harness.tol())
  np.testing.assert_allclose(np.asarray(out), want_out, **harness.tol())
  for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
    harness.assert_near(np.asarray(g), w, grad, err_msg=name)


@pytest.mark.parametrize("platform,sinks", [("xla", True), ("xla", False), ("reference", True)])
def test_lse_and_its_gradient_match_the_oracle(platform, sinks):
  q, k, v, seg, s, rng = _inputs(1)
  config = sh.AttentionConfig(platform=platform, allow_fallback=False, block_sizes=TILES,
                              sliding_window=(30, 0), logits_soft_cap=6.0)
  f = lambda q, k, v, s=None: sh.attention(q, k, v, config=config, q_segment_ids=seg,
                                           softmax_aux=s, return_residuals=True)
  _check(f, q, k, v, s if sinks else None, rng, window=(30, 0), soft_cap=6.0, q_seg=seg)
  out = sh.attention(q, k, v, config=config, q_segment_ids=seg)
  assert out.lse is None  # only when asked for
  if not sinks:
    lse = f(q, k, v).lse
    assert np.isneginf(np.asarray(lse)[:, -5:]).all()  # padding rows see nothing


@pytest.mark.parametrize("strategy,mesh_name,balanced", [
    ("all_gather", "2x4", False), ("ring", "dp2_sp2_tp2", False), ("ring", "sp4", True),
    ("ulysses", "dp2_sp2_tp2", False)])
def test_lse_under_meshes(strategy, mesh_name, balanced):
  q, k, v, seg, s, rng = _inputs(2, length=32, hq=8, hkv=2)
  n = harness.axis_size(mesh_name, "sp")
  order = (lambda a: sh.sharding.load_balance(a, n)) if balanced else (lambda a: a)
  restore = (lambda a: sh.sharding.restore_order(a, n)) if balanced else (lambda a: a)
  axes = sh.MeshAxes(batch="dp", heads="tp", sequence="sp" if "sp" in mesh_name else None,
                     sequence_strategy=strategy, load_balanced=balanced)
  mesh = harness.mesh(mesh_name)
  config = sh.AttentionConfig(sliding_window=(20, 0))
  decision = sh.explain(order(q), order(k), order(v), config=config, mesh=mesh, axes=axes,
                        q_segment_ids=order(seg), return_residuals=True)
  assert not decision.fallback and decision.ring == (strategy == "ring"), decision

  def f(q, k, v, s):
    o = sh.attention(order(q), order(k), order(v), config=config, mesh=mesh, axes=axes,
                     q_segment_ids=order(seg), softmax_aux=s, return_residuals=True)
    return o._replace(attention_outputs=restore(o.attention_outputs), lse=restore(o.lse))

  _check(f, q, k, v, s, rng, grad="sharded_grad", window=(20, 0), q_seg=seg)


def test_kernels_without_a_differentiable_lse_fall_back_naming_it():
  q, k, v, *_ = _inputs(3, length=128)
  for platform in ("splash", "triton"):
    config = sh.AttentionConfig(platform=platform, interpret=True)
    decision = sh.explain(q, k, v, config=config, return_residuals=True)
    assert decision.fallback and decision.backend == "xla", decision
    assert "return_residuals=True" in decision.reason, decision
  with pytest.raises(ValueError, match="return_residuals"):
    sh.attention(q, k, v, config=sh.AttentionConfig(platform="splash", interpret=True,
                                                    allow_fallback=False),
                 return_residuals=True)


@pytest.mark.parametrize("parts", [2, 3, 8])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_merging_any_split_of_the_keys_equals_the_whole_call(parts, dtype):
  """The keys cut at random points into `parts` pieces (causal, sinks in the first piece only):
  merged outputs and lse equal the oracle's whole call, and so do the gradients through the
  merge; rows that see nothing in a piece contribute nothing."""
  q, k, v, _, s, rng = _inputs(4 + parts, length=96)
  cuts = np.sort(rng.choice(np.arange(1, 96), parts - 1, replace=False))
  bounds = list(zip([0, *cuts], [*cuts, 96]))
  cast = lambda a: jnp.asarray(a, dtype)

  def merged(q, k, v, s):
    outs, lses = [], []
    for i, (lo, hi) in enumerate(bounds):
      kv_pos = jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32), (2, hi - lo))
      o = sh.attention(q, k[:, lo:hi], v[:, lo:hi], q_positions=jnp.broadcast_to(
          jnp.arange(96, dtype=jnp.int32), (2, 96)), kv_positions=kv_pos,
          softmax_aux=s if i == 0 else None, return_residuals=True)
      outs.append(o.attention_outputs)
      lses.append(o.lse)
    out, lse = sh.merge_attention(outs, lses)
    return sh.AttentionOutput(out, None, lse)

  if dtype == jnp.bfloat16:
    got = merged(cast(q), cast(k), cast(v), s)
    want_out, _, want_lse = oracle.attention(q, k, v, sinks=s, with_lse=True)
    assert got.attention_outputs.dtype == jnp.bfloat16 and got.lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got.attention_outputs, np.float32), want_out,
                               **harness.tol("out", jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(got.lse), want_lse, **harness.tol("out", jnp.bfloat16))
    return
  _check(merged, q, k, v, s, rng)


def test_merge_of_empty_parts_is_zero_and_minus_inf_never_nan():
  out = np.array([[1.0, 2.0], [np.nan, 5.0], [3.0, 3.0]], np.float32)  # row 1's part 0 unseen
  lse = np.array([0.0, -np.inf, -np.inf], np.float32)
  out2 = np.array([[3.0, 4.0], [7.0, 9.0], [np.nan, np.nan]], np.float32)
  lse2 = np.array([0.0, 1.5, -np.inf], np.float32)
  merged, total = sh.merge_attention([out, out2], [lse, lse2])
  np.testing.assert_allclose(merged, [[2.0, 3.0], [7.0, 9.0], [0.0, 0.0]])
  np.testing.assert_allclose(total, [np.log(2.0), 1.5, -np.inf])
  grads = jax.grad(lambda o, l: jnp.sum(sh.merge_attention([o, out2], [l, lse2])[0]),
                   argnums=(0, 1))(out, lse)
  assert all(np.isfinite(g).all() for g in grads)
  with pytest.raises(ValueError, match=r"`outputs` and `lses` must be equally long"):
    sh.merge_attention([out], [])
  with pytest.raises(ValueError, match=r"part 1: `outputs\[1\]` must have the shape"):
    sh.merge_attention([out, out[:2]], [lse, lse[:2]])


def test_paged_lse_matches_the_oracle_per_row():
  """A step of a decode, a prefill and a chunk over shuffled pages: each row's lse (and its
  output) as the oracle computes over its sequence's history; padding rows -inf."""
  rng = np.random.default_rng(7)
  page, hq, hkv, d = 4, 4, 2, 16
  kv_lens, q_lens = (5, 0, 9), (1, 6, 3)
  pool = sh.PagedKVCache.zeros(16, page, hkv, d)
  table = np.full((4, 5), -1, np.int32)
  free = list(rng.permutation(16))
  hist_k, hist_v = [], []
  key, value = (np.array(a) for a in pool.token_major())
  for s, (kv, ql) in enumerate(zip(kv_lens, q_lens)):
    hist_k.append(rng.normal(size=(kv + ql, hkv, d)).astype(np.float32))
    hist_v.append(rng.normal(size=(kv + ql, hkv, d)).astype(np.float32))
    for p in range(-(-(kv + ql) // page)):
      table[s, p] = free.pop()
    for t in range(kv):
      key[table[s, t // page], t % page], value[table[s, t // page], t % page] = hist_k[s][t], \
          hist_v[s][t]
  q = rng.normal(size=(sum(q_lens) + 2, hq, d)).astype(np.float32)
  new_k = np.concatenate([h[kv:] for h, kv in zip(hist_k, kv_lens)] + [np.zeros((2, hkv, d))])
  new_v = np.concatenate([h[kv:] for h, kv in zip(hist_v, kv_lens)] + [np.zeros((2, hkv, d))])
  cu = np.array([0, 1, 7, 10, 10], np.int32)
  batch = sh.RaggedBatch(cu, np.array([*kv_lens, 0], np.int32), table, np.int32(3))
  sinks = rng.normal(size=(hq,)).astype(np.float32)
  for platform in ("xla", "reference"):
    out, _, lse = sh.paged_attention(q, new_k.astype(np.float32), new_v.astype(np.float32),
                                     sh.PagedKVCache.from_token_major(key, value), batch,
                                     config=sh.AttentionConfig(platform=platform),
                                     softmax_aux=sinks, return_residuals=True)
    for s, (kv, ql) in enumerate(zip(kv_lens, q_lens)):
      rows = slice(cu[s], cu[s + 1])
      want_out, _, want_lse = oracle.attention(q[None, rows], hist_k[s][None], hist_v[s][None],
                                               sinks=sinks, with_lse=True)
      np.testing.assert_allclose(np.asarray(lse[rows]), want_lse[0], err_msg=platform,
                                 **harness.tol())
      np.testing.assert_allclose(np.asarray(out[rows]), want_out[0], **harness.tol())
    assert np.isneginf(np.asarray(lse[10:])).all()


def test_merge_takes_attention_outputs_and_any_iterable():
  """What `attention(..., return_residuals=True)` returns merges as it is (its lse beside it),
  from a list or a generator; refusals name `outputs` / `lses`."""
  q, k, v, _, _, _ = _inputs(11, length=96)
  config = sh.AttentionConfig(causal=False)
  parts = [sh.attention(q, k[:, lo:hi], v[:, lo:hi], config=config, return_residuals=True)
           for lo, hi in ((0, 40), (40, 96))]
  want, _, want_lse = oracle.attention(q, k, v, causal=False, with_lse=True)
  for given in (parts, (p for p in parts)):
    out, lse = sh.merge_attention(given)
    np.testing.assert_allclose(np.asarray(out), want, **harness.tol())
    np.testing.assert_allclose(np.asarray(lse), want_lse, **harness.tol())
  out, _ = sh.merge_attention((p.attention_outputs for p in parts), (p.lse for p in parts))
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())
  with pytest.raises(ValueError, match=r"`outputs` are AttentionOutputs, which carry their lse"):
    sh.merge_attention(parts, [p.lse for p in parts])
  with pytest.raises(ValueError, match=r"`outputs` holds an AttentionOutput without its lse"):
    sh.merge_attention([sh.attention(q, k, v, config=config), parts[0]])
  with pytest.raises(ValueError, match=r"`outputs` must all be arrays or all be AttentionOutputs"):
    sh.merge_attention([parts[0], parts[1].attention_outputs])
  with pytest.raises(ValueError, match=r"`lses` is needed with array `outputs`"):
    sh.merge_attention([p.attention_outputs for p in parts])
