"""Context parallelism: load-balanced sequence shards and ring attention, against the oracle."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import splash_hk as sh
from cases import Case
import harness

CASE = Case("cp", batch=2, query_len=32, kv_len=32, num_heads=4, num_kv_heads=2, head_dim=8,
            window=(9, 0), chunk=12, soft_cap=5.0, segments="packed", sinks="heads_n")


def _axes(strategy: str, balanced: bool) -> sh.MeshAxes:
  return sh.MeshAxes(batch="dp", heads="tp", sequence="sp", sequence_strategy=strategy,
                     load_balanced=balanced)


# Half of the mesh x strategy x order cross product, every pair of factor values still met
# (Ulysses has its own file, tests/test_ulysses.py).
@pytest.mark.parametrize("mesh_name,strategy,balanced", [
    ("sp2", "all_gather", False), ("sp2", "ring", True), ("sp4", "all_gather", True),
    ("sp4", "ring", False), ("sp8", "all_gather", False), ("sp8", "ring", True),
    ("dp2_sp2_tp2", "all_gather", True), ("dp2_sp2_tp2", "ring", False)])
def test_sharded_sequence_matches_oracle_forward_and_gradients(mesh_name, strategy, balanced):
  mesh = harness.mesh(mesh_name, explicit=True)
  n = harness.axis_size(mesh_name, "sp")
  axes = _axes(strategy, balanced)
  q, k, v, extras = CASE.arrays(seed=3)
  sinks = extras.pop("softmax_aux")
  cot = np.random.default_rng(4).normal(size=q.shape).astype(np.float32)
  order = (lambda a: sh.sharding.load_balance(a, n)) if balanced else (lambda a: a)
  seg = order(extras["q_segment_ids"])
  decision = sh.explain(order(q), order(k), order(v), config=CASE.config, mesh=mesh, axes=axes,
                        q_segment_ids=seg, softmax_aux=sinks)
  assert decision.ring == (strategy == "ring") and not decision.fallback, decision

  f = lambda q, k, v, sinks: sh.attention(q, k, v, config=CASE.config, mesh=mesh, axes=axes,
                                          q_segment_ids=seg, softmax_aux=sinks).attention_outputs
  out, grads = harness.values_and_grads(f, (order(q), order(k), order(v), sinks), order(cot))
  back = (lambda a: sh.sharding.restore_order(a, n)) if balanced else (lambda a: a)
  want = harness.oracle_values_and_grads(q, k, v, cot, sinks=sinks, **harness.oracle_rules(
      CASE.config, **extras))
  harness.assert_close((back(out), [*map(back, grads[:3]), grads[3]]), want, grad="sharded_grad")


def test_ring_keeps_keys_sharded_and_falls_back_with_reasons():
  mesh = harness.mesh("sp4", explicit=True)
  axes = sh.MeshAxes(batch=None, heads=None, sequence="sp", sequence_strategy="ring")
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  q = spec(1, 64, 2, 8)
  assert sh.explain(q, q, q, mesh=mesh, axes=axes).ring
  prefill = sh.explain(spec(1, 32, 2, 8), q, q, mesh=mesh, axes=axes)
  assert not prefill.ring and prefill.fallback and "self-attention" in prefill.reason
  mask = jax.ShapeDtypeStruct((1, 1, 64, 64), jnp.bool_)
  assert "dense mask" in sh.explain(q, q, q, mesh=mesh, axes=axes, mask=mask).reason
  with pytest.raises(ValueError, match="falls back to all_gather.*allow_fallback=False"):
    sh.explain(spec(1, 32, 2, 8), q, q, mesh=mesh, axes=axes,
               config=sh.AttentionConfig(allow_fallback=False))
  x = jnp.ones((1, 64, 2, 8))
  out = jax.jit(lambda x: sh.attention(x, x, x, mesh=mesh, axes=axes).attention_outputs)(x)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "sp", None, None)), 4)


def test_ring_memory_per_device_falls_with_the_ring():
  # argument + temp bytes of the compiled forward+backward are per device (an SPMD program).
  # The measurement in docs/guide/context_parallel.md (T=32768, Hq=Hkv=8, D=64, f32, causal),
  # compiled only; the inputs arrive sharded over sp, as a model's activations do.
  sizes = {}
  for n in (1, 8):
    mesh = harness.mesh(f"sp{n}", explicit=True)
    x = jax.ShapeDtypeStruct((1, 32768, 8, 64), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "sp", None, None)))
    axes = sh.MeshAxes(batch=None, heads=None, sequence="sp", sequence_strategy="ring")
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(sh.attention(
        q, k, v, mesh=mesh, axes=axes).attention_outputs), argnums=(0, 1, 2)))
    memory = grad.lower(x, x, x).compile().memory_analysis()
    sizes[n] = memory.argument_size_in_bytes + memory.temp_size_in_bytes
  assert sizes[8] <= sizes[1] / 4, sizes


def test_load_balance_is_the_dual_chunk_swap_and_restore_order_undoes_it():
  x = np.arange(16)[None]
  balanced = sh.sharding.load_balance(x, 2)
  np.testing.assert_array_equal(balanced[0], [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
  np.testing.assert_array_equal(sh.sharding.restore_order(balanced, 2), x)
  y = jnp.arange(2 * 24 * 3).reshape(2, 24, 3)
  np.testing.assert_array_equal(sh.sharding.restore_order(sh.sharding.load_balance(y, 3), 3), y)
  with pytest.raises(ValueError, match="restore_order.*2 \\* 4"):
    sh.sharding.restore_order(np.zeros((1, 12)), 4)
  with pytest.raises(ValueError, match="load_balance"):
    sh.sharding.load_balance(np.zeros((1, 10)), 2)


def test_load_balanced_needs_self_attention_and_a_splitting_mesh():
  mesh = harness.mesh("sp4", explicit=True)
  axes = sh.MeshAxes(batch=None, heads=None, sequence="sp", load_balanced=True)
  x = jnp.ones((1, 64, 2, 8))
  for kwargs, needle in [(dict(query=x[:, :32]), "self-attention"),
                         (dict(mesh=None), "mesh=None"),
                         (dict(mesh=jax.make_mesh((4, 1), ("dp", "sp"))), "does not split"),
                         (dict(query=jnp.ones((1, 36, 2, 8)), key=jnp.ones((1, 36, 2, 8))),
                          "multiple of 2 \\* 4")]:
    call = dict(query=x, key=x, mesh=mesh) | kwargs
    with pytest.raises(ValueError, match=f"load_balanced.*{needle}|{needle}.*load_balanced"):
      sh.attention(call["query"], call["key"], call["key"], mesh=call["mesh"], axes=axes)
  with pytest.raises(ValueError, match="sequence_strategy must be one of .*'ulysses'"):
    sh.MeshAxes(sequence="sp", sequence_strategy="all_to_all")
  with pytest.raises(ValueError, match="needs `sequence`"):
    sh.MeshAxes(load_balanced=True)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_shard_work_balances_causal_work(strategy):
  mesh = harness.mesh("sp8", explicit=True)
  counts = {}
  for balanced in (False, True):
    axes = sh.MeshAxes(batch=None, heads=None, sequence="sp", sequence_strategy=strategy,
                       load_balanced=balanced)
    counts[balanced] = sh.sharding.shard_work(8192, 8192, sh.AttentionConfig(), mesh, axes)
  unsharded = sh.sharding.shard_work(8192, 8192, sh.AttentionConfig(), None, sh.MeshAxes())
  assert 1.7 < max(counts[False]) / np.mean(counts[False]) < 2.0
  assert max(counts[True]) / np.mean(counts[True]) <= 1.05 and len(counts[True]) == 8
  # Shards use 256-row query tiles, the whole call 512: compare work, pairs x tile area.
  assert sum(counts[True]) * 256 * 256 <= sum(unsharded) * 512 * 256


def test_splash_serves_load_balanced_shards():
  case = Case("splash_lb", batch=2, query_len=512, kv_len=512, num_heads=4, num_kv_heads=2,
              head_dim=32, window=(100, 0), segments="packed")
  q, k, v, extras = case.arrays(seed=5)
  mesh = harness.mesh("dp2_sp2_tp2", explicit=True)
  axes = _axes("all_gather", True)
  order = lambda a: sh.sharding.load_balance(a, 2)
  seg = order(extras["q_segment_ids"])
  config = case.config.replace(platform="splash", interpret=True, allow_fallback=False)
  out = jax.jit(lambda q, k, v: sh.attention(q, k, v, config=config, mesh=mesh, axes=axes,
                                             q_segment_ids=seg).attention_outputs)(
      order(q), order(k), order(v))
  np.testing.assert_allclose(sh.sharding.restore_order(np.asarray(out), 2),
                             case.oracle(q, k, v, extras)[0], **harness.tol())
