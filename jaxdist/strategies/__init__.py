"""Strategies: where replicas run and how code runs on them."""

from jaxdist.costs import ACCELERATORS as ACCELERATORS
from jaxdist.costs import Accelerator as Accelerator
from jaxdist.costs import Estimate as Estimate
from jaxdist.strategies import compat as compat
from jaxdist.strategies.agreement import ProgramMismatchError as ProgramMismatchError
from jaxdist.strategies.base import Strategy as Strategy
from jaxdist.strategies.cluster import initialize_cluster as initialize_cluster
from jaxdist.strategies.context import get_replica_context as get_replica_context
from jaxdist.strategies.context import get_strategy as get_strategy
from jaxdist.strategies.context import has_strategy as has_strategy
from jaxdist.strategies.context import in_cross_replica_context as in_cross_replica_context
from jaxdist.strategies.extended import StrategyExtended as StrategyExtended
from jaxdist.strategies.global_view import StrategyFunction as StrategyFunction
from jaxdist.strategies.input import DistributedDataset as DistributedDataset
from jaxdist.strategies.input import DistributedIterator as DistributedIterator
from jaxdist.strategies.input import InputContext as InputContext
from jaxdist.strategies.legacy import StrategyV1Names as StrategyV1Names
from jaxdist.strategies.legacy import TowerContext as TowerContext
from jaxdist.strategies.losses import compute_average_loss as compute_average_loss
from jaxdist.strategies.losses import scale_regularization_loss as scale_regularization_loss
from jaxdist.strategies.mirrored import MirroredStrategy as MirroredStrategy
from jaxdist.strategies.multi_worker import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from jaxdist.strategies.offload import HOST_OFFLOAD_MODES as HOST_OFFLOAD_MODES
from jaxdist.strategies.one_device import OneDeviceStrategy as OneDeviceStrategy
from jaxdist.strategies.plan import Plan as Plan
from jaxdist.strategies.plan_mesh import plan_mesh as plan_mesh
from jaxdist.strategies.policy import IdleAxisWarning as IdleAxisWarning
from jaxdist.strategies.policy import LayoutPolicy as LayoutPolicy
from jaxdist.strategies.programs import ProgramCache as ProgramCache
from jaxdist.strategies.programs import RecompileWarning as RecompileWarning
from jaxdist.strategies.replica_context import ReplicaContext as ReplicaContext
from jaxdist.strategies.roles import UndeclaredBatchWarning as UndeclaredBatchWarning
from jaxdist.strategies.sharded import ShardedStrategy as ShardedStrategy
from jaxdist.strategies.sharded import UnmatchedLayoutRuleWarning as UnmatchedLayoutRuleWarning
from jaxdist.strategies.steps import MultiStepContext as MultiStepContext
from jaxdist.strategies.value_context import ValueContext as ValueContext

__all__ = [
    "ACCELERATORS",
    "HOST_OFFLOAD_MODES",
    "Accelerator",
    "DistributedDataset",
    "DistributedIterator",
    "Estimate",
    "IdleAxisWarning",
    "InputContext",
    "LayoutPolicy",
    "MirroredStrategy",
    "MultiStepContext",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "Plan",
    "ProgramCache",
    "ProgramMismatchError",
    "RecompileWarning",
    "ReplicaContext",
    "ShardedStrategy",
    "Strategy",
    "StrategyExtended",
    "StrategyFunction",
    "StrategyV1Names",
    "TowerContext",
    "UndeclaredBatchWarning",
    "UnmatchedLayoutRuleWarning",
    "ValueContext",
    "compat",
    "compute_average_loss",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "initialize_cluster",
    "plan_mesh",
    "scale_regularization_loss",
]
