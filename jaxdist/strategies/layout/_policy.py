"""`LayoutPolicy`: the one object that decides where every value of a strategy lives.

A policy owns the mesh and the role of each of its axes (batch, FSDP, model, ...:
`jaxdist.strategies.layout._meshes`), and answers, alone, "which layout does this value get":

* variables: `variable_layout` / `variable_shardings` (layout rules, Flax annotations through
  logical rules, the FSDP rule or mirrored; ``colocate_vars_with`` targets; host offloading as the
  *memory kind* of the same shardings);
* batches: `batch_sharding` (axis 0 split over the batch axes), `batch_layout` (with context axes,
  the sequence dimension of a batch of rank >= 2 split over them too);
* outputs of a compiled step: through `jaxdist.strategies.compile._trace._resolve`, which applies
  these per program while the step traces;
* what a placed value's layout says of its role: `layout_role`.

Every strategy is a configuration of a policy, and every verb (``jit``, ``run``, loops, input,
reduce) takes one (see `jaxdist.strategies.base`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core.meta import Partitioned
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.costs import format_bytes
from jaxdist.job import spans_processes
from jaxdist.replicate.layouts import (
    REPLICA_AXIS,
    is_on_mesh,
    path_name,
    replicated,
    splits_batch_axis,
)
from jaxdist.strategies import ambient
from jaxdist.strategies.layout._axis_types import shape_scope, trace_mesh
from jaxdist.strategies.layout._meshes import (
    ROLES,
    axis_roles,
    check_role_keywords,
    short_form_mesh,
)
from jaxdist.strategies.layout._offload import offload_shardings, parse_host_offload
from jaxdist.strategies.layout._provenance import own
from jaxdist.strategies.layout._roles import placed_as_batch
from jaxdist.strategies.layout._rules import (
    VariableRules,
    annotation,
    is_annotated,
    is_box,
    is_variable,
)

__all__ = ["IdleAxisWarning", "LayoutPolicy", "colocated_layout"]


def colocated_layout(target: jax.sharding.Sharding, aval: Any) -> jax.sharding.Sharding:
    """``target``'s layout for a value of ``aval``'s shape: the same sharding where it fits, else a
    whole copy on the same devices (same memory kind).

    Examples:
        >>> import jax
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("replica",))
        >>> scalar = jax.ShapeDtypeStruct((), "int32")
        >>> colocated_layout(NamedSharding(mesh, P(None, "replica")), scalar).spec
        P()
    """
    if not isinstance(target, NamedSharding):
        return target
    shape = tuple(np.shape(aval))
    if len(target.spec) <= len(shape):
        sizes = dict(target.mesh.shape)
        fits = True
        for axis, entry in enumerate(target.spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            parts = int(np.prod([sizes[n] for n in names if n is not None], dtype=np.int64))
            fits = fits and shape[axis] % parts == 0
        if fits:
            return target
    return NamedSharding(target.mesh, PartitionSpec(), memory_kind=target.memory_kind)


def held_whole_bytes(sharding: Any, aval: Any, mesh: Mesh, axis: str) -> int:
    """Bytes per device of a variable of ``aval`` in ``sharding`` held whole along mesh ``axis``
    though one of its dimensions not yet split could be split over it (0 if the axis splits it
    already, or none could).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((4, 2), ("data", "tensor"))
        >>> w = jax.ShapeDtypeStruct((8, 6), jnp.float32)
        >>> (held_whole_bytes(P("data"), w, mesh, "tensor"),
        ...  held_whole_bytes(P("data", "tensor"), w, mesh, "tensor"))
        (48, 0)
    """
    spec = tuple(getattr(sharding, "spec", sharding) or ())
    if axis in jax.tree.leaves(spec):
        return 0
    shape, size = tuple(np.shape(aval)), mesh.shape[axis]
    entries = [spec[i] if i < len(spec) else None for i in range(len(shape))]
    if not any(e is None and d % size == 0 for e, d in zip(entries, shape, strict=True)):
        return 0
    parts = 1
    for entry in entries:
        for name in jax.tree.leaves(entry):
            parts *= mesh.shape[name]
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize // parts


class IdleAxisWarning(UserWarning):
    """A model axis of a strategy's mesh splits none of a program's variables (checked once per
    compiled step, and by `ShardedStrategy.create_variables`).

    A batch is whole along a model axis, so unless model code splits activations over it
    (``nn.with_logical_constraint``), its devices compute the same thing: map a logical name to it
    in ``logical_axis_rules``, name it in a layout rule or ``nn.with_partitioning``, or make it a
    batch axis.

    Examples:
        >>> import warnings, jax, jax.numpy as jnp, jaxdist as jd
        >>> s = jd.ShardedStrategy(mesh=jax.make_mesh((4, 2), ("data", "tensor")),
        ...                        batch_axes="data")
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = s.create_variables(lambda: {"w": jnp.zeros((8, 8))})
        >>> [type(w.message).__name__ for w in caught]
        ['IdleAxisWarning']
    """


class LayoutPolicy:
    """Mesh, axis roles and the layout of every variable, batch and output of one strategy.

    Args:
        devices: the devices, in replica order (the short form; None with ``mesh``).
        model_parallelism: devices per replica along a ``"model"`` mesh axis (the short-form mesh is
            then ``(replica, model)``; a replica's devices hold one model copy).
        mesh: the user's own `jax.sharding.Mesh` instead of ``devices`` (any axis names; see
            `jaxdist.strategies.layout._meshes`).
        batch_axes: with ``mesh``, the axes a batch's rows are split over.
        fsdp_axes: with ``mesh``, the batch axes the FSDP rule splits variables over (default:
            ``batch_axes``).
        split_variables: whether unannotated variables are split over the FSDP axes or mirrored.
        min_shard_size: with ``split_variables``, variables with fewer elements stay mirrored.
        layout_rules: ``[(regex, PartitionSpec), ...]`` overriding the variable rule for matching
            paths.
        logical_axis_rules: Flax logical axis rules for annotated variables (and activations in
            traced steps).
        activation_axes: logical names only activations use.
        sequence_axis: which dimension of a batch leaf is its sequence (split over the context
            axes).
        host_offload: ``"opt_state"``, ``"params"``, ``"all"`` or None: which variables live in host
            memory.
        role_arguments: for each role of `jaxdist.strategies.layout._meshes.ROLES`, ``<name>_axes=``
            (with ``mesh``: its axes) or ``<short_form>=k`` (the short form: its axis of size
            ``k``): ``context_axes`` / ``context_parallelism`` (a batch's sequence split),
            ``stage_axes`` / ``pipeline_parallelism`` (pipeline stages), ``expert_axes`` /
            ``expert_parallelism`` (the stacked experts of `jaxdist.nn.MoE`).

    Raises:
        TypeError: for a keyword that is no role's argument.
        ValueError: for ``model_parallelism`` that does not divide the devices, bad axis roles, a
            malformed rule or one naming an axis the mesh lacks, or an unknown ``host_offload``.

    Examples:
        >>> import jax, jaxdist as jd
        >>> policy = jd.strategies.LayoutPolicy(jax.devices()[:4], split_variables=True,
        ...                                     min_shard_size=1)
        >>> w = jax.ShapeDtypeStruct((4, 8), "float32")
        >>> policy.num_replicas, policy.variable_layout("w", w).spec
        (4, P(None, 'replica'))
        >>> hsdp = jd.strategies.LayoutPolicy(mesh=jax.make_mesh((2, 4), ("data", "fsdp")),
        ...                                   batch_axes=("data", "fsdp"), fsdp_axes=("fsdp",),
        ...                                   split_variables=True, min_shard_size=1)
        >>> w = jax.ShapeDtypeStruct((8, 4), "float32")
        >>> hsdp.num_replicas, hsdp.batch_sharding.spec, hsdp.variable_layout("w", w).spec
        (8, P(('data', 'fsdp'),), P('fsdp',))
    """

    def __init__(self, devices: Sequence[jax.Device] | None = None, model_parallelism: int = 1, *,
                 mesh: Mesh | None = None, batch_axes: str | Sequence[str] | None = None,
                 fsdp_axes: str | Sequence[str] | None = None, split_variables: bool = False,
                 min_shard_size: int = 1024,
                 layout_rules: Sequence[tuple[str, PartitionSpec]] | None = None,
                 logical_axis_rules: Sequence[tuple[str, Any]] | None = None,
                 activation_axes: Sequence[str] = (), host_offload: str | None = None,
                 sequence_axis: int = 1, **role_arguments: Any):
        # Each role (meshes.ROLES) is named by its axes on a user's mesh (<name>_axes=), or sized by
        # its short form (<short_form>=k) on the strategy's own.
        check_role_keywords("LayoutPolicy", role_arguments,
                            [n for r in ROLES for n in (r.argument, r.short_form)],
                            "besides the parameters it lists, it takes the roles' arguments")
        role_axes = {r.argument: role_arguments[r.argument] for r in ROLES
                     if role_arguments.get(r.argument) is not None}
        short = {r.short_form: role_arguments.get(r.short_form, 1) for r in ROLES}
        if mesh is None:
            named = {"batch_axes": batch_axes, "fsdp_axes": fsdp_axes, **role_axes}
            named = {k: v for k, v in named.items() if v is not None}
            if named:
                forms = ", ".join(f"{r.short_form}=k adds {r.axis!r}" for r in ROLES)
                raise ValueError(f"{' / '.join(f'{k}={v!r}' for k, v in named.items())} name axes "
                                 "of a mesh: pass mesh= too (without it the strategy builds its "
                                 f"own: ('replica',); model_parallelism=k adds 'model', {forms}).")
            if devices is None:
                raise ValueError("LayoutPolicy needs devices= or mesh=.")
            # The short form: an axis exists only when asked for ("model" for rules to split over).
            mesh = short_form_mesh(devices, model_parallelism, **short)
            present = {r: (r.axis,) for r in ROLES if r.axis in mesh.axis_names}
            batch = (REPLICA_AXIS, *(axis for r, axes in present.items() if r.batch
                                     for axis in axes))
            roles = axis_roles(mesh, batch, None if split_variables else (), split=True,
                               **{r.argument: axes for r, axes in present.items()})
        else:
            if devices is not None or model_parallelism != 1:
                raise ValueError(f"mesh= and devices= / model_parallelism={model_parallelism!r} "
                                 "both given: a user mesh already says which devices and axes; "
                                 "pass only mesh=, batch_axes= and fsdp_axes=.")
            for role in ROLES:
                if short[role.short_form] != 1:
                    raise ValueError(f"mesh= and {role.short_form}={short[role.short_form]!r} both "
                                     f"given: on a user mesh, name its {role.name} axes with "
                                     f"{role.name}_axes=({role.axis!r},) (its own names) instead.")
            roles = axis_roles(mesh, batch_axes, fsdp_axes, split=split_variables, **role_axes)
        if (not isinstance(sequence_axis, int) or isinstance(sequence_axis, bool)
                or sequence_axis < 1):
            raise ValueError(f"sequence_axis={sequence_axis!r} must be an int >= 1: the dimension "
                             "of a batch leaf that holds its sequence (axis 0 holds its rows), "
                             "e.g. 1 for (batch, length, ...).")
        self.roles = roles
        """The axis roles (`jaxdist.strategies.layout._meshes.AxisRoles`): batch, FSDP, model..."""
        self.mesh = roles.mesh
        # a plan mesh (jd.plan_mesh, an AbstractMesh) has no devices: its strategies never run
        self.devices = (() if isinstance(roles.mesh, jax.sharding.AbstractMesh)
                        else tuple(roles.mesh.devices.flat))
        self.host_offload = parse_host_offload(host_offload, self.devices)
        self.batch_axes = roles.batch_axes
        """The mesh axes a batch's rows are split over."""
        self.replica_axis = roles.replica_axis
        """The batch axes as one name (or a tuple of names): a `PartitionSpec` entry and ``run``'s
        default ``axis_name``."""
        self.context_axes = roles.context_axes
        """The mesh axes a batch's sequence dimension is split over (context parallelism)."""
        self.sequence_axis = sequence_axis
        """The dimension of a batch leaf that the context axes split (1: ``(batch, length,
        ...)``)."""
        self.expert_axes = roles.expert_axes
        """The batch axes the stacked experts of mixture-of-experts layers are split over."""
        self.rules = VariableRules(roles, split=split_variables, min_shard_size=min_shard_size,
                                   layout_rules=layout_rules or (),
                                   logical_axis_rules=logical_axis_rules or (),
                                   activation_axes=activation_axes)
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec(self.replica_axis))
        """The layout of per-replica values and of batch leaves of rank 1 (or, without context axes,
        of any rank: `batch_layout`): axis 0 split over the replicas."""
        self._sequence_sharding = NamedSharding(self.mesh, PartitionSpec(
            self.replica_axis, *[None] * (sequence_axis - 1), roles.entry("context"))
        ) if self.context_axes else None
        self.replicated_sharding = replicated(self.mesh)
        """The layout of mirrored values: a whole copy on every device."""
        self._reported_idle: set[str] = set()  # model axes already reported (once each)
        self._variable_hook: Any = None  # a strategy's override of variable_layout (see use_hooks)
        self._role_hook: Any = None  # a strategy's override of layout_role (see use_hooks)
        self._batch_hook: Any = None  # a strategy's override of batch_layout (see use_hooks)

    def batch_layout(self, ndim: int, shape: Sequence[int] | None = None) -> jax.sharding.Sharding:
        """The layout of a batch leaf of rank ``ndim`` (and ``shape``, where known), for every
        caller that places a batch: a strategy's ``batch_layout`` hook (`use_hooks`) where it has
        one (given the shape, a dimension None where unknown), else `rule_batch_layout`.

        Examples:
            >>> import jax, jaxdist as jd
            >>> jd.strategies.LayoutPolicy(jax.devices()[:2]).batch_layout(2, (8, 3)).spec
            P('replica',)
        """
        if self._batch_hook is not None:
            return self._batch_hook(tuple(shape) if shape is not None else (None,) * ndim)
        return self.rule_batch_layout(ndim, shape)

    def rule_batch_layout(self, ndim: int, shape: Sequence[int] | None = None) -> NamedSharding:
        """The layout this policy's axes give a batch leaf of rank ``ndim``: rows split over the
        batch axes, and with context axes, the sequence dimension (``sequence_axis``) of a leaf that
        has one split over them (a leaf of ``shape`` whose sequence dimension has size 1, a
        broadcast one, stays whole along it).

        Examples:
            >>> import jax, jaxdist as jd
            >>> cp = jd.strategies.LayoutPolicy(mesh=jax.make_mesh((2, 4), ("data", "context")),
            ...                                 batch_axes="data", context_axes="context")
            >>> cp.rule_batch_layout(2).spec, cp.rule_batch_layout(1).spec
            (P('data', 'context'), P('data',))
        """
        if self._sequence_sharding is not None and ndim > self.sequence_axis and (
                shape is None or shape[self.sequence_axis] != 1):
            return self._sequence_sharding
        return self.batch_sharding

    @property
    def context_size(self) -> int:
        """How many parts the context axes split a sequence into (1: no context parallelism)."""
        return self.roles.size(self.context_axes)

    # ------------------------------------------------------------------------------------- topology
    @functools.cached_property
    def num_replicas(self) -> int:
        """How many replicas (the product of the batch axes' sizes)."""
        return self.roles.size(self.batch_axes)

    @property
    def replica_devices(self) -> tuple[jax.Device, ...]:
        """The first device of each replica, in replica order (the order of a batch's rows)."""
        order = [self.mesh.axis_names.index(a)
                 for a in (*self.batch_axes, *self.context_axes, *self.roles.model_axes)]
        return tuple(np.transpose(self.mesh.devices, order).reshape(self.num_replicas, -1)[:, 0])

    @property
    def local_replicas(self) -> tuple[int, ...]:
        """The replicas (row blocks of a batch) this process's devices hold, in replica order."""
        blocks = self.batch_sharding.addressable_devices_indices_map((self.num_replicas,)).values()
        return tuple(sorted({index[0].start or 0 for index in blocks}))

    @property
    def replicas_span_processes(self) -> bool:
        """Whether a replica's devices belong to several processes (a model axis across processes):
        then no process owns a replica's rows alone."""
        owners: dict[int, set[int]] = {}
        for device, index in self.batch_sharding.devices_indices_map((self.num_replicas,)).items():
            owners.setdefault(index[0].start or 0, set()).add(device.process_index)
        return any(len(p) > 1 for p in owners.values())

    @property
    def spans_processes(self) -> bool:
        """Whether the mesh's devices belong to more than one process
        (`jaxdist.job.spans_processes`)."""
        return spans_processes(self.devices)

    @property
    def splits_variables(self) -> bool:
        """Whether variables can be split (FSDP, tensor parallelism): then a `jit` step that
        receives no distributed batch gathers them at entry (protection against an XLA Shardy
        partitioner miscompute of conv nets with split kernels and a replicated batch)."""
        return self.rules.split or any(self.mesh.shape[a] > 1 for a in self.roles.model_axes)

    # ------------------------------------------------------------------------------------ variables
    def variable_layout(self, path: str, aval: jax.ShapeDtypeStruct,
                        annotation: Partitioned | None = None) -> NamedSharding:
        """The layout of the variable at ``path`` (``"params/Dense_0/kernel"``) of ``aval``.

        Args:
            path: the variable's pytree path, ``/``-joined (what layout rules match).
            aval: its shape and dtype.
            annotation: the Flax partitioning box around it, when the model annotated it.

        Every caller that places a variable comes here, so a strategy's ``variable_layout`` hook
        (`use_hooks`) decides for all of them.

        Raises:
            ValueError: when a rule or annotation does not fit the variable.
        """
        if self._variable_hook is not None:
            return own(self._variable_hook(path, aval, annotation))
        return own(self.rule_layout(path, aval, annotation))

    def rule_layout(self, path: str, aval: jax.ShapeDtypeStruct,
                    annotation: Partitioned | None = None) -> NamedSharding:
        """The layout this policy's rules give the variable at ``path`` (what `variable_layout`
        returns unless a strategy overrides it).

        Examples:
            >>> import jax, jaxdist as jd
            >>> policy = jd.strategies.LayoutPolicy(jax.devices()[:2], split_variables=True,
            ...                                     min_shard_size=1)
            >>> policy.rule_layout("w", jax.ShapeDtypeStruct((4, 8), "float32")).spec
            P(None, 'replica')
        """
        return NamedSharding(self.mesh, self.rules.spec(path, tuple(np.shape(aval)), annotation,
                                                        getattr(aval, "dtype", None)))

    def use_hooks(self, variable_layout: Any = None, layout_role: Any = None,
                  batch_layout: Any = None) -> None:
        """Install a strategy's overrides of its layout hooks: ``variable_layout(path, aval,
        annotation) -> Sharding`` then decides every variable's layout, ``batch_layout(shape) ->
        Sharding`` every batch leaf's, ``layout_role(x) -> str | None`` every placed value's role.

        Examples:
            >>> import jax, jaxdist as jd
            >>> policy = jd.strategies.LayoutPolicy(jax.devices()[:2])
            >>> policy.use_hooks(
            ...     variable_layout=lambda path, aval, annotation=None: policy.batch_sharding)
            >>> policy.variable_layout("w", jax.ShapeDtypeStruct((4,), "float32")).spec
            P('replica',)
        """
        if batch_layout is not None:
            self._batch_hook = batch_layout
        if variable_layout is not None:
            self._variable_hook = variable_layout
        if layout_role is not None:
            self._role_hook = layout_role

    def variable_shardings(self, shapes: Any) -> Any:
        """The layout of each variable of ``shapes`` (arrays or `jax.ShapeDtypeStruct`s; Flax boxes
        and nnx Variables kept around their sharding), inside ``colocate_vars_with`` the target's,
        with offloaded variables in host memory."""

        def one(path, leaf):
            if is_box(leaf):  # the path of the box, not of its ".value"
                return leaf.replace_boxed(
                    self.variable_layout(path_name(path), leaf.value, annotation=leaf))
            # an nnx Variable: laid out by its metadata, kept around its layout
            if is_variable(leaf):
                box = annotation(leaf, self.mesh.axis_names)
                return leaf.replace(self.variable_layout(path_name(path), leaf.get_value(),
                                                         annotation=box))
            return self.variable_layout(path_name(path), leaf)

        layouts = jax.tree_util.tree_map_with_path(one, shapes, is_leaf=is_annotated)
        target = ambient.colocation_target(self)
        if target is not None:
            return jax.tree.map(lambda _, aval: own(colocated_layout(target, aval)), layouts,
                                shapes)
        return jax.tree.map(own, offload_shardings(self.host_offload, shapes, layouts))

    # ---------------------------------------------------------------------------------------- roles
    @property
    def roles_by_layout(self) -> bool:
        """True when `layout_role` is a function of an array's layout alone (no strategy hook, and
        variables never split like a batch, where which arrays the input functions placed decides):
        a program chosen by its arguments' layouts then also holds for their roles.

        Examples:
            >>> import jax, jaxdist as jd
            >>> jd.strategies.LayoutPolicy(jax.devices()[:2]).roles_by_layout
            True
        """
        return self._role_hook is None and not self.rules.split

    def layout_role(self, x: Any) -> str | None:
        """The role ``x``'s layout gives it: ``"batch"``, ``"variable"``, or None (it cannot tell).

        None for values not on this mesh (numpy, arrays on other devices: their role must be
        declared) and, where variables may be split over the replicas too (FSDP), for arrays split
        like a batch that the input functions did not place
        (`jaxdist.strategies.layout._roles.placed_as_batch`). A strategy's override of its
        ``layout_role`` hook decides instead (`use_hooks`).
        """
        if self._role_hook is not None:
            return self._role_hook(x)
        return self.role_from_layout(x)

    def role_from_layout(self, x: Any) -> str | None:
        """The role this policy's layouts give ``x`` (`layout_role` unless a strategy overrides it).

        Examples:
            >>> import jax, numpy as np, jaxdist as jd
            >>> policy = jd.strategies.LayoutPolicy(jax.devices()[:2])
            >>> batch = jax.device_put(np.ones((4, 2)), policy.batch_sharding)
            >>> policy.role_from_layout(batch), policy.role_from_layout(np.ones(2))
            ('batch', None)
        """
        if not is_on_mesh(x, self.mesh):
            return None
        if not self.is_batch_layout(x):
            return "variable"
        if not self.rules.split or placed_as_batch(x):
            return "batch"
        return None

    def is_batch_layout(self, x: Any) -> bool:
        """True when ``x`` is on this mesh with axis 0 split over the replicas (a batch's layout; on
        a mesh of context axes only, its sequence dimension split over them)."""
        if not self.batch_axes:
            spec = getattr(getattr(x, "sharding", None), "spec", ())
            return (is_on_mesh(x, self.mesh) and len(spec) > self.sequence_axis
                    and spec[self.sequence_axis] == self.roles.entry("context"))
        return splits_batch_axis(x, self.mesh, self.batch_axes)

    # --------------------------------------------------------------------------------------- checks
    def idle_axes(self, specs: Any) -> list[str]:
        """The model axes (size > 1) that none of ``specs`` (the `PartitionSpec`s or shardings of a
        program's variables) splits and no activation uses (through ``activation_axes``)."""
        model = [a for a in self.roles.model_axes if self.mesh.shape[a] > 1]
        if not model:
            return []
        used = {n for s in specs for n in jax.tree.leaves(tuple(getattr(s, "spec", s) or ()))}
        rules = self.rules
        used |= {a for name, axes in rules.logical_axis_rules if name in rules.activation_axes
                 for a in jax.tree.leaves(axes)}  # activations declared to use it
        return [a for a in model if a not in used]

    def warn_idle_axes(self, specs: Any, what: str, names: Sequence[str] = (),
                       avals: Sequence[Any] = ()) -> None:
        """Warn once per axis (`IdleAxisWarning`) of each model axis ``specs`` leave idle.

        Args:
            specs: the layouts of the program's variables.
            what: how the message names them ("the variables created here", "the step's variables").
            names: a few of the variables, for the message.
            avals: the variables' shapes and dtypes (same order as ``specs``): the message then says
                how many bytes per device are held whole along the idle axis though it could split
                them.
        """
        idle = [a for a in self.idle_axes(specs) if a not in self._reported_idle]
        if not idle:
            return
        self._reported_idle.update(idle)
        axis, size = idle[0], self.mesh.shape[idle[0]]
        some = f" (e.g. {', '.join(names[:3])})" if names else ""
        if axis in self.roles.stage_axes:
            warnings.warn(
                f"stage axis {axis!r} (size {size}) splits none of {what}{some}: the model has no "
                "pipeline layer (jd.nn.Pipeline, whose stacked layer parameters carry the logical "
                "axis 'layers'), so the stage devices are idle: they hold and compute the same "
                "thing. Put the model's stack of identical blocks in jd.nn.Pipeline(block=..., "
                "num_layers=..., num_microbatches=...), or drop stage_axes (pipeline_parallelism).",
                IdleAxisWarning, stacklevel=4)
            return
        held = sum(held_whole_bytes(s, a, self.mesh, axis)
                   for s, a in zip(specs, avals, strict=False))
        if held:
            some += (f"; {format_bytes(held)} per device of them could be split {size} ways along "
                     "it but are held whole on each of its devices")
        warnings.warn(
            f"mesh axis {axis!r} (size {size}) is not in batch_axes={self.batch_axes} and splits "
            f"none of {what}{some}: a batch is whole along it, so its devices compute the same "
            "thing. Annotate variables with it (nnx.with_partitioning / nn.with_partitioning, e.g. "
            f"(None, {axis!r})), map a logical name to it in logical_axis_rules (e.g. ('mlp', "
            f"{axis!r})), name it in a layout rule, declare activation names that use it "
            "(activation_axes=...), or add it to batch_axes.", IdleAxisWarning, stacklevel=4)

    # ------------------------------------------------------------------------------------- contexts
    def flax_rules(self) -> contextlib.AbstractContextManager[Any]:
        """Flax's logical axis rules set to this policy's (nothing without rules)."""
        rules = self.rules.logical_axis_rules
        return nn.logical_axis_rules(rules) if rules else contextlib.nullcontext()

    @contextlib.contextmanager
    def tracing_scope(self):
        """What a step is traced in: this mesh as JAX's abstract mesh (so ``P(...)`` specs,
        ``out_sharding=`` and ``jax.shard_map`` in model code name its axes, as under the user's own
        ``jax.set_mesh``) and the logical rules (``nn.with_logical_constraint`` lays out
        activations; without rules Flax leaves them alone)."""
        with jax.sharding.use_abstract_mesh(trace_mesh(self.mesh).abstract_mesh), self.flax_rules():
            yield

    @contextlib.contextmanager
    def shape_scope(self):
        """What a user's model and losses are evaluated in for their shapes alone, outside any
        program (the Trainer's loss check and state shapes, a restore's target): `tracing_scope`'s
        mesh and logical rules, with the mesh's Explicit axes Auto (a shape never depends on axis
        types: `jaxdist.strategies.layout.shape_scope`), on this mesh whatever mesh the caller set
        (`call_scope`). Arrays entering it pass through `untyped`.

        Examples:
            >>> import jax, jaxdist as jd
            >>> from jax.sharding import PartitionSpec as P
            >>> policy = LayoutPolicy(jax.devices()[:2])
            >>> with policy.shape_scope():
            ...     jax.eval_shape(lambda x: jax.lax.with_sharding_constraint(x, P("replica")),
            ...                    jax.numpy.ones(4))
            ShapeDtypeStruct(shape=(4,), dtype=float32)
        """
        with self.call_scope(), shape_scope(self.mesh), self.flax_rules():
            yield

    def call_scope(self, args: Any = ()) -> contextlib.AbstractContextManager[Any]:
        """What a compiled call of this policy's programs runs under: this mesh as JAX's context
        mesh when the caller set another one (``jax.set_mesh`` at import, as Flax's MiniGPT does;
        ``scope()`` sets this one), so the step is traced on the strategy's mesh whatever the user
        set outside; nothing otherwise (one thread-local read per call).

        Args:
            args: the call's arguments: a call inside another trace (a tracer among them) cannot
                change the context mesh; it keeps a mesh of the same size (``tracing_scope`` renames
                it), and another size is an error.

        Raises:
            ValueError: for a call inside another ``jax.jit`` while a mesh of another size is set.

        Examples:
            >>> import jax, jaxdist as jd
            >>> policy = LayoutPolicy(jax.devices()[:2])
            >>> with jax.set_mesh(jax.make_mesh((1,), ("other",), devices=jax.devices()[:1])):
            ...     with policy.call_scope():
            ...         dict(jax.sharding.get_abstract_mesh().shape)
            {'replica': 2}
        """
        if isinstance(self.mesh, jax.sharding.AbstractMesh):  # compiles in a process of its own
            return contextlib.nullcontext()
        current = jax.sharding.get_abstract_mesh()
        if current.empty or current == self.mesh.abstract_mesh:
            return contextlib.nullcontext()
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            if current.size == self.mesh.size:
                return contextlib.nullcontext()
            raise ValueError("this strategy's step was called inside another jax.jit while a mesh "
                             f"of {current.size} devices ({dict(current.shape)}) is JAX's context "
                             f"mesh; the strategy's mesh has {self.mesh.size} "
                             f"({dict(self.mesh.shape)}). Call it outside that jit, or inside "
                             "`with strategy.scope():` (its mesh becomes the context mesh), or "
                             "build the strategy on that mesh (mesh=...).")
        return jax.set_mesh(self.mesh)

    def __repr__(self) -> str:
        return (f"LayoutPolicy(mesh={dict(self.mesh.shape)}, batch_axes={self.batch_axes}, "
                f"fsdp_axes={self.roles.fsdp_axes}, split_variables={self.rules.split})")
