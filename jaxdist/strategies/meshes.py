"""Meshes and the roles of their axes: the short form (``"replica"`` x ``"model"``) or the user's own mesh.

A strategy's mesh has two kinds of axes:

* **batch axes**: a batch's rows are split over them (together, in order), and ``num_replicas_in_sync`` is
  the product of their sizes. A subset of them, the **FSDP axes**, are the axes the FSDP rule splits
  unannotated variables over: all of them is ZeRO-3 over the whole data-parallel group; a subset is HSDP
  (shard within a host, replicate across hosts: ``batch_axes=("data", "fsdp")``, ``fsdp_axes=("fsdp",)``).
* **context axes** (context parallelism): a batch's sequence dimension (axis 1 unless declared) is split over
  them, its rows are not. A replica (one model copy on one slice of the batch) spans them, so
  ``num_replicas_in_sync`` leaves them out. The FSDP rule splits variables over them too by default (their
  devices would otherwise hold the same weights: MaxText does the same).
* **expert axes** (expert parallelism): a subset of the batch axes over which the stacked experts of a
  mixture-of-experts layer (`jaxdist.nn.MoE`, logical name ``"expert"``) are split; tokens travel to their
  experts' devices by all-to-all inside the layer. Outside expert layers they split the batch like any batch
  axis ("dp2ep"), and the FSDP rule splits other variables over them unless ``fsdp_axes`` leaves them out.
* **model axes**: every other axis. Only layout rules and annotations split variables over them (tensor
  parallelism); a batch is whole along them. **Stage axes** among them lay out pipeline stages.

Each role gives logical axis names a meaning (`AxisRoles.logical_rules`): ``"length"`` (and ``"batch"``) the
context axes, ``"layers"`` the stage axes, ``"expert"`` / ``"exp"`` the expert axes. They are appended to the
user's ``logical_axis_rules`` wherever those do not name them.

The short form builds ``("replica",)`` or ``("replica", "model")`` from a device list and
``model_parallelism``. A user's mesh (``jax.make_mesh``, ``mesh_utils.create_hybrid_device_mesh``, by hand)
is kept as it is: its axis names, device order AND axis types. Code written for it depends on them: on
``Explicit`` axes (``jax.make_mesh``'s default) a value's layout is part of its type, and model code annotates
(``out_sharding=``, ``jax.reshard``, ``jax.shard_map`` with specs that match its inputs' types).

The meshes jaxdist builds itself (the short form) have ``Auto`` axes, deliberately: there XLA propagates
layouts through unannotated code, so an unmodified single-device step compiles as it is. On ``Explicit`` axes
the same step can be refused by JAX: an embedding lookup (``jnp.take`` of a whole table with indices whose rows
are split over the batch axis) asks for an ``out_sharding`` the single-device code does not give.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from jaxdist.replicate.layouts import MODEL_AXIS, REPLICA_AXIS

__all__ = ["CONTEXT_AXIS", "EXPERT_AXIS", "EXPERT_NAMES", "LAYERS", "ROLES", "STAGE_AXIS", "AxisRoles", "Role",
           "axis_roles", "short_form_mesh"]

CONTEXT_AXIS = "context"
"""The context axis of the short-form mesh (``ShardedStrategy(context_parallelism=N)``)."""

STAGE_AXIS = "stage"
"""The pipeline-stage axis of a short-form mesh (``ShardedStrategy(pipeline_parallelism=k)``)."""

EXPERT_AXIS = "expert"
"""The expert axis of a short-form mesh (``ShardedStrategy(expert_parallelism=e)``)."""

LAYERS = "layers"
"""The logical name of the stacked layer axis (``nn.scan``'s ``metadata_params={nn.PARTITION_NAME: "layers"}``,
`jaxdist.nn.Pipeline`): split over the stage axes."""

EXPERT_NAMES = ("expert", "exp")
"""The logical names of the stacked expert axis (`jaxdist.nn.MoE`; MaxText's ``"exp"``): split over the expert
axes."""


@dataclasses.dataclass(frozen=True)
class Role:
    """A role mesh axes take besides the batch and model roles: one entry of `ROLES` gives it its argument on a
    user's mesh (``<name>_axes=``), its short form (``<short_form>=k``: an axis ``axis`` of size ``k`` on the
    strategy's own mesh) and the logical axis names that map to its axes (`AxisRoles.logical_rules`). How its
    axes relate to the batch axes is checked in `axis_roles`."""

    name: str
    short_form: str
    axis: str
    logical: tuple[str, ...]


ROLES = (
    Role("stage", "pipeline_parallelism", STAGE_AXIS, (LAYERS,)),
    Role("expert", "expert_parallelism", EXPERT_AXIS, EXPERT_NAMES),
    Role("context", "context_parallelism", CONTEXT_AXIS, ("length",)),
)
"""Every role besides batch and model, in the short-form mesh's axis order around ``"replica"``: ``"stage"``
outermost (slowest links), then ``"replica"``, ``"expert"``, ``"context"`` and ``"model"`` innermost."""


def short_form_mesh(
    devices: Sequence[jax.Device], model_parallelism: int = 1, context_parallelism: int = 1,
    pipeline_parallelism: int = 1, expert_parallelism: int = 1,
) -> Mesh:
    """The strategy's own mesh over ``devices``: ``("replica",)``, with an axis of size ``k`` for each
    ``<role>_parallelism=k > 1`` (`ROLES`) and ``"model"`` for ``model_parallelism=k > 1``, in the order
    ``stage, replica, expert, context, model`` (``"model"``'s ``k`` consecutive devices hold one model copy;
    stage ``i`` is the ``i``-th block of ``N / p`` devices). ``"replica"`` takes the devices left over.

    Raises:
        ValueError: for a ``*_parallelism`` that is not an int >= 1 dividing the device count, or several whose
            product does not.

    Examples:
        >>> import jax
        >>> dict(short_form_mesh(jax.devices()[:8], 2).shape)
        {'replica': 4, 'model': 2}
        >>> dict(short_form_mesh(jax.devices()[:8], context_parallelism=4).shape)
        {'replica': 2, 'context': 4}
        >>> dict(short_form_mesh(jax.devices()[:8], pipeline_parallelism=4).shape)
        {'stage': 4, 'replica': 2}
        >>> dict(short_form_mesh(jax.devices()[:8], 2, pipeline_parallelism=2, expert_parallelism=2).shape)
        {'stage': 2, 'replica': 1, 'expert': 2, 'model': 2}
    """
    devices = tuple(devices)
    n = len(devices)
    sizes = {"model_parallelism": model_parallelism, "context_parallelism": context_parallelism,
             "expert_parallelism": expert_parallelism, "pipeline_parallelism": pipeline_parallelism}
    axis = {"model_parallelism": MODEL_AXIS, **{r.short_form: r.axis for r in ROLES}}
    for name, k in sizes.items():
        if not isinstance(k, int) or isinstance(k, bool) or k < 1 or n % k:
            raise ValueError(
                f"{name}={k!r} must be an int >= 1 that divides the {n} devices (the mesh's {axis[name]!r} axis: the "
                f"'replica' axis takes the devices left over)."
            )
    asked = {name: k for name, k in sizes.items() if k > 1}
    if n % math.prod(asked.values()):
        raise ValueError(
            f"{' x '.join(f'{name}={k}' for name, k in asked.items())} must divide the {n} devices (the mesh is "
            f"({', '.join(axis[name] for name in asked)}, replica))."
        )
    order = (STAGE_AXIS, REPLICA_AXIS, EXPERT_AXIS, CONTEXT_AXIS, MODEL_AXIS)
    shape = {axis[name]: k for name, k in asked.items()}
    shape[REPLICA_AXIS] = n // math.prod(asked.values())
    names = tuple(a for a in order if a in shape)
    grid = np.array(devices).reshape([shape[a] for a in names])
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


class AxisRoles:
    """A mesh and the role of each of its axes (see the module doc).

    Attributes:
        mesh: the mesh (the user's, as it is: names, device order, axis types).
        batch_axes: the axes a batch's rows are split over, in order.
        fsdp_axes: the batch (and context) axes the FSDP rule splits variables over (empty: none).
        context_axes: the axes a batch's sequence dimension is split over (empty: none).
        model_axes: every other axis, in mesh order.
        stage_axes: the model axes that pipeline stages are laid out over (empty: no pipeline).
        expert_axes: the batch axes that the stacked experts of a mixture-of-experts layer are split over.
    """

    def __init__(self, mesh: Mesh, batch_axes: tuple[str, ...], fsdp_axes: tuple[str, ...],
                 context_axes: tuple[str, ...] = (), stage_axes: tuple[str, ...] = (),
                 expert_axes: tuple[str, ...] = ()):
        self.mesh = mesh
        self.batch_axes = batch_axes
        self.fsdp_axes = fsdp_axes
        self.context_axes = context_axes
        self.model_axes = tuple(a for a in mesh.axis_names if a not in batch_axes and a not in context_axes)
        self.stage_axes = stage_axes
        """The model axes pipeline stages are laid out over (`jaxdist.nn.Pipeline`): the logical axis
        ``"layers"`` of stacked layer parameters is split over them."""
        self.expert_axes = expert_axes
        """The batch axes the stacked experts are split over (`jaxdist.nn.MoE`: logical axis ``"expert"``)."""

    @property
    def logical_rules(self) -> tuple[tuple[str, Any], ...]:
        """The logical axis names the roles give a meaning, as Flax rules ``(name, mesh axes)``: appended to a
        strategy's ``logical_axis_rules`` wherever those do not name them (a user's rule wins).

        Examples:
            >>> import jax
            >>> roles = axis_roles(jax.make_mesh((2, 4), ("data", "expert")), ("data", "expert"), split=True,
            ...                    expert_axes="expert")
            >>> roles.logical_rules
            (('expert', 'expert'), ('exp', 'expert'))
        """
        rules = [(name, _entry(self.axes(role.name))) for role in ROLES if self.axes(role.name)
                 for name in role.logical]
        if self.context_axes:  # Flax lm1b / MaxText activation names: activations stay split along the sequence
            rules.append(("batch", self.replica_axis))
        return tuple(rules)

    def axes(self, role: str) -> tuple[str, ...]:
        """The axes of ``role`` (``"batch"``, ``"fsdp"``, ``"model"`` or a `ROLES` name)."""
        return getattr(self, f"{role}_axes")

    @property
    def replica_axis(self) -> str | tuple[str, ...] | None:
        """The batch axes as JAX names them in a `PartitionSpec` entry or a collective's ``axis_name``: one
        name, or the tuple of several (None: no batch axis, a mesh of context axes only)."""
        if not self.batch_axes:  # context parallelism alone: one replica, whole rows
            return None
        return self.batch_axes[0] if len(self.batch_axes) == 1 else self.batch_axes

    @property
    def fsdp_entry(self) -> str | tuple[str, ...] | None:
        """The FSDP axes as one `PartitionSpec` entry (None: no FSDP axis)."""
        return _entry(self.fsdp_axes)

    @property
    def context_entry(self) -> str | tuple[str, ...] | None:
        """The context axes as one `PartitionSpec` entry (None: no context axis)."""
        return _entry(self.context_axes)

    def size(self, axes: Sequence[str]) -> int:
        """The product of the sizes of ``axes``."""
        return int(np.prod([self.mesh.shape[a] for a in axes], dtype=np.int64))

    @property
    def stage_entry(self) -> str | tuple[str, ...] | None:
        """The stage axes as one `PartitionSpec` entry (None: no stage axis)."""
        return _entry(self.stage_axes)

    @property
    def expert_entry(self) -> str | tuple[str, ...] | None:
        """The expert axes as one `PartitionSpec` entry (None: no expert axis)."""
        return _entry(self.expert_axes)

    @property
    def explicit_axes(self) -> tuple[str, ...]:
        """The mesh axes of type ``Explicit`` (a value's layout over them is part of its type)."""
        return tuple(a for a, t in zip(self.mesh.axis_names, self.mesh.axis_types, strict=True)
                     if t == AxisType.Explicit)


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    """``axes`` as one `PartitionSpec` entry: None, one name, or the tuple of several."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _names(value: Any, argument: str, mesh: Mesh) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{argument}={value!r} must be a mesh axis name or a sequence of them, e.g. ('data', 'fsdp').")
    names = tuple(names)
    for name in names:
        if name not in mesh.axis_names:
            raise ValueError(f"{argument}={value!r} names axis {name!r}, but the mesh axes are {mesh.axis_names}.")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{argument}={value!r} lists axis {twice[0]!r} twice: name each axis once.")
    return names


def axis_roles(
    mesh: Any, batch_axes: Any = None, fsdp_axes: Any = None, *, split: bool, strategy: str = "ShardedStrategy",
    context_axes: Any = None, stage_axes: Any = (), expert_axes: Any = (),
) -> AxisRoles:
    """Validate a user's ``mesh`` and the roles given to its axes.

    Args:
        mesh: a `jax.sharding.Mesh` (any axis names, any devices of any processes).
        batch_axes: the axes a batch's rows are split over; None: the mesh's only axis, or for a mirroring
            strategy (``split=False``) every axis.
        fsdp_axes: the batch (and context) axes the FSDP rule splits variables over; None: ``batch_axes``
            and ``context_axes`` when ``split``, else none.
        split: whether the strategy splits variables (Sharded) or keeps them whole (Mirrored, TPU).
        strategy: the strategy's name, for error messages.
        context_axes: the axes a batch's sequence dimension is split over (context parallelism); None: none.
        stage_axes: the axes pipeline stages are laid out over (model axes: not batch axes).
        expert_axes: the batch axes the stacked experts of mixture-of-experts layers are split over.

    Raises:
        TypeError: when ``mesh`` is not a `jax.sharding.Mesh`.
        ValueError: for an axis the mesh lacks, an axis named twice, FSDP axes that are not batch axes, a
            mirroring strategy given model axes, a multi-axis mesh without ``batch_axes``, or a stage axis that
            is also a batch axis.

    Examples:
        >>> import jax
        >>> mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
        >>> roles = axis_roles(mesh, ("data", "fsdp"), ("fsdp",), split=True)
        >>> roles.replica_axis, roles.fsdp_axes, roles.model_axes
        (('data', 'fsdp'), ('fsdp',), ('tensor',))
        >>> cp = axis_roles(jax.make_mesh((2, 4), ("data", "context")), "data", split=True, context_axes="context")
        >>> cp.context_axes, cp.fsdp_axes, cp.model_axes
        (('context',), ('data', 'context'), ())
    """
    if not isinstance(mesh, (Mesh, AbstractMesh)):  # an AbstractMesh (jd.plan_mesh): plans only
        raise TypeError(
            f"mesh={mesh!r} (type {type(mesh).__name__}) is not a jax.sharding.Mesh: build one with "
            "jax.make_mesh((2, 4), ('data', 'fsdp')) or jax.sharding.Mesh(devices, axis_names) (or, to plan "
            "without devices, jd.plan_mesh({'data': 64, 'fsdp': 16}))."
        )
    context = _names(context_axes or (), "context_axes", mesh)
    if batch_axes is None:
        if split and len(mesh.axis_names) - len(context) > 1:
            raise ValueError(
                f"batch_axes is missing: the mesh has axes {mesh.axis_names}; name the ones a batch's rows are "
                f"split over, e.g. {strategy}(mesh=mesh, batch_axes={mesh.axis_names[:-1]!r}) (the rest are "
                "model axes, for tensor parallelism)."
            )
        batch_axes = tuple(a for a in mesh.axis_names if a not in context)
    batch = _names(batch_axes, "batch_axes", mesh)
    both = [a for a in context if a in batch]
    if both:
        raise ValueError(
            f"context_axes={context_axes!r} and batch_axes={batch!r} both name axis {both[0]!r}: a batch's rows "
            "are split over the batch axes and its sequence over the context axes; give each axis one role."
        )
    if not batch and not context:
        raise ValueError("batch_axes=() is empty: name at least one axis to split a batch's rows over.")
    if not split:
        model = [a for a in mesh.axis_names if a not in batch and a not in context]
        if model:
            raise ValueError(
                f"A mirroring strategy (Mirrored, TPU, MultiWorkerMirrored) keeps every variable whole, so mesh "
                f"axis {model[0]!r} (not in batch_axes={batch!r}) "
                "would hold copies that compute the same thing: make it a batch axis, or use "
                "ShardedStrategy(mesh=..., batch_axes=...) whose layout rules split variables over it."
            )
    fsdp = batch + context if fsdp_axes is None and split else _names(fsdp_axes or (), "fsdp_axes", mesh)
    if fsdp and not split:
        raise ValueError(f"fsdp_axes={fsdp_axes!r}: a mirroring strategy keeps variables whole; use ShardedStrategy "
                         "for FSDP.")
    outside = [a for a in fsdp if a not in batch and a not in context]
    if outside:
        raise ValueError(
            f"fsdp_axes={fsdp_axes!r} names {outside[0]!r}, which is not in batch_axes={batch!r}: FSDP splits "
            "variables over (part of) the data-parallel group; add it to batch_axes, or split variables over a "
            "model axis with layout rules / logical_axis_rules instead."
        )
    stage = _names(stage_axes or (), "stage_axes", mesh)
    if stage and not split:
        raise ValueError(f"stage_axes={stage_axes!r}: a mirroring strategy keeps every layer whole on every device; "
                         "use ShardedStrategy(mesh=..., batch_axes=..., stage_axes=...) for pipeline parallelism.")
    both = [a for a in stage if a in batch]
    if both:
        raise ValueError(
            f"stage_axes={stage_axes!r} names {both[0]!r}, which is also in batch_axes={batch!r}: a pipeline stage "
            "holds its own layers and sees the whole micro-batch, so a stage axis cannot split a batch's rows; "
            "drop it from batch_axes."
        )
    expert = _names(expert_axes or (), "expert_axes", mesh)
    if expert and not split:
        raise ValueError(f"expert_axes={expert_axes!r}: a mirroring strategy keeps every expert whole on every "
                         "device; use ShardedStrategy(mesh=..., batch_axes=..., expert_axes=...) for expert "
                         "parallelism.")
    outside = [a for a in expert if a not in batch]
    if outside:
        raise ValueError(
            f"expert_axes={expert_axes!r} names {outside[0]!r}, which is not in batch_axes={batch!r}: outside "
            "expert layers the expert axes split the batch like any batch axis (tokens are exchanged between "
            "their devices inside the layer), so they must be batch axes; add it to batch_axes (an axis that "
            "splits experts cannot also be a tensor axis)."
        )
    return AxisRoles(mesh, batch, fsdp, context, stage, expert)
