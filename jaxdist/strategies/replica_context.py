"""`ReplicaContext`: what a replica function sees of its strategy (tf.distribute.ReplicaContext).

Collectives here run over the strategy's replica axis inside `Strategy.run` (a `jax.shard_map`). Outside any
strategy the default context has one replica and every collective returns its input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jaxdist.replicate.collectives import all_reduce
from jaxdist.replicate.layouts import REPLICA_AXIS
from jaxdist.replicate.ops import ReduceOp, VariableAggregation, check_mean_dtype

if TYPE_CHECKING:
    from jaxdist.strategies.base import Strategy

__all__ = ["ReplicaContext"]


class ReplicaContext:
    """The replica being run: its id, the replica count and the cross-replica collectives.

    Get it with ``jd.get_replica_context()`` inside the function given to ``strategy.run``.

    Example:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> def replica_fn(x):
        ...     ctx = jd.get_replica_context()
        ...     return ctx.all_reduce(jd.ReduceOp.SUM, x * (ctx.replica_id_in_sync_group + 1))
        >>> float(strategy.run(replica_fn, args=(jnp.float32(2.0),)))
        2.0
    """

    def __init__(self, strategy: Strategy, traced: bool = True):
        self._strategy = strategy
        self._traced = traced

    @property
    def strategy(self) -> Strategy:
        """The strategy running this replica."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run this function in lockstep."""
        return self._strategy.num_replicas_in_sync if self._traced else 1

    @property
    def replica_id_in_sync_group(self) -> jax.Array | int:
        """This replica's index in ``[0, num_replicas_in_sync)`` (a traced int32 inside ``run``)."""
        if not self._traced:
            return 0
        return jax.lax.axis_index(REPLICA_AXIS)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Combine ``value`` (a pytree) across replicas; every replica gets the result.

        Args:
            reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN` (or "sum" / "mean").
            value: a pytree of arrays, the same structure on every replica.

        Returns:
            The reduced pytree, identical on every replica (so ``run`` returns it mirrored).

        Raises:
            ValueError: for an unknown ``reduce_op``.
        """
        op = ReduceOp.parse(reduce_op, "reduce_op")
        if not self._traced:
            return value
        return all_reduce(value, op)

    def all_gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenate every replica's ``value`` (a pytree) along ``axis``; every replica gets the result.

        Args:
            value: a pytree of arrays of rank >= 1, the same shapes on every replica.
            axis: the axis to concatenate along.

        Returns:
            The gathered pytree, whose ``axis`` is ``num_replicas_in_sync`` times longer.
        """
        if not self._traced:
            return value

        def gather(x):
            x = jnp.asarray(x)
            if x.ndim == 0:
                raise ValueError(
                    "all_gather got a scalar: it concatenates along an axis; gather x[None] to stack scalars."
                )
            return jax.lax.all_gather(x, REPLICA_AXIS, axis=axis % x.ndim, tiled=True, to="invarying")

        return jax.tree.map(gather, value)

    def aggregate(self, value: Any, aggregation: VariableAggregation | str) -> Any:
        """Turn replica-local updates of a mirrored value into one mirrored value (a replica-context update).

        This is how a mirrored value is updated from replica context: the per-replica new values are combined
        with ``aggregation`` (SUM, MEAN, or ONLY_FIRST_REPLICA: replica 0's value is broadcast), so every
        replica holds the same result and ``run`` returns it mirrored.

        Args:
            value: a pytree of per-replica new values.
            aggregation: a `VariableAggregation` other than NONE, or its name.

        Returns:
            The aggregated pytree, identical on every replica.

        Raises:
            ValueError: for NONE ("specify an aggregation") or an unknown mode.
            TypeError: for MEAN of an integer value.

        Example:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> out = strategy.run(lambda w: jd.get_replica_context().aggregate(w + 1, "mean"),
            ...                    args=(jnp.zeros(2),))
            >>> out.tolist()
            [1.0, 1.0]
        """
        mode = VariableAggregation.parse(aggregation, "aggregation")
        if mode is VariableAggregation.NONE:
            raise ValueError(
                "aggregation=VariableAggregation.NONE: a mirrored value updated in replica context would "
                "differ between replicas; specify an aggregation (SUM, MEAN or ONLY_FIRST_REPLICA)."
            )
        if mode is VariableAggregation.MEAN:
            for leaf in jax.tree.leaves(value):
                check_mean_dtype(leaf, "the updated mirrored value")
        if not self._traced:
            return value
        if mode is not VariableAggregation.ONLY_FIRST_REPLICA:
            return all_reduce(value, mode)
        first = jax.lax.axis_index(REPLICA_AXIS) == 0

        def broadcast_first(x):
            x = jnp.asarray(x)
            return jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), REPLICA_AXIS)

        return jax.tree.map(broadcast_first, value)

    def __repr__(self) -> str:
        return f"ReplicaContext(strategy={self._strategy!r}, num_replicas_in_sync={self.num_replicas_in_sync})"
