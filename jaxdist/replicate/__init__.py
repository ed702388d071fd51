"""Replicated values and their layouts: mirrored, per-replica and sync-on-read values; reduce and
aggregation."""

from jaxdist.replicate.layouts import MODEL_AXIS as MODEL_AXIS
from jaxdist.replicate.layouts import REPLICA_AXIS as REPLICA_AXIS
from jaxdist.replicate.layouts import batch_sharded as batch_sharded
from jaxdist.replicate.layouts import replicated as replicated
from jaxdist.replicate.ops import ReduceOp as ReduceOp
from jaxdist.replicate.ops import VariableAggregation as VariableAggregation
from jaxdist.replicate.values import PerReplica as PerReplica
from jaxdist.replicate.values import SyncOnRead as SyncOnRead
from jaxdist.replicate.values import component_name as component_name

__all__ = ["MODEL_AXIS", "REPLICA_AXIS", "PerReplica", "ReduceOp", "SyncOnRead",
           "VariableAggregation", "batch_sharded", "component_name", "replicated"]
