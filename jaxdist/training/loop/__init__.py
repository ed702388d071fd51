"""The host loop of `Trainer.fit`: the fit itself, preemption, the watchdog and the agreement of a job's processes.

This `__init__` is the folder's interface: the rest of `jaxdist.training` imports these names from here.
"""

from jaxdist.training.loop._fit import FitOptions as FitOptions
from jaxdist.training.loop._fit import run_fit as run_fit
from jaxdist.training.loop._hosts import StragglerWarning as StragglerWarning
from jaxdist.training.loop._job import JobDisagreementError as JobDisagreementError
from jaxdist.training.loop._job import agree_on_fit as agree_on_fit
from jaxdist.training.loop._job import data_ended as data_ended
from jaxdist.training.loop._job import failing as failing
from jaxdist.training.loop._non_finite import NonFiniteError as NonFiniteError
from jaxdist.training.loop._non_finite import NonFiniteGuard as NonFiniteGuard
from jaxdist.training.loop._non_finite import NonFinitePolicy as NonFinitePolicy
from jaxdist.training.loop._non_finite import Window as Window
from jaxdist.training.loop._non_finite import log_values as log_values
from jaxdist.training.loop._preemption import PreemptionWatcher as PreemptionWatcher
from jaxdist.training.loop._start import fit_live as fit_live
from jaxdist.training.loop._watchdog import Watchdog as Watchdog

__all__ = [
    "FitOptions", "JobDisagreementError", "NonFiniteError", "NonFiniteGuard", "NonFinitePolicy",
    "PreemptionWatcher", "StragglerWarning", "Watchdog", "Window", "agree_on_fit", "data_ended", "failing",
    "fit_live", "log_values",
    "run_fit",
]
