"""Sharding: mesh axes, always-valid PartitionSpecs, and the shard_map wrapper."""

from splash_hk.sharding.axes import MeshAxes
from splash_hk.sharding.shard import shard_kernel
from splash_hk.sharding.specs import attention_specs
from splash_hk.sharding.specs import kv_head_repeats
from splash_hk.sharding.specs import query_sequence_shards
from splash_hk.sharding.specs import stable_spec

__all__ = ("MeshAxes", "attention_specs", "kv_head_repeats", "query_sequence_shards", "shard_kernel", "stable_spec")
