"""The host loop of `Trainer.fit`: the fit itself (`FitLoop`, driving a `LiveState`) and its operations features,
each a callback (the watchdog, the profile, the slow hosts), with preemption.

This `__init__` is the folder's interface: the rest of `jaxdist.training` imports these names from here.
"""

from jaxdist.training.loop._fit import FitLoop as FitLoop
from jaxdist.training.loop._fit import run_fit as run_fit
from jaxdist.training.loop._hosts import StragglerWarning as StragglerWarning
from jaxdist.training.loop._options import FitOptions as FitOptions
from jaxdist.training.loop._preemption import PreemptionWatcher as PreemptionWatcher
from jaxdist.training.loop._start import fit as fit
from jaxdist.training.loop._watchdog import Watchdog as Watchdog

__all__ = ["FitLoop", "FitOptions", "PreemptionWatcher", "StragglerWarning", "Watchdog", "fit", "run_fit"]
