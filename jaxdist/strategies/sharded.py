"""`ShardedStrategy`: FSDP / ZeRO-3, tensor parallelism and HSDP, on its own mesh or the user's,
across hosts.

Every variable is split on its largest axis that the FSDP group divides evenly; variables smaller
than ``min_shard_size`` elements, or with no divisible axis, stay replicated. Batches are split over
the replicas as in `MirroredStrategy`. In ``strategy.jit`` XLA gathers each parameter where the step
needs it and reduce-scatters its gradient, so each device holds ~1/N of the parameters and optimizer
state and the step still equals single-device training. The mesh is the strategy's own
(``model_parallelism=k``: ``(replica, model)`` = ``(N / k, k)``) or the user's, names and all
(``mesh=``, ``batch_axes=``, ``fsdp_axes=``: a subset of the batch axes is HSDP); see
`jaxdist.strategies.layout._meshes`. Over several processes the mesh must span them all.

Which layout a variable gets, first that applies:

1. the first ``layout_rules`` regex (Keras' ``LayoutMap``) that `re.search` finds in its path
   (``"params/Dense_0/kernel"``; optimizer state such as Adam's ``mu`` contains the same path, so it
   follows its parameter): exactly that spec, the override of last resort;
2. its Flax partitioning annotation (MaxText / T5X): mesh axes as named (``nn.with_partitioning``),
   or logical names (``nn.with_logical_partitioning``) through ``logical_axis_rules`` in Flax's
   priority order (``nn.logical_to_mesh_axes``); a logical name with no rule at all is FSDP's to
   use: when no dimension is already split over an FSDP axis, the largest such dimension that the
   FSDP group divides is (a rule ``(name, None)`` keeps a dimension whole). Optax states built from
   boxed params hold the same boxes, so optimizer state follows its parameter;
3. the FSDP rule (unannotated variables).

An entry of ``layout_rules`` / ``logical_axis_rules`` that matches no variable of what
`create_variables` builds is reported (`UnmatchedLayoutRuleWarning`): a renamed layer or axis would
otherwise silently fall back to FSDP. Inside ``scope()`` the logical rules are also Flax's ambient
rules, so ``nn.with_logical_constraint`` in model code (activations) and the constraints Flax
applies when it unboxes a parameter use the same table.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxdist.job import initialize_cluster
from jaxdist.replicate.layouts import path_name
from jaxdist.strategies.base import Strategy
from jaxdist.strategies.layout import (
    IdleAxisWarning,
    LayoutPolicy,
    is_annotated,
    logical_names,
    resolve_devices,
    unboxed,
)
from jaxdist.strategies.tf_api import StrategyExtended, StrategyV1Names

__all__ = ["IdleAxisWarning", "ShardedStrategy", "UnmatchedLayoutRuleWarning"]


class UnmatchedLayoutRuleWarning(UserWarning):
    """A ``layout_rules`` / ``logical_axis_rules`` entry of a `ShardedStrategy` matched no variable
    it created.

    The variables it was meant for got another layout (usually the FSDP rule): fix the regex or the
    logical name, or drop the entry. Logical names that only activations use
    (``nn.with_logical_constraint``) are declared with ``ShardedStrategy(activation_axes=...)`` and
    never reported.
    """


class ShardedStrategy(Strategy, StrategyExtended, StrategyV1Names):
    """Data parallelism with parameters and optimizer state sharded over the replicas (FSDP).

    Args:
        devices: the devices (as for `MirroredStrategy`); None for every device of every process.
        min_shard_size: variables with fewer elements stay replicated (sharding tiny arrays costs
            more in collectives than it saves in memory).
        layout_rules: ``[(regex, PartitionSpec), ...]`` overriding the FSDP rule for matching
            variable paths.
        model_parallelism: devices per replica along a ``"model"`` mesh axis, for tensor-parallel
            rules.
        logical_axis_rules: Flax logical axis rules ``[(logical_name, mesh_axes), ...]``
            (``mesh_axes``: None, a mesh axis name or a tuple of them, e.g. ``"replica"`` /
            ``"model"``) for variables annotated with ``nn.with_logical_partitioning``; earlier
            rules take priority, as in Flax.
        activation_axes: logical names of ``logical_axis_rules`` that only activations use
            (``nn.with_logical_constraint``): never reported as matching no variable.
        host_offload: keep ``"opt_state"``, ``"params"`` or ``"all"`` variables in host memory
            between steps, in their FSDP layout (ZeRO-Offload; see the host-offload guide); None:
            device memory.
        axis_name: the name ``run`` binds the replica axis to (pmap-era code: ``"batch"``); None:
            ``"replica"``.
        mesh: the user's own `jax.sharding.Mesh` (any axis names, any devices of any processes)
            instead of ``devices`` / ``model_parallelism``.
        batch_axes: with ``mesh``, the axes a batch's rows are split over (required when it has
            several).
        fsdp_axes: with ``mesh``, the batch axes the FSDP rule splits variables over; default
            ``batch_axes`` (ZeRO-3) and the context axes, a subset for HSDP, ``()`` for none
            (variables split only by rules and annotations).
        context_axes: with ``mesh``, the axes a batch's sequence dimension is split over (context
            parallelism: long sequences; see `jaxdist.nn.dot_product_attention`). Their devices
            are otherwise idle for weights, so by default the FSDP rule splits variables over them
            too. The logical name ``"length"`` maps to them (and ``"batch"`` to the batch axes)
            unless ``logical_axis_rules`` say otherwise.
        context_parallelism: the short form of ``context_axes``: a ``"context"`` axis of that size
            on the strategy's own mesh ``(replica, context[, model])``.
        sequence_axis: which dimension of a batch leaf is its sequence (1: ``(batch, length,
            ...)``).
        stage_axes: with ``mesh``, the model axes pipeline stages are laid out over: the stacked
            layers of a `jaxdist.nn.Pipeline` (logical axis ``"layers"``) are split over them and
            run as a pipeline.
        pipeline_parallelism: the short form of ``stage_axes``: a leading ``"stage"`` mesh axis of
            that size (``(stage, replica)``, or ``(stage, replica, model)`` with
            ``model_parallelism``).
        expert_axes: with ``mesh``, the batch axes the stacked experts of mixture-of-experts layers
            (`jaxdist.nn.MoE`, logical axis ``"expert"`` or ``"exp"``) are split over (expert
            parallelism); tokens reach their experts by all-to-all inside the layer. Outside expert
            layers they split the batch like the other batch axes ("dp2ep"), and by default the FSDP
            rule splits the other variables over them too (``fsdp_axes`` without them opts out).
        expert_parallelism: the short form of ``expert_axes``: an ``"expert"`` batch axis of that
            size on the strategy's own mesh ``(replica, expert[, model])``.
        coordinator_address: the cluster, as for `MultiWorkerMirroredStrategy`: process 0's
            ``"host:port"`` (default: the ``JAXDIST_*`` variables, else JAX's cluster detection,
            else this process alone).
        num_processes: as for `MultiWorkerMirroredStrategy`: how many processes take part.
        process_id: as for `MultiWorkerMirroredStrategy`: this process's index.
        initialization_timeout: seconds to wait for every process to join.
        heartbeat_timeout_seconds: seconds without heartbeats after which a peer counts as dead.

    Raises:
        ValueError: for a bad device list, ``model_parallelism`` that does not divide the device
            count, bad axis roles (an axis the mesh lacks or named twice, FSDP axes outside the
            batch axes, several axes and no ``batch_axes``), a malformed layout rule or logical axis
            rule, a rule naming an axis the mesh does not have, or devices that leave out processes
            of the job.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.ShardedStrategy(min_shard_size=16)
        >>> params = strategy.create_variables(lambda: {"w": jnp.zeros((64, 8)), "b": jnp.zeros(8)})
        >>> params["w"].sharding.spec, params["b"].sharding.spec
        (P('replica',), P())
        >>> # the Flax way: annotate with logical names, map them with rules
        >>> import flax.linen as nn
        >>> tp = jd.ShardedStrategy(model_parallelism=2, min_shard_size=1,
        ...                         logical_axis_rules=[("embed", None), ("mlp", "model")])
        >>> dense = nn.Dense(16, kernel_init=nn.with_logical_partitioning(
        ...     nn.initializers.lecun_normal(), ("embed", "mlp")))
        >>> tp.create_variables(dense.init, jax.random.key(0),
        ...                     jnp.ones((1, 8)))["params"]["kernel"].value.sharding.spec
        P(None, 'model')
        >>> mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))  # the user's mesh and names
        >>> hsdp = jd.ShardedStrategy(mesh=mesh, batch_axes=("data", "fsdp"), fsdp_axes=("fsdp",),
        ...                           min_shard_size=1, logical_axis_rules=[("mlp", "tensor")])
        >>> hsdp.num_replicas_in_sync, hsdp.batch_sharding.spec
        (4, P(('data', 'fsdp'),))
        >>> kernel = hsdp.create_variables(dense.init, jax.random.key(0),
        ...                                jnp.ones((1, 8)))["params"]["kernel"]
        >>> kernel.value.sharding.spec, kernel.value.sharding.mesh.axis_names
        (P('fsdp', 'tensor'), ('data', 'fsdp', 'tensor'))
        >>> cp = jd.ShardedStrategy(mesh=jax.make_mesh((2, 4), ("data", "context")),
        ...                         batch_axes="data", context_axes="context")  # sequences over 4
        >>> cp.num_replicas_in_sync, cp.policy.batch_layout(2).spec
        (2, P('data', 'context'))
    """

    def __init__(
        self, devices: Sequence[Any] | None = None, min_shard_size: int = 1024,
        layout_rules: Sequence[tuple[str, PartitionSpec]] | None = None, model_parallelism: int = 1,
        logical_axis_rules: Sequence[tuple[str, Any]] | None = None,
        activation_axes: Sequence[str] = (), host_offload: str | None = None,
        axis_name: str | None = None, *, mesh: jax.sharding.Mesh | None = None,
        batch_axes: str | Sequence[str] | None = None, fsdp_axes: str | Sequence[str] | None = None,
        context_axes: str | Sequence[str] | None = None, context_parallelism: int = 1,
        sequence_axis: int = 1, stage_axes: str | Sequence[str] | None = None,
        pipeline_parallelism: int = 1, expert_axes: str | Sequence[str] | None = None,
        expert_parallelism: int = 1, coordinator_address: str | None = None,
        num_processes: int | None = None, process_id: int | None = None,
        initialization_timeout: int = 120, heartbeat_timeout_seconds: int = 30,
    ):
        initialize_cluster(coordinator_address, num_processes, process_id,
                           initialization_timeout=initialization_timeout,
                           heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                           caller="ShardedStrategy")
        if mesh is not None and devices is not None:
            raise ValueError("ShardedStrategy got both devices= and mesh=: a mesh already says "
                             "which devices; pass one of them.")
        policy = LayoutPolicy(
            None if mesh is not None else resolve_devices(devices, "devices"), model_parallelism,
            mesh=mesh, batch_axes=batch_axes, fsdp_axes=fsdp_axes, split_variables=True,
            min_shard_size=min_shard_size, layout_rules=layout_rules,
            logical_axis_rules=logical_axis_rules, activation_axes=activation_axes,
            host_offload=host_offload, context_axes=context_axes,
            context_parallelism=context_parallelism, sequence_axis=sequence_axis,
            stage_axes=stage_axes, pipeline_parallelism=pipeline_parallelism,
            expert_axes=expert_axes, expert_parallelism=expert_parallelism)
        super().__init__(policy, axis_name=axis_name)
        self._reported: set[str] = set()

    @property
    def context_axes(self) -> tuple[str, ...]:
        """The mesh axes a batch's sequence dimension is split over (empty: none)."""
        return self.policy.context_axes

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """The batch axes the stacked experts of MoE layers are split over (empty: none)."""
        return self.policy.expert_axes

    @property
    def min_shard_size(self) -> int:
        """Variables with fewer elements stay replicated."""
        return self.policy.rules.min_shard_size

    @property
    def logical_axis_rules(self) -> tuple[tuple[str, Any], ...]:
        """The Flax logical axis rules this strategy lays annotated variables out with."""
        return self.policy.rules.logical_axis_rules

    def variable_layouts(self, tree: Any) -> dict[str, PartitionSpec]:
        """``{path: PartitionSpec}`` this strategy gives each variable of ``tree`` (arrays, shapes).

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> jd.ShardedStrategy(min_shard_size=1).variable_layouts({"w": jnp.zeros((8, 16))})
            {'w': P(None, 'replica')}
        """
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x),
                                                             getattr(x, "dtype", np.float32)), tree)
        leaves = jax.tree_util.tree_leaves_with_path(self.variable_shardings(shapes),
                                                     is_leaf=is_annotated)
        return {path_name(p): unboxed(s).spec for p, s in leaves}

    # ---------------------------------------------------------------------------------- rule checks
    def unmatched_rules(self, tree: Any) -> list[str]:
        """The rules that placed no variable of ``tree`` (arrays or shapes, Flax boxes kept).

        A ``layout_rules`` entry is unmatched when it is the first match of no variable's path; a
        ``logical_axis_rules`` entry when no variable's annotation uses its logical name (names
        declared in ``activation_axes`` excepted). `create_variables` warns about them
        (`UnmatchedLayoutRuleWarning`).

        Examples:
            >>> import jax.numpy as jnp, jaxdist as jd
            >>> from jax.sharding import PartitionSpec as P
            >>> s = jd.ShardedStrategy(layout_rules=[("Dense_0/kernel", P()),
            ...                                      ("Dense_9/kernel", P())])
            >>> s.unmatched_rules({"params": {"Dense_0": {"kernel": jnp.zeros((2, 2))}}})
            ["layout_rules[1]=('Dense_9/kernel', P())"]
        """
        return self.policy.rules.unmatched(tree)

    def idle_axes(self, tree: Any) -> list[str]:
        """The model axes (size > 1) that split no variable of ``tree`` (arrays or shapes) and no
        activation (``activation_axes`` names mapped to them).

        Examples:
            >>> import jax, jax.numpy as jnp, jaxdist as jd
            >>> s = jd.ShardedStrategy(mesh=jax.make_mesh((4, 2), ("data", "tensor")),
            ...                        batch_axes="data")
            >>> s.idle_axes({"w": jnp.zeros((8, 8))})
            ['tensor']
        """
        return self.policy.idle_axes(self.variable_layouts(tree).values())

    def create_variables(self, init_fn: Any, *args: Any, **kwargs: Any) -> Any:
        """As `Strategy.create_variables`; then warns once per rule that placed none of the
        variables, and once per model axis that splits none of them.

        Warns:
            UnmatchedLayoutRuleWarning: naming each ``layout_rules`` / ``logical_axis_rules`` entry
                that matched no variable (see `unmatched_rules`).
            IdleAxisWarning: naming each model axis no variable is split over (see `idle_axes`).
        """
        variables = super().create_variables(init_fn, *args, **kwargs)
        layouts = self.variable_layouts(variables)
        leaves = [unboxed(x) for x in jax.tree.leaves(variables, is_leaf=is_annotated)]
        avals = [jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x)) for x in leaves]
        self.policy.warn_idle_axes(list(layouts.values()), "the variables created here",
                                   list(layouts), avals)
        unmatched = [entry for entry in self.unmatched_rules(variables)
                     if entry not in self._reported]
        if unmatched:
            self._reported.update(unmatched)
            annotated = sorted(logical_names(variables, self.mesh.axis_names))
            seen = (f"the variables' logical names are {annotated}" if annotated else
                    "no variable carries a logical annotation (nn.with_logical_partitioning; "
                    "unboxed params lose it)")
            warnings.warn(
                f"{', '.join(unmatched)} matched no variable created here ({seen}): the variables "
                f"meant for {'it' if len(unmatched) == 1 else 'them'} got another layout (the FSDP "
                "rule). Fix the regex or logical name, or drop the entry; a logical name only "
                "activations use goes in ShardedStrategy(activation_axes=...).",
                UnmatchedLayoutRuleWarning, stacklevel=2)
        return variables

    def __repr__(self) -> str:
        return (f"ShardedStrategy(num_replicas_in_sync={self.num_replicas_in_sync}, "
                f"mesh={dict(self.mesh.shape)})")
