"""Reduce operations and variable aggregation modes, with their validation.

`ReduceOp` says how per-replica values combine into one (SUM or MEAN). `VariableAggregation` says
how a replica-context update of a mirrored or sync-on-read value is combined across replicas. Both
accept their enum members or their names in any case (``"sum"``, ``"MEAN"``); anything else is a
ValueError that lists the valid choices.
"""

from __future__ import annotations

import enum
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["ReduceOp", "VariableAggregation", "check_mean_dtype"]


class _ParsableEnum(enum.Enum):
    """An enum that converts names (any case) into members, with a helpful error."""

    @classmethod
    def parse(cls, value: Any, argument: str = "op"):
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls.__members__[value.upper()]
        # the other enum's member of the same name (ReduceOp.SUM where an aggregation is wanted)
        if isinstance(value, enum.Enum) and value.name in cls.__members__:
            return cls.__members__[value.name]
        valid = ", ".join(f"{cls.__name__}.{m}" for m in cls.__members__)
        raise ValueError(
            f"{argument}={value!r} is not a valid {cls.__name__}: use one of {valid} "
            f"(or their names as strings, e.g. {next(iter(cls.__members__)).lower()!r}).")


class ReduceOp(_ParsableEnum):
    """How per-replica values are combined: ``SUM`` or ``MEAN`` (as ``tf.distribute.ReduceOp``).

    Examples:
        >>> import jaxdist as jd
        >>> jd.ReduceOp.parse("mean")
        <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"


class VariableAggregation(_ParsableEnum):
    """How replica-context updates of a distributed value are combined (as
    ``tf.VariableAggregation``).

    ``NONE``: no aggregation; updating a mirrored value from replica context is then an error.
    ``SUM`` / ``MEAN``: all-reduce the per-replica updates. ``ONLY_FIRST_REPLICA``: replica 0's
    value wins and is broadcast to every replica.

    Examples:
        >>> import jaxdist as jd
        >>> jd.VariableAggregation.parse("only_first_replica")
        <VariableAggregation.ONLY_FIRST_REPLICA: 'ONLY_FIRST_REPLICA'>
    """

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"


def check_mean_dtype(value: Any, what: str = "value") -> None:
    """Raise when a MEAN would be taken of an integer or boolean array (not stored back exactly).

    Args:
        value: an array or anything with a ``dtype``.
        what: how the value is called in the error message.

    Raises:
        TypeError: when ``value`` has an integer or boolean dtype.

    Examples:
        >>> import numpy as np
        >>> check_mean_dtype(np.zeros(3, np.float32))  # fine
    """
    dtype = value.dtype if getattr(value, "dtype", None) is not None else np.asarray(value).dtype
    if jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
        raise TypeError(
            f"{what} has dtype {dtype}: MEAN of an integer value cannot be represented exactly; "
            f"use SUM (or ONLY_FIRST_REPLICA), or cast {what} to a float dtype first.")
