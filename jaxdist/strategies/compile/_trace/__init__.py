"""The global-view trace: everything that runs while a ``strategy.jit`` step traces.

JAX traces a program once (a cache miss), so nothing here runs on a steady-state call. `StepTrace`
(``_step``) is the body of a step's programs; its module doc says what happens, in order, and which
module of this room does each part. What layout a value gets is decided below, in
`jaxdist.strategies.layout`; this room applies those answers in the trace. Only ``compile`` imports
it (``_jit``), and it imports nothing else of ``compile``.
"""

from jaxdist.strategies.compile._trace._padded import PADDING as PADDING
from jaxdist.strategies.compile._trace._padded import padding_argument as padding_argument
from jaxdist.strategies.compile._trace._provenance import Provenance as Provenance
from jaxdist.strategies.compile._trace._shardy import grouped_convolutions as grouped_convolutions
from jaxdist.strategies.compile._trace._step import StepTrace as StepTrace
from jaxdist.strategies.compile._trace._step import enter as enter
from jaxdist.strategies.compile._trace._step import named as named

__all__ = ["PADDING", "Provenance", "StepTrace", "enter", "grouped_convolutions", "named",
           "padding_argument"]
