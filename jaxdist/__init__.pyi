"""What ``import jaxdist`` offers (read by type checkers, and by ``jaxdist/__init__.py`` for the
names it imports on first use)."""

from . import costs as costs
from . import gradients as gradients
from . import nn as nn
from . import tpu as tpu
from . import training as training
from .costs import program_cost as program_cost
from .job import configure_compilation_cache as configure_compilation_cache
from .job import initialize_cluster as initialize_cluster
from .replicate import MODEL_AXIS as MODEL_AXIS
from .replicate import REPLICA_AXIS as REPLICA_AXIS
from .replicate import PerReplica as PerReplica
from .replicate import ReduceOp as ReduceOp
from .replicate import SyncOnRead as SyncOnRead
from .replicate import VariableAggregation as VariableAggregation
from .strategies import DistributedDataset as DistributedDataset
from .strategies import IdleAxisWarning as IdleAxisWarning
from .strategies import InputContext as InputContext
from .strategies import LayoutPolicy as LayoutPolicy
from .strategies import MirroredStrategy as MirroredStrategy
from .strategies import MultiStepContext as MultiStepContext
from .strategies import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from .strategies import OneDeviceStrategy as OneDeviceStrategy
from .strategies import Plan as Plan
from .strategies import RecompileWarning as RecompileWarning
from .strategies import ReplicaContext as ReplicaContext
from .strategies import ShardedStrategy as ShardedStrategy
from .strategies import Strategy as Strategy
from .strategies import StrategyFunction as StrategyFunction
from .strategies import UndeclaredBatchWarning as UndeclaredBatchWarning
from .strategies import UnmatchedLayoutRuleWarning as UnmatchedLayoutRuleWarning
from .strategies import ValueContext as ValueContext
from .strategies import compat as compat
from .strategies import compute_average_loss as compute_average_loss
from .strategies import get_replica_context as get_replica_context
from .strategies import get_strategy as get_strategy
from .strategies import has_strategy as has_strategy
from .strategies import in_cross_replica_context as in_cross_replica_context
from .strategies import plan_mesh as plan_mesh
from .strategies import scale_regularization_loss as scale_regularization_loss
from .tpu import TPUStrategy as TPUStrategy

__version__: str
