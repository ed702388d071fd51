"""Reading per-replica results in cross-replica code: reduce, gather, and this process's components.

``strategy.run`` returns `PerReplica` / `SyncOnRead` values (one component per replica, stacked on a
leading axis split over the replicas). These verbs turn them into one mirrored value (`reduce`,
`gather`) or list this process's components (`local_results`); each compiled program lives in the
strategy's `ProgramCache`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxdist.replicate.ops import ReduceOp
from jaxdist.replicate.trees import is_distributed
from jaxdist.replicate.values import local_components
from jaxdist.strategies.compile._cache import ProgramCache
from jaxdist.strategies.layout import LayoutPolicy

__all__ = ["gather", "local_results", "reduce"]


def _check_owner(owner: Any, value: Any, what: str) -> None:
    if value.owner is not None and value.owner is not owner:
        raise ValueError(f"{what} got a {type(value).__name__} of another strategy "
                         f"({value.owner!r}), not {owner!r}: use the strategy that produced it.")


def _program(programs: ProgramCache, key: Any, build: Callable[[], Callable]) -> Callable:
    return programs.get(None, key, lambda _: build())


def reduce(policy: LayoutPolicy, programs: ProgramCache, owner: Any, reduce_op: ReduceOp | str,
           value: Any, axis: int | None) -> Any:
    """Combine per-replica values into one mirrored value (see `Strategy.reduce`)."""
    op = ReduceOp.parse(reduce_op, "reduce_op")
    if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
        raise TypeError(  # e.g. 2018 code passing reduce(aggregation, value, destinations)
            f"axis={axis!r} must be an int or None. The 2018 form reduce(aggregation, value, "
            "destinations) is strategy.batch_reduce(aggregation, [(value, destinations)]).")
    n = policy.num_replicas

    def one(v):
        if is_distributed(v):
            _check_owner(owner, v, "strategy.reduce")
            stacked, distributed = v.stacked, True
        else:
            stacked, distributed = jnp.asarray(v), False
        ndim = stacked.ndim - (1 if distributed else 0)
        if axis is not None and not -ndim <= axis < ndim:
            raise ValueError(f"axis={axis} is out of range for per-replica values of rank {ndim}; "
                             f"use None or an axis in [{-ndim}, {ndim}).")
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

            return jax.jit(reduce_fn, out_shardings=policy.replicated_sharding)

        return _program(programs, ("reduce", op, inner, distributed), build)(stacked)

    return jax.tree.map(one, value, is_leaf=is_distributed)


def gather(policy: LayoutPolicy, programs: ProgramCache, owner: Any, value: Any, axis: int) -> Any:
    """Concatenate per-replica values along ``axis`` into one mirrored array (`Strategy.gather`)."""
    n = policy.num_replicas

    def one(v):
        if is_distributed(v):
            _check_owner(owner, v, "strategy.gather")
            stacked = v.stacked
        else:
            v = jnp.asarray(v)
            stacked = None
        ndim = (stacked.ndim - 1) if stacked is not None else v.ndim
        if ndim == 0:
            raise ValueError("strategy.gather got scalar per-replica values: gather concatenates "
                             "along an axis; use strategy.experimental_local_results or "
                             "strategy.reduce for scalars.")
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

            return jax.jit(gather_fn, out_shardings=policy.replicated_sharding)

        return _program(programs, ("gather", ax, stacked is None), build)(
            stacked if stacked is not None else v)

    return jax.tree.map(one, value, is_leaf=is_distributed)


def local_results(policy: LayoutPolicy, owner: Any, value: Any) -> tuple[Any, ...]:
    """The values of this process's replicas, one entry per local replica (see
    `Strategy.experimental_local_results`)."""
    replicas = policy.local_replicas
    holders: dict[int, jax.Device] = {}  # a device of this process in each local replica
    indices = policy.batch_sharding.addressable_devices_indices_map((policy.num_replicas,))
    for device, index in indices.items():
        holders.setdefault(index[0].start or 0, device)
    local = [holders[r] for r in replicas]

    def components(v):
        if is_distributed(v):
            _check_owner(owner, v, "strategy.experimental_local_results")
            return local_components(v.stacked)
        if isinstance(v, jax.Array) and v.sharding.is_fully_replicated:
            by_device = {s.device: s.data for s in v.addressable_shards}
            if all(d in by_device for d in local):
                return tuple(by_device[d] for d in local)
        return (v,) * len(replicas)

    leaves, treedef = jax.tree.flatten(value, is_leaf=is_distributed)
    per_leaf = [components(v) for v in leaves]
    return tuple(jax.tree.unflatten(treedef, [c[i] for c in per_leaf])
                 for i in range(len(replicas)))
