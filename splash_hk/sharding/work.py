"""`shard_work`: how many block pairs each sequence shard computes (context-parallel balance)."""

from __future__ import annotations

import jax
import numpy as np

from splash_hk import tiles
from splash_hk.config import AttentionConfig
from splash_hk.masks import _plan
from splash_hk.masks import _rules
from splash_hk.sharding import specs
from splash_hk.sharding.axes import MeshAxes
from splash_hk.types import Facts


def shard_work(query_len: int, kv_len: int, config: AttentionConfig,
               mesh: jax.sharding.Mesh | None, axes: MeshAxes) -> tuple[int, ...]:
  """(query block, key block) pairs each sequence shard computes, per batch row and head.

  Counted with the xla path's tiles and block plan (`splash_hk.tiles`: what its
  kernel really computes, not an idealised count), at default positions, over all
  ring steps when `axes.sequence_strategy == "ring"` applies (T == S). Under
  "ulysses" every device attends the whole sequence for its share of the heads:
  each count is the whole sequence's pairs, per head it holds.

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
  facts = Facts.from_shapes(
      config, (1, query_len, 1, 1), (1, kv_len, 1, 1), sequence_shards=shards,
      load_balanced=axes.load_balanced, sequence_strategy=axes.sequence_strategy)
  if axes.load_balanced:
    q_pos = kv_pos = _rules.load_balanced_order(query_len, shards)[None]
  else:
    q_pos, kv_pos = _rules.end_aligned_positions(1, query_len, kv_len, np)
  ring = axes.sequence_strategy == "ring" and shards > 1 and query_len == kv_len

  def count(facts: Facts, q: np.ndarray, kv: np.ndarray) -> int:
    block_q, block_kv = tiles.tiles_for(facts)[:2]
    return _plan.count_pairs(facts.rule, q, kv, block_q, block_kv)

  if axes.sequence_strategy == "ulysses" and shards > 1:
    return (count(facts.on_whole_sequence(), q_pos, kv_pos),) * shards
  rows, cols = query_len // shards, kv_len // shards
  counts = []
  for i in range(shards):
    q = q_pos[:, i * rows:(i + 1) * rows]
    blocks = [kv_pos[:, j * cols:(j + 1) * cols] for j in range(shards)] if ring else [kv_pos]
    counts.append(sum(count(facts, q, kv) for kv in blocks))
  return tuple(counts)
