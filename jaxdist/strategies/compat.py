"""The 2018 module-level names (``tf.contrib.distribute``): ``jd.compat``.

The strategy methods of 2018 (``call_for_each_tower``, ``num_towers``, ``unwrap``, ...) are on every
strategy through `StrategyV1Names`; this module adds the 2018 functions that find the current
strategy and tower context, and re-exports the mixin and `TowerContext`.
"""

from __future__ import annotations

from jaxdist.strategies.context import get_replica_context, get_strategy, has_strategy
from jaxdist.strategies.tf_api import StrategyV1Names, TowerContext

__all__ = [
    "StrategyV1Names", "TowerContext", "get_distribution_strategy", "get_tower_context",
    "has_distribution_strategy"
]


def get_tower_context() -> TowerContext | None:
    """2018 ``tf.get_tower_context()``: the running replica's `TowerContext`, else None.

    Examples:
        >>> import jaxdist as jd
        >>> with jd.OneDeviceStrategy().scope():
        ...     print(jd.compat.get_tower_context())
        None
    """
    ctx = get_replica_context()
    return None if ctx is None else TowerContext(ctx)


def get_distribution_strategy():
    """2018 name of ``jd.get_strategy()``.

    Examples:
        >>> import jaxdist as jd
        >>> s = jd.OneDeviceStrategy()
        >>> with s.scope():
        ...     jd.compat.get_distribution_strategy() is s
        True
    """
    return get_strategy()


def has_distribution_strategy() -> bool:
    """2018 name of ``jd.has_strategy()``.

    Examples:
        >>> import jaxdist as jd
        >>> jd.compat.has_distribution_strategy()
        False
    """
    return has_strategy()
