"""Per sequence strategy: bytes each device sends per attention call, and its peak memory.

  python -m benchmarks.bench --cpu_devices=8 --workloads= --traffic_len=65536 --sequence_shards=8

Compiled only (nothing runs): causal self-attention, [B, T, H, D] inputs sharded
over the sequence as a model's activations are, on the xla backend.
Measured by `sh.sharding.traffic` from the compiled program; beside it the
analytic count of the big arrays per forward (q, k, v, out; positions and
segment ids are not in it), with n shards and H = Hq = Hkv:
all_gather receives the other (n - 1) / n of K and V: 2 (n - 1) T H D / n values;
the ring sends its K/V shard n - 1 times: 2 (n - 1) T H D / n;
Ulysses sends (n - 1) / n of its q, k, v and out shards: 4 (n - 1) T H D / n^2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import splash_hk as sh
from splash_hk.sharding import MeshAxes

STRATEGIES = ("all_gather", "ring", "ulysses")
_MIB = 2.0**20


def analytic_bytes(strategy: str, query_len: int, shards: int, heads: int, head_dim: int,
                   itemsize: int, batch: int = 1) -> float:
  """The big arrays one device sends per forward (see the module docstring)."""
  values = batch * query_len * heads * head_dim
  n = shards
  per_strategy = {"all_gather": 2 * (n - 1) / n, "ring": 2 * (n - 1) / n,
                  "ulysses": 4 * (n - 1) / n**2}
  return per_strategy[strategy] * values * itemsize


def measure(strategy: str, query_len: int, shards: int, batch: int, heads: int, head_dim: int,
            dtype) -> tuple[sh.sharding.traffic.Traffic, sh.sharding.traffic.Traffic]:
  """(forward, forward + backward) traffic of one call; the backward as a training step
  runs it: the output and the gradients of q, k, v for a cotangent."""
  mesh = jax.make_mesh((shards,), ("sp",), devices=jax.devices()[:shards])
  axes = MeshAxes(batch=None, heads=None, sequence="sp", sequence_strategy=strategy)
  x = jax.ShapeDtypeStruct((batch, query_len, heads, head_dim), dtype,
                           sharding=NamedSharding(mesh, PartitionSpec(None, "sp", None, None)))
  config = sh.AttentionConfig(platform="xla")
  attend = lambda q, k, v: sh.attention(q, k, v, config=config, mesh=mesh,
                                        axes=axes).attention_outputs

  def step(q, k, v):
    out, pullback = jax.vjp(attend, q, k, v)
    return out, pullback(jnp.ones_like(out))

  measure_ = sh.sharding.traffic.measure
  return measure_(jax.jit(attend), x, x, x), measure_(jax.jit(step), x, x, x)


def report(query_len: int, shards: int, batch: int, heads: int, head_dim: int,
           dtype) -> dict[str, dict[str, float]]:
  """Prints the table and returns {strategy: {column: MiB}}."""
  itemsize = jnp.dtype(dtype).itemsize
  print(f"\nper device, T={query_len}, sp={shards}, B={batch}, H=Hkv={heads}, D={head_dim}, "
        f"{jnp.dtype(dtype).name}, causal, xla (MiB; compiled, not run)")
  print(f"{'strategy':<11} {'sent fwd':>9} {'analytic':>9} {'sent f+b':>9} {'mem fwd':>9} "
        f"{'mem f+b':>9}")
  table = {}
  for strategy in STRATEGIES:
    forward, step = measure(strategy, query_len, shards, batch, heads, head_dim, dtype)
    row = {"sent_forward": forward.sent_bytes / _MIB,
           "analytic_forward": analytic_bytes(strategy, query_len, shards, heads, head_dim,
                                              itemsize, batch) / _MIB,
           "sent_forward_backward": step.sent_bytes / _MIB,
           "memory_forward": forward.memory_bytes / _MIB,
           "memory_forward_backward": step.memory_bytes / _MIB}
    table[strategy] = row
    print(f"{strategy:<11} " + " ".join(f"{v:>9.1f}" for v in row.values()))
  return table
