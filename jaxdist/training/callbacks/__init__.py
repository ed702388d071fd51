"""What a fit reports to: the `Callback` hooks, the `FitControl` they may use, `History`, and the
writers (`Progress`, `CSVLogger`, `TensorBoardLogger`, and the trackers' `WandbLogger`,
`MLflowLogger`).

This `__init__` is the folder's interface: the rest of `jaxdist.training` imports these names from
here.
"""

from jaxdist.training.callbacks._callbacks import HOOKS as HOOKS
from jaxdist.training.callbacks._callbacks import TIME_PARTS as TIME_PARTS
from jaxdist.training.callbacks._callbacks import Callback as Callback
from jaxdist.training.callbacks._callbacks import CSVLogger as CSVLogger
from jaxdist.training.callbacks._callbacks import FitControl as FitControl
from jaxdist.training.callbacks._callbacks import History as History
from jaxdist.training.callbacks._callbacks import Progress as Progress
from jaxdist.training.callbacks._callbacks import TensorBoardLogger as TensorBoardLogger
from jaxdist.training.callbacks._callbacks import overriding as overriding
from jaxdist.training.callbacks._trackers import MLflowLogger as MLflowLogger
from jaxdist.training.callbacks._trackers import WandbLogger as WandbLogger

__all__ = [
    "HOOKS", "TIME_PARTS", "CSVLogger", "Callback", "FitControl", "History", "MLflowLogger",
    "Progress", "TensorBoardLogger", "WandbLogger", "overriding",
]
