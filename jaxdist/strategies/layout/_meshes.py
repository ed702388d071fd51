"""Meshes and the roles of their axes: the short form (``"replica"`` x ``"model"``) or the user's.

A strategy's mesh has two kinds of axes:

* **batch axes**: a batch's rows are split over them (together, in order), and
  ``num_replicas_in_sync`` is the product of their sizes. A subset of them, the **FSDP axes**, are
  the axes the FSDP rule splits unannotated variables over: all of them is ZeRO-3 over the whole
  data-parallel group; a subset is HSDP (shard within a host, replicate across hosts:
  ``batch_axes=("data", "fsdp")``, ``fsdp_axes=("fsdp",)``).
* **context axes** (context parallelism): a batch's sequence dimension (axis 1 unless declared) is
  split over them, its rows are not. A replica (one model copy on one slice of the batch) spans
  them, so ``num_replicas_in_sync`` leaves them out. The FSDP rule splits variables over them too by
  default (their devices would otherwise hold the same weights: MaxText does the same).
* **expert axes** (expert parallelism): a subset of the batch axes over which the stacked experts of
  a mixture-of-experts layer (`jaxdist.nn.MoE`, logical name ``"expert"``) are split; tokens travel
  to their experts' devices by all-to-all inside the layer. Outside expert layers they split the
  batch like any batch axis ("dp2ep"), and the FSDP rule splits other variables over them unless
  ``fsdp_axes`` leaves them out.
* **model axes**: every other axis. Only layout rules and annotations split variables over them
  (tensor parallelism); a batch is whole along them; **stage axes** among them hold pipeline stages.

Each role gives logical axis names a meaning (`AxisRoles.logical_rules`): ``"length"`` (and
``"batch"``) the context axes, ``"layers"`` the stage axes, ``"expert"`` / ``"exp"`` the expert
axes. They are appended to the user's ``logical_axis_rules`` wherever those do not name them.

A role besides batch and model is one entry of `ROLES` (a `Role`), from which `axis_roles`,
`short_form_mesh`, `AxisRoles` and the `jaxdist.strategies.LayoutPolicy` derive everything; only
`jaxdist.ShardedStrategy`'s signature lists each role's two keywords by name, for readers and type
checkers.

A user's mesh (``jax.make_mesh``, ``mesh_utils.create_hybrid_device_mesh``, by hand) is kept as it
is: its axis names, device order AND axis types, which code written for it depends on (on
``Explicit`` axes, ``jax.make_mesh``'s default, a value's layout is part of its type). The short
form's meshes have ``Auto`` axes, deliberately: there XLA propagates layouts through unannotated
code, so an unmodified single-device step compiles as it is (on ``Explicit`` axes JAX can refuse it:
an embedding lookup over a split batch asks for an ``out_sharding``).
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

__all__ = ["CONTEXT_AXIS", "EXPERT_AXIS", "EXPERT_NAMES", "LAYERS", "ROLES", "STAGE_AXIS",
           "AxisRoles", "Role", "axis_roles", "check_role_keywords", "short_form_mesh"]

CONTEXT_AXIS = "context"
"""The context axis of the short-form mesh (``ShardedStrategy(context_parallelism=N)``)."""

STAGE_AXIS = "stage"
"""The pipeline-stage axis of a short-form mesh (``ShardedStrategy(pipeline_parallelism=k)``)."""

EXPERT_AXIS = "expert"
"""The expert axis of a short-form mesh (``ShardedStrategy(expert_parallelism=e)``)."""

LAYERS = "layers"
"""The logical name of the stacked layer axis (``nn.scan``'s ``metadata_params={nn.PARTITION_NAME:
"layers"}``, `jaxdist.nn.Pipeline`): split over the stage axes."""

EXPERT_NAMES = ("expert", "exp")
"""The logical names of the stacked expert axis, split over the expert axes (`jaxdist.nn.MoE`)."""


@dataclasses.dataclass(frozen=True)
class Role:
    """A role mesh axes take besides the batch and model roles. One entry of `ROLES` is the whole
    role: its argument on a user's mesh (``<name>_axes=``), its short form (``<short_form>=k``: an
    axis ``axis`` of size ``k`` on the strategy's own mesh, before ``"replica"`` when ``outer``),
    the logical axis names that map to its axes (`AxisRoles.logical_rules`) and how its axes relate
    to the batch axes (checked by `axis_roles`, ``reason`` saying why in the error), and whether it
    splits variables (``variables``: not under a mirroring strategy)."""

    name: str
    short_form: str
    axis: str
    logical: tuple[str, ...]
    batch: bool
    """True: its axes must be batch axes (they split the batch outside the role's layers); False:
    never."""
    reason: str
    outer: bool = False
    variables: bool = True
    """Whether the role splits variables over its axes (stage: layers, expert: experts), which a
    mirroring strategy cannot; context splits a batch's sequences and works with variables kept
    whole too."""

    @property
    def argument(self) -> str:
        """Its argument on a user's mesh: ``"<name>_axes"``."""
        return f"{self.name}_axes"


ROLES = (
    Role("stage", "pipeline_parallelism", STAGE_AXIS, (LAYERS,), batch=False, outer=True, reason=(
        "a pipeline stage holds its own layers and sees the whole micro-batch, so a stage axis "
        "cannot split a batch's rows; drop it from batch_axes")),
    Role("expert", "expert_parallelism", EXPERT_AXIS, EXPERT_NAMES, batch=True, reason=(
        "outside expert layers the expert axes split the batch like any batch axis (tokens are "
        "exchanged between their devices inside the layer), so they must be batch axes; add it to "
        "batch_axes (an axis that splits experts cannot also be a tensor axis)")),
    Role("context", "context_parallelism", CONTEXT_AXIS, ("length",), batch=False, reason=(
        "a batch's rows are split over the batch axes and its sequence over the context axes; give "
        "each axis one role"), variables=False),
)
"""Every role besides batch and model. The short-form mesh's axis order: the ``outer`` roles' axes,
then ``"replica"``, the other roles' axes in this order and ``"model"`` innermost: ``stage, replica,
expert, context, model`` (stages over the slowest links, a model copy on consecutive devices)."""


def check_role_keywords(caller: str, given: Any, known: Any, say: str) -> None:
    """The keywords of ``given`` that ``caller`` takes generically (``known``: the roles'), else a
    TypeError as Python's own, naming them.

    Examples:
        >>> check_role_keywords("f", {"expert_axes": 1}, ["expert_axes"], "it takes")
        >>> check_role_keywords("f", {"tensor_axes": 1}, ["expert_axes"], "it takes")
        Traceback (most recent call last):
        ...
        TypeError: f() got an unexpected keyword argument 'tensor_axes': it takes ['expert_axes'].
    """
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}: {say} "
                        f"{sorted(known)}.")


