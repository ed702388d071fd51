"""`StrategyExtended`: the lower-level cross-replica API of tf.distribute, on every strategy.

TF's 2018 DistributionStrategy (later ``strategy.extended``) had a layer below ``run`` / ``reduce``:
update a variable on every device that holds it, reduce many values in one call and send them where
variables live, place new variables next to existing ones, and say which process writes checkpoints.
In JAX a variable is an array whose sharding says where its copies (or shards) live, so each of
these is a compiled function whose output sharding is the variable's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxdist.replicate.collectives import reduce_stacked
from jaxdist.replicate.layouts import REPLICA_AXIS, put, replicated
from jaxdist.replicate.ops import VariableAggregation, check_mean_dtype
from jaxdist.replicate.trees import (
    fn_name,
    hashable,
    is_chief,
    is_distributed,
    merge_static,
    signature,
    split_static,
)
from jaxdist.replicate.values import PerReplica, SyncOnRead
from jaxdist.strategies import ambient
from jaxdist.strategies.layout import (
    HOST_MEMORY_KIND,
    colocated_layout,
    resolve_device,
    resolve_devices,
    to_device_memory,
)

__all__ = ["StrategyExtended"]


def _checked(var: Any, new: Any, name: str) -> Any:
    """``new`` when it has ``var``'s structure, shapes and dtypes (an update keeps var's layout)."""
    if signature(new) != signature(var):
        described = [", ".join(f"{d}{list(s)}" for s, d in signature(t)[1]) for t in (new, var)]
        raise ValueError(f"fn={name} returned [{described[0]}] for a variable of [{described[1]}]: "
                         "strategy.update stores fn's result in the variable's layout, so it must "
                         "return the new value of var with the same structure, shapes and dtypes; "
                         "compute other results with strategy.jit.")
    return new


class StrategyExtended:
    """Cross-replica updates, reductions and variable placement (TF's lower strategy layer).

    A mixin of `Strategy`: every strategy has these methods. See the module doc.
    """

    # -------------------------------------------------------------------------------- process roles
    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints: True on the chief (process 0) only.

        The one-writer rule for files a single process writes (a ``np.save`` of gathered values, a
        log). Orbax's ``CheckpointManager.save`` is collective: every process calls it and orbax
        itself lets only the primary host write shared files.

        Examples:
            >>> import jaxdist as jd
            >>> jd.OneDeviceStrategy().should_checkpoint
            True
        """
        return is_chief()

    @property
    def should_save_summary(self) -> bool:
        """Whether this process writes summaries (TensorBoard, CSV logs): True on the chief only.

        Examples:
            >>> import jaxdist as jd
            >>> jd.OneDeviceStrategy().should_save_summary
            True
        """
        return is_chief()

    @property
    def should_init(self) -> bool:
        """Whether this process takes part in initializing variables: True on every process.

        ``create_variables`` is one SPMD program every process runs (each creates the parts on its
        own devices); on `MultiWorkerMirroredStrategy` the chief's arguments are used everywhere.

        Examples:
            >>> import jaxdist as jd
            >>> jd.OneDeviceStrategy().should_init
            True
        """
        return True

    # ------------------------------------------------------------------------------------ placement
    @property
    def parameter_devices(self) -> tuple[jax.Device, ...]:
        """The devices that hold variables: every device of the mesh (a copy or a shard each).

        With ``host_offload`` the variables live in these devices' host memory (``"pinned_host"``).

        Examples:
            >>> import jaxdist as jd
            >>> s = jd.MirroredStrategy()
            >>> s.parameter_devices == s.devices
            True
        """
        return self.devices

    def non_slot_devices(self, var_list: Any) -> jax.sharding.Sharding:
        """The layout of non-slot variables (an optimizer's step count, Adam's bias corrections).

        Non-slot variables belong to no one parameter: they are mirrored on every device (in host
        memory when optimizer state is offloaded). Pass the result to `colocate_vars_with` to create
        such variables and to `update_non_slot` to update them; its ``.device_set`` is the devices.

        Args:
            var_list: the variables being optimized (a pytree of arrays), as in TF; only checked.

        Returns:
            A replicated `jax.sharding.NamedSharding` on this strategy's mesh.

        Raises:
            TypeError: when ``var_list`` holds something other than arrays.

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> jd.OneDeviceStrategy().non_slot_devices({"w": jnp.zeros(2)}).spec
            P()
        """
        bad = [x for x in jax.tree.leaves(var_list)
               if not isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))]
        if bad:
            raise TypeError(f"var_list holds {type(bad[0]).__name__} {bad[0]!r}: pass the "
                            "variables being optimized (a pytree of arrays, e.g. the params).")
        offloaded = self.host_offload in ("opt_state", "all")
        return NamedSharding(self.mesh, PartitionSpec(), memory_kind=HOST_MEMORY_KIND if offloaded
                             else None)

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Variables created inside take the layout of ``colocate_with_variable`` (a slot's).

        Inside the block, `create_variables`, `mirror` and variables placed by `jit` get that
        variable's sharding (devices, partition spec and memory kind) when their shape fits it, else
        a whole copy on the same devices (a scalar next to a split matrix).

        Args:
            colocate_with_variable: a variable (`jax.Array`), a `jax.sharding.Sharding` (e.g. from
                `non_slot_devices`) or a `jax.Device`.

        Raises:
            RuntimeError: outside this strategy's ``scope()`` (as in TF), or inside a replica
                function.
            TypeError: for anything else as ``colocate_with_variable``.

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> from jax.sharding import PartitionSpec as P
            >>> s = jd.ShardedStrategy(min_shard_size=1)
            >>> w = s.mirror(jnp.zeros((8, 16)))  # FSDP splits its largest axis
            >>> with s.scope(), s.colocate_vars_with(w):
            ...     slot, step = s.create_variables(lambda: (jnp.zeros((8, 16)),
            ...                                              jnp.zeros((), "int32")))
            >>> w.sharding.spec, slot.sharding.spec, step.sharding.spec
            (P(None, 'replica'), P(None, 'replica'), P())
        """
        if ambient.current_scope() is not self or ambient.current_replica() is not None:
            raise RuntimeError("colocate_vars_with is used inside this strategy's scope(), in "
                               "cross-replica code: `with strategy.scope(), "
                               "strategy.colocate_vars_with(v): ...`.")
        target = colocate_with_variable
        if isinstance(target, jax.Array) and not isinstance(target, jax.core.Tracer):
            target = target.sharding
        elif isinstance(target, jax.Device):
            target = SingleDeviceSharding(target)
        elif not isinstance(target, jax.sharding.Sharding):
            raise TypeError(f"colocate_with_variable={colocate_with_variable!r} (type "
                            f"{type(colocate_with_variable).__name__}) is not a variable: pass a "
                            "placed jax.Array, a jax.sharding.Sharding (e.g. "
                            "strategy.non_slot_devices(params)) or a jax.Device.")
        with ambient.colocation(self.policy, target):
            yield

    # -------------------------------------------------------------------------------------- updates
    def update(self, var: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(var, *args, **kwargs)`` applied to every copy of ``var``, its layout kept.

        ``var`` is a variable (or a pytree of them: mirrored, FSDP-split, host-offloaded); ``fn``
        returns its new value, which comes back in exactly ``var``'s layout (sharding and memory
        kind). Mirrored ``args`` are used as they are; per-replica values are refused, as in TF
        (reduce them first). The update is compiled once per ``fn`` and signature. Inside a compiled
        step (`jit`, or in ``ctx.merge_call``) ``fn`` is simply applied: the enclosing program keeps
        the layout.

        Args:
            var: the variable(s) to update.
            fn: ``fn(var, *args, **kwargs) -> new_var`` (same structure, shapes and dtypes as
                ``var``).
            *args: more arguments for ``fn``; array leaves are traced, other leaves are constants.
            **kwargs: keyword arguments for ``fn``; ``grouped=False`` (TF's option, not passed to
                ``fn``) returns a list with the new value's copy on each local replica instead.

        Returns:
            The updated variable(s), in ``var``'s layout.

        Raises:
            TypeError: when ``fn`` is not callable or ``var`` holds something other than placed
                arrays.
            ValueError: for per-replica values in ``var`` / ``args``, or a result not shaped like
                ``var``.
            RuntimeError: inside a replica function (use ``ctx.merge_call`` or ``ctx.aggregate``
                there).

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> s = jd.MirroredStrategy()
            >>> w = s.mirror(jnp.ones(2))
            >>> w = s.update(w, lambda v, g: v - 0.5 * g, jnp.ones(2))
            >>> w.tolist(), w.sharding.is_fully_replicated
            ([0.5, 0.5], True)
        """
        grouped = kwargs.pop("grouped", True)
        if not callable(fn):
            raise TypeError(f"fn={fn!r} is not callable: pass fn(var, *args) -> new value of var.")
        self._refuse_per_replica((args, kwargs), "args / kwargs of strategy.update")
        if any(is_distributed(x) for x in jax.tree.leaves(var, is_leaf=is_distributed)):
            raise ValueError("strategy.update got a PerReplica / SyncOnRead as var: update applies "
                             "fn to a variable's copies; update a sync-on-read value with .assign "
                             "(or inside strategy.run), reduce a PerReplica first.")
        leaves = jax.tree.leaves(var)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return self._update_in_trace(var, fn, args, kwargs)
        bad = [x for x in leaves if not isinstance(x, jax.Array)]
        if bad:
            raise TypeError(f"strategy.update got var holding {type(bad[0]).__name__} {bad[0]!r}: "
                            "var must be placed variables (from strategy.create_variables or "
                            "strategy.mirror) so that its layout can be kept.")
        dynamic, treedef, statics = split_static((args, kwargs))
        shardings = tuple(x.sharding for x in leaves)
        var_tree = jax.tree.structure(var)
        key = ("update", var_tree, shardings, signature(var)[1], treedef, hashable(statics),
               tuple((np.shape(x), str(jax.dtypes.result_type(x))) for x in dynamic))
        name = fn_name(fn)  # not fn itself: a cached program must not keep its function alive

        def build(weak_fn):
            def body(v, dyn):
                v, dyn = to_device_memory(v), to_device_memory(dyn)
                call_args, call_kwargs = merge_static(dyn, treedef, statics)
                return _checked(v, weak_fn(v, *call_args, **call_kwargs), name)

            return jax.jit(body, out_shardings=jax.tree.unflatten(var_tree, shardings))

        new = self.programs.get(fn, key, build, reason=(hashable(statics), key[-1]))(var, dynamic)
        return new if grouped else list(self.experimental_local_results(new))

    def _update_in_trace(self, var: Any, fn: Callable, args: tuple, kwargs: dict) -> Any:
        ctx = ambient.current_replica()
        if ctx is not None and not ctx.in_merge_call:
            raise RuntimeError("strategy.update was called inside a replica function: every "
                               "replica would update its own copy. Combine the replicas' values "
                               "first: return ctx.aggregate(new_value, aggregation), or call "
                               "update inside ctx.merge_call(lambda strategy, *a: "
                               "strategy.update(...), args=(...)).")
        return _checked(var, fn(var, *args, **kwargs), fn_name(fn))

    def update_non_slot(self, colocate_with: Any, fn: Callable[..., Any], *args: Any,
                        **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` compiled, its results placed at ``colocate_with`` (non-slots).

        Args:
            colocate_with: where the results live: the result of `non_slot_devices`, another
                sharding, or a variable (its layout).
            fn: the update; array leaves of ``args`` / ``kwargs`` are traced, other leaves are
                constants.
            *args: positional arguments for ``fn`` (per-replica values are refused).
            **kwargs: keyword arguments for ``fn``; ``grouped=False`` returns one entry per local
                replica.

        Returns:
            ``fn``'s results, each in ``colocate_with``'s layout (a whole copy where the shape does
            not fit it).

        Raises:
            TypeError: when ``fn`` is not callable or ``colocate_with`` is not a sharding or an
                array.
            ValueError: for per-replica values in ``args`` / ``kwargs``.

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> s = jd.MirroredStrategy()
            >>> where = s.non_slot_devices({"w": jnp.zeros(2)})
            >>> int(s.update_non_slot(where, lambda step: step + 1, s.mirror(jnp.int32(4))))
            5
        """
        grouped = kwargs.pop("grouped", True)
        if not callable(fn):
            raise TypeError(f"fn={fn!r} is not callable: pass fn(*args) -> the new non-slot "
                            "values.")
        target = colocate_with.sharding if isinstance(colocate_with, jax.Array) else colocate_with
        if not isinstance(target, jax.sharding.Sharding):
            raise TypeError(f"colocate_with={colocate_with!r} is not a layout: pass "
                            "strategy.non_slot_devices(var_list), a jax.sharding.Sharding or a "
                            "placed variable.")
        self._refuse_per_replica((args, kwargs), "args / kwargs of strategy.update_non_slot")
        dynamic, treedef, statics = split_static((args, kwargs))
        avals = tuple((np.shape(x), str(jax.dtypes.result_type(x))) for x in dynamic)

        def build(weak_fn):
            def body(dyn):
                call_args, call_kwargs = merge_static(to_device_memory(dyn), treedef, statics)
                return weak_fn(*call_args, **call_kwargs)

            shapes = jax.eval_shape(body, dynamic)
            return jax.jit(body, out_shardings=jax.tree.map(lambda a: colocated_layout(target, a),
                                                            shapes))

        key = ("update_non_slot", target, treedef, hashable(statics), avals)
        new = self.programs.get(fn, key, build, reason=(hashable(statics), avals))(dynamic)
        return new if grouped else list(self.experimental_local_results(new))

    def _refuse_per_replica(self, tree: Any, where: str) -> None:
        if any(is_distributed(x) for x in jax.tree.leaves(tree, is_leaf=is_distributed)):
            raise ValueError(f"{where} hold a PerReplica / SyncOnRead value: they must be the same "
                             "on every replica (as in TF). Combine it first with "
                             "strategy.reduce(op, value) or read it with strategy.read_var(value).")

    # ----------------------------------------------------------------------------------- reductions
    def _destination(self, destination: Any, aval: Any, argument: str) -> jax.sharding.Sharding:
        """The layout ``destination`` (None, a variable, a sharding, device(s)) gives a value."""
        if destination is None:
            return replicated(self.mesh)
        if isinstance(destination, jax.Array) and not isinstance(destination, jax.core.Tracer):
            return colocated_layout(destination.sharding, aval)
        if isinstance(destination, jax.sharding.Sharding):
            return colocated_layout(destination, aval)
        if isinstance(destination, (jax.Device, str, int)) and not isinstance(destination, bool):
            return SingleDeviceSharding(resolve_device(destination, argument))
        if isinstance(destination, (list, tuple)) and destination:
            devices = resolve_devices(destination, argument)
            return NamedSharding(Mesh(np.array(devices), (REPLICA_AXIS,)), PartitionSpec())
        raise TypeError(f"{argument}={destination!r} (type {type(destination).__name__}) is not a "
                        "destination: pass None (every replica), a variable (its layout), a "
                        "jax.sharding.Sharding, a device ('cpu:0') or a list of devices.")

    def batch_reduce(self, reduce_op: Any,
                     value_destination_pairs: Sequence[tuple[Any, Any]]) -> list[Any]:
        """Reduce several per-replica values in ONE compiled program, each at its destination.

        Args:
            reduce_op: SUM, MEAN (`jd.ReduceOp` or `jd.VariableAggregation`) or ONLY_FIRST_REPLICA
                (replica 0's value), or their names.
            value_destination_pairs: ``[(value, destination), ...]``; a value is a pytree of
                `PerReplica` / `SyncOnRead` leaves (a plain array counts as the same value on every
                replica); a destination is None (mirrored on every replica), a variable (its layout:
                reduce straight into an FSDP or host-offloaded layout), a `jax.sharding.Sharding`, a
                device (``"cpu:0"``) or a list of devices.

        Returns:
            A list with one reduced pytree per pair.

        Raises:
            ValueError: for an unknown or NONE ``reduce_op``, a malformed pair, or a value of
                another strategy.
            TypeError: for MEAN of integers, or a destination of another kind.

        Examples:
            >>> import jaxdist as jd
            >>> s = jd.MirroredStrategy()
            >>> ids = s.run(lambda: jd.get_replica_context().replica_id_in_sync_group + 1.0)
            >>> [float(v) for v in s.batch_reduce("sum", [(ids, None), (ids, "cpu:0")])]
            [36.0, 36.0]
        """
        mode = VariableAggregation.parse(reduce_op, "reduce_op")
        if mode is VariableAggregation.NONE:
            raise ValueError("reduce_op=VariableAggregation.NONE: specify how to combine (SUM, "
                             "MEAN or ONLY_FIRST_REPLICA).")
        pairs = value_destination_pairs
        pairs = list(pairs) if isinstance(pairs, (list, tuple)) else None
        if pairs is None or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
            raise ValueError(
                f"value_destination_pairs={value_destination_pairs!r} must be a list of (value, "
                "destination) pairs, e.g. [(grads, None), (loss, 'cpu:0')]."
            )
        n = self.num_replicas_in_sync
        inputs, flags, outs, trees = [], [], [], []
        for i, (value, destination) in enumerate(pairs):
            leaves, tree = jax.tree.flatten(value, is_leaf=is_distributed)
            trees.append((tree, len(leaves)))
            for leaf in leaves:
                if is_distributed(leaf):
                    if leaf.owner is not None and leaf.owner is not self:
                        raise ValueError(f"value_destination_pairs[{i}] holds a "
                                         f"{type(leaf).__name__} of {leaf.owner!r}, not {self!r}: "
                                         "reduce it with the strategy that produced it.")
                    x, distributed = leaf.stacked, True
                else:
                    x, distributed = jnp.asarray(leaf), False
                if mode is VariableAggregation.MEAN:
                    check_mean_dtype(x, f"value_destination_pairs[{i}]")
                aval = jax.ShapeDtypeStruct(x.shape[1:] if distributed else x.shape, x.dtype)
                inputs.append(x)
                flags.append(distributed)
                outs.append(self._destination(destination, aval,
                                              f"value_destination_pairs[{i}] destination"))

        def build():
            def reduce_all(*xs):
                return tuple(reduce_stacked(x, mode) if distributed
                             else x * n if mode is VariableAggregation.SUM else x
                             for x, distributed in zip(xs, flags, strict=True))

            return jax.jit(reduce_all, out_shardings=in_program)

        # Destinations on the mesh's devices are the program's output layouts; others (a single
        # device, other devices) are reached by one copy of the mirrored result.
        mesh_devices = set(self.mesh.devices.flat)
        in_program = tuple(s if s.device_set == mesh_devices else replicated(self.mesh)
                           for s in outs)
        key = ("batch_reduce", mode, tuple(flags), tuple((x.shape, str(x.dtype)) for x in inputs),
               in_program)
        reduced = self.programs.get(None, key, lambda _: build())(*inputs)
        results = iter(r if s is p else jax.device_put(r, s)
                       for r, s, p in zip(reduced, outs, in_program, strict=True))
        return [jax.tree.unflatten(tree, [next(results) for _ in range(k)]) for tree, k in trees]

    def broadcast(self, tensor: Any, destinations: Any = None) -> Any:
        """Mirror ``tensor`` (on one device, or the host) onto every replica or ``destinations``.

        Args:
            tensor: a pytree of arrays (the same value on every process).
            destinations: None (a whole copy on every device of the mesh), a variable (its layout),
                a `jax.sharding.Sharding`, a device or a list of devices.

        Returns:
            The placed pytree.

        Raises:
            ValueError: for a `PerReplica` (several values: reduce one out first).
            RuntimeError: inside a replica function (broadcast replica 0's value with
                ``ctx.aggregate(x, "only_first_replica")``).

        Examples:
            >>> import numpy as np, jaxdist as jd
            >>> s = jd.MirroredStrategy()
            >>> len(s.broadcast(np.arange(3.0)).sharding.device_set) == s.num_replicas_in_sync
            True
        """
        self._refuse_per_replica(tensor, "the tensor given to strategy.broadcast")
        leaves, treedef = jax.tree.flatten(tensor)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            if ambient.current_replica() is not None:
                raise RuntimeError("strategy.broadcast was called inside a replica function: to "
                                   "give every replica replica 0's value, return ctx.aggregate(x, "
                                   "'only_first_replica') (or use ctx.merge_call).")
            # inside a compiled global-view step a value is already the same for every device
            return tensor
        placed = []
        for x in leaves:
            x = x if isinstance(x, jax.Array) else np.asarray(x)
            where = self._destination(destinations, jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                                      "destinations")
            placed.append(put(x, where) if isinstance(where, NamedSharding)
                          else jax.device_put(x, where))
        return jax.tree.unflatten(treedef, placed)

    def read_var(self, var: Any) -> Any:
        """A variable's value: a sync-on-read one aggregated across replicas, a mirrored one as is.

        Args:
            var: a pytree of `SyncOnRead` values and mirrored arrays.

        Returns:
            The same pytree with every `SyncOnRead` read (in a replica function: this replica's
            component).

        Raises:
            ValueError: for a `PerReplica`, which is not a variable (combine it with
                ``strategy.reduce``).

        Examples:
            >>> import jaxdist as jd
            >>> s = jd.MirroredStrategy()
            >>> count = s.run(lambda c: c.assign_add(1.0), args=(s.sync_on_read(0.0, "sum"),))
            >>> float(s.read_var(count))
            8.0
        """

        def read(v):
            if isinstance(v, SyncOnRead):
                return v.read()
            if isinstance(v, PerReplica):
                raise ValueError("strategy.read_var got a PerReplica: it holds one value per "
                                 "replica, not a variable; combine them with strategy.reduce(op, "
                                 "value) or list them with strategy.experimental_local_results.")
            return v

        return jax.tree.map(read, var, is_leaf=is_distributed)
