"""Context parallelism helpers: the dual-chunk (load-balanced) sequence order and its inverse."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

from splash_hk.masks import _rules


def _take(x: Any, order: np.ndarray, axis: int) -> Any:
  """x[..., order, ...] along `axis`; a jax.Array sharded explicitly keeps its other axes' sharding."""
  if isinstance(x, np.ndarray):
    return np.take(x, order, axis=axis)
  index = (slice(None),) * axis + (order,)
  sharding = jax.typeof(x).sharding
  spec = getattr(sharding, "spec", None)
  if spec is None or all(e is None for e in spec):
    return jnp.asarray(x)[index]
  spec = list(spec) + [None] * (x.ndim - len(spec))
  spec[axis] = None  # the permuted axis is gathered whole
  return x.at[index].get(out_sharding=NamedSharding(sharding.mesh, PartitionSpec(*spec)))


def _order(x: Any, num_shards: int, axis: int, name: str) -> np.ndarray:
  try:
    return _rules.load_balanced_order(x.shape[axis], num_shards)
  except ValueError as e:
    raise ValueError(f"{name}: axis {axis} of shape {tuple(x.shape)}: {e}") from None


def load_balance(x: Any, num_shards: int, axis: int = 1) -> Any:
  """Contiguous -> load-balanced order along `axis` (the dual-chunk swap).

  The axis is cut into 2n chunks; shard i then holds chunks i and 2n - 1 - i,
  in that order, so causal attention gives every shard the same work. Apply it
  once to a model's token batch (and targets), not per layer; `restore_order`
  undoes it.

  Raises:
    ValueError: if 2 * num_shards does not divide the axis.
  """
  return _take(x, _order(x, num_shards, axis, "load_balance"), axis)


def restore_order(x: Any, num_shards: int, axis: int = 1) -> Any:
  """Load-balanced -> contiguous order along `axis` (the inverse of `load_balance`)."""
  return _take(x, np.argsort(_order(x, num_shards, axis, "restore_order")), axis)