def short_form_mesh(devices: Sequence[jax.Device], model_parallelism: int = 1,
                    **parallelism: int) -> Mesh:
    """The strategy's own mesh over ``devices``: ``("replica",)``, with an axis of size ``k`` for
    each ``<role>_parallelism=k > 1`` (`ROLES`' short forms) and ``"model"`` for
    ``model_parallelism=k > 1``, in `ROLES`' order (``stage, replica, expert, context, model``:
    ``"model"``'s ``k`` consecutive devices hold one model copy; stage ``i`` is the ``i``-th block
    of ``N / p`` devices). ``"replica"`` takes the devices left over.

    Raises:
        TypeError: for a keyword that is no role's short form.
        ValueError: for a ``*_parallelism`` that is not an int >= 1 dividing the device count, or
            several whose product does not.

    Examples:
        >>> import jax
        >>> dict(short_form_mesh(jax.devices()[:8], 2).shape)
        {'replica': 4, 'model': 2}
        >>> dict(short_form_mesh(jax.devices()[:8], context_parallelism=4).shape)
        {'replica': 2, 'context': 4}
        >>> dict(short_form_mesh(jax.devices()[:8], pipeline_parallelism=4).shape)
        {'stage': 4, 'replica': 2}
        >>> dict(short_form_mesh(jax.devices()[:8], 2, pipeline_parallelism=2,
        ...                      expert_parallelism=2).shape)
        {'stage': 2, 'replica': 1, 'expert': 2, 'model': 2}
    """
    devices = tuple(devices)
    n = len(devices)
    axis = {"model_parallelism": MODEL_AXIS, **{r.short_form: r.axis for r in ROLES}}
    check_role_keywords("short_form_mesh", parallelism, axis, "the short forms are")
    sizes = {"model_parallelism": model_parallelism, **parallelism}
    for name, k in sizes.items():
        if not isinstance(k, int) or isinstance(k, bool) or k < 1 or n % k:
            raise ValueError(f"{name}={k!r} must be an int >= 1 that divides the {n} devices (the "
                             f"mesh's {axis[name]!r} axis: the 'replica' axis takes the devices "
                             "left over).")
    order = (*(r.axis for r in ROLES if r.outer), REPLICA_AXIS,
             *(r.axis for r in ROLES if not r.outer), MODEL_AXIS)
    asked = {name: sizes[name] for a in order for name in sizes
             if axis[name] == a and sizes[name] > 1}
    if n % math.prod(asked.values()):
        raise ValueError(
            f"{' x '.join(f'{name}={k}' for name, k in asked.items())} must divide the {n} devices "
            "(the mesh would be "
            f"({', '.join(a for a in order if a == REPLICA_AXIS or a in map(axis.get, asked))})).")
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
        model_axes: every axis that is neither a batch nor a context axis, in mesh order.
        role_axes: ``{role: axes}`` for each of `ROLES` (empty: none); `axes` reads any role's.
    """

    def __init__(self, mesh: Mesh, batch_axes: tuple[str, ...], fsdp_axes: tuple[str, ...],
                 role_axes: dict[str, tuple[str, ...]] | None = None):
        self.mesh = mesh
        self.batch_axes = batch_axes
        self.fsdp_axes = fsdp_axes
        self.role_axes = {role.name: tuple((role_axes or {}).get(role.name, ())) for role in ROLES}
        self.model_axes = tuple(a for a in mesh.axis_names if a not in batch_axes
                                and a not in self.context_axes)

    @property
    def context_axes(self) -> tuple[str, ...]:
        """The axes a batch's sequence dimension is split over
        (`jaxdist.nn.dot_product_attention`)."""
        return self.role_axes["context"]

    @property
    def stage_axes(self) -> tuple[str, ...]:
        """The model axes pipeline stages are laid out over (`jaxdist.nn.Pipeline`): the logical
        axis ``"layers"`` of stacked layer parameters is split over them."""
        return self.role_axes["stage"]

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """The batch axes the stacked experts are split over (`jaxdist.nn.MoE`: logical axis
        ``"expert"``)."""
        return self.role_axes["expert"]

    @property
    def logical_rules(self) -> tuple[tuple[str, Any], ...]:
        """The logical axis names the roles give a meaning, as Flax rules ``(name, mesh axes)``:
        appended to a strategy's ``logical_axis_rules`` wherever those do not name them (a user's
        rule wins).

        Examples:
            >>> import jax
            >>> roles = axis_roles(jax.make_mesh((2, 4), ("data", "expert")), ("data", "expert"),
            ...                    split=True, expert_axes="expert")
            >>> roles.logical_rules
            (('expert', 'expert'), ('exp', 'expert'))
        """
        rules = [(name, self.entry(role.name)) for role in ROLES if self.axes(role.name)
                 for name in role.logical]
        # Flax lm1b / MaxText activation names: activations stay split along the sequence
        if self.context_axes:
            rules.append(("batch", self.replica_axis))
        return tuple(rules)

    def axes(self, role: str) -> tuple[str, ...]:
        """The axes of ``role`` (``"batch"``, ``"fsdp"``, ``"model"`` or a `ROLES` name)."""
        return self.role_axes[role] if role in self.role_axes else getattr(self, f"{role}_axes")

    def entry(self, role: str) -> str | tuple[str, ...] | None:
        """The axes of ``role`` as one `PartitionSpec` entry: None (no axis), one name, or a tuple.

        Examples:
            >>> import jax
            >>> roles = axis_roles(jax.make_mesh((2, 4), ("data", "fsdp")), ("data", "fsdp"),
            ...                    split=True)
            >>> roles.entry("fsdp"), roles.entry("expert")
            (('data', 'fsdp'), None)
        """
        return _entry(self.axes(role))

    @property
    def replica_axis(self) -> str | tuple[str, ...] | None:
        """The batch axes as JAX names them in a `PartitionSpec` entry or a collective's
        ``axis_name``: one name, or the tuple of several (None: no batch axis, a mesh of context
        axes only)."""
        return self.entry("batch")

    def size(self, axes: Sequence[str]) -> int:
        """The product of the sizes of ``axes``."""
        return int(np.prod([self.mesh.shape[a] for a in axes], dtype=np.int64))

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
        raise ValueError(f"{argument}={value!r} must be a mesh axis name or a sequence of them, "
                         "e.g. ('data', 'fsdp').")
    names = tuple(names)
    for name in names:
        if name not in mesh.axis_names:
            raise ValueError(f"{argument}={value!r} names axis {name!r}, but the mesh axes are "
                             f"{mesh.axis_names}.")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{argument}={value!r} lists axis {twice[0]!r} twice: name each axis "
                         "once.")
    return names


def axis_roles(mesh: Any, batch_axes: Any = None, fsdp_axes: Any = None, *, split: bool,
               strategy: str = "ShardedStrategy", **role_axes: Any) -> AxisRoles:
    """Validate a user's ``mesh`` and the roles given to its axes.

    Args:
        mesh: a `jax.sharding.Mesh` (any axis names, any devices of any processes).
        batch_axes: the axes a batch's rows are split over; None: the mesh's only axis (besides
            context axes), or for a mirroring strategy (``split=False``) every axis.
        fsdp_axes: the batch (and context) axes the FSDP rule splits variables over; None:
            ``batch_axes`` and ``context_axes`` when ``split``, else none.
        split: whether the strategy splits variables (Sharded) or keeps them whole (Mirrored, TPU).
        strategy: the strategy's name, for error messages.
        role_axes: ``<role>_axes=`` for each of `ROLES` given (``context_axes``, ``stage_axes``,
            ``expert_axes``): the axes of that role. Each must be batch axes or never be
            (`Role.batch`).

    Raises:
        TypeError: when ``mesh`` is not a `jax.sharding.Mesh`, or for an argument that is no role's.
        ValueError: for an axis the mesh lacks, an axis named twice, FSDP axes that are not batch
            axes, a mirroring strategy given model axes or role axes, a multi-axis mesh without
            ``batch_axes``, or role axes that break their relation to the batch axes.

    Examples:
        >>> import jax
        >>> mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
        >>> roles = axis_roles(mesh, ("data", "fsdp"), ("fsdp",), split=True)
        >>> roles.replica_axis, roles.fsdp_axes, roles.model_axes
        (('data', 'fsdp'), ('fsdp',), ('tensor',))
        >>> cp = axis_roles(jax.make_mesh((2, 4), ("data", "context")), "data", split=True,
        ...                 context_axes="context")
        >>> cp.context_axes, cp.fsdp_axes, cp.model_axes
        (('context',), ('data', 'context'), ())
    """
    if not isinstance(mesh, (Mesh, AbstractMesh)):  # an AbstractMesh (jd.plan_mesh): plans only
        raise TypeError(
            f"mesh={mesh!r} (type {type(mesh).__name__}) is not a jax.sharding.Mesh: build one "
            "with jax.make_mesh((2, 4), ('data', 'fsdp')) or jax.sharding.Mesh(devices, "
            "axis_names) (or, to plan without devices, jd.plan_mesh({'data': 64, 'fsdp': 16})).")
    check_role_keywords("axis_roles", role_axes, [role.argument for role in ROLES],
                        "the roles' arguments are")
    given = {role.name: _names(role_axes.get(role.argument) or (), role.argument, mesh)
             for role in ROLES}
    context = given["context"]
    if batch_axes is None:
        if split and len(mesh.axis_names) - len(context) > 1:
            raise ValueError(f"batch_axes is missing: the mesh has axes {mesh.axis_names}; name "
                             f"the ones a batch's rows are split over, e.g. {strategy}(mesh=mesh, "
                             f"batch_axes={mesh.axis_names[:-1]!r}) (the rest are model axes, for "
                             "tensor parallelism).")
        batch_axes = tuple(a for a in mesh.axis_names if a not in context)
    batch = _names(batch_axes, "batch_axes", mesh)
    for role in ROLES:
        if given[role.name] and role.variables and not split:
            raise ValueError(f"{role.argument}={role_axes[role.argument]!r}: a mirroring strategy "
                             f"keeps every variable whole on every device and has no {role.name} "
                             "axes; use ShardedStrategy(mesh=..., batch_axes=..., "
                             f"{role.argument}=...) (or {role.short_form}=k on its own mesh).")
        wrong = [a for a in given[role.name] if (a in batch) != role.batch]  # batch axes, or never
        if wrong:
            raise ValueError(f"{role.argument}={role_axes[role.argument]!r} names {wrong[0]!r}, "
                             f"which is {'not in' if role.batch else 'also in'} "
                             f"batch_axes={batch!r}: {role.reason}.")
    if not batch and not context:
        raise ValueError("batch_axes=() is empty: name at least one axis to split a batch's rows "
                         "over.")
    if not split:
        model = [a for a in mesh.axis_names if a not in batch and a not in context]
        if model:
            raise ValueError("A mirroring strategy (Mirrored, TPU, MultiWorkerMirrored) keeps "
                             f"every variable whole, so mesh axis {model[0]!r} (not in "
                             f"batch_axes={batch!r}) would hold copies that compute the same "
                             "thing: make it a batch axis, or use ShardedStrategy(mesh=..., "
                             "batch_axes=...) whose layout rules split variables over it.")
    fsdp = (batch + context if fsdp_axes is None and split
            else _names(fsdp_axes or (), "fsdp_axes", mesh))
    if fsdp and not split:
        raise ValueError(f"fsdp_axes={fsdp_axes!r}: a mirroring strategy keeps variables whole; "
                         "use ShardedStrategy for FSDP.")
    outside = [a for a in fsdp if a not in batch and a not in context]
    if outside:
        raise ValueError(f"fsdp_axes={fsdp_axes!r} names {outside[0]!r}, which is not in "
                         f"batch_axes={batch!r}: FSDP splits variables over (part of) the "
                         "data-parallel group; add it to batch_axes, or split variables over a "
                         "model axis with layout rules / logical_axis_rules instead.")
    return AxisRoles(mesh, batch, fsdp, given)
