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
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.replicate.layouts import MODEL_AXIS, REPLICA_AXIS, path_name
from jaxdist.strategies.base import Strategy
from jaxdist.strategies.devices import resolve_devices

__all__ = ["ShardedStrategy"]


class ShardedStrategy(Strategy):
    """Data parallelism with parameters and optimizer state sharded over the replicas (FSDP / ZeRO-3).

    Args:
        devices: the devices (as for `MirroredStrategy`); None for every local device.
        min_shard_size: variables with fewer elements stay replicated (sharding tiny arrays costs more in
            collectives than it saves in memory).
        layout_rules: ``[(regex, PartitionSpec), ...]`` overriding the FSDP rule for matching variable paths.
        model_parallelism: devices per replica along a ``"model"`` mesh axis, for tensor-parallel rules.

    Raises:
        ValueError: for a bad device list, ``model_parallelism`` that does not divide the device count, or a
            malformed layout rule.

    Example:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.ShardedStrategy(min_shard_size=16)
        >>> params = strategy.create_variables(lambda: {"w": jnp.zeros((64, 8)), "b": jnp.zeros(8)})
        >>> params["w"].sharding.spec, params["b"].sharding.spec
        (P('replica',), P())
    """

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        min_shard_size: int = 1024,
        layout_rules: Sequence[tuple[str, PartitionSpec]] | None = None,
        model_parallelism: int = 1,
    ):
        resolved = resolve_devices(devices, "devices")
        if not isinstance(model_parallelism, int) or model_parallelism < 1 or len(resolved) % model_parallelism:
            raise ValueError(
                f"model_parallelism={model_parallelism!r} must be an int >= 1 that divides the {len(resolved)} "
                "devices (the mesh is (replica, model) = (devices / model_parallelism, model_parallelism))."
            )
        if not isinstance(min_shard_size, int) or min_shard_size < 0:
            raise ValueError(f"min_shard_size={min_shard_size!r} must be an int >= 0 (elements).")
        super().__init__(resolved, model_parallelism=model_parallelism)
        self.min_shard_size = min_shard_size
        self._rules = [self._check_rule(i, rule) for i, rule in enumerate(layout_rules or ())]
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

    def variable_layout(self, path: str, aval: jax.ShapeDtypeStruct) -> jax.sharding.Sharding:
        """The layout rule that matches ``path`` first, else the FSDP rule (see the class docstring)."""
        shape = tuple(aval.shape)
        for pattern, spec in self._rules:
            if pattern.search(path):
                self._check_fits(path, shape, spec)
                return NamedSharding(self.mesh, spec)
        return NamedSharding(self.mesh, self._fsdp_spec(shape))

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

    def _check_fits(self, path: str, shape: tuple[int, ...], spec: PartitionSpec) -> None:
        if len(spec) > len(shape):
            raise ValueError(
                f"layout rule {spec} for variable {path!r} of shape {shape} names {len(spec)} axes but the "
                f"variable has only {len(shape)}: shorten the PartitionSpec."
            )
        for axis, entry in enumerate(spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            parts = int(np.prod([self.mesh.shape[a] for a in names if a is not None], dtype=np.int64))
            if shape[axis] % parts:
                raise ValueError(
                    f"layout rule {spec} splits axis {axis} (size {shape[axis]}) of variable {path!r} into {parts} "
                    "parts, which does not divide it: pick another axis or pad the variable."
                )

    def variable_layouts(self, tree: Any) -> dict[str, PartitionSpec]:
        """``{path: PartitionSpec}`` this strategy gives each variable of ``tree`` (arrays or shapes).

        Example:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> jd.ShardedStrategy(min_shard_size=1).variable_layouts({"w": jnp.zeros((8, 16))})
            {'w': P(None, 'replica')}
        """
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        return {
            path_name(p): self.variable_layout(
                path_name(p), jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", np.float32))
            ).spec
            for p, x in leaves
        }

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
