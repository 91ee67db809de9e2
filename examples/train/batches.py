"""The training binary's data: recall batches, sharded over the mesh, load-balanced once per batch."""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

import splash_hk as sh
from examples.train import recall


def make_batches(task: recall.RecallTask, mesh,
                 axes: sh.MeshAxes) -> Callable[[int, int, int], dict[str, Any]]:
  """(seed, step, batch_size) -> this process's rows of the global batch, sharded over batch.

  With load-balanced axes every batch is put in load-balanced order once, here
  (not per layer), with the tokens' original positions for the embeddings.
  """
  shards = mesh.shape["sp"] if axes.load_balanced else None

  def host(seed: int, step: int, batch_size: int, rows: slice | None = None):
    b = task.batch(seed, step, batch_size, rows)
    if shards:
      b = {k: sh.sharding.load_balance(v, shards) for k, v in b.items()}
      order = sh.sharding.load_balance(np.arange(task.seq_len, dtype=np.int32)[None], shards)
      b["positions"] = np.repeat(order, len(b["inputs"]), axis=0)
    return b

  if mesh is None:
    return host

  def batch(seed: int, step: int, batch_size: int) -> dict[str, jax.Array]:
    spec = sh.sharding.stable_spec(PartitionSpec(("dp", "fsdp")), (batch_size, 1), mesh, keep=(0,))
    sharding = NamedSharding(mesh, spec)
    rows = sorted({idx[0].indices(batch_size) for idx in
                   sharding.addressable_devices_indices_map((batch_size, 1)).values()})
    local = host(seed, step, batch_size, slice(rows[0][0], rows[-1][1]))
    return {k: jax.make_array_from_process_local_data(sharding, v, (batch_size, *v.shape[1:]))
            for k, v in local.items()}

  return batch
