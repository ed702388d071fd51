"""`ShardedStrategy`: FSDP / ZeRO-3 — parameters and optimizer state split over the replicas.

Every variable is split on its largest axis that the replica count divides evenly (AutoDist's partitioned
variables, in JAX terms); variables smaller than ``min_shard_size`` elements, or with no divisible axis, stay
replicated. Batches are split over the replicas as in `MirroredStrategy`. In ``strategy.jit`` XLA gathers
each parameter where the step needs it and reduce-scatters its gradient, so each device holds ~1/N of the
parameters and optimizer state and the step still equals single-device training.

Layout rules (Keras' ``LayoutMap``): ``layout_rules=[(regex, PartitionSpec), ...]`` match the variable's path
(``"params/Dense_0/kernel"``; optimizer state such as Adam's ``mu`` contains the same path, so it follows its
parameter) with `re.search`; the first match wins, unmatched variables get the FSDP rule. With
``model_parallelism=k`` the mesh is ``(replica, model)`` = ``(N / k, k)`` and rules can split variables over
``"model"`` for tensor parallelism.

Partitioning annotations, the Flax way (MaxText / T5X): a linen model boxes its parameters with
``nn.with_logical_partitioning(init, ("embed", "mlp"))`` and ``logical_axis_rules=[("embed", None),
("mlp", "model"), ...]`` (Flax's own rule format, `flax.linen.logical_axis_rules`) maps the logical names to
mesh axes; ``nn.with_partitioning(init, (None, "model"))`` names mesh axes directly. Optax states built from
boxed params hold the same boxes, so optimizer state follows its parameter. Which layout a variable gets,
first that applies:

1. the first ``layout_rules`` regex matching its path (exactly that spec: the override of last resort);
2. its annotation: mesh axes as named (``nn.with_partitioning``), or logical names through
   ``logical_axis_rules`` in Flax's priority order (``nn.logical_to_mesh_axes``); a logical name with no
   rule at all is FSDP's to use: when no dimension is already split over ``"replica"``, the largest such
   dimension that the replica count divides is (a rule ``(name, None)`` keeps a dimension whole);
3. the FSDP rule (unannotated variables).

An entry of ``layout_rules`` / ``logical_axis_rules`` that matches no variable of what `create_variables`
builds is reported (`UnmatchedLayoutRuleWarning`): a renamed layer or axis would otherwise silently fall back
to FSDP. Inside ``scope()`` the logical rules are also Flax's ambient rules, so ``nn.with_logical_constraint``
in model code (activations) and the constraints Flax applies when it unboxes a parameter use the same table.
"""

from __future__ import annotations

import contextlib
import re
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core.meta import Partitioned
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.replicate.layouts import MODEL_AXIS, REPLICA_AXIS, path_name
from jaxdist.strategies.base import Strategy
from jaxdist.strategies.devices import resolve_devices

__all__ = ["ShardedStrategy", "UnmatchedLayoutRuleWarning"]


class UnmatchedLayoutRuleWarning(UserWarning):
    """A ``layout_rules`` / ``logical_axis_rules`` entry of a `ShardedStrategy` matched no variable it created.

    The variables it was meant for got another layout (usually the FSDP rule): fix the regex or the logical
    name, or drop the entry. Logical names that only activations use (``nn.with_logical_constraint``) are
    declared with ``ShardedStrategy(activation_axes=...)`` and never reported.
    """


