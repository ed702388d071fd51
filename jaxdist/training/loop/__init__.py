"""The host loop of `Trainer.fit`: the fit itself (`FitLoop`, driving a `LiveState`), its checkpoint
cadence (`Cadence`), its operations features, each a callback (the watchdog, the profile, the slow
hosts), with preemption, and the callbacks a Keras user reaches for (`EarlyStopping`,
`ModelCheckpoint`, `LearningRateScheduler`, `DeleteBackups`).

This `__init__` is the folder's interface: the rest of `jaxdist.training` imports these names from
here.
"""

from jaxdist.training.loop._cadence import BACKUP_EVERY as BACKUP_EVERY
from jaxdist.training.loop._cadence import Cadence as Cadence
from jaxdist.training.loop._fit import FitLoop as FitLoop
from jaxdist.training.loop._fit import run_fit as run_fit
from jaxdist.training.loop._hosts import StragglerWarning as StragglerWarning
from jaxdist.training.loop._keras import DeleteBackups as DeleteBackups
from jaxdist.training.loop._keras import EarlyStopping as EarlyStopping
from jaxdist.training.loop._keras import LearningRateScheduler as LearningRateScheduler
from jaxdist.training.loop._keras import ModelCheckpoint as ModelCheckpoint
from jaxdist.training.loop._options import FitOptions as FitOptions
from jaxdist.training.loop._preemption import PreemptionWatcher as PreemptionWatcher
from jaxdist.training.loop._start import fit as fit
from jaxdist.training.loop._watchdog import Watchdog as Watchdog

__all__ = ["BACKUP_EVERY", "Cadence", "DeleteBackups", "EarlyStopping", "FitLoop", "FitOptions",
           "LearningRateScheduler", "ModelCheckpoint", "PreemptionWatcher", "StragglerWarning",
           "Watchdog", "fit", "run_fit"]
