"""sh.attention(mesh=...) equals the float64 oracle on every mesh shape; stable specs."""

import dataclasses
import itertools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import splash_hk as sh
from splash_hk import kernel
from splash_hk import platforms
from splash_hk.sharding import stable_spec, kv_head_repeats
import harness
import oracle

MESHES = ("1x8", "2x4", "4x2", "8x1", "2x2x2")  # batch over dp (and fsdp), heads over tp


def _mesh(name, explicit=True):
  return harness.mesh(name, explicit)


def _inputs(batch, query_len, kv_len, num_kv_heads, seed=0, num_heads=8, head_dim=16):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(batch, query_len, num_heads, head_dim)).astype(np.float32)
  k = rng.normal(size=(batch, kv_len, num_kv_heads, head_dim)).astype(np.float32)
  v = rng.normal(size=(batch, kv_len, num_kv_heads, head_dim)).astype(np.float32)
  sinks = rng.normal(size=(num_heads, 2)).astype(np.float32)
  seg = np.zeros((batch, kv_len), np.int32)
  seg[:, kv_len // 2:] = 1
  seg[:, -2:] = -1
  cot = rng.normal(size=(batch, query_len, num_heads, head_dim)).astype(np.float32)
  return q, k, v, sinks, seg, cot


def _check(config, mesh, q, k, v, sinks, cot, axes=sh.MeshAxes(), **extras):
  """Sharded attention's values and gradients (q, k, v, sinks) against the float64 oracle."""
  f = lambda q, k, v, sinks: sh.attention(q, k, v, config=config, softmax_aux=sinks, mesh=mesh,
                                          axes=axes, **extras).attention_outputs
  harness.check_against_oracle(f, q, k, v, cot, sinks=sinks, **harness.oracle_rules(config, **extras))


EVERYTHING = sh.AttentionConfig(causal=True, sliding_window=(5, 0), logits_soft_cap=4.0)


# Every mesh with every kv-head count, and every batch size (1: batch axes dropped, 2, 8)
# on every mesh: a covering set of the mesh x Hkv x batch product.
COVER = [(mesh, hkv, batch) for n, mesh in enumerate(MESHES) for m, hkv in enumerate((1, 2, 8))
         for batch in [(1, 2, 8)[(n + m) % 3]]]


@pytest.mark.parametrize("mesh_name,num_kv_heads,batch", COVER)
def test_sharded_equals_unsharded_train_forward_and_grads(mesh_name, num_kv_heads, batch):
  q, k, v, sinks, seg, cot = _inputs(batch, 16, 16, num_kv_heads)
  mesh = _mesh(mesh_name)
  _check(EVERYTHING, mesh, q, k, v, sinks, cot, q_segment_ids=seg)


@pytest.mark.parametrize("mesh_name,num_kv_heads,batch", COVER)
def test_sharded_equals_unsharded_decode(mesh_name, num_kv_heads, batch):
  q, k, v, sinks, seg, cot = _inputs(batch, 1, 16, num_kv_heads)
  mesh = _mesh(mesh_name, explicit=False)
  extras = dict(q_segment_ids=np.zeros((batch, 1), np.int32), kv_segment_ids=seg)
  _check(EVERYTHING, mesh, q, k, v, sinks, cot, **extras)


FEATURES = {
    "causal": sh.AttentionConfig(),
    "bidirectional": sh.AttentionConfig(causal=False),
    "window": sh.AttentionConfig(sliding_window=3),
    "chunk": sh.AttentionConfig(chunk_size=4),
    "soft_cap": sh.AttentionConfig(logits_soft_cap=2.0),
    "reference": sh.AttentionConfig(platform="reference", sliding_window=(2, 6)),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_on_2x4(feature):
  q, k, v, sinks, seg, cot = _inputs(2, 16, 16, 2)
  _check(FEATURES[feature], _mesh("2x4"), q, k, v, sinks, cot)


@pytest.mark.parametrize("heads", [1, 8])
def test_dense_mask_with_mesh_is_exact(heads):
  q, k, v, sinks, _, cot = _inputs(2, 16, 16, 2)
  mask = np.random.default_rng(1).random((2, heads, 16, 16)) < 0.6
  _check(sh.AttentionConfig(), _mesh("2x4"), q, k, v, sinks, cot, mask=mask)


@pytest.mark.parametrize("query_len", [16, 6])
def test_query_sequence_sharding_uses_global_positions(query_len):
  mesh = harness.mesh("dp2_sp2_tp2", explicit=True)
  axes = sh.MeshAxes(batch="dp", heads="tp", sequence="sp")
  q, k, v, sinks, seg, cot = _inputs(2, query_len, 16, 2)
  config = sh.AttentionConfig(sliding_window=(4, 0))
  _check(config, mesh, q, k, v, sinks, cot, axes=axes)
  out = jax.jit(lambda q, k, v: sh.attention(q, k, v, config=config, mesh=mesh, axes=axes))(
      q, k, v).attention_outputs
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", "sp", "tp", None)), 4)


def _spy_on_xla(monkeypatch, record):
  real = kernel.backend("xla")
  spy = lambda x, facts: record(x) or real.attend(x, facts)
  monkeypatch.setitem(platforms._TABLE, "xla", dataclasses.replace(real, attend=spy))  # pylint: disable=protected-access


def test_shard_map_really_shards(monkeypatch):
  shapes = []
  _spy_on_xla(monkeypatch, lambda x: shapes.append(
      (x.query.shape, x.key.shape, x.q_segment_ids.shape)))
  q, k, v, sinks, seg, _ = _inputs(8, 16, 16, 8)
  mesh = _mesh("2x4")
  fn = jax.jit(lambda q, k, v: sh.attention(q, k, v, mesh=mesh, q_segment_ids=seg).attention_outputs)
  out = fn(q, k, v)
  assert shapes == [((4, 16, 2, 16), (4, 16, 2, 16), (4, 16))]  # B/2, Hq/4 per device
  hlo = fn.lower(q, k, v).compile().as_text()
  assert "f32[4,16,2,16]" in hlo
  assert out.sharding == NamedSharding(mesh, P("dp", None, "tp", None))


def test_gqa_kv_heads_repeat_to_the_head_shards(monkeypatch):
  shapes = []
  _spy_on_xla(monkeypatch, lambda x: shapes.append((x.query.shape[2], x.key.shape[2])))
  q, k, v, *_ = _inputs(2, 16, 16, 2)  # Hq = 8, Hkv = 2 on tp = 4
  sh.attention(q, k, v, mesh=_mesh("2x4"))
  assert shapes == [(2, 1)]  # each shard: 2 query heads and their one kv head


# Half of the 2x2x2 cross product, every pair of factor values still met (an
# eager call costs ~10 s here: shard_map runs op by op).
@pytest.mark.parametrize("explicit,jit,presharded", [
    (True, True, True), (True, False, False), (False, True, False), (False, False, True)])
def test_mesh_kinds_and_input_shardings(explicit, jit, presharded):
  mesh = _mesh("2x4", explicit=explicit)
  q, k, v, sinks, seg, _ = _inputs(2, 16, 16, 8)
  if presharded:  # sharded some other way than the kernel wants
    q, k, v = (jax.device_put(a, NamedSharding(mesh, P(None, "dp"))) for a in (q, k, v))
  f = lambda q, k, v: sh.attention(q, k, v, mesh=mesh, softmax_aux=sinks).attention_outputs
  out = (jax.jit(f) if jit else f)(q, k, v)
  want, _ = oracle.attention(np.asarray(q), np.asarray(k), np.asarray(v), sinks=sinks)
  np.testing.assert_allclose(np.asarray(out), want, **harness.tol())
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", None, "tp", None)), 4)


def test_bad_mesh_arguments():
  q = jnp.ones((2, 4, 8, 8))
  with pytest.raises(ValueError, match="mesh"):
    sh.attention(q, q, q, mesh="dp=2")
  with pytest.raises(ValueError, match="axes"):
    sh.attention(q, q, q, mesh=_mesh("2x4"), axes=("dp", "tp"))
  with pytest.raises(ValueError, match="at most once"):
    sh.MeshAxes(batch=("dp", "tp"), heads="tp")


class _FakeMesh:
  shape = {"dp": 2, "fsdp": 4, "tp": 4, "sp": 2}


STABLE_SPEC_TABLE = [
    # (spec, shape, keep, expected)
    (P("dp", "tp"), (8, 8), (0, 1), P("dp", "tp")),  # divisible
    (P("dp", "tp"), (3, 6), (0, 1), P(None, None)),  # indivisible
    (P("ep", "tp"), (8, 8), (0, 1), P(None, "tp")),  # missing axis
    (P(("dp", "fsdp"), "tp"), (4, 8), (0, 1), P("dp", "tp")),  # tuple: dp divides, dp*fsdp not
    (P(("fsdp", "dp"), None), (2, 8), (0, 1), P("dp", None)),  # tuple: skips fsdp, keeps dp
    (P(("dp", "fsdp"), "tp"), (16, 4), (0, 1), P(("dp", "fsdp"), "tp")),  # whole tuple
    (P(("dp", "ep", "fsdp"),), (8,), (0,), P(("dp", "fsdp"),)),  # missing axis inside a tuple
    (P("tp", "tp"), (8, 8), (0, 1), P("tp", None)),  # never repeats an axis
    (P("tp", "tp"), (8, 8), (1,), P(None, "tp")),  # keep decides who gets it
    (P(None, "sp", "tp"), (2, 3, 8), (0, 1), P(None, None, "tp")),  # non-kept dim drops too
    (P("dp"), (4, 8, 16), (0, 1), P("dp", None, None)),  # shorter spec is padded
    (P(), (4, 8), (0, 1), P(None, None)),
    (P("dp", "tp", "sp"), (1, 1, 1), (0, 1), P(None, None, None)),  # length-1 dims
]


@pytest.mark.parametrize("spec,shape,keep,expected", STABLE_SPEC_TABLE)
def test_stable_spec_table(spec, shape, keep, expected):
  assert stable_spec(spec, shape, _FakeMesh(), keep=keep) == expected


def test_stable_spec_rank_mismatch():
  with pytest.raises(ValueError, match="rank 2"):
    stable_spec(P("dp", "tp", None), (4, 8), _FakeMesh())


def test_stable_spec_is_always_valid_on_real_meshes():
  for name, (b, h, t) in itertools.product(MESHES, [(1, 8, 1), (3, 6, 5), (8, 8, 16)]):
    mesh = _mesh(name, explicit=False)
    spec = stable_spec(P(("dp", "fsdp"), "tp", "dp"), (b, h, t, 4), mesh)
    jax.device_put(np.zeros((b, h, t, 4)), NamedSharding(mesh, spec))  # raises if invalid


@pytest.mark.parametrize("hq,hkv,n,expected", [(8, 8, 4, 1), (8, 2, 4, 2), (8, 1, 4, 4),
                                               (8, 1, 8, 8), (8, 2, 1, 1), (12, 3, 4, 4),
                                               (8, 4, 8, 2)])
def test_kv_head_repeats(hq, hkv, n, expected):
  r = kv_head_repeats(hq, hkv, n)
  assert r == expected and (hkv * r) % n == 0 and (hq // hkv) % r == 0


def test_axes_a_mesh_lacks_are_dropped_said_once_and_listed_by_explain(caplog):
  from splash_hk.sharding import axes as axes_lib  # pylint: disable=g-import-not-at-top
  axes_lib._LOGGED.clear()  # a cache: each (names, mesh) said once per process
  q = np.random.default_rng(41).normal(size=(2, 16, 8, 8)).astype(np.float32)
  mesh = _mesh("2x4")
  typo = sh.MeshAxes(batch="dp", heads="typo")
  with caplog.at_level(logging.INFO):
    for _ in range(2):
      out = sh.attention(q, q, q, mesh=mesh, axes=typo).attention_outputs
  said = [r for r in caplog.records if "are not in the mesh" in r.getMessage()]
  assert len(said) == 1 and said[0].levelno == logging.WARNING
  assert "['typo']" in said[0].getMessage() and "['dp', 'tp']" in said[0].getMessage()
  np.testing.assert_allclose(np.asarray(out), oracle.attention(q, q, q)[0], **harness.tol())
  assert sh.explain(q, q, q, mesh=mesh, axes=typo).dropped_axes == ("typo",)
  assert sh.explain(q, q, q, mesh=mesh).dropped_axes == ("fsdp",)  # the default's spare name
  assert sh.explain(q, q, q, mesh=mesh, axes=sh.MeshAxes(batch="dp")).dropped_axes == ()
  assert sh.explain(q, q, q).dropped_axes == ()


@pytest.mark.parametrize("axes", [sh.MeshAxes(batch="data", heads="model"), sh.MeshAxes()])
def test_a_mesh_sharing_no_name_with_the_axes_is_refused_naming_axes(axes):
  q = jnp.ones((2, 16, 8, 8))
  mesh = jax.make_mesh((2, 4), ("x", "y"), devices=jax.devices()[:8])
  with pytest.raises(ValueError, match=r"`axes` names mesh axes .* none of them \(its axes are "
                                       r"\['x', 'y'\]\)"):
    sh.attention(q, q, q, mesh=mesh, axes=axes)
