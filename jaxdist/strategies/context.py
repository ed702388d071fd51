"""Which strategy is current, and the replica context: ``jd.get_strategy()``,
``jd.get_replica_context()``.

Cross-replica context is the normal Python code between steps; replica context is the body of a
function running under `Strategy.run`. The default strategy is created on first use, never at
import: `jax.distributed.initialize` must be able to run before any device is queried.
"""

from __future__ import annotations

import threading
from typing import Any

from jaxdist.strategies import ambient
from jaxdist.strategies.one_device import OneDeviceStrategy
from jaxdist.strategies.replica_context import ReplicaContext

__all__ = ["get_replica_context", "get_strategy", "has_strategy", "in_cross_replica_context"]

_default: dict[str, Any] = {}
_default_lock = threading.Lock()


def _default_strategy() -> OneDeviceStrategy:
    with _default_lock:
        if "strategy" not in _default:
            _default["strategy"] = OneDeviceStrategy()
        return _default["strategy"]


def get_strategy() -> Any:
    """The current strategy: the innermost open ``scope()`` (or running replica), else the default
    one, a `OneDeviceStrategy` on the first device created on the first call.

    Returns:
        The current `Strategy`.

    Examples:
        >>> import jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> with strategy.scope():
        ...     assert jd.get_strategy() is strategy
    """
    replica = ambient.current_replica()
    if replica is not None:
        return replica.strategy
    scope = ambient.current_scope()
    return scope if scope is not None else _default_strategy()


def has_strategy() -> bool:
    """True inside some strategy's ``scope()`` or replica function (tf.distribute.has_strategy).

    Examples:
        >>> import jaxdist as jd
        >>> jd.has_strategy()
        False
    """
    return ambient.in_scope_or_replica()


def in_cross_replica_context() -> bool:
    """True inside a strategy's ``scope()`` but not inside a replica function.

    Examples:
        >>> import jaxdist as jd
        >>> with jd.OneDeviceStrategy().scope():
        ...     jd.in_cross_replica_context()
        True
    """
    return ambient.current_scope() is not None and ambient.current_replica() is None


def get_replica_context() -> ReplicaContext | None:
    """The replica context of the replica function being run, or None in cross-replica context.

    Inside ``strategy.run(fn)``: the `ReplicaContext` of the replica (its id, all-reduce,
    all-gather). Inside ``strategy.scope()`` but outside ``run``: None (cross-replica context).
    Outside any scope: a single-replica context of the default strategy, so replica code also runs
    without a strategy.

    Examples:
        >>> import jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> with strategy.scope():
        ...     print(jd.get_replica_context())
        None
    """
    replica = ambient.current_replica()
    if replica is not None:
        return replica
    if ambient.current_scope() is not None:
        return None
    return ReplicaContext(_default_strategy(), traced=False)
