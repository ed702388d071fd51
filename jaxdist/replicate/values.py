"""Distributed values: `PerReplica` and `SyncOnRead`, and the naming of mirrored components.

Mirrored values are plain pytrees of replicated `jax.Array`s (see `layouts.replicated`): nothing to
wrap. Values that differ between replicas are stored the JAX way, as ONE global array whose new
leading axis has one entry per replica and is split over the replica axis, so each device holds
exactly its own component and no copy is ever made to build or read them:

* `PerReplica`: what `Strategy.run` returns for outputs that differ between replicas
  (tf.distribute's ``PerReplica``). Read the components with ``.values`` (this process's replicas)
  or combine them with ``strategy.reduce`` / ``strategy.gather``.
* `SyncOnRead`: a value each replica updates locally (metrics, batch-norm statistics) and that
  aggregates only when read in cross-replica context (tf.distribute's ``SyncOnReadVariable``).

Both are pytree nodes, so they pass through `jax.jit` and `jax.tree_util` unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jaxdist.replicate.collectives import reduce_stacked
from jaxdist.replicate.ops import VariableAggregation, check_mean_dtype

__all__ = ["CapturedSyncOnRead", "PerReplica", "SyncOnRead", "assigned", "component_name",
           "in_replica", "local_components", "local_view", "noticing_captures", "store_components"]

_capturing = threading.local()  # per thread: is a replica function being traced for the first time


class CapturedSyncOnRead(Exception):
    """Raised while a replica function is first traced when it reads or updates a `SyncOnRead` it
    did not get as an argument (one it captured, as tf.distribute code uses its metric objects):
    ``strategy.run`` then passes that value in, out of sight, and traces again."""

    def __init__(self, value: SyncOnRead):
        super().__init__("a captured sync-on-read value was used in replica context")
        self.value = value


class _View:
    """One trace of a replica function's view of a sync-on-read value: whether the function assigned
    it. Shared by the copies JAX makes of the value while it traces (a `SyncOnRead` passed through a
    nested ``jax.jit`` is flattened and made again): the flag is the view's, not one object's."""

    __slots__ = ("assigned",)

    def __init__(self) -> None:
        self.assigned = False


def in_replica(component: Any, aggregation: Any, owner: Any = None) -> SyncOnRead:
    """A sync-on-read value as a replica function sees it while ``strategy.run`` traces it:
    ``component`` (this replica's) held in a `jax.Ref`, so that its updates are effects JAX carries
    out of ``lax.scan`` / ``lax.cond`` bodies and nested ``jax.jit`` functions, as tf.distribute's
    in-place updates are. Read what it holds at the end with ``.read()``; `assigned` says whether
    the function updated it.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def replica(c):
        ...     v = in_replica(c, "sum")
        ...     def body(i, carry):
        ...         v.assign_add(1.0)  # an effect of the loop's body, carried out of it
        ...         return carry
        ...     jax.lax.fori_loop(0, 3, body, 0)
        ...     return v.read()
        >>> float(jax.jit(replica)(jnp.zeros(())))
        3.0
    """
    return SyncOnRead(jax.ref.new_ref(component), aggregation, owner, local=_View())


def assigned(value: SyncOnRead) -> bool:
    """Whether the replica function being traced assigned ``value`` (one made by `in_replica` or
    seen through `local_view`); False for any other value."""
    view = value._local
    return isinstance(view, _View) and view.assigned


@contextlib.contextmanager
def noticing_captures(on: bool = True) -> Iterator[None]:
    """While active (on this thread), a cross-replica `SyncOnRead` read or updated raises
    `CapturedSyncOnRead`: ``strategy.run`` traces its replica function under it. ``on=False``
    suspends that for cross-replica code inside the replica function (``merge_call``'s function,
    where a sync-on-read value reads aggregated)."""
    before = getattr(_capturing, "on", False)
    _capturing.on = on
    try:
        yield
    finally:
        _capturing.on = before


@contextlib.contextmanager
def local_view(value: SyncOnRead, component: Any) -> Iterator[None]:
    """``value`` seen as one replica's ``component`` for the time of a replica function's trace (a
    captured value: its updates there are that replica's, held in a `jax.Ref` as `in_replica` holds
    them); restored after. Read the component with ``value.read()`` inside, and whether it was
    updated with `assigned`."""
    saved = value._value, value._local
    value._value, value._local = jax.ref.new_ref(component), _View()
    try:
        yield
    finally:
        value._value, value._local = saved


def component_name(name: str, replica_id: int) -> str:
    """The display name of component ``replica_id`` of the mirrored value ``name``: component 0
    keeps the name; component i > 0 is ``name/replica_i`` (as tf.distribute names them).

    Examples:
        >>> component_name("dense/kernel", 0), component_name("dense/kernel", 3)
        ('dense/kernel', 'dense/kernel/replica_3')
    """
    if replica_id < 0:
        raise ValueError(f"replica_id={replica_id} must be >= 0.")
    return name if replica_id == 0 else f"{name}/replica_{replica_id}"


def local_components(stacked: jax.Array) -> tuple[jax.Array, ...]:
    """The components of a stacked per-replica array held by this process, in replica order: each
    a single-device array (no copy), the shard of ``stacked`` on that replica's device without its
    leading axis of length 1.

    Examples:
        >>> import jax, numpy as np
        >>> [float(c) for c in local_components(jax.numpy.arange(1.0))]
        [0.0]
    """
    by_replica: dict[int, jax.Array] = {}
    # keyed by the row a shard starts at, its replica index (several devices hold one component
    # when an axis is replicated)
    for shard in stacked.addressable_shards:
        start = (shard.index[0].start or 0) if shard.index else 0
        by_replica.setdefault(start, shard.data[0] if shard.data.ndim else shard.data)
    return tuple(by_replica[i] for i in sorted(by_replica))


class _Distributed:
    """Values with one component per replica, stored stacked on a leading axis."""

    __slots__ = ("_owner", "_value")

    def __init__(self, value: Any, owner: Any = None):
        self._value = value
        self._owner = owner

    @property
    def owner(self) -> Any:
        """The strategy these components belong to (None when made by hand)."""
        return self._owner

    @property
    def stacked(self) -> jax.Array:
        """The global array: axis 0 indexes replicas and is split over the replica axis."""
        return self._value

    @property
    def values(self) -> tuple[jax.Array, ...]:
        """This process's components, in replica order (tf.distribute's ``.values``)."""
        return local_components(self._value)

    def __repr__(self) -> str:
        if isinstance(self._value, jax.Array) and not isinstance(self._value, jax.core.Tracer):
            body = ", ".join(f"{i}: {v}" for i, v in enumerate(self.values))
        else:
            body = repr(self._value)
        return f"{type(self).__name__}({{{body}}})"


@jax.tree_util.register_pytree_node_class
class PerReplica(_Distributed):
    """One value per replica, returned by ``strategy.run`` for outputs that differ between replicas.

    ``.stacked`` is a global array of shape ``(num_replicas, *component_shape)`` split over the
    replicas; ``.values`` are this process's components. Pass it back to ``strategy.run`` and each
    replica sees its own component again.

    Examples:
        >>> import jax, jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> out = strategy.run(lambda: jd.get_replica_context().replica_id_in_sync_group)
        >>> isinstance(out, jd.PerReplica), [int(v) for v in out.values]
        (True, [0])
    """

    __slots__ = ()

    def tree_flatten(self):
        return (self._value,), self._owner

    @classmethod
    def tree_unflatten(cls, owner, children):
        return cls(children[0], owner)


@jax.tree_util.register_pytree_node_class
class SyncOnRead(_Distributed):
    """A value each replica updates locally and that aggregates only when read across replicas.

    Create one with ``strategy.sync_on_read(initial_value, aggregation)``. Inside ``strategy.run``
    each replica sees its own component: ``.value`` reads it, ``.assign(x)`` / ``.assign_add(x)`` /
    ``.assign_sub(x)`` update it in place. In cross-replica context ``.read()`` aggregates the
    components and ``.assign(x)`` stores components that read back as ``x``. Inside
    ``strategy.jit`` a step that updates one in place returns it (a compiled step's updates leave
    through its outputs).

    Examples:
        >>> import jaxdist as jd, jax.numpy as jnp
        >>> strategy = jd.OneDeviceStrategy()
        >>> total = strategy.sync_on_read(jnp.zeros(()), jd.VariableAggregation.SUM)
        >>> def count(t):  # updated in place, as in tf.distribute: nothing to return
        ...     t.assign_add(2.0)
        >>> strategy.run(count, args=(total,))
        >>> float(total.read())
        2.0
    """

    __slots__ = ("_aggregation", "_local")

    def __init__(self, value: Any, aggregation: Any, owner: Any = None, local: bool = False):
        super().__init__(value, owner)
        aggregation = VariableAggregation.parse(aggregation, "aggregation")
        if aggregation is VariableAggregation.NONE:
            raise ValueError(
                "aggregation=VariableAggregation.NONE is not valid for a sync-on-read value: "
                "reading it across replicas needs an aggregation; specify an aggregation (SUM, "
                "MEAN or ONLY_FIRST_REPLICA).")
        self._aggregation = aggregation
        self._local = local

    @property
    def aggregation(self) -> VariableAggregation:
        """How the components combine when read in cross-replica context."""
        return self._aggregation

    @property
    def value(self) -> jax.Array:
        """This replica's component (replica context only: inside a function ``strategy.run`` runs,
        whether the value was passed to it or captured)."""
        if not self._local:
            if getattr(_capturing, "on", False):
                raise CapturedSyncOnRead(self)
            raise RuntimeError(
                "SyncOnRead.value is this replica's component and exists only inside strategy.run; "
                "in cross-replica context use .read() for the aggregated value or .values for the "
                "components.")
        return self._component()

    def _component(self) -> jax.Array:
        return self._value[...] if isinstance(self._local, _View) else self._value

    def _check_dtype(self, value: Any) -> None:
        if self._aggregation is VariableAggregation.MEAN:
            check_mean_dtype(value, "the sync-on-read value")

    def _check_kind(self, value: Any, call: str) -> None:
        """Refuse ``value`` of a kind the components' dtype cannot hold (a float for an integer
        value, a complex for a real one): stored, it would be truncated without a word
        (``assign_add(0.5)`` on an int32 value adds 0). tf.distribute refuses it too."""
        source = value.dtype if hasattr(value, "dtype") else jnp.asarray(value).dtype
        target = self._value.dtype
        if _kind(source) <= _kind(target):
            return
        shown = value if isinstance(value, (bool, int, float, complex)) else f"a {source} value"
        raise TypeError(
            f"{call}({shown}): the sync-on-read value is {target}, which cannot hold a {source} "
            f"value (it would be truncated without a word). Pass a value of dtype {target} (e.g. "
            f"jnp.asarray(x, jnp.{target})), or create the value with a "
            f"{_KIND_NAMES[_kind(source)]} dtype: strategy.sync_on_read(jnp.zeros(shape, "
            f"jnp.{jnp.dtype(source).name}), aggregation).")

    def assign(self, value: Any) -> SyncOnRead:
        """Store ``value`` in place (as tf.distribute's variables do) and return this value.

        In replica context (inside ``strategy.run``), ``value`` becomes this replica's component;
        ``run`` keeps the update when it returns, in the object passed in. In cross-replica context
        the components are set so that ``.read()`` returns ``value``: with SUM each of the N
        components is ``value / N`` (integers: replica 0 holds ``value``, the others 0, so the sum
        stays exact); with MEAN and ONLY_FIRST_REPLICA every component is ``value``.

        Raises:
            TypeError: for a value the dtype cannot hold (a float for an integer value, a complex
                for a real one).
        """
        self._check_kind(value, "assign")
        if self._local:
            value = jnp.asarray(value, self._value.dtype)
            if value.shape != self._value.shape:
                raise ValueError(
                    f"value has shape {value.shape} but this replica's component has shape "
                    f"{self._value.shape}; a sync-on-read value keeps its shape.")
            if isinstance(self._local, _View):
                # An assignment is not differentiable (as tf.Variable.assign is not): what a replica
                # function stores while jax.grad traces it is the value, not a path for gradients.
                self._value[...] = jax.lax.stop_gradient(value)
                self._local.assigned = True
            else:
                self._value = value
            return self
        if getattr(_capturing, "on", False):
            raise CapturedSyncOnRead(self)
        target = self._value
        value = jnp.asarray(value, target.dtype)
        if value.shape != target.shape[1:]:
            raise ValueError(
                f"value has shape {value.shape} but the sync-on-read value has shape "
                f"{target.shape[1:]}; a sync-on-read value keeps its shape.")
        self._check_dtype(value)
        traced = isinstance(target, jax.core.Tracer)
        stacked = _spread(value, target.shape[0], self._aggregation.name,
                          None if traced else target.sharding)
        if isinstance(stacked, jax.core.Tracer) and not traced:
            raise ValueError(
                "a compiled function (strategy.jit, jax.jit, a loop body) assigns a sync-on-read "
                f"value ({self._aggregation.name}, shape {target.shape[1:]}) that it captured from "
                "the enclosing code: the update would live only in that trace (a JAX function "
                "cannot change the objects around it), and the value would read as before. Pass it "
                "to the step as an argument and return it: `seen = step(seen, batch)`.")
        self._value = stacked
        return self

    def assign_add(self, delta: Any) -> SyncOnRead:
        """Add ``delta`` in place (to this replica's component in replica context); return it.

        Raises:
            TypeError: for a ``delta`` the dtype cannot hold (``assign_add(0.5)`` on an integer).

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> seen = jd.OneDeviceStrategy().sync_on_read(jnp.zeros((), jnp.int32), "sum")
            >>> int(seen.assign_add(2).read())
            2
            >>> seen.assign_add(0.5)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            TypeError: assign_add(0.5): the sync-on-read value is int32, which cannot hold a ...
        """
        self._check_kind(delta, "assign_add")
        return self.assign(self.read() + jnp.asarray(delta, self._value.dtype))

    def assign_sub(self, delta: Any) -> SyncOnRead:
        """Subtract ``delta`` in place (from this replica's component in replica context); return
        this value.

        Raises:
            TypeError: for a ``delta`` the dtype cannot hold (``assign_sub(0.5)`` on an integer).
        """
        self._check_kind(delta, "assign_sub")
        return self.assign(self.read() - jnp.asarray(delta, self._value.dtype))

    def read(self) -> jax.Array:
        """The aggregated value in cross-replica context; this replica's component in replica
        context (inside a function ``strategy.run`` runs, whether the value was passed to it or
        captured)."""
        if self._local:
            return self._component()
        if getattr(_capturing, "on", False):
            raise CapturedSyncOnRead(self)
        return _aggregate_stacked(self._value, self._aggregation.name)

    def tree_flatten(self):
        return (self._value,), (self._aggregation, self._owner, self._local)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj._value, (obj._aggregation, obj._owner, obj._local) = children[0], aux
        return obj


_KIND_NAMES = ("bool", "integer", "floating", "complex")


def _kind(dtype: Any) -> int:
    """0 bool, 1 integer, 2 floating, 3 complex: a higher kind does not fit a lower one."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return 3
    if jnp.issubdtype(dtype, jnp.inexact):
        return 2
    if jnp.issubdtype(dtype, jnp.integer):
        return 1
    return 0 if jnp.issubdtype(dtype, jnp.bool_) else 2  # other types (keys, ...): as floating


def store_components(value: SyncOnRead, stacked: Any) -> None:
    """Store ``stacked`` (one component per replica, stacked on axis 0) as ``value``'s components,
    in place: how ``strategy.run`` keeps the in-place updates its replica function made.

    Examples:
        >>> import jax.numpy as jnp
        >>> v = SyncOnRead(jnp.zeros((2,)), "sum")
        >>> store_components(v, jnp.ones((2,)))
        >>> float(v.read())
        2.0
    """
    value._value = stacked


@functools.partial(jax.jit, static_argnames="mode")
def _aggregate_stacked(stacked: jax.Array, mode: str) -> jax.Array:
    return reduce_stacked(stacked, VariableAggregation[mode])


def _spread(value: jax.Array, n: int, mode: str, sharding) -> jax.Array:
    """Components, stacked, that aggregate back to ``value`` under ``mode`` (laid out with
    ``sharding``; None inside a trace, where the enclosing program lays them out)."""

    def build(v):
        if mode != "SUM" or n == 1:
            return jnp.broadcast_to(v, (n, *v.shape))
        if jnp.issubdtype(v.dtype, jnp.inexact):
            return jnp.broadcast_to(v / n, (n, *v.shape)).astype(v.dtype)
        first = (jnp.arange(n) == 0).reshape((n,) + (1,) * v.ndim)
        return jnp.where(first, v, jnp.zeros_like(v))

    if sharding is None:
        return build(value)
    return jax.jit(build, out_shardings=sharding)(value)
