"""`shard_work`: how many block pairs each sequence shard computes (context-parallel balance)."""

from __future__ import annotations

import numpy as np

from splash_hk import masks
from splash_hk.backends import xla
from splash_hk.backends import xla_blocks
from splash_hk.config import AttentionConfig
from splash_hk.mode import detect_mode
from splash_hk.sharding import specs
from splash_hk.sharding.axes import MeshAxes
from splash_hk.types import Facts


def shard_work(query_len: int, kv_len: int, config: AttentionConfig, mesh,
               axes: MeshAxes) -> tuple[int, ...]:
  """(query block, key block) pairs each sequence shard computes, per batch row and head.

  Counted on the xla path with its own tiles and block rule (what its kernel
  really computes, not an idealised count), at default positions, over all ring
  steps when `axes.sequence_strategy == "ring"` applies (T == S).

  Args:
    query_len: T; kv_len: S.
    config: the attention config (mask rules, block sizes).
    mesh: the device mesh; axes: as passed to `attention`.

  Returns:
    One count per sequence shard, in shard order (one entry if the sequence is not sharded).
  """
  shards = 1 if mesh is None else specs.query_sequence_shards((1, query_len, 1, 1), mesh, axes)
  if axes.load_balanced:
    specs.check_load_balanced(query_len, kv_len, mesh, axes, shards)
  facts = Facts(config=config, query_shape=(1, query_len, 1, 1), key_shape=(1, kv_len, 1, 1),
                value_dim=1, mode=detect_mode(query_len, kv_len), default_positions=True,
                sequence_shards=shards, load_balanced=axes.load_balanced,
                sequence_strategy=axes.sequence_strategy)
  if axes.load_balanced:
    q_pos = kv_pos = masks.load_balanced_order(query_len, shards)
  else:
    q_pos, kv_pos = np.arange(query_len) + kv_len - query_len, np.arange(kv_len)
  ring = axes.sequence_strategy == "ring" and shards > 1 and query_len == kv_len
  block_q, block_kv = xla.tiles_for(facts)[:2]
  rows, cols = query_len // shards, kv_len // shards
  counts = []
  for i in range(shards):
    q = q_pos[None, i * rows:(i + 1) * rows]
    blocks = ([kv_pos[None, j * cols:(j + 1) * cols] for j in range(shards)] if ring
              else [kv_pos[None]])
    counts.append(sum(xla_blocks.count_pairs(q, kv, facts.rules, block_q, block_kv)
                      for kv in blocks))
  return tuple(counts)
