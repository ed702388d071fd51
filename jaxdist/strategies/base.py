"""`Strategy`: the whole jaxdist model in one class.

A strategy is a `LayoutPolicy` (where every value lives: the mesh, its replica and model axes, the
layouts of variables, batches and outputs, memory kinds) wired to the verbs that run code on it:

* values: mirrored pytrees (`create_variables`, `mirror`), distributed batches (axis 0 split over
  the replicas: `experimental_distribute_dataset`), and one-component-per-replica values
  (`PerReplica`, `SyncOnRead`: stacked on a leading axis split over the replicas);
* the global view, `jit`: an unmodified single-device step compiled for those layouts (XLA inserts
  the collectives), and its on-device loop;
* the per-replica view, `run`: tf.distribute's ``run``, a `jax.shard_map` in which each replica sees
  its rows of every batch and its own copy of every mirrored value, with explicit collectives
  through `get_replica_context()`; `reduce`, `gather` and `experimental_local_results` read its
  outputs.

Roles are declared or carried by the value, never guessed (`jaxdist.strategies.layout._roles`): a
value is a batch because it was placed as one or because the caller declared it
(``batch_argnums``); everything else is a variable in the policy's variable layout. Each verb takes
the policy and never calls back into a strategy; the strategy classes only configure a policy. The
programs of ``run``, on-device loops and reductions live in ``strategy.programs``; a ``jit`` step
keeps its own, and both report recompiles to the one `RecompileWarning`. The 2018 API
(`StrategyExtended`, `StrategyV1Names`) is mixed into the concrete strategies, outside this core.
The rooms below this class are folders whose ``__init__`` is their interface: ``ambient``,
``layout``, ``input``, ``plan``, ``replica_context``, ``compile`` and ``tf_api``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
from flax.core.meta import Partitioned
from jax.sharding import Mesh, NamedSharding

from jaxdist.job import check_spans_processes
from jaxdist.replicate.ops import ReduceOp, VariableAggregation
from jaxdist.replicate.values import SyncOnRead
from jaxdist.strategies import ambient
from jaxdist.strategies.compile import (
    MultiStepContext,
    ProgramCache,
    ReplicaRunner,
    StrategyFunction,
    as_argnums,
    check_axis_name,
    check_mirrored_arg,
    check_vma_arg,
    local_results,
    run_steps_on_dataset,
)
from jaxdist.strategies.compile import gather as gather_values
from jaxdist.strategies.compile import reduce as reduce_values
from jaxdist.strategies.input import (
    DistributedDataset,
    InputContext,
    check_batches,
    check_remainder,
    place_batch,
    replicas_on_this_process,
)
from jaxdist.strategies.layout import LayoutPolicy, to_device_memory
from jaxdist.strategies.plan import Plan, abstract_variables, is_plan_mesh, refuse_to_run
from jaxdist.strategies.replica_context import (
    ValueContext,
    create_variables,
    distribute_values_from_function,
    enter_scope,
    sync_on_read,
)
from jaxdist.strategies.replica_context import mirror as mirror_tree

__all__ = ["Strategy"]


class Strategy:
    """Base class of every strategy: a `LayoutPolicy` wired to the verbs (see the module doc).

    The concrete strategies add the lower-level cross-replica API (``update``, ``batch_reduce``,
    ``colocate_vars_with``, ...: `StrategyExtended`) and the 2018 tower-era names
    (`StrategyV1Names`).

    Args:
        policy: where every value lives (mesh, axis roles, variable / batch / output layouts, memory
            kinds).
        axis_name: the name ``run`` binds the replica axis to by default (pmap-era code:
            ``"batch"``), so ``jax.lax`` collectives and ``BatchNorm(axis_name=...)`` in replica
            functions find it; None: the batch axis (``"replica"``, or the tuple of a user mesh's
            batch axes).

    Raises:
        ValueError: when a policy over several devices leaves out processes of the job (each process
            would train its own copy).

    Examples:
        >>> import jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> strategy.num_replicas_in_sync, strategy.mesh.axis_names
        (1, ('replica',))
    """

    def __init__(self, policy: LayoutPolicy, axis_name: str | None = None):
        # a single device (OneDevice, the default strategy) says where it runs
        if len(policy.devices) > 1:
            check_spans_processes(policy.devices, type(self).__name__)
        self._policy = policy
        # A subclass's hooks decide for every internal caller (the verbs ask the policy).
        for hook in ("variable_layout", "layout_role", "batch_layout"):
            if getattr(type(self), hook) is not getattr(Strategy, hook):
                policy.use_hooks(**{hook: getattr(self, hook)})
        self._axis_name = check_axis_name(policy, axis_name)
        self._programs = ProgramCache()
        self._runner = ReplicaRunner(policy, self._programs, self)
        self.steps_per_run = 1

    # ------------------------------------------------------------------------------------- topology
    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The replicas' devices, in replica order (all processes)."""
        return self._policy.devices

    @property
    def worker_devices(self) -> tuple[jax.Device, ...]:
        """Alias of `devices` (tf.distribute's name)."""
        return self._policy.devices

    @property
    def mesh(self) -> Mesh:
        """The `jax.sharding.Mesh` over `devices`: axis ``"replica"`` (and ``"model"``), or the
        user's own mesh."""
        return self._policy.mesh

    @property
    def policy(self) -> LayoutPolicy:
        """The `LayoutPolicy` that decides where every value of this strategy lives.

        Examples:
            >>> import jax, jaxdist as jd
            >>> policy = jd.ShardedStrategy(min_shard_size=1).policy
            >>> policy.variable_layout("w", jax.ShapeDtypeStruct((8, 4), "float32")).spec
            P('replica',)
        """
        return self._policy

    @property
    def axis_name(self) -> str:
        """The name ``run`` binds the replica axis to unless the call says otherwise.

        Examples:
            >>> import jaxdist as jd
            >>> jd.MirroredStrategy(axis_name="batch").axis_name, jd.MirroredStrategy().axis_name
            ('batch', 'replica')
        """
        return self._axis_name

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step in lockstep."""
        return self._policy.num_replicas

    @property
    def replica_devices(self) -> tuple[jax.Device, ...]:
        """The first device of each replica, in order (= `devices` without model parallelism)."""
        return self._policy.replica_devices

    @property
    def num_hosts(self) -> int:
        """How many processes (hosts) own this strategy's devices."""
        return len({d.process_index for d in self.devices})

    @property
    def num_replicas_per_host(self) -> int:
        """Replicas on each host (this process's count)."""
        return replicas_on_this_process(self._policy)

    @property
    def batch_sharding(self) -> NamedSharding:
        """The layout of distributed batches: axis 0 split over the replicas."""
        return self._policy.batch_sharding

    @property
    def replicated_sharding(self) -> NamedSharding:
        """The layout of mirrored values: a whole copy on every replica."""
        return self._policy.replicated_sharding

    @property
    def programs(self) -> ProgramCache:
        """The one cache of this strategy's compiled programs (weak on user functions, bounded)."""
        return self._programs

    @property
    def host_offload(self) -> str | None:
        """Which variables live in host memory between steps: ``"opt_state"``, ``"params"``,
        ``"all"`` or None."""
        return self._policy.host_offload

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"

    # --------------------------------------------------------------------------------------- scopes
    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        """Make this the current strategy (``jd.get_strategy()``) inside a ``with`` block.

        Raises:
            RuntimeError: when another strategy's scope is already open ("Mixing different Strategy
                objects").

        Examples:
            >>> import jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> with strategy.scope():
            ...     jd.get_strategy() is strategy
            True
        """
        return enter_scope(self, self._policy)

    def tracing_scope(self) -> contextlib.AbstractContextManager[Any]:
        """The context a `jit` step is traced in: nothing here; `ShardedStrategy` with
        ``logical_axis_rules`` enters its mesh and rules, so ``nn.with_logical_constraint`` in the
        model lays out activations.

        Examples:
            >>> import jaxdist as jd
            >>> with jd.OneDeviceStrategy().tracing_scope():
            ...     pass
        """
        return self._policy.tracing_scope()

    # --------------------------------------------------------------------------------- layout hooks
    def variable_layout(
        self, path: str, aval: jax.ShapeDtypeStruct, annotation: Partitioned | None = None
    ) -> jax.sharding.Sharding:
        """The layout of the variable at ``path`` (``"params/Dense_0/kernel"``) of shape ``aval``.

        The hook a strategy overrides to place variables (Keras' ``get_variable_layout``): mirrored
        strategies replicate every variable; `ShardedStrategy` splits them (FSDP, layout rules,
        partitioning annotations). Everything that places variables goes through it:
        `create_variables`, `mirror`, `variable_shardings`, unplaced non-batch arguments of `jit`
        and `run`, nnx state, outputs of `jit` given the variable layout, the `Trainer` and
        checkpoint restores. An override may call ``super().variable_layout(...)`` for the
        strategy's own rule.

        Args:
            path: the variable's pytree path, ``/``-joined (what layout rules match).
            aval: its shape and dtype (an array or `jax.ShapeDtypeStruct`).
            annotation: the Flax partitioning box around the variable, when the model annotated it
                (``nn.with_partitioning``: a `flax.core.meta.Partitioned` naming mesh axes;
                ``nn.with_logical_partitioning``: a `flax.linen.LogicallyPartitioned` naming logical
                axes); passed only for annotated variables. Strategies that replicate every variable
                ignore it.

        Examples:
            >>> import jax, jaxdist as jd
            >>> aval = jax.ShapeDtypeStruct((4,), "float32")
            >>> jd.OneDeviceStrategy().variable_layout("w", aval).spec
            P()

            A strategy that keeps biases whole on every device and splits the rest by its own rule:

            >>> class WholeBiases(jd.ShardedStrategy):
            ...     def variable_layout(self, path, aval, annotation=None):
            ...         if path.endswith("bias"):
            ...             return jax.sharding.NamedSharding(self.mesh,
            ...                                               jax.sharding.PartitionSpec())
            ...         return super().variable_layout(path, aval, annotation)
            >>> s = WholeBiases(min_shard_size=1)
            >>> params = s.create_variables(lambda: {"bias": jax.numpy.zeros(8),
            ...                                      "kernel": jax.numpy.zeros(8)})
            >>> params["bias"].sharding.spec, params["kernel"].sharding.spec
            (P(), P('replica',))
        """
        return self._policy.rule_layout(path, aval, annotation)

    def batch_layout(self, shape: tuple[int | None, ...]) -> jax.sharding.Sharding:
        """The layout of a batch leaf of ``shape`` (Keras' ``get_data_layout``).

        The hook a strategy overrides to place batches: rows split over the replicas, and with
        context axes the sequence too. Everything that places a batch goes through it:
        ``batch_argnums`` of `jit`, `experimental_distribute_dataset` /
        `experimental_distribute_values` and the other input functions, the `Trainer`'s batches and
        plans. ``shape`` has None for a dimension not known where it is asked. An override may call
        ``super().batch_layout(shape)`` for the strategy's own layout.

        Examples:
            >>> import jaxdist as jd
            >>> jd.OneDeviceStrategy().batch_layout((8, 3)).spec
            P('replica',)
        """
        return self._policy.rule_batch_layout(len(shape), shape)

    def is_batch_layout(self, x: Any) -> bool:
        """True when ``x`` is an array on this strategy's mesh with axis 0 split over the replicas.

        Examples:
            >>> import numpy as np, jaxdist as jd
            >>> s = jd.OneDeviceStrategy()
            >>> (s.is_batch_layout(s.experimental_distribute_values(np.ones((2, 1)))),
            ...  s.is_batch_layout(np.ones(2)))
            (True, False)
        """
        return self._policy.is_batch_layout(x)

    def layout_role(self, x: Any) -> str | None:
        """The role ``x``'s layout gives it: ``"batch"``, ``"variable"``, or None if it cannot tell.

        None for values not on this strategy's mesh (numpy, arrays on another device: their role
        must be declared) and, on strategies whose variables can share the batch layout
        (`ShardedStrategy`'s FSDP), for arrays split like a batch: there a batch is declared
        (``batch_argnums``). A strategy that adds layouts overrides this hook; every internal caller
        goes through the override.

        Examples:
            >>> import numpy as np, jaxdist as jd
            >>> s = jd.OneDeviceStrategy()
            >>> (s.layout_role(s.experimental_distribute_values(np.ones((2, 1)))),
            ...  s.layout_role(np.ones(2)))
            ('batch', None)
        """
        return self._policy.role_from_layout(x)

    @property
    def gathers_variables_without_batch(self) -> bool:
        """Whether a `jit` step with no distributed batch gathers its split variables at entry.

        True where variables can be split (a protection against an XLA Shardy partitioner miscompute
        of conv nets with split kernels and a replicated batch; see the README); False for mirrored
        strategies.
        """
        return self._policy.splits_variables

    def variable_shardings(self, shapes: Any) -> Any:
        """The layout this strategy gives each variable of ``shapes`` (arrays or shape structs).

        What ``create_variables`` and ``mirror`` use; handy for restoring a checkpoint straight into
        the layout (``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` targets) without running
        the initializer. Variables boxed by a Flax partitioning annotation
        (``nn.with_partitioning``, ``nn.with_logical_partitioning``: what ``model.init`` returns for
        annotated models, and what optax states built from such params hold) are laid out by
        `variable_layout` with their box as ``annotation``; the box is kept around the sharding, so
        the result has the structure of ``shapes``.

        Examples:
            >>> import jax, jax.numpy as jnp, jaxdist as jd
            >>> shapes = jax.eval_shape(lambda: {"w": jnp.zeros((4, 2))})
            >>> jd.OneDeviceStrategy().variable_shardings(shapes)["w"].is_fully_replicated
            True
        """
        return self._policy.variable_shardings(shapes)

    def create_variables(self, init_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``init_fn(*args, **kwargs)`` compiled straight into this strategy's variable layout.

        The initializer runs under `jax.jit` with ``out_shardings``, so values are created on the
        devices where they live (mirrored: on every replica) with no host copy.

        Args:
            init_fn: returns the initial pytree, e.g. ``model.init``.
            *args: its arguments (rng keys, sample inputs, configs). Array leaves (jax or numpy
                arrays) are traced; every other leaf (Python numbers, strings, callables, config
                objects, dataclasses) is passed through unchanged, as a constant of the initializer.
            **kwargs: keyword arguments, handled the same way.

        Returns:
            The pytree of variables in this strategy's layout.

        Raises:
            TypeError: when ``init_fn`` is not callable.

        Examples:
            >>> import jax, jax.numpy as jnp, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> params = strategy.create_variables(lambda key: {"w": jax.random.normal(key, (3,))},
            ...                                    jax.random.key(0))
            >>> params["w"].shape
            (3,)
        """
        if is_plan_mesh(self._policy.mesh):  # plans only: the variables' shapes in their layouts
            return abstract_variables(self._policy, init_fn, args, kwargs)
        return create_variables(self._policy, init_fn, args, kwargs)

    def mirror(self, tree: Any) -> Any:
        """Place an existing pytree in the variable layout (mirrored: a copy on every replica).

        Values are placed as ``jax.device_put`` places them: arrays (jax and numpy) and Python
        numbers (a Flax ``TrainState``'s ``step=0`` is a counter). Inside an Equinox module only
        arrays are: its Python bools and numbers are settings (``eqx.filter_jit``'s rule), so
        ``eqx.nn.BatchNorm``'s ``inference`` flag stays what the step's ``if`` sees. Functions,
        strings and None are kept as they are everywhere.

        Args:
            tree: any pytree (a model, an optimizer state, an Equinox module and its
                ``eqx.nn.State``).

        Returns:
            ``tree`` with its values copied into the variable layout and its other leaves unchanged.

        Examples:
            >>> import numpy as np, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> placed = strategy.mirror({"b": np.zeros(2), "act": abs})
            >>> placed["b"].sharding.is_fully_replicated, placed["act"]
            (True, <built-in function abs>)
        """
        refuse_to_run(self._policy.mesh, "strategy.mirror")  # placing values needs devices
        return mirror_tree(self._policy, tree)

    def sync_on_read(
        self, initial_value: Any, aggregation: VariableAggregation | str = VariableAggregation.SUM
    ) -> SyncOnRead:
        """One component per replica, each starting at ``initial_value``, aggregated on read.

        Args:
            initial_value: an array (or scalar); every replica's component starts as it (as
                tf.distribute).
            aggregation: SUM, MEAN or ONLY_FIRST_REPLICA, how ``.read()`` combines the components.

        Returns:
            A `SyncOnRead`.

        Raises:
            ValueError: for NONE or an unknown aggregation.
            TypeError: for MEAN on an integer value.

        Examples:
            >>> import jaxdist as jd
            >>> count = jd.OneDeviceStrategy().sync_on_read(0, "sum")
            >>> int(count.read())
            0
        """
        return sync_on_read(self._policy, self, initial_value, aggregation)

    # -------------------------------------------------------------------------------------- running
    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
            batch_argnums: int | Sequence[int] | None = None, axis_name: str | None = None,
            check_vma: bool | None = None, check_mirrored: str | None = None) -> Any:
        """Run ``fn`` once per replica, in lockstep (tf.distribute's ``Strategy.run``).

        Each replica sees its own rows of every batch, its own component of every `PerReplica` /
        `SyncOnRead`, and its own copy of everything else (mirrored values, numpy arrays: as in
        tf.distribute, a value that is not distributed is given whole to every replica). A batch is
        an argument declared in ``batch_argnums`` (host arrays there are split over the replicas),
        or, with no declaration, an array whose layout says so (from a distributed dataset). Inside
        a ``strategy.jit`` step the step's own arguments keep the role they entered with; a value
        COMPUTED in the step (say ``x / 255``) carries no role, so ``run`` refuses it (rank >= 1)
        unless ``batch_argnums`` declares the roles. Gradients are LOCAL, as in tf.distribute:
        ``jax.grad`` inside ``fn`` differentiates this replica's loss with respect to this replica's
        copy of the parameters; combine them explicitly with
        ``jd.get_replica_context().all_reduce(jd.ReduceOp.MEAN, grads)``. Python scalars and
        non-array arguments (strings, callables) are compile-time constants, as in tf.function.

        Args:
            fn: the replica function.
            args: positional arguments for ``fn``.
            kwargs: keyword arguments for ``fn`` (never batches).
            batch_argnums: the positions in ``args`` that are batches; given, every other array
                argument is mirrored (``()``: none is a batch).
            axis_name: the name of the replica axis inside ``fn`` (default: the strategy's
                ``axis_name``, ``"replica"``). pmap-era code ports by naming its axis: with
                ``axis_name="batch"``, ``jax.lax.pmean(x, "batch")``, ``lax.psum``,
                ``lax.axis_index`` and ``BatchNorm(axis_name="batch")`` in ``fn`` work over the
                replicas and compute what ``jax.pmap(fn, axis_name="batch")`` computes on the same
                per-device batches. A collective over an axis name that is not bound is a ValueError
                naming the axis and this argument.
            check_vma: JAX's varying-type check inside the replica program (``jax.shard_map``'s).
                None (the default): off where the replica axis is named (``axis_name`` here or the
                strategy's own: pmap-era code runs as ``jax.pmap`` runs it, its gradients through
                ``pmean`` included); otherwise on, except where only the check refuses a
                function that ``jax.pmap`` runs (a ``lax.scan`` whose carry starts as a constant and
                comes out different per replica): that one runs with the check off, as ``pmap`` runs
                it (gradients still local), with a one-time note in the ``"jaxdist"`` log. True: the
                check always (its error as JAX raises it). False: no check, no note. Which outputs
                are mirrored is proven from the program's values in every case. See the run guide.
            check_mirrored: when to check on device that the outputs returned mirrored are the same
                on every replica: ``"first"`` (the first call of each compiled program; the default,
                or what the ``JAXDIST_CHECK_MIRRORED`` environment variable says) or ``"every"``
                (every call, while debugging; inside a ``strategy.jit`` step, as a host callback of
                the step).

        Returns:
            ``fn``'s outputs, same structure. Values proven the same on every replica come back
            mirrored: results of ``all_reduce`` / ``aggregate`` / ``all_gather``, constants, and
            what pure operations compute only from them and from mirrored arguments (parameters
            updated with all-reduced gradients), read from the program value by value and checked on
            device at the first call (``JAXDIST_CHECK_MIRRORED=every``: every call); everything else
            (what the analysis cannot prove) comes back as `PerReplica` (``ctx.per_replica(value)``
            declares one on purpose); `SyncOnRead`s stay `SyncOnRead`. Sync-on-read arguments (and
            ones ``fn`` captures) updated in place with ``assign`` / ``assign_add`` / ``assign_sub``
            keep the update, also from inside ``lax.scan`` / ``lax.cond`` / a nested ``jax.jit`` in
            ``fn``; one that ``fn`` returns (``return seen.assign_add(1.0)``) comes back as the
            object passed in or captured.

        Raises:
            ValueError: for an output that takes a mirrored argument's place (computed from it
                element-wise, outside the backward pass: an update) but may differ between replicas
                (all-reduce the gradients first, or declare it with ``ctx.per_replica``), a
                `PerReplica` / `SyncOnRead` of another strategy, a value computed inside a step
                whose role is not declared, a declared batch the replicas do not divide, or a
                collective in ``fn`` over an axis name that is not bound (pass ``axis_name=``).
            RuntimeError: when called inside another replica function, or when an output proven the
                same on every replica is found to differ on device (the first call's check).

        Examples:
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
        if ambient.current_replica() is not None:
            raise RuntimeError("strategy.run was called inside a replica function: replica "
                               "functions do not nest; call the inner function directly (it "
                               "already runs per replica).")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args={args!r} must be a tuple of positional arguments, e.g. "
                            "args=(params, batch).")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs={kwargs!r} must be a dict of keyword arguments or None.")
        declared = None if batch_argnums is None else as_argnums(batch_argnums, "batch_argnums")
        if declared is not None and any(not 0 <= i < len(args) for i in declared):
            raise ValueError(f"batch_argnums={declared!r} names positions outside args (it has "
                             f"{len(args)} arguments).")
        axis = self._axis_name if axis_name is None else check_axis_name(self._policy, axis_name)
        args, kwargs = tuple(args), kwargs or {}
        if self._policy.host_offload is not None:
            # host-offloaded values go to device memory for the program (in a step: its entry did)
            args, kwargs = to_device_memory((args, kwargs))
        check_vma = check_vma_arg(check_vma)
        if check_vma is None and (axis_name is not None or axis != self._policy.replica_axis):
            # pmap-era code names its axis: it runs as jax.pmap runs it (its gradients too)
            check_vma = False
        return self._runner(fn, args, kwargs, declared, axis, check_vma,
                            check_mirrored_arg(check_mirrored))

    def jit(
        self, fn: Callable[..., Any] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        static_argnums: int | Sequence[int] | None = None,
        batch_argnums: int | Sequence[int] | None = None, *,
        static_argnames: str | Sequence[str] | None = None,
        donate_argnames: str | Sequence[str] | None = None,
        batch_argnames: str | Sequence[str] | None = None, out_layouts: Any = None,
        axis_types: jax.sharding.AxisType | None = None,
    ) -> StrategyFunction | Callable[[Callable[..., Any]], StrategyFunction]:
        """Compile an UNMODIFIED single-device step for this strategy (the global, drop-in view).

        ``fn`` sees global values: whole parameters, the whole global batch, and XLA inserts the
        collectives, so the result equals ``fn`` on one device. Where each argument lives is
        declared or carried, never guessed:

        * ``batch_argnums`` arguments are batches: split on axis 0 over the replicas (host arrays
          are placed so; the replicas must divide the rows);
        * other arguments already on the mesh keep their layout (batches from a distributed dataset
          carry theirs); arrays not yet there take the strategy's variable layout (mirrored; FSDP on
          `ShardedStrategy`). With no ``batch_argnums`` at all, the first unplaced array of rank >=
          1 raises a one-time `UndeclaredBatchWarning` (it might be a batch computed on every
          replica whole);
        * nnx graph objects (modules, optimizers, metrics, ``nnx.Rngs``) are accepted as ``nnx.jit``
          accepts them: their state lives in the variable layout and in-place updates are written
          back.

        Outputs: an output that is one of the step's variables keeps that variable's layout (the nnx
        state written back in place; a returned ``nnx.state(...)``, path by path; an output shaped
        like a positional argument, ``state -> new_state``); ``out_layouts`` declares any other; the
        rest takes the variable layout (metrics mirrored; gradients FSDP like their parameters on
        `ShardedStrategy`). Layouts are resolved once per program, when it is traced
        (`jaxdist.strategies.compile._trace._resolve`).

        It has `jax.jit`'s shape: ``strategy.jit(step, ...)``, ``@strategy.jit`` and, with no
        function, a decorator factory (``@strategy.jit(batch_argnums=1)``, as ``nnx.jit(...)`` and
        ``functools.partial(jax.jit, ...)`` are used); keyword arguments at call time,
        ``*_argnames`` completed from ``*_argnums`` through the signature (and back), and the
        ahead-of-time stages ``.trace`` / ``.lower`` / ``.compile``.

        Args:
            fn: the step function (None: return a decorator that takes it, with these options).
            donate_argnums: arguments whose buffers the step may reuse (usually the state), as in
                `jax.jit`.
            static_argnums: arguments treated as compile-time constants, as in `jax.jit`.
            batch_argnums: the positional arguments that are batches (``()``: none is).
            static_argnames: static arguments by name, as in `jax.jit`.
            donate_argnames: donated arguments by name, as in `jax.jit`.
            batch_argnames: batch arguments by name.
            out_layouts: the layout of outputs no rule covers: a pytree prefix of the outputs of
                `jax.sharding.Sharding` / `PartitionSpec` (on this strategy's mesh) / None (jaxdist
                decides).
            axis_types: on a mesh with ``Explicit`` axes (``jax.make_mesh``'s default), what types
                the step runs with: None (each program decides when traced: the mesh's Explicit axes
                where the step type-checks with them, as code written for that mesh does; Auto where
                it does not, as unannotated single-device code; logged, and in `Plan.axis_types`),
                or ``jax.sharding.AxisType.Auto`` / ``jax.sharding.AxisType.Explicit`` to force one
                (see `jaxdist.strategies.layout._axis_types`). The numbers are the same either way.

        Returns:
            A callable `StrategyFunction` (without ``fn``: a decorator that makes one).

        Raises:
            TypeError: when ``fn`` is not callable or an ``*_argnums`` is not an int / tuple of
                ints.
            ValueError: for an argument both static and batch/donated, an ``axis_types`` that is not
                an AxisType, and (when called) a declared batch the replicas do not divide.

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> step = strategy.jit(lambda w, x: w - 0.5 * x.mean(0), donate_argnums=0,
            ...                     batch_argnums=1)
            >>> step(strategy.mirror(jnp.ones(2)), jnp.ones((4, 2))).tolist()
            [0.5, 0.5]
            >>> @strategy.jit(batch_argnums=1)
            ... def sgd(w, x):
            ...     return w - 0.5 * x.mean(0)
            >>> sgd(jnp.ones(2), jnp.ones((4, 2))).tolist()
            [0.5, 0.5]
        """
        options = dict(donate_argnums=donate_argnums, static_argnums=static_argnums,
                       batch_argnums=batch_argnums, static_argnames=static_argnames,
                       donate_argnames=donate_argnames, batch_argnames=batch_argnames,
                       out_layouts=out_layouts, axis_types=axis_types)
        if fn is None:
            return functools.partial(self.jit, **options)
        return StrategyFunction(self._policy, self._programs, fn, **options)

    def plan(self, fn: Callable[..., Any], *args: Any, kwargs: dict | None = None,
             **jit_kwargs: Any) -> Plan:
        """``self.jit(fn, **jit_kwargs).plan(*args, **kwargs)``: what ``fn`` costs on this
        strategy's layout (memory, FLOPs, collectives per device), compiled but never run (see
        `StrategyFunction.plan`).

        Args:
            fn: the step function.
            *args: its positional arguments (values or `jax.ShapeDtypeStruct`s).
            kwargs: its keyword arguments.
            **jit_kwargs: `jit`'s options (``batch_argnums=``, ``donate_argnums=``,
                ``static_argnums=``, ...).

        Returns:
            A `jd.Plan`.

        Examples:
            >>> import jax, jax.numpy as jnp, jaxdist as jd
            >>> plan = jd.MirroredStrategy().plan(lambda w, x: (x @ w).sum(), jnp.zeros((16, 4)),
            ...                                   jnp.zeros((64, 16)), batch_argnums=1)
            >>> plan.argument_bytes == 16 * 4 * 4 + 64 // 8 * 16 * 4
            True
        """
        return self.jit(fn, **jit_kwargs).plan(*args, **(kwargs or {}))

    def run_steps_on_dataset(self, step_fn: Callable[..., Any], iterator: Iterator[Any],
                             iterations: int | None = None, initial_loop_values: Any = None,
                             donate: bool = False) -> MultiStepContext:
        """Run ``iterations`` steps in ONE compiled on-device loop over batches from ``iterator``.

        The batches are checked for static shapes, stacked and placed once (axis 1 split over the
        replicas), and a `jax.lax.scan` runs ``step_fn`` over them: the host is involved once per
        call, not per step.

        Args:
            step_fn: ``step_fn(ctx, state, *inputs) -> state`` (``step_fn(ctx, *inputs)`` without
                ``initial_loop_values``), a global-view step as for `jit` (it may call `run`). A
                tuple batch ``(x, y)`` is unpacked into ``inputs``; any other batch is passed as one
                input. ``ctx`` is the `MultiStepContext`: ``ctx.set_last_step_output(name, value,
                aggregation)``.
            iterator: an iterator of global batches (numpy or placed arrays); consecutive calls
                continue it.
            iterations: steps per call; defaults to ``steps_per_run``.
            initial_loop_values: the state carried from step to step (e.g. params and optimizer
                state).
            donate: let the loop reuse the buffers of ``initial_loop_values`` for its result (as
                ``donate_argnums`` in `jit`; the arrays passed in are then invalid). Saves a copy of
                the state.

        Returns:
            The `MultiStepContext`: ``loop_values`` (the state after the last step),
            ``last_step_outputs``.

        Raises:
            ValueError: for a batch the replicas do not divide, ragged or differently shaped
                batches, or an iterator that ends part-way through the loop (drop the remainder or
                pad).
            StopIteration: when the iterator is already exhausted.
            TypeError: when ``iterator`` is not an iterator or ``step_fn`` is not callable.

        Examples:
            >>> import numpy as np, jaxdist as jd
            >>> strategy = jd.MirroredStrategy()
            >>> batches = iter([np.ones((8, 2), np.float32)] * 4)
            >>> ctx = strategy.run_steps_on_dataset(lambda ctx, w, x: w + x.mean(), batches,
            ...                                     iterations=4, initial_loop_values=np.float32(0))
            >>> float(ctx.loop_values)
            4.0
        """
        return run_steps_on_dataset(self._policy, self._programs, step_fn, iterator,
                                    self.steps_per_run if iterations is None else iterations,
                                    initial_loop_values, donate=donate)

    # -------------------------------------------------------------------------------------- results
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combine per-replica values into one mirrored value (cross-replica context).

        Args:
            reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN` (or "sum" / "mean").
            value: a pytree of `PerReplica` / `SyncOnRead` leaves (a plain array counts as the same
                value on every replica: MEAN returns it, SUM returns it times
                ``num_replicas_in_sync``).
            axis: also reduce along this axis of each replica's value (``axis=0``: over the global
                batch).

        Returns:
            The reduced pytree, replicated on every device.

        Raises:
            ValueError: for an unknown ``reduce_op``, or a value of another strategy.
            TypeError: for an ``axis`` that is not an int (2018's ``destinations``: use
                `batch_reduce`).

        Examples:
            >>> import jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> ids = strategy.run(lambda: jd.get_replica_context().replica_id_in_sync_group + 1.0)
            >>> float(strategy.reduce("sum", ids))
            1.0
        """
        return reduce_values(self._policy, self._programs, self, reduce_op, value, axis)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenate the per-replica values along ``axis`` into one mirrored array.

        Args:
            value: a pytree of `PerReplica` leaves of rank >= 1 (a plain array counts as the same
                value on every replica and is concatenated ``num_replicas_in_sync`` times).
            axis: the axis of each replica's value to concatenate along.

        Returns:
            The gathered pytree, replicated on every device.

        Raises:
            ValueError: for scalar per-replica values or an axis out of range.

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> batch = strategy.experimental_distribute_values(jnp.ones((2, 1)))
            >>> rows = strategy.run(lambda x: x * 2, args=(batch,))
            >>> strategy.gather(rows).shape
            (2, 1)
        """
        return gather_values(self._policy, self._programs, self, value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of this process's replicas, one entry per local replica, in replica order.

        `PerReplica` / `SyncOnRead` leaves give their components; a mirrored array gives its copy on
        each local replica's device; anything else is repeated.

        Examples:
            >>> import jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> out = strategy.run(lambda: jd.get_replica_context().replica_id_in_sync_group)
            >>> [int(v) for v in strategy.experimental_local_results(out)]
            [0]
        """
        return local_results(self._policy, self, value)

    # ---------------------------------------------------------------------------------------- input
    def experimental_distribute_values(self, batch: Any) -> Any:
        """Place one global batch (a pytree of arrays) split on axis 0 over the replicas.

        Each process transfers only the rows its own devices hold.

        Raises:
            ValueError: when ``num_replicas_in_sync`` does not divide the batch, or a leaf is a
                scalar.

        Examples:
            >>> import numpy as np, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> strategy.experimental_distribute_values(np.zeros((4, 3))).shape
            (4, 3)
        """
        return place_batch(self._policy, batch)

    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], prefetch: int = 2, remainder: str = "error"
    ) -> DistributedDataset:
        """Distribute an iterable of GLOBAL batches, each split on axis 0 over the replicas.

        Args:
            dataset: a re-iterable of global batches (pytrees of numpy or jax arrays), e.g. a list,
                a generator function's result is iterable once.
            prefetch: batches placed ahead on the devices by a background thread (0: on demand).
            remainder: what a batch with fewer rows than the first (the last of an epoch) gets:
                "error" (a ValueError naming this argument where the replicas do not divide it; for
                a list or tuple, before anything runs; one they divide runs, as a program of its
                own), "drop" (skipped: tf.data's ``drop_remainder=True``) or "pad" (padded to the
                first batch's rows; ``strategy.run`` gives its replicas the row weights,
                `ReplicaContext.batch_weights`, and ``jd.compute_average_loss`` leaves the padding
                rows out; also a ``run`` inside a ``strategy.jit`` step that got the batch, while a
                step that hands it to no ``run`` is refused).

        Returns:
            A `DistributedDataset`; iterate it in the training loop.

        Raises:
            TypeError: when ``dataset`` is not iterable.
            ValueError: for an unknown ``remainder``; a list with a batch the replicas do not
                divide, under "error"; (while iterating) when the replicas do not divide a batch.

        Examples:
            >>> import numpy as np, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> batches = [np.ones((4, 2), np.float32) for _ in range(3)]
            >>> [b.shape for b in strategy.experimental_distribute_dataset(batches)]
            [(4, 2), (4, 2), (4, 2)]
            >>> dropped = strategy.experimental_distribute_dataset(batches + [np.ones((1, 2))],
            ...                                                    remainder="drop")
            >>> [b.shape for b in dropped]
            [(4, 2), (4, 2), (4, 2)]
        """
        if not isinstance(dataset, Iterable):
            raise TypeError(f"dataset={dataset!r} (type {type(dataset).__name__}) is not iterable: "
                            "pass an iterable of global batches, e.g. a list or generator of "
                            "(x, y) numpy arrays.")
        if check_remainder(remainder) == "error" and isinstance(dataset, (list, tuple)):
            check_batches(dataset, self.num_replicas_in_sync)
        return DistributedDataset(lambda: dataset, lambda b: place_batch(self._policy, b), prefetch,
                                  remainder, self.num_replicas_in_sync)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext],
                                                                              Any]) -> Any:
        """One value per replica: ``value_fn(ctx)`` for each replica, as `PerReplica`s for `run`.

        ``ctx`` is a `ValueContext` (``replica_id_in_sync_group``, ``num_replicas_in_sync``). Each
        process calls ``value_fn`` only for its own replicas (as tf.distribute does); passed to
        ``run``, each replica sees its own value, e.g. per-replica dropout keys:
        ``keys = strategy.experimental_distribute_values_from_function(lambda ctx:
        jax.random.fold_in(key, ctx.replica_id_in_sync_group))``.

        Args:
            value_fn: a function of a `ValueContext` returning an array, a number, or a pytree of
                them (the same structure, shapes and dtypes for every replica).

        Returns:
            The pytree ``value_fn`` returns, with each leaf a `PerReplica`.

        Raises:
            TypeError: when ``value_fn`` is not callable or returns a leaf that is not an array or a
                number.
            ValueError: when the replicas' values differ in structure, shape or dtype, or are traced
                (call it outside ``jax.jit`` / ``strategy.jit``).
            RuntimeError: when called inside a replica function.

        Examples:
            >>> import jaxdist as jd
            >>> strategy = jd.MirroredStrategy()
            >>> ids = strategy.experimental_distribute_values_from_function(
            ...     lambda ctx: ctx.replica_id_in_sync_group)
            >>> [int(v) for v in strategy.experimental_local_results(ids)][:3]
            [0, 1, 2]
        """
        return distribute_values_from_function(self._policy, self, value_fn)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], prefetch: int = 2,
        remainder: str = "error"
    ) -> DistributedDataset:
        """Distribute per-process input: ``dataset_fn(ctx)`` yields this process's share of batches.

        ``ctx`` is an `InputContext` (``num_input_pipelines`` = processes, ``input_pipeline_id`` =
        this one); each batch it yields holds ``ctx.get_per_replica_batch_size(global_batch) *
        num_replicas_per_host`` rows, and the global batch is the concatenation over processes.
        ``dataset_fn`` may return a grain ``MapDataset`` / ``IterDataset`` / ``DataLoader`` reading
        this process's shard; the iterators then have ``get_state`` / ``set_state`` (see
        `jaxdist.strategies.DistributedIterator`). ``remainder`` is as in
        `experimental_distribute_dataset`, per process: a padded batch is padded to the first
        batch's rows.

        Raises:
            TypeError: when ``dataset_fn`` is not callable.
            ValueError: for an unknown ``remainder``.

        Examples:
            >>> import numpy as np, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> def dataset_fn(ctx):
            ...     return [np.full((ctx.get_per_replica_batch_size(4), 1),
            ...                     ctx.input_pipeline_id)] * 2
            >>> [b.shape for b in strategy.distribute_datasets_from_function(dataset_fn)]
            [(4, 1), (4, 1)]
        """
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn={dataset_fn!r} is not callable: pass a function of an "
                            "InputContext.")
        ctx = InputContext(jax.process_count(), jax.process_index(), self.num_replicas_in_sync)
        return DistributedDataset(
            lambda: dataset_fn(ctx), lambda b: place_batch(self._policy, b, process_local=True),
            prefetch, check_remainder(remainder), max(1, replicas_on_this_process(self._policy)),
        )