class ShardedStrategy(Strategy):
    """Data parallelism with parameters and optimizer state sharded over the replicas (FSDP / ZeRO-3).

    Args:
        devices: the devices (as for `MirroredStrategy`); None for every local device.
        min_shard_size: variables with fewer elements stay replicated (sharding tiny arrays costs more in
            collectives than it saves in memory).
        layout_rules: ``[(regex, PartitionSpec), ...]`` overriding the FSDP rule for matching variable paths.
        model_parallelism: devices per replica along a ``"model"`` mesh axis, for tensor-parallel rules.
        logical_axis_rules: Flax logical axis rules ``[(logical_name, mesh_axes), ...]`` (``mesh_axes``: None,
            ``"replica"``, ``"model"`` or a tuple of them) for variables annotated with
            ``nn.with_logical_partitioning``; earlier rules take priority, as in Flax.
        activation_axes: logical names of ``logical_axis_rules`` that only activations use
            (``nn.with_logical_constraint``): never reported as matching no variable.
        host_offload: keep ``"opt_state"``, ``"params"`` or ``"all"`` variables in host memory between steps,
            in their FSDP layout (ZeRO-Offload; see `jaxdist.strategies.offload`); None: device memory.

    Raises:
        ValueError: for a bad device list, ``model_parallelism`` that does not divide the device count, a
            malformed layout rule or logical axis rule, or a rule naming an axis the mesh does not have.

    Example:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.ShardedStrategy(min_shard_size=16)
        >>> params = strategy.create_variables(lambda: {"w": jnp.zeros((64, 8)), "b": jnp.zeros(8)})
        >>> params["w"].sharding.spec, params["b"].sharding.spec
        (P('replica',), P())
        >>> import flax.linen as nn  # the Flax way: annotate with logical names, map them with rules
        >>> tp = jd.ShardedStrategy(model_parallelism=2, min_shard_size=1,
        ...                         logical_axis_rules=[("embed", None), ("mlp", "model")])
        >>> dense = nn.Dense(16, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
        ...                                                               ("embed", "mlp")))
        >>> tp.create_variables(dense.init, jax.random.key(0), jnp.ones((1, 8)))["params"]["kernel"].value.sharding.spec
        P(None, 'model')
    """

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        min_shard_size: int = 1024,
        layout_rules: Sequence[tuple[str, PartitionSpec]] | None = None,
        model_parallelism: int = 1,
        logical_axis_rules: Sequence[tuple[str, Any]] | None = None,
        activation_axes: Sequence[str] = (),
        host_offload: str | None = None,
    ):
        resolved = resolve_devices(devices, "devices")
        if not isinstance(model_parallelism, int) or model_parallelism < 1 or len(resolved) % model_parallelism:
            raise ValueError(
                f"model_parallelism={model_parallelism!r} must be an int >= 1 that divides the {len(resolved)} "
                "devices (the mesh is (replica, model) = (devices / model_parallelism, model_parallelism))."
            )
        if not isinstance(min_shard_size, int) or min_shard_size < 0:
            raise ValueError(f"min_shard_size={min_shard_size!r} must be an int >= 0 (elements).")
        super().__init__(resolved, model_parallelism=model_parallelism, host_offload=host_offload)
        self.min_shard_size = min_shard_size
        self._rules = [self._check_rule(i, rule) for i, rule in enumerate(layout_rules or ())]
        self._logical_rules = tuple(self._check_logical_rule(i, r) for i, r in enumerate(logical_axis_rules or ()))
        if isinstance(activation_axes, str) or not all(isinstance(a, str) for a in activation_axes):
            raise ValueError(
                f"activation_axes={activation_axes!r} must be a sequence of logical axis names, e.g. "
                "activation_axes=('batch', 'length')."
            )
        self._activation_axes = frozenset(activation_axes)
        self._reported: set[str] = set()
        self._batches: dict[int, weakref.ref] = {}

    def _check_rule(self, i: int, rule: Any) -> tuple[re.Pattern, PartitionSpec]:
        try:
            pattern, spec = rule
            compiled = re.compile(pattern)
        except (TypeError, ValueError, re.error) as err:
            raise ValueError(
                f"layout_rules[{i}]={rule!r} is not a (regex, PartitionSpec) pair ({err}); e.g. "
                "(r'Dense_0/kernel', PartitionSpec(None, 'model'))."
            ) from None
        if not isinstance(spec, PartitionSpec):
            raise ValueError(f"layout_rules[{i}] has spec {spec!r}: use a jax.sharding.PartitionSpec.")
        for entry in spec:
            for name in entry if isinstance(entry, tuple) else (entry,):
                if name is not None and name not in self.mesh.axis_names:
                    raise ValueError(
                        f"layout_rules[{i}] names mesh axis {name!r}, but the mesh axes are {self.mesh.axis_names}"
                        + ("" if MODEL_AXIS in self.mesh.axis_names else "; pass model_parallelism > 1 for 'model'")
                        + "."
                    )
        return compiled, spec

    def _check_logical_rule(self, i: int, rule: Any) -> tuple[str, Any]:
        example = "e.g. ('mlp', 'model') or ('embed', None)"
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"logical_axis_rules[{i}]={rule!r} is not a (logical_name, mesh_axes) pair: {example}.")
        name, axes = rule
        names = axes if isinstance(axes, (tuple, list)) else (axes,)
        for axis in names:
            if axis is not None and axis not in self.mesh.axis_names:
                raise ValueError(
                    f"logical_axis_rules[{i}]={tuple(rule)!r} maps {name!r} to mesh axis {axis!r}, but the mesh "
                    f"axes are {self.mesh.axis_names}"
                    + ("" if MODEL_AXIS in self.mesh.axis_names else "; pass model_parallelism > 1 for 'model'")
                    + f": {example}."
                )
        return name, tuple(axes) if isinstance(axes, list) else axes

    @property
    def logical_axis_rules(self) -> tuple[tuple[str, Any], ...]:
        """The Flax logical axis rules this strategy lays annotated variables out with (Flax's format)."""
        return self._logical_rules

    def variable_layout(
        self, path: str, aval: jax.ShapeDtypeStruct, annotation: Partitioned | None = None
    ) -> jax.sharding.Sharding:
        """The first ``layout_rules`` match, else the annotation, else the FSDP rule (see the class docstring).

        Raises:
            ValueError: when a rule or annotation splits a dimension into parts that do not divide it, or a
                ``nn.with_partitioning`` annotation names an axis the mesh does not have.

        Example:
            >>> import jax, flax.linen as nn, jaxdist as jd
            >>> s = jd.ShardedStrategy(model_parallelism=2, min_shard_size=1, logical_axis_rules=[("mlp", "model")])
            >>> box = nn.LogicallyPartitioned(None, ("embed", "mlp"))  # "embed" has no rule: FSDP's to split
            >>> s.variable_layout("kernel", jax.ShapeDtypeStruct((8, 16), "float32"), box).spec
            P('replica', 'model')
        """
        shape = tuple(aval.shape)
        for pattern, spec in self._rules:
            if pattern.search(path):
                self._check_fits(path, shape, spec, f"layout rule {spec}")
                return NamedSharding(self.mesh, spec)
        if annotation is not None:
            return NamedSharding(self.mesh, self._annotated_spec(path, shape, annotation))
        return NamedSharding(self.mesh, self._fsdp_spec(shape))

    def _annotated_spec(self, path: str, shape: tuple[int, ...], annotation: Partitioned) -> PartitionSpec:
        names = tuple(annotation.names)
        what = f"annotation {names}"
        if len(names) > len(shape):
            raise ValueError(
                f"{what} of variable {path!r} names {len(names)} axes but the variable has shape {shape}: "
                "annotate one name per dimension."
            )
        if isinstance(annotation, nn.LogicallyPartitioned):
            rules = annotation.rules if annotation.rules is not None else self._logical_rules
            axes = list(nn.logical_to_mesh_axes(names, rules))  # Flax's own resolution: rule order is priority
            ruled = {name for name, _ in rules}
            free = [i for i, name in enumerate(names) if isinstance(name, str) and name not in ruled]
            what += f" through logical_axis_rules to {PartitionSpec(*axes)}"
        else:  # nn.with_partitioning names mesh axes: exactly what the model asks for
            for name in jax.tree.leaves(names):
                if isinstance(name, str) and name not in self.mesh.axis_names:
                    raise ValueError(
                        f"{what} of variable {path!r} (nn.with_partitioning) names mesh axis {name!r}, but this "
                        f"strategy's mesh axes are {self.mesh.axis_names}: name mesh axes 'replica' / 'model', or "
                        "annotate logical names (nn.with_logical_partitioning) and map them with "
                        "ShardedStrategy(logical_axis_rules=...)."
                    )
            axes, free = list(names), []
        self._check_fits(path, shape, PartitionSpec(*axes), what)
        used = set(jax.tree.leaves([a for a in axes if a is not None]))
        n = self.num_replicas_in_sync
        if free and REPLICA_AXIS not in used and n > 1 and int(np.prod(shape, dtype=np.int64)) >= self.min_shard_size:
            candidates = [(shape[i], -i) for i in free if shape[i] % n == 0]
            if candidates:
                axes[-max(candidates)[1]] = REPLICA_AXIS
        while axes and axes[-1] is None:  # no trailing Nones: the canonical form jit returns
            axes.pop()
        return PartitionSpec(*axes)

    def _fsdp_spec(self, shape: tuple[int, ...]) -> PartitionSpec:
        n = self.num_replicas_in_sync
        if n == 1 or int(np.prod(shape, dtype=np.int64)) < self.min_shard_size:
            return PartitionSpec()
        candidates = [(size, -axis) for axis, size in enumerate(shape) if size % n == 0]
        if not candidates:
            return PartitionSpec()
        _, neg_axis = max(candidates)  # the largest divisible axis (the first of equals)
        spec = [None] * (-neg_axis + 1)  # no trailing Nones: the canonical form jit returns
        spec[-neg_axis] = REPLICA_AXIS
        return PartitionSpec(*spec)

    def _check_fits(self, path: str, shape: tuple[int, ...], spec: PartitionSpec, what: str) -> None:
        if len(spec) > len(shape):
            raise ValueError(
                f"{what} for variable {path!r} of shape {shape} names {len(spec)} axes but the "
                f"variable has only {len(shape)}: shorten the PartitionSpec."
            )
        for axis, entry in enumerate(spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            parts = int(np.prod([self.mesh.shape[a] for a in names if a is not None], dtype=np.int64))
            if shape[axis] % parts:
                raise ValueError(
                    f"{what} splits axis {axis} (size {shape[axis]}) of variable {path!r} into {parts} "
                    "parts, which does not divide it: pick another axis or pad the variable."
                )

    def variable_layouts(self, tree: Any) -> dict[str, PartitionSpec]:
        """``{path: PartitionSpec}`` this strategy gives each variable of ``tree`` (arrays or shapes).

        Example:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> jd.ShardedStrategy(min_shard_size=1).variable_layouts({"w": jnp.zeros((8, 16))})
            {'w': P(None, 'replica')}
        """
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", np.float32)), tree)
        leaves = jax.tree_util.tree_leaves_with_path(self.variable_shardings(shapes), is_leaf=_is_box)
        return {path_name(p): (s.value if _is_box(s) else s).spec for p, s in leaves}

    # ------------------------------------------------------------------------------------ rule checks
    def unmatched_rules(self, tree: Any) -> list[str]:
        """The rules that placed no variable of ``tree`` (arrays or shapes; Flax boxes keep annotations).

        A ``layout_rules`` entry is unmatched when it is the first match of no variable's path; a
        ``logical_axis_rules`` entry when no variable's annotation uses its logical name (names declared in
        ``activation_axes`` excepted). `create_variables` warns about them (`UnmatchedLayoutRuleWarning`).

        Example:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> from jax.sharding import PartitionSpec as P
            >>> s = jd.ShardedStrategy(layout_rules=[("Dense_0/kernel", P()), ("Dense_9/kernel", P())])
            >>> s.unmatched_rules({"params": {"Dense_0": {"kernel": jnp.zeros((2, 2))}}})
            ["layout_rules[1]=('Dense_9/kernel', P())"]
        """
        used: set[int] = set()
        names: set[str] = set()
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_box):
            name = path_name(path)
            first = next((i for i, (pattern, _) in enumerate(self._rules) if pattern.search(name)), None)
            if first is not None:
                used.add(first)
            else:  # a layout rule overrides the annotation: its names placed nothing here
                names |= _logical_names(leaf)
        out = [
            f"layout_rules[{i}]=({pattern.pattern!r}, {spec})"
            for i, (pattern, spec) in enumerate(self._rules)
            if i not in used
        ]
        out += [
            f"logical_axis_rules[{i}]={(name, axes)!r}"
            for i, (name, axes) in enumerate(self._logical_rules)
            if name not in names and name not in self._activation_axes
        ]
        return out

    def create_variables(self, init_fn: Any, *args: Any, **kwargs: Any) -> Any:
        """As `Strategy.create_variables`; then warns once per rule that placed none of the variables.

        Warns:
            UnmatchedLayoutRuleWarning: naming each ``layout_rules`` / ``logical_axis_rules`` entry that
                matched no variable (see `unmatched_rules`).
        """
        variables = super().create_variables(init_fn, *args, **kwargs)
        unmatched = [entry for entry in self.unmatched_rules(variables) if entry not in self._reported]
        if unmatched:
            self._reported.update(unmatched)
            annotated = sorted(_logical_names(variables))
            seen = (
                f"the variables' logical names are {annotated}"
                if annotated
                else "no variable carries a logical annotation (nn.with_logical_partitioning; unboxed params lose it)"
            )
            warnings.warn(
                f"{', '.join(unmatched)} matched no variable created here ({seen}): the variables meant for "
                f"{'it' if len(unmatched) == 1 else 'them'} got another layout (the FSDP rule). Fix the regex or "
                "logical name, or drop the entry; a logical name only activations use goes in "
                "ShardedStrategy(activation_axes=...).",
                UnmatchedLayoutRuleWarning,
                stacklevel=2,
            )
        return variables

    def scope(self) -> contextlib.AbstractContextManager[ShardedStrategy]:
        """As `Strategy.scope`; with ``logical_axis_rules``, also Flax's logical axis rules inside.

        So ``nn.with_logical_constraint(x, ("batch", "length", "embed"))`` in a model traced inside the scope
        constrains activations with this strategy's rules and mesh (outside any rules it is a no-op, as in
        Flax: the math is the same either way).

        Example:
            >>> import flax.linen as nn, jaxdist as jd
            >>> s = jd.ShardedStrategy(logical_axis_rules=[("batch", "replica")], activation_axes=("batch",))
            >>> with s.scope():
            ...     nn.logical_to_mesh_axes(("batch", "embed"))
            P('replica', None)
        """
        return _with_flax_rules(super().scope(), self._logical_rules)

    def tracing_scope(self) -> contextlib.AbstractContextManager[Any]:
        """With ``logical_axis_rules``: this mesh (as JAX's abstract mesh) and Flax's rules while `jit` traces
        a step, so ``nn.with_logical_constraint`` in the model constrains activations whether or not the step
        is called inside `scope`. Without rules, nothing: Flax would replicate every name no rule maps.

        Example:
            >>> import flax.linen as nn, jaxdist as jd
            >>> s = jd.ShardedStrategy(logical_axis_rules=[("batch", "replica")], activation_axes=("batch",))
            >>> with s.tracing_scope():
            ...     nn.logical_to_mesh_axes(("batch", "embed"))
            P('replica', None)
        """
        if not self._logical_rules:
            return contextlib.nullcontext()
        return _with_flax_rules(jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh), self._logical_rules)

    # Variables and batches can both be split on axis 0 here, so the layout alone cannot tell them apart:
    # a batch is an array this strategy's input functions placed (or one the caller declares a batch).
    def mark_batch(self, x: jax.Array) -> None:
        """Remember (weakly) that ``x`` was placed as a distributed batch (see `Strategy.mark_batch`)."""
        if not isinstance(x, jax.Array):
            return
        key = id(x)
        self._batches[key] = weakref.ref(x, lambda _, key=key: self._batches.pop(key, None))

    def layout_role(self, x: Any) -> str | None:
        """``"batch"`` for arrays placed by this strategy's input functions; None for other arrays split
        like a batch (an FSDP variable or a batch computed from one: the layout cannot tell)."""
        role = super().layout_role(x)
        if role != "batch":
            return role
        ref = self._batches.get(id(x))
        return "batch" if ref is not None and ref() is x else None

    @property
    def gathers_variables_without_batch(self) -> bool:
        """True: split variables are gathered at entry of a step with no distributed batch (see `Strategy`)."""
        return self.num_replicas_in_sync > 1 or MODEL_AXIS in self.mesh.axis_names

    def __repr__(self) -> str:
        return f"ShardedStrategy(num_replicas_in_sync={self.num_replicas_in_sync}, mesh={dict(self.mesh.shape)})"


def _is_box(x: Any) -> bool:
    return isinstance(x, Partitioned)


def _logical_names(tree: Any) -> set[str]:
    """The logical axis names of the ``nn.with_logical_partitioning`` boxes in ``tree``."""
    boxes = [leaf for leaf in jax.tree.leaves(tree, is_leaf=_is_box) if isinstance(leaf, nn.LogicallyPartitioned)]
    return {n for box in boxes for n in jax.tree.leaves(tuple(box.names)) if isinstance(n, str)}


@contextlib.contextmanager
def _with_flax_rules(scope: Any, rules: tuple) -> Iterator[Any]:
    with scope as strategy:
        if not rules:
            yield strategy
            return
        with nn.logical_axis_rules(rules):
            yield strategy
