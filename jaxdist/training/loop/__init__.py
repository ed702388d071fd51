"""The host loop of `Trainer.fit`: the fit itself, preemption, the watchdog, the slow hosts.

This `__init__` is the folder's interface: the rest of `jaxdist.training` imports these names from here.
"""

from jaxdist.training.loop._fit import FitOptions as FitOptions
from jaxdist.training.loop._fit import run_fit as run_fit
from jaxdist.training.loop._hosts import StragglerWarning as StragglerWarning
from jaxdist.training.loop._preemption import PreemptionWatcher as PreemptionWatcher
from jaxdist.training.loop._start import fit_live as fit_live
from jaxdist.training.loop._watchdog import Watchdog as Watchdog

__all__ = ["FitOptions", "PreemptionWatcher", "StragglerWarning", "Watchdog", "fit_live", "run_fit"]
