"""The replica context, the in-replica API: the per-replica `ReplicaContext` and `ValueContext`,
variables created and mirrored under a policy, sync-on-read values, and entering a strategy's scope.
(Not `jaxdist.replicate`, the public package of replicated values and reductions, which this room
builds on.)
"""

from jaxdist.strategies.replica_context._replica_context import ReplicaContext as ReplicaContext
from jaxdist.strategies.replica_context._scopes import enter_scope as enter_scope
from jaxdist.strategies.replica_context._value_context import ValueContext as ValueContext
from jaxdist.strategies.replica_context._value_context import (
    distribute_values_from_function as distribute_values_from_function,
)
from jaxdist.strategies.replica_context._variables import create_variables as create_variables
from jaxdist.strategies.replica_context._variables import mirror as mirror
from jaxdist.strategies.replica_context._variables import sync_on_read as sync_on_read

__all__ = [
    "ReplicaContext", "ValueContext", "create_variables", "distribute_values_from_function",
    "enter_scope", "mirror", "sync_on_read"
]
