"""Compile: the verbs that turn user functions into programs on the mesh.

``_jit`` is `StrategyFunction`, the global-view ``strategy.jit`` (jax.jit's shape, its express path
and its full path); ``_placing`` places its calls' arguments, and the room ``_trace`` holds
everything that runs while one of its programs traces (the step's body, the layouts resolved at
entry and applied to the outputs, the roles and provenance of its values, the Shardy guards; its
``__init__`` is its interface, and it imports nothing else of ``compile``). ``_run`` is the
per-replica ``strategy.run`` (``_vma`` its varying-type check, ``_identical`` the proof of which
outputs are mirrored, ``_mirror_check`` that proof checked on device); ``_loops`` the on-device
steps loops (``steps_per_run``); ``_results`` the reductions of their outputs; ``_cache`` the
programs they compile; ``_agreement`` checks that the processes of a job compiled the same program;
``_signatures`` reads argument numbers and names; ``_equinox`` splits Equinox modules into arrays
and statics.
"""

from jaxdist.strategies.compile._agreement import ProgramMismatchError as ProgramMismatchError
from jaxdist.strategies.compile._cache import ProgramCache as ProgramCache
from jaxdist.strategies.compile._cache import RecompileWarning as RecompileWarning
from jaxdist.strategies.compile._jit import StrategyFunction as StrategyFunction
from jaxdist.strategies.compile._loops import MultiStepContext as MultiStepContext
from jaxdist.strategies.compile._loops import run_steps_on_dataset as run_steps_on_dataset
from jaxdist.strategies.compile._mirror_check import check_mirrored_arg as check_mirrored_arg
from jaxdist.strategies.compile._results import gather as gather
from jaxdist.strategies.compile._results import local_results as local_results
from jaxdist.strategies.compile._results import reduce as reduce
from jaxdist.strategies.compile._run import ReplicaRunner as ReplicaRunner
from jaxdist.strategies.compile._run import check_axis_name as check_axis_name
from jaxdist.strategies.compile._signatures import as_argnums as as_argnums
from jaxdist.strategies.compile._vma import check_vma_arg as check_vma_arg

__all__ = ["MultiStepContext", "ProgramCache", "ProgramMismatchError", "RecompileWarning",
           "ReplicaRunner", "StrategyFunction", "as_argnums", "check_axis_name",
           "check_mirrored_arg", "check_vma_arg", "gather", "local_results", "reduce",
           "run_steps_on_dataset"]
