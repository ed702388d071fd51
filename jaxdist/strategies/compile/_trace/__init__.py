"""The global-view trace: everything that runs while a ``strategy.jit`` step traces, in one room of
``compile``.

JAX traces a program once (a cache miss), so nothing here runs on a steady-state call. `StepTrace`
(``_step``) is the body of a step's programs, in the order it happens: the call's placed values are
read, the arguments enter in their roles (``_roles``), the layouts are resolved at entry and applied
to the outputs (``_resolve``), the step's own code runs (watched for sync-on-read values updated in
place: ``_in_place``; a padded batch's row weights recorded for the ``strategy.run`` inside:
``_padded``; through the guards that keep XLA's Shardy partitioner off its known conv miscomputes:
``_shardy``), and which outputs leave in jaxdist's own layouts is recorded (``_provenance``, which
also keys a step's programs by the provenance of its arguments' layouts).

What layout a value gets is decided below, in `jaxdist.strategies.layout` (the policy, the
annotations, an nnx state's layouts, the axis types a program runs with, whose layout a sharding
is); this room applies those answers in the trace. Only ``compile`` imports it (``_jit``), and it
imports nothing else of ``compile``.
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
