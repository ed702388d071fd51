"""jaxdist: tf.distribute strategies rebuilt on JAX, for Flax and Optax.

Two ways in. ``strategy.jit(step, batch_argnums=...)`` compiles your own single-device step for a
strategy: the arguments named by ``batch_argnums`` are split over the replicas, the rest are laid
out by the strategy, and the step computes the numbers it computes on one device.
``jd.training.Trainer(strategy, model, optimizer, loss_fn).fit(data, steps=...)`` is the loop built
on it (checkpoints, preemption, logs); `jd.training.prepare` wraps your own loop's step and data in
two lines.

Importing jaxdist starts no JAX backend: devices are looked up when a strategy is created.

Each public name lives in one package (``jd.strategies``, ``jd.replicate``, ``jd.costs``,
``jd.training``, ...); the ones used most are also here (``jd.MirroredStrategy`` is
``jd.strategies.MirroredStrategy``). The job's own two, ``jd.initialize_cluster`` and
``jd.configure_compilation_cache``, are only here.

Examples:
    >>> import jax, numpy as np, jaxdist as jd
    >>> def sgd_step(w, x):
    ...     loss, g = jax.value_and_grad(lambda w: ((x @ w) ** 2).mean())(w)
    ...     return w - 0.1 * g, loss
    >>> strategy = jd.MirroredStrategy()
    >>> step = strategy.jit(sgd_step, donate_argnums=0, batch_argnums=1)  # x's rows split
    >>> w, loss = step(strategy.mirror(np.ones(3, np.float32)), np.ones((64, 3), np.float32))
    >>> round(float(loss), 3)
    9.0

    The Trainer, on the same strategy:

    >>> import flax.linen as nn, optax
    >>> trainer = jd.training.Trainer(strategy, nn.Dense(1), optax.sgd(0.1),
    ...                               lambda out, y: ((out - y) ** 2).mean())
    >>> history = trainer.fit([(np.ones((16, 3), np.float32), np.ones((16, 1), np.float32))],
    ...                       steps=2, verbose=0)
    >>> trainer.step
    2
    >>> with strategy.scope():
    ...     assert jd.get_strategy() is strategy
"""

from jaxdist import costs as costs
from jaxdist import gradients as gradients
from jaxdist import nn as nn
from jaxdist import tpu as tpu
from jaxdist import training as training
from jaxdist.costs import program_cost as program_cost
from jaxdist.job import configure_compilation_cache as configure_compilation_cache
from jaxdist.job import initialize_cluster as initialize_cluster
from jaxdist.replicate import MODEL_AXIS as MODEL_AXIS
from jaxdist.replicate import REPLICA_AXIS as REPLICA_AXIS
from jaxdist.replicate import PerReplica as PerReplica
from jaxdist.replicate import ReduceOp as ReduceOp
from jaxdist.replicate import SyncOnRead as SyncOnRead
from jaxdist.replicate import VariableAggregation as VariableAggregation
from jaxdist.strategies import DistributedDataset as DistributedDataset
from jaxdist.strategies import IdleAxisWarning as IdleAxisWarning
from jaxdist.strategies import InputContext as InputContext
from jaxdist.strategies import LayoutPolicy as LayoutPolicy
from jaxdist.strategies import MirroredStrategy as MirroredStrategy
from jaxdist.strategies import MultiStepContext as MultiStepContext
from jaxdist.strategies import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from jaxdist.strategies import OneDeviceStrategy as OneDeviceStrategy
from jaxdist.strategies import Plan as Plan
from jaxdist.strategies import RecompileWarning as RecompileWarning
from jaxdist.strategies import ReplicaContext as ReplicaContext
from jaxdist.strategies import ShardedStrategy as ShardedStrategy
from jaxdist.strategies import Strategy as Strategy
from jaxdist.strategies import StrategyFunction as StrategyFunction
from jaxdist.strategies import UndeclaredBatchWarning as UndeclaredBatchWarning
from jaxdist.strategies import UnmatchedLayoutRuleWarning as UnmatchedLayoutRuleWarning
from jaxdist.strategies import ValueContext as ValueContext
from jaxdist.strategies import compat as compat
from jaxdist.strategies import compute_average_loss as compute_average_loss
from jaxdist.strategies import get_replica_context as get_replica_context
from jaxdist.strategies import get_strategy as get_strategy
from jaxdist.strategies import has_strategy as has_strategy
from jaxdist.strategies import in_cross_replica_context as in_cross_replica_context
from jaxdist.strategies import plan_mesh as plan_mesh
from jaxdist.strategies import scale_regularization_loss as scale_regularization_loss
from jaxdist.tpu import TPUStrategy as TPUStrategy

__version__ = "0.1.0"

__all__ = [
    "MODEL_AXIS", "REPLICA_AXIS", "DistributedDataset", "IdleAxisWarning", "InputContext",
    "LayoutPolicy", "MirroredStrategy", "MultiStepContext", "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy", "PerReplica", "Plan", "RecompileWarning", "ReduceOp", "ReplicaContext",
    "ShardedStrategy", "Strategy", "StrategyFunction", "SyncOnRead", "TPUStrategy",
    "UndeclaredBatchWarning", "UnmatchedLayoutRuleWarning", "ValueContext", "VariableAggregation",
    "compat", "compute_average_loss", "configure_compilation_cache", "costs", "gradients", "nn",
    "get_replica_context", "get_strategy", "has_strategy", "in_cross_replica_context",
    "initialize_cluster", "plan_mesh", "program_cost", "scale_regularization_loss", "tpu",
    "training",
]
