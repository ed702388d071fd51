"""Replica-axis collective helpers: the one home of "is varying", "make varying", all-reduce by op,
and reducing a stacked per-replica value.

Inside `jax.shard_map` (``check_vma`` on) every traced value has a type that says over which manual
mesh axes it may differ ("varying") and over which it is known to be identical ("invariant").
Collectives that move data need varying inputs; values whose type is invariant are what
``strategy.run`` returns mirrored. JAX renamed where that type lives (``aval.vma`` up to 0.11,
``aval.manual_axis_type.varying`` since 0.12): `is_varying` reads both, so no other module depends
on the attribute name.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxdist.replicate.layouts import REPLICA_AXIS
from jaxdist.replicate.ops import ReduceOp, VariableAggregation

__all__ = ["AxisName", "all_reduce", "axis_names", "axis_size", "is_axis_name", "is_varying",
           "keep_per_replica", "PER_REPLICA_SCOPE", "reduce_stacked", "to_varying"]

AxisName = str | tuple[str, ...]
"""A replica axis: one mesh axis name, or several (a user mesh whose batch is split over ``("data",
"fsdp")``) that collectives reduce over together, as JAX's own ``axis_name`` arguments accept."""


def axis_names(axis_name: AxisName) -> tuple[str, ...]:
    """The mesh axis names of ``axis_name``.

    Examples:
        >>> axis_names("replica"), axis_names(("data", "fsdp"))
        (('replica',), ('data', 'fsdp'))
    """
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def is_axis_name(value: Any) -> bool:
    """True for a mesh axis name or a non-empty tuple of them (a JAX collective's ``axis_name``).

    Examples:
        >>> is_axis_name("replica"), is_axis_name(("data", "fsdp")), is_axis_name(3)
        (True, True, False)
    """
    if isinstance(value, str):
        return bool(value)
    return isinstance(value, tuple) and bool(value) and all(isinstance(a, str) and a for a in value)


def _varying_axes(x: Any) -> frozenset[str]:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    varying = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)
    return varying or frozenset()


def is_varying(x: Any, axis_name: AxisName = REPLICA_AXIS) -> bool:
    """True when traced ``x`` may differ over mesh axis ``axis_name`` (over any of several; False
    outside `shard_map`).

    Examples:
        >>> import jax.numpy as jnp
        >>> is_varying(jnp.ones(2))
        False
    """
    varying = _varying_axes(x)
    return any(a in varying for a in axis_names(axis_name))


def to_varying(x: Any, axis_name: AxisName = REPLICA_AXIS) -> Any:
    """``x`` typed as varying over ``axis_name`` (every one of several; a no-op when it already is):
    each replica then owns its copy, ``jax.grad`` with respect to it is local, and collectives
    accept it."""
    varying = _varying_axes(x)
    missing = tuple(a for a in axis_names(axis_name) if a not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


PER_REPLICA_SCOPE = "jaxdist_per_replica"
"""The name scope of `keep_per_replica`'s marker: ``strategy.run`` reads it in the replica
function's jaxpr."""


def keep_per_replica(value: Any, axis_name: AxisName = REPLICA_AXIS) -> Any:
    """``value`` (a pytree) declared different on every replica on purpose: ``strategy.run`` returns
    it as a `PerReplica` and never takes it for a mirrored value that drifted (error-feedback
    residuals, local SGD). The declaration is a marker in the program (an optimisation barrier,
    which computes nothing, under the name scope `PER_REPLICA_SCOPE`); outside `shard_map` (one
    replica) ``value`` is returned unchanged.

    Examples:
        >>> import jax.numpy as jnp
        >>> keep_per_replica(jnp.ones(2)).tolist()
        [1.0, 1.0]
    """
    if axis_size(axis_name) is None:
        return value
    with jax.named_scope(PER_REPLICA_SCOPE):
        return jax.lax.optimization_barrier(
            jax.tree.map(lambda x: to_varying(jnp.asarray(x), axis_name), value))


def axis_size(axis_name: AxisName = REPLICA_AXIS) -> int | None:
    """The size of mesh axis ``axis_name`` where it is bound (inside `shard_map`), else None.

    Examples:
        >>> axis_size() is None
        True
    """
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        return None


def all_reduce(value: Any, reduce_op: ReduceOp | VariableAggregation,
               axis_name: AxisName = REPLICA_AXIS) -> Any:
    """psum / pmean (by ``reduce_op``: SUM or MEAN) of a pytree over ``axis_name``; every replica
    gets it. Outside `shard_map` (the axis is not bound: one replica) ``value`` comes back as is.

    Examples:
        >>> import jax.numpy as jnp
        >>> all_reduce(jnp.ones(2), ReduceOp.SUM).tolist()
        [1.0, 1.0]
    """
    if axis_size(axis_name) is None:
        return value
    # invariant x sums to N * x
    value = jax.tree.map(lambda x: to_varying(jnp.asarray(x), axis_name), value)
    if reduce_op.name == "SUM":
        return jax.lax.psum(value, axis_name)
    if reduce_op.name == "MEAN":
        return jax.lax.pmean(value, axis_name)
    raise ValueError(f"reduce_op={reduce_op!r}: all_reduce takes SUM or MEAN.")


def reduce_stacked(stacked: jax.Array, mode: ReduceOp | VariableAggregation,
                   axis: int = 0) -> jax.Array:
    """Combine the components of a per-replica value stacked on ``axis``: SUM, MEAN or
    ONLY_FIRST_REPLICA.

    Examples:
        >>> import jax.numpy as jnp
        >>> reduce_stacked(jnp.array([1.0, 3.0]), ReduceOp.MEAN).tolist()
        2.0
    """
    if mode.name == "SUM":
        return jnp.sum(stacked, axis=axis)
    if mode.name == "MEAN":
        return jnp.mean(stacked, axis=axis)
    if mode.name == "ONLY_FIRST_REPLICA":
        return jnp.take(_typed_whole_along(stacked, axis), 0, axis=axis)
    raise ValueError(f"mode={mode!r}: a stacked per-replica value reduces by SUM, MEAN or "
                     "ONLY_FIRST_REPLICA.")


def _typed_whole_along(x: jax.Array, axis: int) -> jax.Array:
    """``x`` typed whole along ``axis`` where its type splits that axis over Explicit mesh axes (a
    reshard: one component is then indexed as on one device); as it is elsewhere."""
    typed = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(typed, "spec", None)
    if not spec or axis >= len(spec) or spec[axis] is None:
        return x
    mesh = typed.mesh if isinstance(x, jax.core.Tracer) else x.sharding.mesh
    entries = list(spec)
    entries[axis] = None
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh,
                                                               jax.sharding.PartitionSpec(*entries)))
