"""Strategies: where replicas run and how code runs on them.

The names used most are also at the top (``jd.MirroredStrategy`` is
``jd.strategies.MirroredStrategy``).
"""

from jaxdist.strategies import compat as compat
from jaxdist.strategies.base import Strategy as Strategy
from jaxdist.strategies.compile import MultiStepContext as MultiStepContext
from jaxdist.strategies.compile import ProgramCache as ProgramCache
from jaxdist.strategies.compile import ProgramMismatchError as ProgramMismatchError
from jaxdist.strategies.compile import RecompileWarning as RecompileWarning
from jaxdist.strategies.compile import StrategyFunction as StrategyFunction
from jaxdist.strategies.context import get_replica_context as get_replica_context
from jaxdist.strategies.context import get_strategy as get_strategy
from jaxdist.strategies.context import has_strategy as has_strategy
from jaxdist.strategies.context import in_cross_replica_context as in_cross_replica_context
from jaxdist.strategies.input import DistributedDataset as DistributedDataset
from jaxdist.strategies.input import DistributedIterator as DistributedIterator
from jaxdist.strategies.input import InputContext as InputContext
from jaxdist.strategies.layout import HOST_OFFLOAD_MODES as HOST_OFFLOAD_MODES
from jaxdist.strategies.layout import IdleAxisWarning as IdleAxisWarning
from jaxdist.strategies.layout import LayoutPolicy as LayoutPolicy
from jaxdist.strategies.layout import UndeclaredBatchWarning as UndeclaredBatchWarning
from jaxdist.strategies.losses import compute_average_loss as compute_average_loss
from jaxdist.strategies.losses import scale_regularization_loss as scale_regularization_loss
from jaxdist.strategies.mirrored import MirroredStrategy as MirroredStrategy
from jaxdist.strategies.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from jaxdist.strategies.one_device import OneDeviceStrategy as OneDeviceStrategy
from jaxdist.strategies.plan import Plan as Plan
from jaxdist.strategies.plan import plan_mesh as plan_mesh
from jaxdist.strategies.replica_context import ReplicaContext as ReplicaContext
from jaxdist.strategies.replica_context import ValueContext as ValueContext
from jaxdist.strategies.search import Candidate as Candidate
from jaxdist.strategies.search import plan_search as plan_search
from jaxdist.strategies.sharded import ShardedStrategy as ShardedStrategy
from jaxdist.strategies.sharded import UnmatchedLayoutRuleWarning as UnmatchedLayoutRuleWarning
from jaxdist.strategies.tf_api import StrategyExtended as StrategyExtended

__all__ = [
    "HOST_OFFLOAD_MODES", "Candidate", "DistributedDataset", "DistributedIterator",
    "IdleAxisWarning", "InputContext", "LayoutPolicy", "MirroredStrategy", "MultiStepContext",
    "MultiWorkerMirroredStrategy", "OneDeviceStrategy", "Plan", "ProgramCache",
    "ProgramMismatchError", "RecompileWarning", "ReplicaContext", "ShardedStrategy", "Strategy",
    "StrategyExtended", "StrategyFunction", "UndeclaredBatchWarning", "UnmatchedLayoutRuleWarning",
    "ValueContext", "compat", "compute_average_loss", "get_replica_context", "get_strategy",
    "has_strategy", "in_cross_replica_context", "plan_mesh", "plan_search",
    "scale_regularization_loss"
]
