"""Ulysses context parallelism (`sequence_strategy="ulysses"`) against the float64 oracle.

Every call runs jitted under 8 virtual devices: forward values and the
gradients of q, k, v and sinks, on the xla backend and on splash in interpret
mode (the point of Ulysses: the kernel stays), with sp in {2, 4, 8}, with and
without a tp head axis, contiguous and load-balanced.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splash_hk as sh
from cases import Case
import harness
import oracle

M = sh.masks
# GQA with Dv != D: the kv heads (2) do not divide over sp = 4 or 8, nor over tp = 4.
CASE = Case("ulysses", batch=2, query_len=32, kv_len=32, num_heads=8, num_kv_heads=2, head_dim=8,
            value_dim=16, window=(9, 0), chunk=12, soft_cap=5.0, segments="packed",
            sinks="heads_n")


def _mesh(name: str):
  return harness.mesh(name, explicit=True)


def _axes(balanced: bool = False) -> sh.MeshAxes:
  return sh.MeshAxes(batch="dp", heads="tp", sequence="sp", sequence_strategy="ulysses",
                     load_balanced=balanced)


def _sp(name: str) -> int:
  return harness.axis_size(name, "sp")


def _run(q, k, v, cot, *, mesh, axes, config, order=lambda a: a, restore=lambda a: a, **kwargs):
  """Ulysses attention, jitted: (out, (dq, dk, dv[, d_sinks])) in the caller's token order."""
  sinks = kwargs.pop("softmax_aux", None)
  decision = sh.explain(order(q), order(k), order(v), config=config, mesh=mesh, axes=axes,
                        softmax_aux=sinks, **kwargs)
  assert decision.ulysses and not decision.fallback, decision

  def loss(q, k, v, sinks):
    out = sh.attention(order(q), order(k), order(v), config=config, mesh=mesh, axes=axes,
                       softmax_aux=sinks, **kwargs).attention_outputs
    out = restore(out)
    return jnp.sum(out * cot), out

  argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(
      q, k, v, sinks)
  return np.asarray(out), [np.asarray(g) for g in grads]


def _check(got, want):
  harness.assert_close(got, want, grad="sharded_grad")


@pytest.mark.parametrize("mesh_name,balanced", [
    ("dp2_sp2_tp2", False), ("sp8", True), ("sp2_tp4", True)])
def test_every_rule_sinks_gqa_and_value_dim_match_the_oracle(mesh_name, balanced):
  n = _sp(mesh_name)
  q, k, v, extras = CASE.arrays(seed=3)
  cot = np.random.default_rng(4).normal(size=(*q.shape[:3], 16))
  order = (lambda a: sh.sharding.load_balance(a, n)) if balanced else (lambda a: a)
  restore = (lambda a: sh.sharding.restore_order(a, n)) if balanced else (lambda a: a)
  got = _run(q, k, v, cot, mesh=_mesh(mesh_name), axes=_axes(balanced),
             config=CASE.config.replace(platform="xla"), order=order, restore=restore,
             q_segment_ids=order(extras["q_segment_ids"]), softmax_aux=extras["softmax_aux"])
  want = oracle.out_and_vjp(q, k, v, cot, causal=True, window=(9, 0), chunk=12, soft_cap=5.0,
                            q_seg=extras["q_segment_ids"], sinks=extras["softmax_aux"])
  _check(got, want)


def test_explicit_positions_and_a_per_head_dense_mask():
  case = Case("positions", batch=2, query_len=32, kv_len=32, num_heads=8, num_kv_heads=4,
              head_dim=8, window=(9, 0), positions=True, mask="heads", segments="packed")
  q, k, v, extras = case.arrays(seed=5)
  cot = np.random.default_rng(6).normal(size=q.shape)
  got = _run(q, k, v, cot, mesh=_mesh("dp2_sp2_tp2"), axes=_axes(),
             config=case.config.replace(platform="xla"), **extras)
  _check(got, oracle.out_and_vjp(q, k, v, cot, causal=True, window=(9, 0),
                                 q_seg=extras["q_segment_ids"], q_pos=extras["q_positions"],
                                 kv_pos=extras["kv_positions"], mask=extras["mask"]))


def test_prefill_against_a_longer_cache_with_a_shared_dense_mask():
  case = Case("prefill", batch=2, query_len=16, kv_len=64, num_heads=8, num_kv_heads=1,
              head_dim=8, mask="shared", sinks="heads")
  q, k, v, extras = case.arrays(seed=7)
  cot = np.random.default_rng(8).normal(size=q.shape)
  got = _run(q, k, v, cot, mesh=_mesh("sp8"), axes=_axes(), config=case.config.replace(
      platform="xla"), **extras)
  _check(got, oracle.out_and_vjp(q, k, v, cot, causal=True, mask=extras["mask"],
                                 sinks=extras["softmax_aux"]))


