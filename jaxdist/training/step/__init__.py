"""What runs on the devices: the train state, the step functions, their compiled forms, the running
sums they add to, the weighted (token) losses, the model wrappers, the non-finite checks (with the
host's policy for them) and the averaged weights (with their restore from a checkpoint); and
`LiveState`, a Trainer's state, step counter and data position with the steps that advance them (the
Trainer is a facade over it).

This `__init__` is the folder's interface: the rest of `jaxdist.training` imports from here.
"""

from jaxdist.training.step._build import check_losses as check_losses
from jaxdist.training.step._build import params_target as params_target
from jaxdist.training.step._build import restore_target as restore_target
from jaxdist.training.step._build import state_builder as state_builder
from jaxdist.training.step._build import state_keys as state_keys
from jaxdist.training.step._compiled import CompiledSteps as CompiledSteps
from jaxdist.training.step._ema import averaged as averaged
from jaxdist.training.step._ema import check_ema_decay as check_ema_decay
from jaxdist.training.step._ema import restore_state as restore_state
from jaxdist.training.step._ema import with_ema as with_ema
from jaxdist.training.step._functions import TrainState as TrainState
from jaxdist.training.step._functions import accuracy as accuracy
from jaxdist.training.step._functions import make_train_step as make_train_step
from jaxdist.training.step._live import LiveState as LiveState
from jaxdist.training.step._live import abstract_state as abstract_state
from jaxdist.training.step._live import check_int as check_int
from jaxdist.training.step._models import LinenModel as LinenModel
from jaxdist.training.step._models import NnxModel as NnxModel
from jaxdist.training.step._models import as_model as as_model
from jaxdist.training.step._non_finite import NonFiniteError as NonFiniteError
from jaxdist.training.step._non_finite import NonFiniteGuard as NonFiniteGuard
from jaxdist.training.step._non_finite import NonFinitePolicy as NonFinitePolicy
from jaxdist.training.step._non_finite import NonFiniteRecord as NonFiniteRecord
from jaxdist.training.step._non_finite import Window as Window
from jaxdist.training.step._non_finite import log_values as log_values
from jaxdist.training.step._non_finite import non_finite_leaves as non_finite_leaves
from jaxdist.training.step._running import Average as Average
from jaxdist.training.step._running import PackedSums as PackedSums
from jaxdist.training.step._running import RunningSums as RunningSums

__all__ = [
    "Average", "CompiledSteps", "LinenModel", "LiveState", "NnxModel", "NonFiniteError",
    "NonFiniteGuard", "NonFinitePolicy", "NonFiniteRecord", "PackedSums", "RunningSums",
    "TrainState", "Window", "abstract_state", "accuracy", "as_model", "averaged", "check_ema_decay",
    "check_int", "check_losses", "log_values", "make_train_step", "non_finite_leaves",
    "params_target", "restore_state", "restore_target", "state_builder", "state_keys", "with_ema",
]
