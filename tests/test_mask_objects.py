"""Mask objects (`splash_hk.masks`): each built-in and nested combinations against the float64 oracle.

The oracle gets each rule as its own NumPy function of positions (written here
from DESIGN.md, not from the library), turned into a dense mask; segments,
padding, GQA, sinks and soft cap apply as in every other test.
"""

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
from splash_hk.masks import _plan
from splash_hk.masks import _rules
from splash_hk.backends.tpu import horizon as splash_horizon
import harness
import oracle

M = sh.masks
T = 72  # not a multiple of the tiles below: partial blocks at both ends
TILES = sh.BlockSizes(16, 8, 8, 16)


def first_four(q_pos, kv_pos):
  return (kv_pos < 4) & (q_pos >= 0)


def first_four_keys(q_pos, kv_pos):  # reads the keys only: [B, 1, 1, S] under validation
  del q_pos
  return kv_pos < 4


def every_third(q_pos, kv_pos):
  return (q_pos - kv_pos) % 3 == 0


def _spans(rng, batch, length, kind):
  """Ids per row: a prefix of random length (id 0), or 2-3 image spans (ids 0, 1, ...)."""
  ids = np.full((batch, length), -1, np.int32)
  for b in range(batch):
    if kind == "prefix":
      ids[b, :rng.integers(5, length // 2)] = 0
    else:
      candidates = np.arange(1, length - 8, 8)
      starts = np.sort(rng.choice(candidates, size=min(3, len(candidates)), replace=False))
      for n, start in enumerate(starts):
        ids[b, start:start + rng.integers(3, 9)] = n
  return ids


@dataclasses.dataclass(frozen=True)
class Rule:
  """A mask object and the oracle's own NumPy rule for it: (q [B,1,T,1], kv [B,1,1,S], ids) -> bool."""

  name: str
  build: object  # ids -> mask object
  oracle: object  # (q_pos, kv_pos, ids) -> bool array
  ids: str | None = None  # "prefix", "images" or None


def _same(ids, q=None, kv=None):
  a = ids[:, None, :, None]
  return (a == ids[:, None, None, :]) & (a >= 0)


RULES = [
    Rule("causal", lambda ids: M.Causal(), lambda q, k, ids: k <= q),
    Rule("window", lambda ids: M.SlidingWindow((9, 2)), lambda q, k, ids: (k >= q - 9) & (k <= q + 2)),
    Rule("chunked_causal", lambda ids: M.Chunked(16) & M.Causal(),
         lambda q, k, ids: (q // 16 == k // 16) & (k <= q)),
    Rule("prefix_lm", lambda ids: M.Causal() | M.Bidirectional(ids),
         lambda q, k, ids: (k <= q) | _same(ids), "prefix"),
    Rule("images", lambda ids: M.Causal() | M.Bidirectional(ids, ids),
         lambda q, k, ids: (k <= q) | _same(ids), "images"),
    Rule("window_or_first4", lambda ids: M.SlidingWindow((8, 0)) | M.MaskFn(first_four),
         lambda q, k, ids: ((k >= q - 8) & (k <= q)) | (k < 4)),
    Rule("nested", lambda ids: (M.Causal() & M.SlidingWindow(20)) | (M.Bidirectional(ids)
                                                                        & M.Chunked(32)),
         lambda q, k, ids: ((k <= q) & (k >= q - 20) & (k <= q + 20))
         | (_same(ids) & (q // 32 == k // 32)), "images"),
    Rule("mask_fn", lambda ids: M.MaskFn(every_third), lambda q, k, ids: (q - k) % 3 == 0),
]


def _inputs(seed, *, batch=2, length=T, hq=4, hkv=2, head_dim=16, padded=True):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(batch, length, hq, head_dim)).astype(np.float32)
  k = rng.normal(size=(batch, length, hkv, head_dim)).astype(np.float32)
  v = rng.normal(size=(batch, length, hkv, head_dim)).astype(np.float32)
  seg = np.repeat(np.arange(2), [length // 2 + 3, length - length // 2 - 3])[None].repeat(batch, 0)
  if padded:
    seg[:, -5:] = -1
  return rng, q, k, v, seg.astype(np.int32)


def _check(rule, platform, seed, *, sinks=True, soft_cap=None, explicit_positions=False,
           tiles=TILES, ids=None, fused_backward=False, **shape):
  rng, q, k, v, seg = _inputs(seed, **shape)
  batch, length = seg.shape
  if ids is None and rule.ids is not None:
    ids = _spans(rng, batch, length, rule.ids)
  pos = np.tile(np.arange(length, dtype=np.int32), (batch, 1))
  extras = {"q_segment_ids": seg}
  if explicit_positions:  # packed documents with restarting positions
    pos = np.where(np.arange(length) < length // 2 + 3, np.arange(length),
                   np.arange(length) - (length // 2 + 3)).astype(np.int32)[None].repeat(batch, 0)
    extras["q_positions"] = pos
  s = rng.normal(size=(q.shape[2], 2)).astype(np.float32) if sinks else None
  config = sh.AttentionConfig(platform=platform, allow_fallback=False, block_sizes=tiles,
                              logits_soft_cap=soft_cap, interpret=platform == "splash",
                              fused_backward=fused_backward)
  cot = rng.normal(size=(*q.shape[:3], v.shape[-1]))
  dense = rule.oracle(pos[:, None, :, None], pos[:, None, None, :], ids)
  harness.check_against_oracle(
      lambda q, k, v, s=None: sh.attention(q, k, v, config=config, mask=rule.build(ids),
                                           softmax_aux=s, **extras).attention_outputs,
      q, k, v, cot, sinks=s, causal=False, q_seg=seg, mask=dense, soft_cap=soft_cap)


# The config's rules as objects (causal, window, chunked causal) run the same code as the
# config path, which every other test file covers; here the objects only config cannot say.
BEYOND_CONFIG = [r for r in RULES if r.name not in ("causal", "window", "chunked_causal",
                                                    "mask_fn")]  # MaskFn: in window_or_first4


@pytest.mark.parametrize("rule", BEYOND_CONFIG, ids=lambda r: r.name)
def test_each_rule_on_xla_matches_the_oracle(rule):
  _check(rule, "xla", seed=len(rule.name), soft_cap=5.0 if "window" in rule.name else None)


def test_reference_and_explicit_positions_match_the_oracle():
  rule = next(r for r in RULES if r.name == "nested")
  _check(rule, "reference", seed=3)
  _check(rule, "xla", seed=4, explicit_positions=True, sinks=False)


def test_real_sizes_with_the_default_tiles():
  prefix = next(r for r in RULES if r.name == "prefix_lm")
  _check(prefix, "xla", seed=5, tiles=sh.BlockSizes(), batch=2, length=1100, hq=4, hkv=1,
         head_dim=32)


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jnp"])
def test_blocks_are_classified_soundly(xp):
  """`may` never says no where a pair sees, `full` never yes where one does not (brute force),
  as the static plans (NumPy) and the kernels (jnp) classify them."""
  rng = np.random.default_rng(7)
  # jnp differs from NumPy in how a MaskFn's pairs are reduced (`masks._blocks.any_all`) only.
  keys_only = Rule("keys_only", lambda ids: M.MaskFn(first_four_keys), lambda q, k, ids: k < 4)
  rules = [keys_only] + (RULES if xp is np else
                         [r for r in RULES if r.name in ("window_or_first4", "mask_fn")])
  for trial in range(40 if xp is np else 6):
    rule = rules[trial % len(rules)]
    batch, t, s, bq, bk = 2, int(rng.integers(20, 60)), int(rng.integers(20, 60)), 8, 4
    if xp is jnp:  # one shape (partial last blocks): jnp compiles each op once per shape
      t, s = 37, 45
    q_pos = np.sort(rng.integers(0, 80, size=(batch, t)), axis=1)
    kv_pos = np.sort(rng.integers(0, 80, size=(batch, s)), axis=1)
    q_seg = np.sort(rng.integers(-1, 3, size=(batch, t)), axis=1)
    kv_seg = np.sort(rng.integers(-1, 3, size=(batch, s)), axis=1)
    ids = None if rule.ids is None else _spans(rng, batch, max(t, s), rule.ids)
    obj = rule.build(ids)
    if ids is not None:
      obj = obj.map_parts(lambda p: M.Bidirectional(ids[:, :t], ids[:, :s])
                          if isinstance(p, M.Bidirectional) else p)
    sides = [xp.asarray(a) for a in (q_pos, kv_pos, q_seg, kv_seg)]
    may, full = map(np.asarray, _plan.blocks_see(obj, _plan.plan_blocks(*sides, bq, bk, xp)))
    see = np.broadcast_to(obj.visible(q_pos[:, None, :, None], kv_pos[:, None, None, :]),
                          (batch, 1, t, s))[:, 0]
    see = see & _rules.segment_mask(q_seg, kv_seg)
    for i in range(-(-t // bq)):
      for j in range(-(-s // bk)):
        block = see[:, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        assert (block.any(axis=(1, 2)) <= may[:, i, j]).all(), (rule.name, i, j)
        complete = block.shape[1:] == (bq, bk)
        assert (full[:, i, j] <= (block.all(axis=(1, 2)) & complete)).all(), (rule.name, i, j)


def test_prefix_lm_plan_runs_the_prefix_full_and_skips_the_future():
  ids = np.where(np.arange(2048) < 768, 0, -1)[None]
  assert M.block_map(M.Causal() | M.Bidirectional(ids), 2048, 2048, 256) == "\n".join([
      "###.....", "###.....", "###.....", "###+....", "####+...", "#####+..", "######+.",
      "#######+"])


@pytest.mark.parametrize("rule", [r for r in RULES if r.name in ("prefix_lm", "images")],
                         ids=lambda r: r.name)
def test_splash_serves_causal_or_bidirectional_with_traced_ids(rule):
  # Per-example spans (B=2), some across a 128-row block boundary; 3 query blocks with a
  # partial last one, GQA, segments, padding, sinks; images with the fused backward.
  ids = np.full((2, 300), -1, np.int32)
  if rule.name == "prefix_lm":
    ids[0, :150], ids[1, :37] = 0, 0
  else:
    ids[0, 10:20], ids[0, 120:140], ids[0, 250:260], ids[1, 100:131] = 0, 1, 2, 0
  _check(rule, "splash", seed=11, tiles=sh.BlockSizes(), length=300, hq=4, hkv=2, head_dim=32,
         ids=ids, fused_backward=rule.name == "images")
  assert splash_horizon.horizon(rule.build(ids), 300, 300)[1]  # the kernel ran, not xla


def test_splash_runs_the_xla_path_where_an_id_comes_back_after_its_span():
  ids = np.full((2, 256), -1, np.int32)
  ids[:, :40] = 0
  ids[1, 200:210] = 0  # row 1: id 0 again after its span: keys [0, h] are not all it sees
  prefix = next(r for r in RULES if r.name == "prefix_lm")
  _check(prefix, "splash", seed=12, tiles=sh.BlockSizes(), length=256, hq=1, hkv=1,
         head_dim=32, ids=ids, sinks=False)
  h, exact = splash_horizon.horizon(M.Causal() | M.Bidirectional(ids), 256, 256)
  assert not exact and splash_horizon.horizon(M.Bidirectional(ids[:1]) | M.Causal(), 256, 256)[1]
  np.testing.assert_array_equal(h[0], np.maximum(np.arange(256), np.where(np.arange(256) < 40, 39, -1)))


def test_splash_builds_static_objects_and_names_what_it_cannot():
  spec = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, 256), jnp.int32)
  config = sh.AttentionConfig(platform="splash", interpret=True)
  served = sh.explain(spec, spec, spec, config=config,
                      mask=M.SlidingWindow((8, 0)) | M.MaskFn(first_four))
  assert served.backend == "splash" and not served.fallback
  assert sh.explain(spec, spec, spec, config=config, mask=M.Causal() | M.Bidirectional(ids)
                    ).backend == "splash"
  short = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.float32)
  longer = sh.explain(spec, short, short, config=config, mask=M.Causal() | M.Bidirectional(
      ids, jax.ShapeDtypeStruct((1, 128), jnp.int32)))
  assert longer.backend == "xla" and "longer than the keys" in longer.reason
  refused = sh.explain(spec, spec, spec, config=config,
                       mask=M.SlidingWindow(8) | M.Bidirectional(ids))
  assert refused.backend == "xla" and "Bidirectional part" in refused.reason
  rng, q, k, v, _ = _inputs(9, batch=1, length=256, hq=2, hkv=2, head_dim=64)
  out = sh.attention(q, k, v, config=config.replace(allow_fallback=False),
                     mask=M.SlidingWindow((8, 0)) | M.MaskFn(first_four)).attention_outputs
  pos = np.arange(256)[None]
  dense = RULES[5].oracle(pos[:, None, :, None], pos[:, None, None, :], None)
  want, _ = oracle.attention(q, k, v, causal=False, mask=dense)
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_sequence_sharded_objects_match_the_oracle(strategy):
  rng, q, k, v, seg = _inputs(11, length=64)
  ids = _spans(rng, 2, 64, "images")
  n = 4
  mesh = harness.mesh(f"sp{n}", explicit=True)
  axes = sh.MeshAxes(batch=None, heads=None, sequence="sp", sequence_strategy=strategy,
                     load_balanced=strategy == "ring")
  order = (lambda a: sh.sharding.load_balance(a, n)) if axes.load_balanced else (lambda a: a)
  config = sh.AttentionConfig(platform="xla", allow_fallback=False, block_sizes=sh.BlockSizes(8, 8))
  rule = M.Causal() | M.Bidirectional(order(ids))
  assert sh.explain(order(q), order(k), order(v), config=config, mask=rule, mesh=mesh, axes=axes,
                    q_segment_ids=order(seg)).ring == (strategy == "ring")
  cot = rng.normal(size=q.shape)

  def f(q, k, v):
    out = sh.attention(order(q), order(k), order(v), config=config, mask=rule, mesh=mesh,
                       axes=axes, q_segment_ids=order(seg)).attention_outputs
    return sh.sharding.restore_order(out, n) if axes.load_balanced else out

  pos = np.arange(64)[None]
  dense = RULES[4].oracle(pos[:, None, :, None], pos[:, None, None, :], ids)
  harness.check_against_oracle(f, q, k, v, cot, causal=False, q_seg=seg, mask=dense,
                               grad="sharded_grad")


def test_decode_after_a_prefix_lm_prefill_through_the_cache():
  """Prefill 10 tokens (a 6-token bidirectional prefix), then decode 3: as the whole sequence."""
  batch, length, prefill, dim = 2, 13, 10, 16
  ids = np.where(np.arange(length) < 6, 0, -1)[None].repeat(batch, 0).astype(np.int32)
  x = np.random.default_rng(12).normal(size=(batch, length, dim)).astype(np.float32)
  mha = lambda: sh.MultiHeadAttention(num_heads=2, key_size=8, num_kv_heads=1,
                                      w_init=hk.initializers.VarianceScaling(1.0),
                                      config=sh.AttentionConfig(platform="xla"))

  @hk.transform
  def cached(x):
    layer, cache = mha(), sh.KVCache.zeros(batch, 16, 1, 8)
    out, cache = layer(x[:, :prefill], kv_cache=cache,
                       mask=M.Causal() | M.Bidirectional(ids[:, :prefill]))
    outs = [out]
    for t in range(prefill, length):
      out, cache = layer(x[:, t:t + 1], kv_cache=cache, mask=M.Causal())
      outs.append(out)
    return jnp.concatenate(outs, axis=1)

  params = hk.transform(lambda x: mha()(x, mask=M.Causal() | M.Bidirectional(ids))).init(
      jax.random.PRNGKey(0), x)
  got = jax.jit(cached.apply)(params, None, x)
  pos = np.arange(length)[None]
  dense = RULES[3].oracle(pos[:, None, :, None], pos[:, None, None, :], ids)
  want = oracle.mha(params, x, num_heads=2, num_kv_heads=1, key_size=8, value_size=8,
                    causal=False, mask=dense)
  np.testing.assert_allclose(np.asarray(got), want, **harness.tol())


def test_bad_objects_say_what_to_change():
  q = jnp.zeros((1, 8, 2, 4))
  with pytest.raises(ValueError, match="sliding_window=.*state the rule in one place"):
    sh.attention(q, q, q, mask=M.Causal(), config=sh.AttentionConfig(sliding_window=2))
  with pytest.raises(ValueError, match=r"MaskFn\(as_int\) must return bool"):
    sh.attention(q, q, q, mask=M.MaskFn(as_int))
  with pytest.raises(ValueError, match=r"Bidirectional.q_ids. must be \[batch, query_len\]"):
    sh.attention(q, q, q, mask=M.Bidirectional(jnp.zeros((1, 5), jnp.int32)))
  with pytest.raises(ValueError, match="needs kv_ids"):
    sh.attention(q[:, :4], q, q, mask=M.Bidirectional(jnp.zeros((1, 4), jnp.int32)))
  with pytest.raises(ValueError, match="combines mask objects"):
    M.Causal() | np.ones((1, 1, 8, 8), bool)


def as_int(q_pos, kv_pos):
  return q_pos - kv_pos


def test_mask_fn_closing_over_traced_values():
  """A differentiated value in a MaskFn's closure: a ValueError that says stop_gradient, which
  then gives the oracle's gradients (and none for the value); splash names a traced closure."""
  rng, q, k, v, seg = _inputs(7, padded=False)
  cot = rng.normal(size=q.shape)
  config = sh.AttentionConfig(block_sizes=TILES)

  def loss(q, k, v, width, stop):
    width = jax.lax.stop_gradient(width) if stop else width
    window = M.MaskFn(lambda q_pos, kv_pos: kv_pos > q_pos - width) & M.Causal()
    return jnp.sum(sh.attention(q, k, v, config=config, mask=window).attention_outputs * cot)

  grad = jax.grad(loss, argnums=(0, 1, 2, 3))
  with pytest.raises(ValueError, match=r"MaskFn\(<lambda>\) closes over a value being "
                                       r"differentiated.*jax.lax.stop_gradient"):
    grad(q, k, v, 5.0, False)
  *grads, d_width = jax.jit(grad, static_argnums=4)(q, k, v, 5.0, True)
  _, want = oracle.out_and_vjp(q, k, v, cot, window=(4, 0))
  for g, w in zip(grads, want):
    harness.assert_near(np.asarray(g), w, "grad")
  assert d_width == 0

  splash = sh.AttentionConfig(platform="splash", interpret=True)
  big = jnp.zeros((1, 128, 2, 128))

  @jax.jit
  def explained(n):
    decision = sh.explain(big, big, big, config=splash, mask=M.MaskFn(lambda q, k: k < n))
    assert decision.fallback and "MaskFn(<lambda>) part" in decision.reason, decision
    assert "MaskFn without traced values" in decision.reason
    return n

  explained(3)
