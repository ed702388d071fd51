"""Per-replica values from a function: `ValueContext` and
``experimental_distribute_values_from_function``.

The components are placed as `PerReplica` values always are (one global array whose leading axis
indexes the replicas, split over the batch axes), built from single-device arrays with
`jax.make_array_from_single_device_arrays`: each process calls ``value_fn`` only for the replicas
its devices hold, and no value ever travels between processes or through device 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxdist.replicate.values import PerReplica
from jaxdist.strategies import ambient
from jaxdist.strategies.layout import LayoutPolicy

__all__ = ["ValueContext", "distribute_values_from_function"]


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """What ``value_fn`` of ``experimental_distribute_values_from_function`` learns of its replica.

    Attributes:
        replica_id_in_sync_group: the replica the value is for, in ``[0, num_replicas_in_sync)``.
        num_replicas_in_sync: how many replicas run in lockstep.

    Raises:
        ValueError: when ``num_replicas_in_sync < 1`` or the replica id is outside ``[0,
            num_replicas_in_sync)``.

    Examples:
        >>> ctx = ValueContext(replica_id_in_sync_group=2, num_replicas_in_sync=4)
        >>> ctx.replica_id_in_sync_group / ctx.num_replicas_in_sync
        0.5
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        if self.num_replicas_in_sync < 1:
            raise ValueError(f"num_replicas_in_sync={self.num_replicas_in_sync} must be >= 1.")
        if not 0 <= self.replica_id_in_sync_group < self.num_replicas_in_sync:
            raise ValueError(f"replica_id_in_sync_group={self.replica_id_in_sync_group} must be in "
                             f"[0, {self.num_replicas_in_sync}) "
                             f"(num_replicas_in_sync={self.num_replicas_in_sync}).")


def _component(leaf: Any, replica: int, path: str) -> Any:
    """One replica's leaf as an array (host or device), checked to be a valid component."""
    if isinstance(leaf, jax.core.Tracer):
        raise ValueError(f"value_fn returned a traced value for replica {replica} at {path}: "
                         "per-replica values are built eagerly, once, from concrete values. Call "
                         "experimental_distribute_values_from_function outside jax.jit / "
                         "strategy.jit and pass the result into the step as an argument.")
    if isinstance(leaf, jax.Array):
        return leaf
    array = np.asarray(leaf)
    if array.dtype.kind not in "biufc":
        raise TypeError(f"value_fn returned {leaf!r} (type {type(leaf).__name__}) for replica "
                        f"{replica} at {path}: each leaf must be an array or a number (e.g. a "
                        "jax.random key, a seed, a float).")
    # Numbers and numpy arrays take the dtype JAX would give them (float64 -> float32 without x64),
    # so that a replica returning a Python number and one returning a jax array of it agree.
    return array.astype(jax.dtypes.canonicalize_dtype(array.dtype), copy=False)


def distribute_values_from_function(policy: LayoutPolicy, owner: Any,
                                    value_fn: Callable[[ValueContext], Any]) -> Any:
    """``value_fn(ValueContext)`` for each of this process's replicas, as a pytree of `PerReplica`
    leaves (see `Strategy.experimental_distribute_values_from_function`).

    Raises:
        TypeError: when ``value_fn`` is not callable or returns a leaf that is not an array or a
            number.
        ValueError: when replicas' values differ in structure, shape or dtype, or a value is traced.
        RuntimeError: when called inside a replica function.
    """
    if not callable(value_fn):
        raise TypeError(f"value_fn={value_fn!r} is not callable: pass a function of a "
                        "jd.ValueContext, e.g. lambda ctx: jax.random.fold_in(key, "
                        "ctx.replica_id_in_sync_group).")
    if ambient.current_replica() is not None:
        raise RuntimeError("experimental_distribute_values_from_function was called inside a "
                           "replica function: it builds per-replica values in cross-replica "
                           "context; call it before strategy.run and pass the result in (inside "
                           "run, jd.get_replica_context().replica_id_in_sync_group is this "
                           "replica's id).")
    n = policy.num_replicas
    replicas = policy.local_replicas
    if not replicas:  # a strategy over other processes' devices only: nothing here to compute
        raise ValueError(f"this process (index {jax.process_index()}) holds none of the {n} "
                         f"replicas of mesh {dict(policy.mesh.shape)}: build the strategy over "
                         "devices that include this process's (jax.local_devices()).")
    per_replica: dict[int, list[Any]] = {}
    paths: list[str] = []
    treedef = None
    for r in replicas:
        leaves, tree = jax.tree_util.tree_flatten_with_path(value_fn(ValueContext(r, n)))
        if treedef is None:
            treedef, paths = tree, [jax.tree_util.keystr(p) or "the root" for p, _ in leaves]
        elif tree != treedef:
            raise ValueError(f"value_fn returned {tree} for replica {r} but {treedef} for replica "
                             f"{replicas[0]}: every replica's value must have the same structure "
                             "(one PerReplica per leaf).")
        per_replica[r] = [_component(leaf, r, path)
                          for path, (_, leaf) in zip(paths, leaves, strict=True)]

    first = per_replica[replicas[0]]
    for r in replicas[1:]:
        for path, a, b in zip(paths, first, per_replica[r], strict=True):
            if (np.shape(a), a.dtype) != (np.shape(b), b.dtype):
                raise ValueError(f"value_fn returned {b.dtype}{list(np.shape(b))} for replica {r} "
                                 f"at {path} but {a.dtype}{list(np.shape(a))} for replica "
                                 f"{replicas[0]}: every replica's component must have the same "
                                 "shape and dtype (they are stacked into one array split over the "
                                 "replicas).")

    sharding = policy.batch_sharding
    stacked = []
    for i, component in enumerate(first):
        shape = (n, *np.shape(component))
        # one shard per device (with a model axis, several devices hold one replica's component)
        shards = [
            jax.device_put(per_replica[index[0].start or 0][i][None], device)
            for device, index in sharding.addressable_devices_indices_map(shape).items()
        ]
        stacked.append(jax.make_array_from_single_device_arrays(shape, sharding, shards))
    return jax.tree.unflatten(treedef, [PerReplica(s, owner) for s in stacked])
