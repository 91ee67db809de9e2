"""`sh.sharding.traffic`: bytes a compiled program sends per device, per strategy."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import pytest

import splash_hk as sh
import harness
from splash_hk.sharding import traffic

HLO = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %cp = f32[4]{0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
}

%cond (p: (s32[], f32[4])) -> pred[] {
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

%branch_a (p: f32[4]) -> f32[8] {
  ROOT %ag = f32[8]{0} all-gather(%y), replica_groups={{0,1}}, dimensions={0}
}

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %sum = f32[] add(%a, %b)
}

%branch_b (p: f32[4]) -> f32[2] {
  %ar = f32[2]{0} all-reduce(%y), replica_groups=[1,2]<=[2], to_apply=%add
}

ENTRY %main (a: f32[2,3]) -> f32[4] {
  %a2a = (f32[2,3]{1,0}, f32[2,3]{1,0}) all-to-all(%a, %b), replica_groups=mesh['x'=2,'y'=1] {'x'}
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %c = f32[8]{0} conditional(%i, %t1, %t2), branch_computations={%branch_a, %branch_b}
  ROOT %rs = f32[4]{0} reduce-scatter(%z), replica_groups={{0,1}}, dimensions={0}
}
"""


def test_sent_bytes_reads_each_collective_loops_and_branches():
  # all-to-all 48 B of which half leaves; the loop's permute 16 B x 3 trips; the costlier branch
  # (all-gather: 16 of its 32 B come from the other device; all-reduce 2 * 8 * 1/2 = 8); the
  # reduce-scatter sends its 16 B result's worth to the other device.
  assert traffic.sent_bytes(HLO) == 24 + 48 + 16 + 16
  with pytest.raises(ValueError, match="no known trip count"):
    traffic.sent_bytes(HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', ""))
  with pytest.raises(ValueError, match="async collective all-gather-start"):
    traffic.sent_bytes(HLO.replace("all-gather(", "all-gather-start("))


@pytest.mark.parametrize("strategy,fraction", [
    ("all_gather", lambda n: 2 * (n - 1) / n), ("ring", lambda n: 2 * (n - 1) / n),
    ("ulysses", lambda n: 4 * (n - 1) / n**2)])
def test_each_strategy_sends_what_its_algorithm_says(strategy, fraction):
  # Per device per forward, in values of one [B, T, H, D] array (H = Hq = Hkv): all_gather
  # receives the other (n-1)/n of K and V, the ring sends its K/V shard n - 1 times, Ulysses
  # (n-1)/n of its q, k, v and output shards. Positions add T ints (under 1%).
  n, shape = 4, (1, 1024, 4, 64)
  mesh = harness.mesh(f"sp{n}", explicit=True)
  x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(None, "sp")))
  axes = sh.MeshAxes(batch=None, heads=None, sequence="sp", sequence_strategy=strategy)
  attend = jax.jit(lambda q, k, v: sh.attention(q, k, v, mesh=mesh, axes=axes,
                                                config=sh.AttentionConfig(platform="xla")))
  measured = traffic.measure(attend, x, x, x)
  assert measured.sent_bytes == pytest.approx(fraction(n) * 4 * 1024 * 4 * 64, rel=0.01)
  assert measured.memory_bytes > 0
