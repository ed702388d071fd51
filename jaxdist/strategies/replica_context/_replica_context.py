"""`ReplicaContext`: what a replica function sees of its strategy (tf.distribute.ReplicaContext).

Collectives here run over the strategy's replica axis inside `Strategy.run` (a `jax.shard_map`).
Outside any strategy the default context has one replica and every collective returns its input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.replicate.collectives import all_reduce, keep_per_replica, to_varying
from jaxdist.replicate.layouts import REPLICA_AXIS
from jaxdist.replicate.ops import ReduceOp, VariableAggregation, check_mean_dtype
from jaxdist.replicate.values import PerReplica, SyncOnRead, noticing_captures

__all__ = ["ReplicaContext"]


class ReplicaContext:
    """The replica being run: its id, the replica count and the cross-replica collectives.

    Get it with ``jd.get_replica_context()`` inside the function given to ``strategy.run``.

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> def replica_fn(x):
        ...     ctx = jd.get_replica_context()
        ...     return ctx.all_reduce(jd.ReduceOp.SUM, x * (ctx.replica_id_in_sync_group + 1))
        >>> float(strategy.run(replica_fn, args=(jnp.float32(2.0),)))
        2.0
    """

    def __init__(self, strategy: Any, num_replicas: int = 1, axis_name: str = REPLICA_AXIS,
                 traced: bool = True, batch_weights: Any = None):
        self._strategy = strategy
        self._num_replicas = num_replicas
        self._axis = axis_name
        self._traced = traced
        self._merge_depth = 0
        self._batch_weights = batch_weights

    @property
    def batch_weights(self) -> jax.Array | None:
        """This replica's row weights when its batch was padded (a distributed dataset's
        ``remainder="pad"``): 1.0 for a real row, 0.0 for padding; None when no batch was padded.

        ``jd.compute_average_loss`` uses them by itself; multiply per-example counts by them, e.g.
        ``correct.assign_add(jnp.sum((pred == y) * ctx.batch_weights))``.
        """
        return self._batch_weights

    @property
    def strategy(self) -> Any:
        """The strategy running this replica."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run this function in lockstep."""
        return self._num_replicas if self._traced else 1

    @property
    def axis_name(self) -> str:
        """The name of the replica axis inside this replica function (``"replica"``, or ``run``'s
        ``axis_name``): what ``jax.lax`` collectives in the function can name.

        Examples:
            >>> import jaxdist as jd
            >>> s = jd.OneDeviceStrategy()
            >>> names = []
            >>> _ = s.run(lambda: names.append(jd.get_replica_context().axis_name) or 0.0,
            ...           axis_name="batch")
            >>> sorted(set(names))  # traced once to learn the outputs, once for the program
            ['batch']
        """
        return self._axis

    @property
    def replica_id_in_sync_group(self) -> jax.Array | int:
        """This replica's index in ``[0, num_replicas_in_sync)`` (a traced int32 inside ``run``)."""
        if not self._traced:
            return 0
        return jax.lax.axis_index(self._axis)

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
        return all_reduce(value, op, self._axis)

    def per_replica(self, value: Any) -> Any:
        """Declare ``value`` (a pytree) this replica's own: ``run`` returns it as a `PerReplica`.

        ``run`` refuses an output that takes the place of a mirrored argument but differs between
        replicas (parameters updated with local gradients drift apart). A value each replica keeps
        apart on purpose (local SGD, an ensemble member, an error-feedback residual) says so here,
        on the value returned.

        Args:
            value: a pytree of arrays.

        Returns:
            ``value``, unchanged in every number.

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> w = strategy.mirror({"w": jnp.ones(2)})
            >>> def replica_fn(w):
            ...     return jd.get_replica_context().per_replica(jax.tree.map(lambda x: x + 1, w))
            >>> out = strategy.run(replica_fn, args=(w,))
            >>> type(out["w"]).__name__
            'PerReplica'
        """
        if not self._traced:
            return value
        return keep_per_replica(value, self._axis)

    def all_gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenate every replica's ``value`` (a pytree) along ``axis``, for every replica.

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
                raise ValueError("all_gather got a scalar: it concatenates along an axis; gather "
                                 "x[None] to stack scalars.")
            return jax.lax.all_gather(x, self._axis, axis=axis % x.ndim, tiled=True, to="invarying")

        return jax.tree.map(gather, value)

    def aggregate(self, value: Any, aggregation: VariableAggregation | str) -> Any:
        """Turn replica-local updates of a mirrored value into one mirrored value.

        The per-replica new values are combined with ``aggregation`` (SUM, MEAN, or
        ONLY_FIRST_REPLICA: replica 0's value is broadcast), so every replica holds the same result
        and ``run`` returns it mirrored.

        Args:
            value: a pytree of per-replica new values.
            aggregation: a `VariableAggregation` other than NONE, or its name.

        Returns:
            The aggregated pytree, identical on every replica.

        Raises:
            ValueError: for NONE ("specify an aggregation") or an unknown mode.
            TypeError: for MEAN of an integer value.

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> out = strategy.run(lambda w: jd.get_replica_context().aggregate(w + 1, "mean"),
            ...                    args=(jnp.zeros(2),))
            >>> out.tolist()
            [1.0, 1.0]
        """
        mode = VariableAggregation.parse(aggregation, "aggregation")
        if mode is VariableAggregation.NONE:
            raise ValueError("aggregation=VariableAggregation.NONE: a mirrored value updated in "
                             "replica context would differ between replicas; specify an "
                             "aggregation (SUM, MEAN or ONLY_FIRST_REPLICA).")
        if mode is VariableAggregation.MEAN:
            for leaf in jax.tree.leaves(value):
                check_mean_dtype(leaf, "the updated mirrored value")
        if not self._traced:
            return value
        if mode is not VariableAggregation.ONLY_FIRST_REPLICA:
            return all_reduce(value, mode, self._axis)
        first = jax.lax.axis_index(self._axis) == 0

        def broadcast_first(x):
            x = jnp.asarray(x)
            return jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), self._axis)

        return jax.tree.map(broadcast_first, value)

    @property
    def in_merge_call(self) -> bool:
        """True while a ``merge_call`` function of this replica runs (cross-replica code)."""
        return self._merge_depth > 0

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple = (),
                   kwargs: dict | None = None) -> Any:
        """Step from this replica into cross-replica code: ``merge_fn(strategy, *args, **kwargs)``
        sees every replica's values, and its result comes back to every replica (tf.distribute's
        ``merge_call``).

        Every array in ``args`` / ``kwargs`` (mirrored ones too: inside ``run`` every replica owns
        its copy) reaches ``merge_fn`` as a `PerReplica` holding all the replicas' values (a
        `SyncOnRead` as a `SyncOnRead` whose ``.read()`` aggregates), for ``strategy.reduce`` /
        ``strategy.gather`` / ``strategy.experimental_local_results``. All replicas run ``merge_fn``
        on the same values (it is part of the one SPMD program), so its result is the same
        everywhere; a `PerReplica` in the result gives each replica its own component back. Inside
        ``merge_fn``, ``jd.get_replica_context()`` still returns this context and `in_merge_call`
        is True. Outside ``run`` ``merge_fn`` is called on the arguments as they are.

        Args:
            merge_fn: ``merge_fn(strategy, *args, **kwargs)``.
            args: positional arguments (a tuple).
            kwargs: keyword arguments (a dict) or None.

        Returns:
            ``merge_fn``'s result, on every replica.

        Raises:
            TypeError: when ``merge_fn`` is not callable, ``args`` is not a tuple or ``kwargs`` not
                a dict.

        Examples:
            >>> import jaxdist as jd
            >>> strategy = jd.MirroredStrategy()
            >>> def replica_fn():
            ...     ctx = jd.get_replica_context()
            ...     v = ctx.replica_id_in_sync_group + 1.0
            ...     total = ctx.merge_call(lambda s, pv: s.reduce("sum", pv), args=(v,))
            ...     return total + v
            >>> [float(x)
            ...  for x in strategy.experimental_local_results(strategy.run(replica_fn))][:3]
            [37.0, 38.0, 39.0]
        """
        if not callable(merge_fn):
            raise TypeError(f"merge_fn={merge_fn!r} is not callable: pass merge_fn(strategy, "
                            "*args).")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args={args!r} must be a tuple of positional arguments, e.g. "
                            "ctx.merge_call(fn, args=(v,)) (the 2018 form merge_call(fn, *args) is "
                            "jd.compat.get_tower_context().merge_call).")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs={kwargs!r} must be a dict of keyword arguments or None.")
        kwargs = kwargs or {}
        if not self._traced:
            return merge_fn(self._strategy, *args, **kwargs)
        strategy, axis = self._strategy, self._axis

        # every replica's value, stacked on a leading replica axis (the same on all replicas)
        def everyone(x):
            return jax.lax.all_gather(to_varying(jnp.asarray(x), axis)[None], axis, tiled=True,
                                      to="invarying")

        def to_cross_replica(v):
            if isinstance(v, SyncOnRead):
                return SyncOnRead(everyone(v.value), v.aggregation, strategy)
            if isinstance(v, (jax.Array, np.ndarray, np.generic)):
                return PerReplica(everyone(v), strategy)
            return v  # Python scalars, strings, callables: the same on every replica

        def to_replica(v):
            if isinstance(v, PerReplica):
                return v.stacked[jax.lax.axis_index(axis)]
            if isinstance(v, SyncOnRead):
                return SyncOnRead(v.stacked[jax.lax.axis_index(axis)], v.aggregation, strategy,
                                  local=True)
            return v

        is_value = lambda v: isinstance(v, (PerReplica, SyncOnRead))  # noqa: E731
        args, kwargs = jax.tree.map(to_cross_replica, (tuple(args), kwargs), is_leaf=is_value)
        self._merge_depth += 1
        try:
            # cross-replica code: a sync-on-read value there reads aggregated
            with noticing_captures(False):
                result = merge_fn(strategy, *args, **kwargs)
        finally:
            self._merge_depth -= 1
        return jax.tree.map(to_replica, result, is_leaf=is_value)

    def __repr__(self) -> str:
        return (f"ReplicaContext(strategy={self._strategy!r}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")