def _images(rng, batch, length):
  """Ids per row: two or three image spans (ids 0, 1, 2), text -1."""
  ids = np.full((batch, length), -1, np.int32)
  for b in range(batch):
    starts = np.sort(rng.choice(np.arange(1, length - 8, 8), size=3, replace=False))
    for i, start in enumerate(starts[:2 + b % 2]):
      ids[b, start:start + rng.integers(3, 9)] = i
  return ids


def test_mask_objects_load_balanced_over_dp_and_sp():
  case = Case("objects", batch=2, query_len=64, kv_len=64, num_heads=8, num_kv_heads=8,
              head_dim=8, segments="packed")
  q, k, v, extras = case.arrays(seed=9)
  rng = np.random.default_rng(10)
  ids = _images(rng, 2, 64)
  cot = rng.normal(size=q.shape)
  n = 4
  order = lambda a: sh.sharding.load_balance(a, n)
  rule = M.Causal() | M.Bidirectional(order(ids))
  got = _run(q, k, v, cot, mesh=_mesh("dp2_sp4"),
             axes=_axes(True), config=sh.AttentionConfig(platform="xla"), order=order,
             restore=lambda a: sh.sharding.restore_order(a, n), mask=rule,
             q_segment_ids=order(extras["q_segment_ids"]))
  pos = np.arange(64)
  same = (ids[:, None, :, None] == ids[:, None, None, :]) & (ids[:, None, :, None] >= 0)
  dense = (pos[None, None, None, :] <= pos[None, None, :, None]) | same
  _check(got, oracle.out_and_vjp(q, k, v, cot, causal=False, q_seg=extras["q_segment_ids"],
                                 mask=dense))


def _window_or_first_four(q_pos, kv_pos):
  return ((q_pos - kv_pos >= 0) & (q_pos - kv_pos <= 40)) | (kv_pos < 4)


@pytest.mark.parametrize("mesh_name,balanced,rules", [
    ("dp2_sp2_tp2", True, "mask_fn"), ("sp8", False, "mask_fn"), ("dp2_sp4", False, "config"),
    ("dp2_sp4", False, "prefix_lm")])
def test_splash_in_interpret_mode_keeps_the_kernel(mesh_name, balanced, rules):
  # MQA at sp = 8 (one kv head repeated for the devices, never for every query head); the
  # config's causal + window + chunk with Dv != D at sp = 4.
  hkv = {"dp2_sp2_tp2": 2, "sp8": 1, "dp2_sp4": 4}[mesh_name]
  case = Case("splash", batch=2, query_len=256, kv_len=256, num_heads=8, num_kv_heads=hkv,
              head_dim=32, value_dim=64 if rules == "config" else None, soft_cap=10.0,
              segments="packed", sinks="heads", window=(40, 0) if rules == "config" else None,
              chunk=96 if rules == "config" else None)
  q, k, v, extras = case.arrays(seed=11)
  cot = np.random.default_rng(12).normal(size=(*q.shape[:3], v.shape[-1]))
  n = _sp(mesh_name)
  order = (lambda a: sh.sharding.load_balance(a, n)) if balanced else (lambda a: a)
  restore = (lambda a: sh.sharding.restore_order(a, n)) if balanced else (lambda a: a)
  config = case.config.replace(platform="splash", interpret=True, allow_fallback=False)
  pos = np.arange(256)
  if rules == "mask_fn":
    mask = {"mask": M.MaskFn(_window_or_first_four)}
    oracle_rules = dict(mask=_window_or_first_four(pos[:, None], pos[None, :])[None, None])
  elif rules == "prefix_lm":  # per-example prefixes gathered with the sequence (traced ids)
    ids = np.where(pos < np.array([[150], [37]]), 0, -1).astype(np.int32)  # [B, T]
    mask = {"mask": M.Causal() | M.Bidirectional(ids)}
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
    oracle_rules = dict(mask=((pos[None, None, :] <= pos[None, :, None]) | same)[:, None])
  else:
    mask, oracle_rules = {}, dict(causal=True, window=(40, 0), chunk=96)
  got = _run(q, k, v, cot, mesh=_mesh(mesh_name), axes=_axes(balanced), config=config,
             order=order, restore=restore, q_segment_ids=order(extras["q_segment_ids"]),
             softmax_aux=extras["softmax_aux"], **mask)
  _check(got, oracle.out_and_vjp(q, k, v, cot, soft_cap=10.0, q_seg=extras["q_segment_ids"],
                                 sinks=extras["softmax_aux"], **{"causal": False, **oracle_rules}))


