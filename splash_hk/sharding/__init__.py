"""Sharding: mesh axes, always-valid PartitionSpecs, the shard_map wrapper, context parallelism,
and what a sharded program sends (`traffic`)."""

from splash_hk.sharding import traffic
from splash_hk.sharding.axes import MeshAxes
from splash_hk.sharding.context import load_balance
from splash_hk.sharding.context import restore_order
from splash_hk.sharding.shard import shard_kernel
from splash_hk.sharding.shard import shard_paged
from splash_hk.sharding.specs import attention_specs
from splash_hk.sharding.specs import kv_head_repeats
from splash_hk.sharding.specs import query_head_shards
from splash_hk.sharding.specs import query_sequence_shards
from splash_hk.sharding.specs import stable_spec
from splash_hk.sharding.work import shard_work

__all__ = ("MeshAxes", "attention_specs", "kv_head_repeats", "load_balance", "query_head_shards",
           "query_sequence_shards", "restore_order", "shard_kernel", "shard_paged", "shard_work", "stable_spec",
           "traffic")
