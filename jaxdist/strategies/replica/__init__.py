"""Replica values and contexts: variables created and mirrored under a policy, sync-on-read values, the
per-replica `ReplicaContext` and `ValueContext`, and entering a strategy's scope.
"""

from jaxdist.strategies.replica._replica_context import ReplicaContext as ReplicaContext
from jaxdist.strategies.replica._scopes import enter_scope as enter_scope
from jaxdist.strategies.replica._value_context import ValueContext as ValueContext
from jaxdist.strategies.replica._value_context import distribute_values_from_function as distribute_values_from_function
from jaxdist.strategies.replica._variables import create_variables as create_variables
from jaxdist.strategies.replica._variables import mirror as mirror
from jaxdist.strategies.replica._variables import sync_on_read as sync_on_read

__all__ = [
    "ReplicaContext",
    "ValueContext",
    "create_variables",
    "distribute_values_from_function",
    "enter_scope",
    "mirror",
    "sync_on_read",
]
