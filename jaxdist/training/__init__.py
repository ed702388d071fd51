"""The drop-in training loop: `Trainer` (Flax linen and nnx, optax), and pieces for your own loop.

``Trainer(strategy, model, optimizer, loss_fn).fit(data, steps=..., eval_data=...,
checkpoint_dir=...)`` trains on any strategy (a loss may return a token-weighted ``(sum, weight)``
pair; logs show tokens/s, MFU and memory, `StepCost`); `prepare` wraps a hand-written ``train_step``
and its data in two lines; `Checkpointer` saves and restores state across strategies and device
counts. The package is concept folders behind this face: ``callbacks``, ``data``, ``step`` (what
runs on the devices), ``checkpoints`` and ``loop`` (the host loop of ``fit``), bottom up;
``trainer`` and ``prepare`` sit on top.

Examples:
    >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
    >>> trainer = jd.training.Trainer(
    ...     jd.OneDeviceStrategy(), nn.Dense(2), optax.adam(1e-2),
    ...     lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out, y).mean())
    >>> data = [(np.ones((4, 3), np.float32), np.ones(4, np.int32))]
    >>> history = trainer.fit(data, steps=3, verbose=0)
    >>> trainer.step
    3
"""

from jaxdist.costs.step import StepCost as StepCost
from jaxdist.job import JobDisagreementError as JobDisagreementError
from jaxdist.training.callbacks import Callback as Callback
from jaxdist.training.callbacks import CSVLogger as CSVLogger
from jaxdist.training.callbacks import FitControl as FitControl
from jaxdist.training.callbacks import History as History
from jaxdist.training.callbacks import MLflowLogger as MLflowLogger
from jaxdist.training.callbacks import Progress as Progress
from jaxdist.training.callbacks import TensorBoardLogger as TensorBoardLogger
from jaxdist.training.callbacks import WandbLogger as WandbLogger
from jaxdist.training.checkpoints import CheckpointConflictError as CheckpointConflictError
from jaxdist.training.checkpoints import CheckpointCorruptedError as CheckpointCorruptedError
from jaxdist.training.checkpoints import Checkpointer as Checkpointer
from jaxdist.training.checkpoints import CheckpointSaveError as CheckpointSaveError
from jaxdist.training.checkpoints import LocalCheckpointer as LocalCheckpointer
from jaxdist.training.data import DataPosition as DataPosition
from jaxdist.training.loop import DeleteBackups as DeleteBackups
from jaxdist.training.loop import EarlyStopping as EarlyStopping
from jaxdist.training.loop import LearningRateScheduler as LearningRateScheduler
from jaxdist.training.loop import ModelCheckpoint as ModelCheckpoint
from jaxdist.training.loop import PreemptionWatcher as PreemptionWatcher
from jaxdist.training.loop import StragglerWarning as StragglerWarning
from jaxdist.training.loop import Watchdog as Watchdog
from jaxdist.training.prepare import prepare as prepare
from jaxdist.training.step import Average as Average
from jaxdist.training.step import LinenModel as LinenModel
from jaxdist.training.step import NnxModel as NnxModel
from jaxdist.training.step import NonFiniteError as NonFiniteError
from jaxdist.training.step import NonFinitePolicy as NonFinitePolicy
from jaxdist.training.step import NonFiniteRecord as NonFiniteRecord
from jaxdist.training.step import PackedSums as PackedSums
from jaxdist.training.step import RunningSums as RunningSums
from jaxdist.training.step import TrainState as TrainState
from jaxdist.training.step import accuracy as accuracy
from jaxdist.training.step import make_train_step as make_train_step
from jaxdist.training.trainer import Trainer as Trainer

__all__ = ["Average", "CSVLogger", "Callback", "CheckpointConflictError",
           "CheckpointCorruptedError", "CheckpointSaveError", "Checkpointer", "DataPosition",
           "DeleteBackups", "EarlyStopping", "FitControl", "History", "JobDisagreementError",
           "LearningRateScheduler", "LinenModel", "LocalCheckpointer", "MLflowLogger",
           "ModelCheckpoint", "NnxModel", "NonFiniteError", "NonFinitePolicy", "NonFiniteRecord",
           "PackedSums", "PreemptionWatcher", "Progress", "RunningSums", "StepCost",
           "StragglerWarning", "TensorBoardLogger", "TrainState", "Trainer", "Watchdog",
           "WandbLogger", "accuracy", "make_train_step", "prepare"]
