"""Strategies: where replicas run and how code runs on them.

The names also exported at ``jd.`` are canonical there (``jd.MirroredStrategy``); ``ACCELERATORS``,
``Accelerator`` and ``Estimate`` are ``jd.costs``'s, ``StrategyV1Names`` and ``TowerContext``
``jd.strategies.compat``'s. Here they are aliases (the same objects), kept for imports written against them.
"""

from jaxdist.costs import ACCELERATORS as ACCELERATORS
from jaxdist.costs import Accelerator as Accelerator
from jaxdist.costs import Estimate as Estimate
from jaxdist.strategies import compat as compat
from jaxdist.strategies.base import Strategy as Strategy
from jaxdist.strategies.cluster import initialize_cluster as initialize_cluster
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
from jaxdist.strategies.multi_worker import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from jaxdist.strategies.one_device import OneDeviceStrategy as OneDeviceStrategy
from jaxdist.strategies.plan import Plan as Plan
from jaxdist.strategies.plan import plan_mesh as plan_mesh
from jaxdist.strategies.replica import ReplicaContext as ReplicaContext
from jaxdist.strategies.replica import ValueContext as ValueContext
from jaxdist.strategies.sharded import ShardedStrategy as ShardedStrategy
from jaxdist.strategies.sharded import UnmatchedLayoutRuleWarning as UnmatchedLayoutRuleWarning
from jaxdist.strategies.tf_api import StrategyExtended as StrategyExtended
from jaxdist.strategies.tf_api import StrategyV1Names as StrategyV1Names
from jaxdist.strategies.tf_api import TowerContext as TowerContext

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