def test_explain_splash_serves_what_the_ring_refuses_and_ulysses_limits_fall_back():
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  q = spec(2, 512, 8, 64)
  mesh = _mesh("dp2_sp4")
  config = sh.AttentionConfig(platform="splash", interpret=True)
  ring = sh.explain(q, q, q, config=config, mesh=mesh,
                    axes=sh.MeshAxes(sequence="sp", sequence_strategy="ring"))
  assert ring.backend == "splash" and ring.fallback and not ring.ring
  assert "no forward/backward halves" in ring.reason
  ulysses = sh.explain(q, q, q, config=config, mesh=mesh, axes=_axes())
  assert ulysses.backend == "splash" and ulysses.ulysses and not ulysses.fallback
  assert "2 of 8 query heads per device (Ulysses over 4 sequence shards)" in ulysses.reason
  for call, needle in [
      (dict(query=spec(2, 512, 4, 64), key=spec(2, 512, 4, 64), mesh=_mesh("sp8")),
       "4 query heads per device after the head axis \\(1 shards\\) do not divide over 8"),
      (dict(query=spec(2, 512, 4, 64), key=spec(2, 512, 4, 64), mesh=_mesh("sp2_tp4")),
       "1 query heads per device after the head axis \\(4 shards\\) do not divide over 2"),
      (dict(query=spec(2, 512, 8, 64), key=spec(2, 514, 8, 64), mesh=mesh),
       "kv_len 514 does not divide over 4"),
      (dict(return_weights=True, config=sh.AttentionConfig(platform="reference")),
       "attention weights were requested")]:
    args = dict(query=q, key=q, mesh=mesh, config=config) | call
    decision = sh.explain(args["query"], args["key"], args["key"], config=args["config"],
                          mesh=args["mesh"], axes=_axes(),
                          return_weights=args.get("return_weights", False))
    assert decision.fallback and not decision.ulysses, decision
    assert "sequence_strategy='ulysses' falls back to all_gather because" in decision.reason
    assert len(re.findall(needle, decision.reason)) == 1, decision.reason
    with pytest.raises(ValueError, match="allow_fallback=False"):
      sh.explain(args["query"], args["key"], args["key"], mesh=args["mesh"], axes=_axes(),
                 config=args["config"].replace(allow_fallback=False),
                 return_weights=args.get("return_weights", False))


def test_decode_never_shards_the_query():
  q, kv = jnp.ones((2, 1, 8, 8)), jnp.ones((2, 64, 8, 8))
  decision = sh.explain(q, kv, kv, mesh=_mesh("dp2_sp4"), axes=_axes())
  assert not decision.ulysses and not decision.fallback


def test_kv_heads_are_repeated_only_as_far_as_the_devices_need():
  # MQA, 8 query heads over sp = 4: each device receives one kv head, not the 2 of its query heads.
  mesh = _mesh("dp2_sp4")
  q, kv = jnp.ones((2, 64, 8, 8)), jnp.ones((2, 64, 1, 8))
  jaxpr = jax.make_jaxpr(lambda q, k, v: sh.attention(
      q, k, v, mesh=mesh, axes=_axes(), config=sh.AttentionConfig(platform="xla")))(q, kv, kv)
  shapes = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "all_to_all":
        shapes.append((tuple(eqn.invars[0].aval.shape), tuple(eqn.outvars[0].aval.shape)))
      for sub in jax.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jaxpr.jaxpr)
  # q in, k in, v in (per device: batch 1, 16 tokens), out back.
  assert shapes == [((1, 16, 8, 8), (1, 64, 2, 8)), ((1, 16, 4, 8), (1, 64, 1, 8)),
                    ((1, 16, 4, 8), (1, 64, 1, 8)), ((1, 64, 2, 8), (1, 16, 8, 8))], shapes


def test_shard_work_counts_the_whole_sequence_on_every_device():
  # Every device attends all T x S pairs for its share of the heads; load-balanced order keeps
  # the xla tiles within a chunk (T / 2n = 512 here, the tiles' own size), so nothing changes.
  config = sh.AttentionConfig()
  whole = sh.sharding.shard_work(8192, 8192, config, None, sh.MeshAxes())
  mesh = _mesh("sp8")
  for balanced in (False, True):
    axes = sh.MeshAxes(batch=None, heads=None, sequence="sp", sequence_strategy="ulysses",
                       load_balanced=balanced)
    assert sh.sharding.shard_work(8192, 8192, config, mesh, axes) == whole * 8


def test_real_size_with_default_tiles_and_a_partial_last_block():
  # B = 2, T = 1800 over sp = 4 (450 tokens per device): the kernel sees 1800 tokens with the
  # default tiles (512 x 256), so the last blocks are partial; GQA, packed rows, sinks.
  case = Case("real", batch=2, query_len=1800, kv_len=1800, num_heads=8, num_kv_heads=2,
              head_dim=64, segments="packed", sinks="heads", window=(700, 0))
  q, k, v, extras = case.arrays(seed=13)
  config = case.config.replace(platform="xla", allow_fallback=False)
  mesh = _mesh("dp2_sp4")
  assert sh.explain(q, k, v, config=config, mesh=mesh, axes=_axes(), **extras).ulysses
  out = jax.jit(lambda q, k, v: sh.attention(q, k, v, config=config, mesh=mesh, axes=_axes(),
                                             **extras).attention_outputs)(q, k, v)
  np.testing.assert_allclose(np.asarray(out), case.oracle(q, k, v, extras)[0], **harness.tol())
