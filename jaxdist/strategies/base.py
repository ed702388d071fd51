"""`Strategy`: the whole jaxdist model in one class.

A strategy owns a `jax.sharding.Mesh` over its devices whose data-parallel axis is ``"replica"``. Everything
else is layouts on that mesh and two ways to run code on it:

* values: mirrored pytrees (replicated arrays: `create_variables`, `mirror`), distributed batches (axis 0 split
  over the replicas: `experimental_distribute_dataset`), and one-component-per-replica values (`PerReplica`,
  `SyncOnRead`: stacked on a leading axis split over the replicas);
* the global view, `jit`: an unmodified single-device step compiled for those layouts (XLA inserts the
  collectives) — the drop-in path;
* the per-replica view, `run`: tf.distribute's ``run``, a `jax.shard_map` in which each replica sees its rows
  of every batch and its own copy of every mirrored value, with explicit collectives through
  `get_replica_context()`; `reduce`, `gather` and `experimental_local_results` read its outputs.

Roles are declared or carried by the value, never guessed: a value is a batch because it was placed as one
(its layout: axis 0 split over the replicas) or because the caller declared it (``batch_argnums``);
everything else is a variable in the strategy's variable layout. Subclasses customise layouts through three
public hooks (Keras' ``get_variable_layout`` is the model): `variable_layout`,
`layout_role` and `mark_batch`; the rest is shared. Every program a strategy compiles lives in its one
`ProgramCache` (``strategy.programs``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core.meta import Partitioned
from jax.sharding import AxisType, Mesh, NamedSharding

from jaxdist.replicate.layouts import (
    MODEL_AXIS,
    REPLICA_AXIS,
    batch_sharded,
    is_on_mesh,
    path_name,
    put,
    replicated,
    splits_batch_axis,
)
from jaxdist.replicate.ops import ReduceOp, VariableAggregation, check_mean_dtype
from jaxdist.replicate.values import PerReplica, SyncOnRead, local_components
from jaxdist.strategies.compat import StrategyV1Names
from jaxdist.strategies.context import enter_scope
from jaxdist.strategies.extended import StrategyExtended, colocated_layout, colocation_target
from jaxdist.strategies.global_view import StrategyFunction, as_argnums
from jaxdist.strategies.input import DistributedDataset, InputContext, place_batch
from jaxdist.strategies.offload import offload_shardings, parse_host_offload, stream_host_memory, to_device_memory
from jaxdist.strategies.programs import ProgramCache
from jaxdist.strategies.run import ReplicaRunner
from jaxdist.strategies.steps import MultiStepContext, run_steps_on_dataset

__all__ = ["Strategy"]


def _is_distributed(x: Any) -> bool:
    return isinstance(x, (PerReplica, SyncOnRead))


class Strategy(StrategyExtended, StrategyV1Names):
    """Base class of every strategy: a mesh over ``devices`` with the data-parallel axis ``"replica"``.

    The lower-level cross-replica API (``update``, ``batch_reduce``, ``colocate_vars_with``, ...) comes from
    `StrategyExtended`, the 2018 tower-era names from `StrategyV1Names`.

    Args:
        devices: the replicas' devices, in replica order (validated by the subclass).
        model_parallelism: devices per replica along a ``"model"`` mesh axis.
        host_offload: keep variables in host memory (``"pinned_host"``) and stream them to the devices for
            each step: ``"opt_state"``, ``"params"`` (every variable but the optimizer state), ``"all"``, or
            None (see `jaxdist.strategies.offload`).

    Example:
        >>> import jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> strategy.num_replicas_in_sync, strategy.mesh.axis_names
        (1, ('replica',))
    """

    def __init__(self, devices: Sequence[jax.Device], model_parallelism: int = 1, host_offload: str | None = None):
        self._devices = tuple(devices)
        self._host_offload = parse_host_offload(host_offload, self._devices)
        # Auto axes (not jax.make_mesh's Explicit default): the global view compiles UNMODIFIED single-device
        # steps, which sharding-in-types would make annotate their own layouts.
        if model_parallelism == 1:
            self._mesh = Mesh(np.array(self._devices), (REPLICA_AXIS,), axis_types=(AxisType.Auto,))
        else:  # replicas are the rows of a (replica, model) grid; a replica's devices hold one model copy
            grid = np.array(self._devices).reshape(-1, model_parallelism)
            self._mesh = Mesh(grid, (REPLICA_AXIS, MODEL_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))
        self._runner = ReplicaRunner(self)
        self._programs = ProgramCache()
        self.steps_per_run = 1

    # ----------------------------------------------------------------------------------------- topology
    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The replicas' devices, in replica order (all processes)."""
        return self._devices

    @property
    def worker_devices(self) -> tuple[jax.Device, ...]:
        """Alias of `devices` (tf.distribute's name)."""
        return self._devices

    @property
    def mesh(self) -> Mesh:
        """The `jax.sharding.Mesh` over `devices`, data-parallel axis ``"replica"``."""
        return self._mesh

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step in lockstep."""
        return self._mesh.shape[REPLICA_AXIS]

    @property
    def replica_devices(self) -> tuple[jax.Device, ...]:
        """The first device of each replica, in replica order (= `devices` without model parallelism)."""
        return tuple(self._mesh.devices.reshape(self.num_replicas_in_sync, -1)[:, 0])

    @property
    def num_hosts(self) -> int:
        """How many processes (hosts) own this strategy's devices."""
        return len({d.process_index for d in self._devices})

    @property
    def num_replicas_per_host(self) -> int:
        """Replicas on each host (this process's count)."""
        return sum(1 for d in self.replica_devices if d.process_index == jax.process_index())

    @property
    def batch_sharding(self) -> NamedSharding:
        """The layout of distributed batches: axis 0 split over the replicas."""
        return batch_sharded(self._mesh)

    @property
    def replicated_sharding(self) -> NamedSharding:
        """The layout of mirrored values: a whole copy on every replica."""
        return replicated(self._mesh)

    @property
    def programs(self) -> ProgramCache:
        """The one cache of this strategy's compiled programs (weak on user functions, bounded)."""
        return self._programs

    @property
    def host_offload(self) -> str | None:
        """Which variables live in host memory between steps: ``"opt_state"``, ``"params"``, ``"all"`` or None."""
        return self._host_offload

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"

    # ------------------------------------------------------------------------------------------- scopes
    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        """Make this the current strategy (``jd.get_strategy()``) inside a ``with`` block.

        Raises:
            RuntimeError: when another strategy's scope is already open ("Mixing different Strategy objects").

        Example:
            >>> import jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> with strategy.scope():
            ...     jd.get_strategy() is strategy
            True
        """
        return enter_scope(self)

    def tracing_scope(self) -> contextlib.AbstractContextManager[Any]:
        """The context a `jit` step is traced in: nothing here; `ShardedStrategy` with ``logical_axis_rules``
        enters its mesh and rules, so ``nn.with_logical_constraint`` in the model lays out activations.

        Example:
            >>> import jaxdist as jd
            >>> with jd.OneDeviceStrategy().tracing_scope():
            ...     pass
        """
        return contextlib.nullcontext()

    # ----------------------------------------------------------------------------------------- variables
    # ------------------------------------------------------------------------------------ layout hooks
    def variable_layout(
        self, path: str, aval: jax.ShapeDtypeStruct, annotation: Partitioned | None = None
    ) -> jax.sharding.Sharding:
        """The layout of the variable at ``path`` (``"params/Dense_0/kernel"``) of shape/dtype ``aval``.

        The hook a strategy overrides to place variables (Keras' ``get_variable_layout``): mirrored strategies
        replicate every variable; `ShardedStrategy` splits them (FSDP, layout rules, partitioning
        annotations). Everything that places variables goes through it: `create_variables`, `mirror`,
        `variable_shardings`, unplaced non-batch arguments of `jit` and `run`, and outputs of `jit` not shaped
        like an argument.

        Args:
            path: the variable's pytree path, ``/``-joined (what layout rules match).
            aval: its shape and dtype (an array or `jax.ShapeDtypeStruct`).
            annotation: the Flax partitioning box around the variable, when the model annotated it
                (``nn.with_partitioning``: a `flax.core.meta.Partitioned` naming mesh axes;
                ``nn.with_logical_partitioning``: a `flax.linen.LogicallyPartitioned` naming logical axes);
                passed only for annotated variables. Strategies that replicate every variable ignore it.

        Example:
            >>> import jax, jaxdist as jd
            >>> jd.OneDeviceStrategy().variable_layout("w", jax.ShapeDtypeStruct((4,), "float32")).spec
            P()
        """
        del path, aval, annotation
        return replicated(self._mesh)

    def is_batch_layout(self, x: Any) -> bool:
        """True when ``x`` is an array on this strategy's mesh with axis 0 split over the replicas.

        Example:
            >>> import numpy as np, jaxdist as jd
            >>> s = jd.OneDeviceStrategy()
            >>> s.is_batch_layout(s.experimental_distribute_values(np.ones((2, 1)))), s.is_batch_layout(np.ones(2))
            (True, False)
        """
        return splits_batch_axis(x, self._mesh)

    def layout_role(self, x: Any) -> str | None:
        """The role ``x``'s layout gives it: ``"batch"``, ``"variable"``, or None when it cannot tell.

        None for values not on this strategy's mesh (numpy, arrays on another device: their role must be
        declared) and, on strategies whose variables can share the batch layout (`ShardedStrategy`), for
        arrays split like a batch that did not come through this strategy's input functions. A strategy
        that adds layouts overrides this hook.

        Example:
            >>> import numpy as np, jaxdist as jd
            >>> s = jd.OneDeviceStrategy()
            >>> s.layout_role(s.experimental_distribute_values(np.ones((2, 1)))), s.layout_role(np.ones(2))
            ('batch', None)
        """
        if not is_on_mesh(x, self._mesh):
            return None
        return "batch" if splits_batch_axis(x, self._mesh) else "variable"

    def mark_batch(self, x: jax.Array) -> None:
        """Record that ``x`` was placed as a distributed batch by this strategy's input functions.

        Called by `experimental_distribute_dataset` and friends for every placed leaf. A no-op where the
        layout alone says what a batch is; `ShardedStrategy` (whose variables may also be split on axis 0)
        remembers the arrays, weakly, for `layout_role`.
        """
        del x

    @property
    def gathers_variables_without_batch(self) -> bool:
        """Whether a `jit` step with no distributed batch gathers its split variables at entry.

        True where variables can be split (a protection against an XLA Shardy partitioner miscompute of
        conv nets with split kernels and a replicated batch; see the README); False for mirrored strategies.
        """
        return False

    def variable_shardings(self, shapes: Any) -> Any:
        """The layout this strategy gives each variable of ``shapes`` (arrays or `jax.ShapeDtypeStruct`s).

        What ``create_variables`` and ``mirror`` use; handy for restoring a checkpoint straight into the
        layout (``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` targets) without running the initializer.
        Variables boxed by a Flax partitioning annotation (``nn.with_partitioning``,
        ``nn.with_logical_partitioning``: what ``model.init`` returns for annotated models, and what optax
        states built from such params hold) are laid out by `variable_layout` with their box as
        ``annotation``; the box is kept around the sharding, so the result has the structure of ``shapes``.

        Example:
            >>> import jax, jax.numpy as jnp, jaxdist as jd
            >>> shapes = jax.eval_shape(lambda: {"w": jnp.zeros((4, 2))})
            >>> jd.OneDeviceStrategy().variable_shardings(shapes)["w"].is_fully_replicated
            True
        """

        def one(path, leaf):
            if isinstance(leaf, Partitioned):  # the path of the box, not of its ".value"
                return leaf.replace_boxed(self.variable_layout(path_name(path), leaf.value, annotation=leaf))
            return self.variable_layout(path_name(path), leaf)

        layouts = jax.tree_util.tree_map_with_path(one, shapes, is_leaf=lambda x: isinstance(x, Partitioned))
        target = colocation_target(self)  # inside colocate_vars_with(v): v's layout
        if target is not None:
            return jax.tree.map(lambda _, aval: colocated_layout(target, aval), layouts, shapes)
        return offload_shardings(self._host_offload, shapes, layouts)  # host_offload: into host memory

    def create_variables(self, init_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``init_fn(*args, **kwargs)`` compiled straight into this strategy's variable layout.

        The initializer runs under `jax.jit` with ``out_shardings``, so values are created on the devices
        where they live (mirrored: on every replica) with no host copy.

        Args:
            init_fn: returns the initial pytree, e.g. ``model.init``.
            *args: its arguments (rng keys, sample inputs, configs). Array leaves (jax or numpy arrays) are
                traced; every other leaf (Python numbers, strings, callables, config objects, dataclasses) is
                passed through unchanged, as a constant of the initializer.
            **kwargs: keyword arguments, handled the same way.

        Returns:
            The pytree of variables in this strategy's layout.

        Raises:
            TypeError: when ``init_fn`` is not callable.

        Example:
            >>> import jax, jax.numpy as jnp, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> params = strategy.create_variables(lambda key: {"w": jax.random.normal(key, (3,))},
            ...                                    jax.random.key(0))
            >>> params["w"].shape
            (3,)
        """
        if not callable(init_fn):
            raise TypeError(
                f"init_fn={init_fn!r} (type {type(init_fn).__name__}) is not callable: pass the function that "
                "builds the variables, e.g. strategy.create_variables(model.init, rng, x); "
                "use strategy.mirror(tree) to place values you already have."
            )
        # Only array leaves are traced: a config object, a string or a Python number is a constant of the
        # initializer (the program is compiled once, so nothing needs to be hashable).
        leaves, treedef = jax.tree.flatten((args, kwargs))
        is_array = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves]
        dynamic = [x for x, a in zip(leaves, is_array, strict=True) if a]

        def fn(*dyn):
            it = iter(dyn)
            call_args, call_kwargs = jax.tree.unflatten(
                treedef, [next(it) if a else x for x, a in zip(leaves, is_array, strict=True)]
            )
            return init_fn(*call_args, **call_kwargs)

        fn.__name__ = fn.__qualname__ = getattr(init_fn, "__name__", "init_fn")  # errors name the user's function
        shapes = jax.eval_shape(fn, *dynamic)
        return jax.jit(fn, out_shardings=self.variable_shardings(shapes))(*dynamic)

    def mirror(self, tree: Any) -> Any:
        """Place an existing pytree in this strategy's variable layout (mirrored: a copy on every replica).

        Example:
            >>> import numpy as np, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> strategy.mirror({"b": np.zeros(2)})["b"].sharding.is_fully_replicated
            True
        """
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)
        return jax.tree.map(put, tree, self.variable_shardings(shapes))

    def sync_on_read(
        self, initial_value: Any, aggregation: VariableAggregation | str = VariableAggregation.SUM
    ) -> SyncOnRead:
        """A value with one component per replica, each starting at ``initial_value``, aggregated on read.

        Args:
            initial_value: an array (or scalar); every replica's component starts as it (as tf.distribute).
            aggregation: SUM, MEAN or ONLY_FIRST_REPLICA, how ``.read()`` combines the components.

        Returns:
            A `SyncOnRead`.

        Raises:
            ValueError: for NONE or an unknown aggregation.
            TypeError: for MEAN on an integer value.

        Example:
            >>> import jaxdist as jd
            >>> count = jd.OneDeviceStrategy().sync_on_read(0, "sum")
            >>> int(count.read())
            0
        """
        mode = VariableAggregation.parse(aggregation, "aggregation")
        value = jnp.asarray(initial_value)
        if mode is VariableAggregation.MEAN:
            check_mean_dtype(value, "initial_value")
        n = self.num_replicas_in_sync
        stacked = jax.jit(
            lambda v: jnp.broadcast_to(v, (n, *v.shape)), out_shardings=batch_sharded(self._mesh)
        )(value)
        return SyncOnRead(stacked, mode, self)

    # ------------------------------------------------------------------------------------------ running
    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        batch_argnums: int | Sequence[int] | None = None,
    ) -> Any:
        """Run ``fn`` once per replica, in lockstep (tf.distribute's ``Strategy.run``).

        Each replica sees its own rows of every batch, its own component of every `PerReplica` /
        `SyncOnRead`, and its own copy of everything else (mirrored values, numpy arrays: as in
        tf.distribute, a value that is not distributed is given whole to every replica). A batch is an
        argument declared in ``batch_argnums`` (host arrays there are split over the replicas), or, with no
        declaration, an array whose layout says so (from a distributed dataset). Inside a ``strategy.jit``
        step the step's own arguments keep the role they entered with; a value COMPUTED in the step (say
        ``x / 255``) carries no role, so ``run`` refuses it (rank >= 1) unless ``batch_argnums`` declares
        the roles. Gradients are LOCAL, as in tf.distribute: ``jax.grad`` inside ``fn``
        differentiates this replica's loss with respect to this replica's copy of the parameters; combine
        them explicitly with ``jd.get_replica_context().all_reduce(jd.ReduceOp.MEAN, grads)``. Python
        scalars and non-array arguments (strings, callables) are compile-time constants, as in tf.function.

        Args:
            fn: the replica function.
            args: positional arguments for ``fn``.
            kwargs: keyword arguments for ``fn`` (never batches).
            batch_argnums: the positions in ``args`` that are batches; given, every other array argument is
                mirrored (``()``: none is a batch).

        Returns:
            ``fn``'s outputs, same structure. Values identical on every replica by JAX's type system
            (results of ``all_reduce`` / ``aggregate`` / ``all_gather``, constants) come back mirrored; values
            that may differ come back as `PerReplica` (this includes values computed from a mirrored argument,
            which each replica owns a copy of: return ``ctx.aggregate(new_value, aggregation)`` for a mirrored
            update); `SyncOnRead`s stay `SyncOnRead`.

        Raises:
            ValueError: for a `PerReplica` / `SyncOnRead` of another strategy, a value computed inside a step
                whose role is not declared, or a declared batch the replicas do not divide.
            RuntimeError: when called inside another replica function.

        Example:
            >>> import jax, jax.numpy as jnp, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> def replica_fn(w, x):
            ...     ctx = jd.get_replica_context()
            ...     g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
            ...     return ctx.all_reduce(jd.ReduceOp.MEAN, g)
            >>> x = strategy.experimental_distribute_values(jnp.ones((4, 2)))
            >>> strategy.run(replica_fn, args=(jnp.ones(2), x)).tolist()
            [4.0, 4.0]
        """
        from jaxdist.strategies.context import get_replica_context, has_strategy

        if has_strategy() and get_replica_context() is not None:
            raise RuntimeError(
                "strategy.run was called inside a replica function: replica functions do not nest; "
                "call the inner function directly (it already runs per replica)."
            )
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args={args!r} must be a tuple of positional arguments, e.g. args=(params, batch).")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs={kwargs!r} must be a dict of keyword arguments or None.")
        declared = None if batch_argnums is None else as_argnums(batch_argnums, "batch_argnums")
        if declared is not None and any(not 0 <= i < len(args) for i in declared):
            raise ValueError(
                f"batch_argnums={declared!r} names positions outside args (it has {len(args)} arguments)."
            )
        args, kwargs = tuple(args), kwargs or {}
        if self._host_offload is not None:
            # Host-offloaded values are copied to device memory for the replica program (inside a step, the
            # step's entry already streamed them).
            args, kwargs = to_device_memory((args, kwargs))
        return self._runner(fn, args, kwargs, declared)

    def jit(
        self,
        fn: Callable[..., Any],
        donate_argnums: int | Sequence[int] | None = None,
        static_argnums: int | Sequence[int] | None = None,
        batch_argnums: int | Sequence[int] | None = None,
    ) -> StrategyFunction:
        """Compile an UNMODIFIED single-device step for this strategy (the global view; the drop-in path).

        ``fn`` sees global values: whole parameters, the whole global batch, and XLA inserts the collectives,
        so the result equals ``fn`` on one device. Where each argument lives is declared or carried, never
        guessed:

        * ``batch_argnums`` arguments are batches: split on axis 0 over the replicas (host arrays are placed
          so; the replicas must divide the rows);
        * other arguments already on the mesh keep their layout (batches from a distributed dataset carry
          theirs); arrays not yet there take the strategy's variable layout (mirrored; FSDP on
          `ShardedStrategy`). With no ``batch_argnums`` at all, the first unplaced array of rank >= 1 raises
          a one-time `UndeclaredBatchWarning` (it might be a batch computed on every replica whole);
        * nnx graph objects (modules, optimizers, metrics, ``nnx.Rngs``) are accepted as ``nnx.jit`` accepts
          them: their state lives in the variable layout and in-place updates are written back.

        Outputs: one shaped like a positional argument (``state -> new_state``) keeps that argument's
        layout; every other output takes the variable layout (metrics mirrored; gradients FSDP like their
        parameters on `ShardedStrategy`).

        Args:
            fn: the step function.
            donate_argnums: arguments whose buffers the step may reuse (usually the state), as in `jax.jit`.
            static_argnums: arguments treated as compile-time constants, as in `jax.jit`.
            batch_argnums: the positional arguments that are batches (``()``: none is).

        Returns:
            A callable `StrategyFunction`.

        Raises:
            TypeError: when ``fn`` is not callable or an ``*_argnums`` is not an int / tuple of ints.
            ValueError: for an argument both static and batch/donated, and (when called) a declared batch
                the replicas do not divide.

        Example:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> step = strategy.jit(lambda w, x: w - 0.5 * x.mean(0), donate_argnums=0, batch_argnums=1)
            >>> step(strategy.mirror(jnp.ones(2)), jnp.ones((4, 2))).tolist()
            [0.5, 0.5]
        """
        if self._host_offload is not None:
            # Arguments in host memory are streamed to the devices at the step's entry and outputs shaped like
            # them go back (the wrapper calls the step as it is when no argument is in host memory).
            fn = stream_host_memory(self, fn, as_argnums(static_argnums, "static_argnums"))
        return StrategyFunction(
            self, fn, donate_argnums=donate_argnums, static_argnums=static_argnums, batch_argnums=batch_argnums
        )

    def run_steps_on_dataset(
        self,
        step_fn: Callable[..., Any],
        iterator: Iterator[Any],
        iterations: int | None = None,
        initial_loop_values: Any = None,
        donate: bool = False,
    ) -> MultiStepContext:
        """Run ``iterations`` steps in ONE compiled on-device loop over batches taken from ``iterator``.

        The batches are checked for static shapes, stacked and placed once (axis 1 split over the replicas),
        and a `jax.lax.scan` runs ``step_fn`` over them: the host is involved once per call, not per step.

        Args:
            step_fn: ``step_fn(ctx, state, *inputs) -> state`` (``step_fn(ctx, *inputs)`` without
                ``initial_loop_values``), a global-view step as for `jit` (it may call `run`). A tuple batch
                ``(x, y)`` is unpacked into ``inputs``; any other batch is passed as one input. ``ctx`` is the
                `MultiStepContext`: ``ctx.set_last_step_output(name, value, aggregation)``.
            iterator: an iterator of global batches (numpy or placed arrays); consecutive calls continue it.
            iterations: steps per call; defaults to ``steps_per_run``.
            initial_loop_values: the state carried from step to step (e.g. params and optimizer state).
            donate: let the loop reuse the buffers of ``initial_loop_values`` for its result (as
                ``donate_argnums`` in `jit`; the arrays passed in are then invalid). Saves a copy of the state.

        Returns:
            The `MultiStepContext`: ``loop_values`` (the state after the last step), ``last_step_outputs``.

        Raises:
            ValueError: for a batch the replicas do not divide, ragged or differently shaped batches, or an
                iterator that ends part-way through the loop (drop the remainder or pad).
            StopIteration: when the iterator is already exhausted.
            TypeError: when ``iterator`` is not an iterator or ``step_fn`` is not callable.

        Example:
            >>> import numpy as np, jaxdist as jd
            >>> strategy = jd.MirroredStrategy()
            >>> batches = iter([np.ones((8, 2), np.float32)] * 4)
            >>> ctx = strategy.run_steps_on_dataset(lambda ctx, w, x: w + x.mean(), batches, iterations=4,
            ...                                     initial_loop_values=np.float32(0))
            >>> float(ctx.loop_values)
            4.0
        """
        return run_steps_on_dataset(
            self, step_fn, iterator, self.steps_per_run if iterations is None else iterations, initial_loop_values,
            donate=donate,
        )

    # ------------------------------------------------------------------------------------------ results
    def _check_owner(self, value: Any, what: str) -> None:
        if value.owner is not None and value.owner is not self:
            raise ValueError(
                f"{what} got a {type(value).__name__} of another strategy ({value.owner!r}), not {self!r}: "
                "use the strategy that produced it."
            )

    def _program(self, key: Any, build: Callable[[], Callable]) -> Callable:
        return self._programs.get(None, key, lambda _: build())

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combine per-replica values into one mirrored value (cross-replica context).

        Args:
            reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN` (or "sum" / "mean").
            value: a pytree of `PerReplica` / `SyncOnRead` leaves (a plain array counts as the same value on
                every replica: MEAN returns it, SUM returns it times ``num_replicas_in_sync``).
            axis: also reduce along this axis of each replica's value (``axis=0``: over the global batch).

        Returns:
            The reduced pytree, replicated on every device.

        Raises:
            ValueError: for an unknown ``reduce_op``, or a value of another strategy.
            TypeError: for an ``axis`` that is not an int (2018's ``destinations``: use `batch_reduce`).

        Example:
            >>> import jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> ids = strategy.run(lambda: jd.get_replica_context().replica_id_in_sync_group + 1.0)
            >>> float(strategy.reduce("sum", ids))
            1.0
        """
        op = ReduceOp.parse(reduce_op, "reduce_op")
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
            raise TypeError(  # e.g. 2018 code passing reduce(aggregation, value, destinations)
                f"axis={axis!r} must be an int or None. The 2018 form reduce(aggregation, value, destinations) is "
                "strategy.batch_reduce(aggregation, [(value, destinations)])."
            )
        n = self.num_replicas_in_sync

        def one(v):
            if _is_distributed(v):
                self._check_owner(v, "strategy.reduce")
                stacked, distributed = v.stacked, True
            else:
                stacked, distributed = jnp.asarray(v), False
            ndim = stacked.ndim - (1 if distributed else 0)
            if axis is not None and not -ndim <= axis < ndim:
                raise ValueError(
                    f"axis={axis} is out of range for per-replica values of rank {ndim}; use None or an axis "
                    f"in [{-ndim}, {ndim})."
                )
            inner = None if axis is None else axis % ndim

            def build():
                def reduce_fn(x):
                    axes = () if inner is None else (inner + (1 if distributed else 0),)
                    if distributed:
                        axes = (0, *axes)
                    if op is ReduceOp.MEAN:
                        return jnp.mean(x, axis=axes) if axes else x
                    total = jnp.sum(x, axis=axes) if axes else x
                    return total if distributed else total * n

                return jax.jit(reduce_fn, out_shardings=replicated(self._mesh))

            return self._program(("reduce", op, inner, distributed), build)(stacked)

        return jax.tree.map(one, value, is_leaf=_is_distributed)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenate the per-replica values along ``axis`` into one mirrored array (cross-replica context).

        Args:
            value: a pytree of `PerReplica` leaves of rank >= 1 (a plain array counts as the same value on
                every replica and is concatenated ``num_replicas_in_sync`` times).
            axis: the axis of each replica's value to concatenate along.

        Returns:
            The gathered pytree, replicated on every device.

        Raises:
            ValueError: for scalar per-replica values or an axis out of range.

        Example:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> rows = strategy.run(lambda x: x * 2, args=(strategy.experimental_distribute_values(jnp.ones((2, 1))),))
            >>> strategy.gather(rows).shape
            (2, 1)
        """
        n = self.num_replicas_in_sync

        def one(v):
            if _is_distributed(v):
                self._check_owner(v, "strategy.gather")
                stacked = v.stacked
            else:
                v = jnp.asarray(v)
                stacked = None
            ndim = (stacked.ndim - 1) if stacked is not None else v.ndim
            if ndim == 0:
                raise ValueError(
                    "strategy.gather got scalar per-replica values: gather concatenates along an axis; use "
                    "strategy.experimental_local_results or strategy.reduce for scalars."
                )
            if not -ndim <= axis < ndim:
                raise ValueError(f"axis={axis} is out of range for per-replica values of rank {ndim}.")
            ax = axis % ndim

            def build():
                def gather_fn(x):
                    if stacked is None:
                        return jnp.concatenate([x] * n, axis=ax)
                    moved = jnp.moveaxis(x, 0, ax)  # (..., N, d_ax, ...) -> merge N into d_ax
                    shape = moved.shape
                    return moved.reshape((*shape[:ax], shape[ax] * shape[ax + 1], *shape[ax + 2 :]))

                return jax.jit(gather_fn, out_shardings=replicated(self._mesh))

            return self._program(("gather", ax, stacked is None), build)(stacked if stacked is not None else v)

        return jax.tree.map(one, value, is_leaf=_is_distributed)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of this process's replicas, one entry per local replica, in replica order.

        `PerReplica` / `SyncOnRead` leaves give their components; a mirrored array gives its copy on each
        local replica's device; anything else is repeated.

        Example:
            >>> import jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> out = strategy.run(lambda: jd.get_replica_context().replica_id_in_sync_group)
            >>> [int(v) for v in strategy.experimental_local_results(out)]
            [0]
        """
        local = [d for d in self.replica_devices if d.process_index == jax.process_index()]

        def components(v):
            if _is_distributed(v):
                self._check_owner(v, "strategy.experimental_local_results")
                return local_components(v.stacked)
            if isinstance(v, jax.Array) and v.sharding.is_fully_replicated:
                by_device = {s.device: s.data for s in v.addressable_shards}
                if all(d in by_device for d in local):
                    return tuple(by_device[d] for d in local)
            return (v,) * len(local)

        leaves, treedef = jax.tree.flatten(value, is_leaf=_is_distributed)
        per_leaf = [components(v) for v in leaves]
        return tuple(jax.tree.unflatten(treedef, [c[i] for c in per_leaf]) for i in range(len(local)))

    # -------------------------------------------------------------------------------------------- input
    def experimental_distribute_values(self, batch: Any) -> Any:
        """Place one global batch (a pytree of arrays) split on axis 0 over the replicas.

        Each process transfers only the rows its own devices hold.

        Raises:
            ValueError: when ``num_replicas_in_sync`` does not divide the batch, or a leaf is a scalar.

        Example:
            >>> import numpy as np, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> strategy.experimental_distribute_values(np.zeros((4, 3))).shape
            (4, 3)
        """
        return place_batch(self, batch)

    def experimental_distribute_dataset(self, dataset: Iterable[Any], prefetch: int = 2) -> DistributedDataset:
        """Distribute an iterable of GLOBAL batches: each comes out split on axis 0 over the replicas.

        Args:
            dataset: a re-iterable of global batches (pytrees of numpy or jax arrays), e.g. a list, a
                generator function's result is iterable once.
            prefetch: batches placed ahead on the devices by a background thread (0: on demand).

        Returns:
            A `DistributedDataset`; iterate it in the training loop.

        Raises:
            TypeError: when ``dataset`` is not iterable.
            ValueError: (while iterating) when the replicas do not divide a batch.

        Example:
            >>> import numpy as np, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> batches = [np.ones((4, 2), np.float32) for _ in range(3)]
            >>> [b.shape for b in strategy.experimental_distribute_dataset(batches)]
            [(4, 2), (4, 2), (4, 2)]
        """
        if not isinstance(dataset, Iterable):
            raise TypeError(
                f"dataset={dataset!r} (type {type(dataset).__name__}) is not iterable: pass an iterable of "
                "global batches, e.g. a list or generator of (x, y) numpy arrays."
            )
        return DistributedDataset(lambda: dataset, lambda b: place_batch(self, b), prefetch)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], prefetch: int = 2
    ) -> DistributedDataset:
        """Distribute per-process input: ``dataset_fn(ctx)`` yields this process's share of each batch.

        ``ctx`` is an `InputContext` (``num_input_pipelines`` = processes, ``input_pipeline_id`` = this one);
        each batch it yields holds ``ctx.get_per_replica_batch_size(global_batch) * num_replicas_per_host``
        rows, and the global batch is the concatenation over processes. ``dataset_fn`` may return a grain
        ``MapDataset`` / ``IterDataset`` / ``DataLoader`` reading this process's shard; the iterators then have
        ``get_state`` / ``set_state`` (see `jaxdist.strategies.input`).

        Raises:
            TypeError: when ``dataset_fn`` is not callable.

        Example:
            >>> import numpy as np, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> def dataset_fn(ctx):
            ...     return [np.full((ctx.get_per_replica_batch_size(4), 1), ctx.input_pipeline_id)] * 2
            >>> [b.shape for b in strategy.distribute_datasets_from_function(dataset_fn)]
            [(4, 1), (4, 1)]
        """
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn={dataset_fn!r} is not callable: pass a function of an InputContext.")
        ctx = InputContext(jax.process_count(), jax.process_index(), self.num_replicas_in_sync)
        return DistributedDataset(
            lambda: dataset_fn(ctx), lambda b: place_batch(self, b, process_local=True), prefetch
        )
