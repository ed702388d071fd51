"""Variable layout rules: the `PartitionSpec` a variable gets from its path, shape and annotation.

The FSDP rule (AutoDist's partitioned variables in JAX terms) splits a variable over the FSDP axes
(all the batch axes, or a subset for HSDP: `jaxdist.strategies.layout._meshes`) on its largest
dimension that their size divides; variables smaller than ``min_shard_size`` elements, or with no
divisible axis, stay whole. Layout rules (Keras' ``LayoutMap``) are ``[(regex, PartitionSpec),
...]`` matched with `re.search` against the variable's path (``"params/Dense_0/kernel"``; optimizer
state such as Adam's ``mu`` contains the same path, so it follows its parameter).

Partitioning annotations, the Flax way (MaxText / T5X): ``nn.with_logical_partitioning(init,
("embed", "mlp"))`` names logical axes that ``logical_axis_rules`` (Flax's own format) map to mesh
axes; ``nn.with_partitioning(init, (None, "model"))`` names mesh axes directly. Which spec a
variable gets, first that applies:

1. the first ``layout_rules`` regex matching its path (exactly that spec: the override of last
   resort);
2. its annotation: mesh axes as named, or logical names through ``logical_axis_rules`` in Flax's
   priority order (``nn.logical_to_mesh_axes``); a logical name with no rule at all is FSDP's to
   use: when no dimension is already split over an FSDP axis, the largest such dimension their size
   divides is;
3. the FSDP rule (unannotated variables).

A dimension of size 1 stays whole whatever a rule or annotation names for it, as XLA keeps it on
Auto axes: split, it would hold its one element on a device and padding on the others (a ``(None,
"model")`` annotation copied onto an output layer of width 1). Any other dimension a split does not
divide is an error.

Typed PRNG key arrays (``jax.random.key``: an nnx ``RngKey``) are never split by the FSDP rule, nor
by its share of an annotation: they are tiny, and code that splits, scans or vmaps them expects them
whole. A ``layout_rules`` entry or an annotation naming their axes still splits them.

A mirroring policy (``split=False``) keeps every variable whole, whatever its annotation says. With
stage axes (pipeline parallelism) the logical name ``"layers"`` (the stacked layer axis of
`jaxdist.nn.Pipeline`) is mapped to them unless the user's rules map it themselves.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core.meta import Partitioned
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.replicate.layouts import REPLICA_AXIS, entry_axes, path_name
from jaxdist.replicate.trees import flax_nnx
from jaxdist.strategies.layout._meshes import LAYERS, AxisRoles

__all__ = ["LAYERS", "VariableRules", "annotation", "is_annotated", "is_box", "is_key",
           "is_variable", "logical_names", "unboxed"]


def is_key(dtype: Any) -> bool:
    """True for the dtype of a typed PRNG key array (``jax.random.key``'s ``key<fry>``); False for
    None."""
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _canonical(axes: list[Any]) -> PartitionSpec:
    """``axes`` as a spec without trailing Nones: the canonical form jit returns."""
    while axes and axes[-1] is None:
        axes.pop()
    return PartitionSpec(*axes)


def is_box(x: Any) -> bool:
    """True for a Flax partitioning box (``nn.Partitioned`` / ``nn.LogicallyPartitioned``)."""
    return isinstance(x, Partitioned)


def is_variable(x: Any) -> bool:
    """True for an nnx Variable (a pytree node whose one child is its value, its annotation in its
    metadata); False for everything while nnx is not imported."""
    nnx = flax_nnx()
    return nnx is not None and isinstance(x, nnx.Variable)


def is_annotated(x: Any) -> bool:
    """True for a leaf carrying its own partitioning annotation: a Flax box or an nnx Variable."""
    return isinstance(x, Partitioned) or is_variable(x)


def unboxed(x: Any) -> Any:
    """The value inside a Flax box or an nnx Variable; anything else as it is."""
    if is_variable(x):
        return x.get_value()
    return x.value if isinstance(x, Partitioned) else x


def annotation(x: Any, mesh_axes: Sequence[str]) -> Partitioned | None:
    """The partitioning annotation a variable carries, as the box `VariableRules.spec` reads.

    A linen box is its own annotation. An nnx Variable's (``nnx.with_partitioning``,
    ``out_sharding=`` / ``sharding=`` metadata) is boxed as linen's are: names that are all axes of
    ``mesh_axes`` as a `Partitioned`, logical names as a ``LogicallyPartitioned`` (mapped by the
    strategy's ``logical_axis_rules``, or the Variable's own ``sharding_rules``); else None.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> with nnx.use_eager_sharding(False):
        ...     kernel = nnx.Param(jnp.zeros((2, 4)), out_sharding=("embed", "model"))
        >>> (type(annotation(kernel, ("replica", "model"))).__name__,
        ...  annotation(kernel, ("replica", "model")).names)
        ('LogicallyPartitioned', ('embed', 'model'))
        >>> annotation(nnx.Param(jnp.zeros(2)), ("replica",)) is None
        True
    """
    if isinstance(x, Partitioned):
        return x
    if not is_variable(x):
        return None
    meta = x.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding")
    if not names:
        return None
    if isinstance(names, NamedSharding):
        names = names.spec
    names = tuple(names)
    if all(n is None or n in set(mesh_axes) for n in jax.tree.leaves(names)):
        return Partitioned(None, names)
    return nn.LogicallyPartitioned(None, names, rules=meta.get("sharding_rules") or None)


def logical_names(tree: Any, mesh_axes: Sequence[str] | None = None) -> set[str]:
    """The logical axis names of the ``nn.with_logical_partitioning`` boxes and the nnx Variables
    annotated with names that are not axes of ``mesh_axes`` in ``tree``.

    Examples:
        >>> import flax.linen as nn
        >>> sorted(logical_names({"k": nn.LogicallyPartitioned(None, ("embed", "mlp"))}))
        ['embed', 'mlp']
    """
    axes = () if mesh_axes is None else mesh_axes
    boxes = [annotation(leaf, axes) for leaf in jax.tree.leaves(tree, is_leaf=is_annotated)]
    boxes = [box for box in boxes if isinstance(box, nn.LogicallyPartitioned)]
    return {n for box in boxes for n in jax.tree.leaves(tuple(box.names)) if isinstance(n, str)}


def _hint(roles: AxisRoles) -> str:
    short_form = roles.mesh.axis_names == (REPLICA_AXIS,)
    return "; pass model_parallelism > 1 for 'model'" if short_form else ""


class VariableRules:
    """The spec rules of one mesh: layout rules, Flax annotations via logical rules, the FSDP rule.

    Args:
        roles: the mesh the specs name axes of, and its FSDP axes (what the FSDP rule splits over).
        split: whether variables are laid out by the rules (FSDP for unannotated ones) or all whole
            (mirrored: annotations and the FSDP rule are ignored).
        min_shard_size: variables with fewer elements stay whole.
        layout_rules: ``[(regex, PartitionSpec), ...]``.
        logical_axis_rules: Flax logical axis rules ``[(logical_name, mesh_axes), ...]``.
        activation_axes: logical names only activations use (never reported as unmatched).

    Raises:
        ValueError: for a malformed rule, or a rule naming an axis the mesh does not have.

    Examples:
        >>> import jax
        >>> from jaxdist.strategies.layout._meshes import axis_roles
        >>> roles = axis_roles(jax.sharding.Mesh(jax.devices()[:8], ("replica",)), split=True)
        >>> VariableRules(roles, split=True, min_shard_size=1).spec("w", (8, 16))
        P(None, 'replica')
    """

    def __init__(self, roles: AxisRoles, split: bool = False, min_shard_size: int = 1024,
                 layout_rules: Sequence[tuple[str, PartitionSpec]] = (),
                 logical_axis_rules: Sequence[tuple[str, Any]] = (),
                 activation_axes: Sequence[str] = ()):
        if not isinstance(min_shard_size, int) or min_shard_size < 0:
            raise ValueError(f"min_shard_size={min_shard_size!r} must be an int >= 0 (elements).")
        if isinstance(activation_axes, str) or not all(isinstance(a, str) for a in activation_axes):
            raise ValueError(f"activation_axes={activation_axes!r} must be a sequence of logical "
                             "axis names, e.g. activation_axes=('batch', 'length').")
        self.roles = roles
        self.mesh = roles.mesh
        self.split = split
        self.min_shard_size = min_shard_size
        self.layout_rules = [self._check_rule(i, rule) for i, rule in enumerate(layout_rules or ())]
        self.logical_axis_rules = tuple(self._check_logical_rule(i, r)
                                        for i, r in enumerate(logical_axis_rules or ()))
        # The logical names the axis roles give a meaning ("layers", "expert", "length", ...):
        # appended where the user's rules do not name them, so every user rule keeps its priority;
        # never reported as unmatched (a model without a pipeline layer is an idle stage axis).
        named = {name for name, _ in self.logical_axis_rules}
        implied = tuple(rule for rule in roles.logical_rules if rule[0] not in named)
        self.logical_axis_rules += implied
        self._implicit = {name for name, _ in implied}
        self.activation_axes = frozenset(activation_axes)

    # ----------------------------------------------------------------------------------- validation
    def _check_rule(self, i: int, rule: Any) -> tuple[re.Pattern, PartitionSpec]:
        try:
            pattern, spec = rule
            compiled = re.compile(pattern)
        except (TypeError, ValueError, re.error) as err:
            raise ValueError(f"layout_rules[{i}]={rule!r} is not a (regex, PartitionSpec) pair "
                             f"({err}); e.g. (r'Dense_0/kernel', PartitionSpec(None, "
                             "'model')).") from None
        if not isinstance(spec, PartitionSpec):
            raise ValueError(f"layout_rules[{i}] has spec {spec!r}: use a "
                             "jax.sharding.PartitionSpec.")
        for entry in spec:
            for name in entry_axes(entry):
                if name not in self.mesh.axis_names:
                    raise ValueError(f"layout_rules[{i}] names mesh axis {name!r}, but the mesh "
                                     f"axes are {self.mesh.axis_names}{_hint(self.roles)}.")
        return compiled, spec

    def _check_logical_rule(self, i: int, rule: Any) -> tuple[str, Any]:
        example = "e.g. ('mlp', 'model') or ('embed', None)"
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"logical_axis_rules[{i}]={rule!r} is not a (logical_name, mesh_axes) "
                             f"pair: {example}.")
        name, axes = rule
        names = axes if isinstance(axes, (tuple, list)) else (axes,)
        for axis in names:
            if axis is not None and axis not in self.mesh.axis_names:
                raise ValueError(f"logical_axis_rules[{i}]={tuple(rule)!r} maps {name!r} to mesh "
                                 f"axis {axis!r}, but the mesh axes are "
                                 f"{self.mesh.axis_names}{_hint(self.roles)}: {example}.")
        return name, tuple(axes) if isinstance(axes, list) else axes

    # ---------------------------------------------------------------------------------------- specs
    def spec(self, path: str, shape: tuple[int, ...], annotation: Partitioned | None = None,
             dtype: Any = None) -> PartitionSpec:
        """The spec of the variable at ``path`` of ``shape`` (and ``dtype``, when known): first
        layout rule, else annotation, else FSDP (never for a typed PRNG key array: module doc).

        Raises:
            ValueError: when a rule or annotation splits a dimension (of size > 1) into parts that
                do not divide it, or a ``nn.with_partitioning`` annotation names an axis the mesh
                does not have.
        """
        if not self.split:  # a mirroring policy: every variable whole, annotations notwithstanding
            return PartitionSpec()
        shape = tuple(shape)
        for pattern, spec in self.layout_rules:
            if pattern.search(path):
                axes = self._fitted(path, shape, spec, f"layout rule {spec}")
                return spec if axes == list(spec) else _canonical(axes)
        fsdp = not is_key(dtype)
        if annotation is not None:
            return self._annotated_spec(path, shape, annotation, fsdp)
        return self._fsdp_spec(shape) if fsdp else PartitionSpec()

    def _annotated_spec(self, path: str, shape: tuple[int, ...], annotation: Partitioned,
                        fsdp: bool = True) -> PartitionSpec:
        names = tuple(annotation.names)
        what = f"annotation {names}"
        if len(names) > len(shape):
            raise ValueError(f"{what} of variable {path!r} names {len(names)} axes but the "
                             f"variable has shape {shape}: annotate one name per dimension.")
        if isinstance(annotation, nn.LogicallyPartitioned):
            rules = annotation.rules if annotation.rules is not None else self.logical_axis_rules
            # Flax's own resolution: rule order is priority
            axes = list(nn.logical_to_mesh_axes(names, rules))
            ruled = {name for name, _ in rules}
            free = [i for i, name in enumerate(names)
                    if isinstance(name, str) and name not in ruled]
            what += f" through logical_axis_rules to {PartitionSpec(*axes)}"
            if LAYERS in names and self.roles.stage_axes:
                self._check_stages(path, shape[names.index(LAYERS)], axes[names.index(LAYERS)])
        else:  # nn.with_partitioning names mesh axes: exactly what the model asks for
            for name in jax.tree.leaves(names):
                if isinstance(name, str) and name not in self.mesh.axis_names:
                    raise ValueError(f"{what} of variable {path!r} (nn.with_partitioning) names "
                                     f"mesh axis {name!r}, but this strategy's mesh axes are "
                                     f"{self.mesh.axis_names}: name axes of that mesh, or annotate "
                                     "logical names (nn.with_logical_partitioning) and map them "
                                     "with ShardedStrategy(logical_axis_rules=...).")
            axes, free = list(names), []
        axes = self._fitted(path, shape, PartitionSpec(*axes), what, annotated=True)
        used = set(jax.tree.leaves([a for a in axes if a is not None]))
        n = self.roles.size(self.roles.fsdp_axes)
        if (fsdp and free and not used & set(self.roles.fsdp_axes) and n > 1
                and self._big_enough(shape)):
            candidates = [(shape[i], -i) for i in free if shape[i] % n == 0]
            if candidates:
                axes[-max(candidates)[1]] = self.roles.entry("fsdp")
        return _canonical(axes)

    def _check_stages(self, path: str, layers: int, entry: Any) -> None:
        parts = self.roles.size([a for a in jax.tree.leaves(entry) if a is not None])
        if layers % parts:
            raise ValueError(f"num_layers={layers} (the 'layers' axis of {path!r}) is not "
                             f"divisible by the {parts} stages of "
                             f"stage_axes={self.roles.stage_axes}: each stage holds num_layers / "
                             f"stages layers; use a multiple of {parts} layers (times the circular "
                             "schedule's repeats), or another stage count.")

    def _big_enough(self, shape: tuple[int, ...]) -> bool:
        return int(np.prod(shape, dtype=np.int64)) >= self.min_shard_size

    def _fsdp_spec(self, shape: tuple[int, ...]) -> PartitionSpec:
        n = self.roles.size(self.roles.fsdp_axes)
        if n == 1 or not self._big_enough(shape):
            return PartitionSpec()
        candidates = [(size, -axis) for axis, size in enumerate(shape) if size % n == 0]
        if not candidates:
            return PartitionSpec()
        _, neg_axis = max(candidates)  # the largest divisible axis (the first of equals)
        spec = [None] * (-neg_axis + 1)  # no trailing Nones: the canonical form jit returns
        spec[-neg_axis] = self.roles.entry("fsdp")
        return PartitionSpec(*spec)

    def _fitted(self, path: str, shape: tuple[int, ...], spec: PartitionSpec, what: str,
                annotated: bool = False) -> list[Any]:
        """``spec``'s entries, checked against ``shape``, with None for the dimensions of size 1
        (those stay whole: module doc)."""
        if len(spec) > len(shape):
            raise ValueError(f"{what} for variable {path!r} of shape {shape} names {len(spec)} "
                             f"axes but the variable has only {len(shape)}: shorten the "
                             "PartitionSpec.")
        for axis, entry in enumerate(spec):
            parts = int(np.prod([self.mesh.shape[a] for a in entry_axes(entry)], dtype=np.int64))
            if shape[axis] % parts and shape[axis] != 1:
                fix = "pick another axis or pad the variable"
                if annotated:  # the fix that leaves the model as it is
                    fix += (", or give it a layout of its own: ShardedStrategy(layout_rules=[("
                            f"{'^' + re.escape(path) + '$'!r}, PartitionSpec(...))]) (layout rules "
                            "come before annotations)")
                raise ValueError(f"{what} splits axis {axis} (size {shape[axis]}) of variable "
                                 f"{path!r} into {parts} parts, which does not divide it: {fix}.")
        return [None if shape[axis] == 1 else entry for axis, entry in enumerate(spec)]

    # ---------------------------------------------------------------------------------- rule checks
    def unmatched(self, tree: Any) -> list[str]:
        """The rules that placed no variable of ``tree`` (arrays or shapes; Flax boxes keep
        annotations).

        A ``layout_rules`` entry is unmatched when it is the first match of no variable's path; a
        ``logical_axis_rules`` entry when no variable's annotation uses its logical name (names in
        ``activation_axes`` excepted).
        """
        used: set[int] = set()
        names: set[str] = set()
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_annotated):
            name = path_name(path)
            first = next((i for i, (pattern, _) in enumerate(self.layout_rules)
                          if pattern.search(name)), None)
            if first is not None:
                used.add(first)
            else:  # a layout rule overrides the annotation: its names placed nothing here
                names |= logical_names(leaf, self.mesh.axis_names)
        out = [f"layout_rules[{i}]=({pattern.pattern!r}, {spec})"
               for i, (pattern, spec) in enumerate(self.layout_rules) if i not in used]
        out += [f"logical_axis_rules[{i}]={(name, axes)!r}"
                for i, (name, axes) in enumerate(self.logical_axis_rules)
                if name not in names and name not in self.activation_axes
                and name not in self._implicit]
        return out
