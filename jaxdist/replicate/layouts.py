"""Layouts: where the pieces of an array live on a strategy's mesh.

Every strategy owns a `jax.sharding.Mesh` whose data-parallel axis is `REPLICA_AXIS`. Three layouts
cover the data-parallel strategies:

* replicated (mirrored values): every replica holds the whole array, `PartitionSpec()`;
* batch-sharded (distributed input): axis 0 split over the replicas, `PartitionSpec("replica")`;
* per-replica (one component per replica, stacked on a new leading axis): also
  `PartitionSpec("replica")`, on an array whose axis 0 has exactly one entry per replica.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["MODEL_AXIS", "REPLICA_AXIS", "batch_sharded", "entry_axes", "is_on_mesh", "on_mesh",
           "path_name", "put", "replicated", "spec_axes", "splits_batch_axis"]

REPLICA_AXIS = "replica"
"""The name of the data-parallel mesh axis of every strategy."""

MODEL_AXIS = "model"
"""The name of the model-parallel mesh axis (a strategy with ``model_parallelism > 1``)."""


def replicated(mesh: Mesh) -> NamedSharding:
    """The mirrored layout: a whole copy of the array on every device of ``mesh``.

    Examples:
        >>> import jax, numpy as np
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (REPLICA_AXIS,))
        >>> replicated(mesh).is_fully_replicated
        True
    """
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """The distributed-input (and per-replica) layout: axis 0 split over ``mesh``'s replica axis.

    Examples:
        >>> import jax, numpy as np
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (REPLICA_AXIS,))
        >>> batch_sharded(mesh).spec
        P('replica',)
    """
    return NamedSharding(mesh, PartitionSpec(REPLICA_AXIS))


def put(x: Any, sharding: NamedSharding, *, copy: bool = False) -> jax.Array:
    """Place host or device value ``x`` (the same on every process) with ``sharding``, across
    processes too: a host value is sliced on the host and each device gets only its part (a split
    layout is born split); a global array spanning processes is resharded on the devices.

    Args:
        x: the value.
        sharding: where it goes.
        copy: never share a buffer with ``x`` (a device array already where it goes is copied): a
            value the caller keeps stays valid when the result is donated.

    Examples:
        >>> import jax, numpy as np
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (REPLICA_AXIS,))
        >>> put(np.ones(2), replicated(mesh)).shape
        (2,)
    """
    # device_put reuses a buffer where it can, whatever may_alias says
    if copy and isinstance(x, jax.Array):
        x = x.copy()
    if (jax.process_count() == 1 or sharding.is_fully_addressable
            or (isinstance(x, jax.Array) and not x.is_fully_addressable)):  # a global array
        return jax.device_put(x, sharding)
    # every process holds the whole value; each transfers only its own devices' parts
    local = np.asarray(x)
    return jax.make_array_from_callback(local.shape, sharding, lambda idx: local[idx])


def on_mesh(sharding: Any, mesh: Mesh) -> bool:
    """True when ``sharding`` lays an array out over exactly ``mesh`` (a `NamedSharding` on it: the
    same devices in the same order, axis names and axis types). The one answer to "is this on the
    mesh".

    Examples:
        >>> import jax, numpy as np
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (REPLICA_AXIS,))
        >>> (on_mesh(replicated(mesh), mesh),
        ...  on_mesh(jax.sharding.SingleDeviceSharding(jax.devices()[0]), mesh))
        (True, False)
    """
    return isinstance(sharding, NamedSharding) and (sharding.mesh is mesh or sharding.mesh == mesh)


def is_on_mesh(x: Any, mesh: Mesh) -> bool:
    """True when ``x`` is a `jax.Array` laid out on ``mesh`` (`on_mesh`).

    Examples:
        >>> import jax, numpy as np
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (REPLICA_AXIS,))
        >>> is_on_mesh(jax.device_put(np.zeros(2), replicated(mesh)), mesh)
        True
    """
    return isinstance(x, jax.Array) and on_mesh(x.sharding, mesh)


def splits_batch_axis(x: Any, mesh: Mesh, axes: tuple[str, ...] = (REPLICA_AXIS,)) -> bool:
    """True when ``x`` is on ``mesh`` with its axis 0 split over (at least) the batch ``axes`` (a
    distributed batch; `REPLICA_AXIS` unless the mesh is the user's own).

    Examples:
        >>> import jax, numpy as np
        >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (REPLICA_AXIS,))
        >>> splits_batch_axis(jax.device_put(np.zeros(2), batch_sharded(mesh)), mesh)
        True
    """
    if not is_on_mesh(x, mesh) or x.ndim == 0:
        return False
    spec = x.sharding.spec
    if not spec or spec[0] is None:
        return False
    first = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    return set(axes) <= set(first)


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one `PartitionSpec` entry names (None, a name, or a tuple of names).

    Examples:
        >>> entry_axes(None), entry_axes("data"), entry_axes(("data", "fsdp"))
        ((), ('data',), ('data', 'fsdp'))
    """
    if entry is None:
        return ()
    return tuple(n for n in entry if n is not None) if isinstance(entry, tuple) else (entry,)


def spec_axes(spec: Any) -> set[str]:
    """Every mesh axis a `PartitionSpec` splits over.

    Examples:
        >>> sorted(spec_axes(PartitionSpec(("data", "fsdp"), None, "tensor")))
        ['data', 'fsdp', 'tensor']
    """
    return {n for entry in spec for n in entry_axes(entry)}


def path_name(path: tuple) -> str:
    """``"params/Dense_0/kernel"`` for a pytree key path: the name layout rules match against.

    Examples:
        >>> import jax
        >>> [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path({"params": {"w": 1}})]
        ['params/w']
    """
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)
