"""What is open on this thread while user code runs or is traced: scopes, replica contexts,
computations.

The bottom room of `jaxdist.strategies`: every other room, and `jaxdist.gradients`, `jaxdist.nn` and
`jaxdist.tpu`, read and push this state through the names below; nothing here decides anything
(``_state`` says why the state is kept per thread).
"""

from jaxdist.strategies.ambient._state import Call as Call
from jaxdist.strategies.ambient._state import Computation as Computation
from jaxdist.strategies.ambient._state import Padded as Padded
from jaxdist.strategies.ambient._state import call as call
from jaxdist.strategies.ambient._state import colocation as colocation
from jaxdist.strategies.ambient._state import colocation_target as colocation_target
from jaxdist.strategies.ambient._state import computation as computation
from jaxdist.strategies.ambient._state import current_call as current_call
from jaxdist.strategies.ambient._state import current_computation as current_computation
from jaxdist.strategies.ambient._state import current_replica as current_replica
from jaxdist.strategies.ambient._state import current_scope as current_scope
from jaxdist.strategies.ambient._state import in_scope_or_replica as in_scope_or_replica
from jaxdist.strategies.ambient._state import probe as probe
from jaxdist.strategies.ambient._state import replica as replica
from jaxdist.strategies.ambient._state import replica_axis as replica_axis
from jaxdist.strategies.ambient._state import scope as scope
from jaxdist.strategies.ambient._state import state as state

__all__ = [
    "Call", "Computation", "Padded", "call", "colocation", "colocation_target", "computation",
    "current_call", "current_computation", "current_replica", "current_scope",
    "in_scope_or_replica", "probe", "replica", "replica_axis", "scope", "state"
]
