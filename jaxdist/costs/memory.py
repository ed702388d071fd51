"""Bytes per device: the one count of what a device holds of a pytree, and what devices report.

`bytes_per_device` reads a value's layout, not its buffers: it works on `jax.ShapeDtypeStruct`s (a
plan of a model too big for this machine) and on arrays spread over processes alike, and counts an
uneven split at its largest shard. `device_memory` is what the devices themselves report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

__all__ = ["array_bytes_per_device", "bytes_per_device", "device_memory", "split_parts"]


def split_parts(shape: Sequence[int], sharding: Any) -> tuple[int, ...]:
    """How many parts each dimension of an array of ``shape`` is split into (1: whole).

    Examples:
        >>> import jax
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> mesh = jax.make_mesh((4, 2), ("data", "model"))
        >>> split_parts((8, 6, 3), NamedSharding(mesh, P(("data", "model"), None)))
        (8, 1, 1)
    """
    if isinstance(sharding, NamedSharding):
        sizes = dict(sharding.mesh.shape)
        entries = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        return tuple(math.prod(sizes[n] for n in (e if isinstance(e, tuple) else (e,))
                               if isinstance(n, str)) for e in entries[:len(shape)])
    if sharding is None or not len(shape):
        return (1,) * len(shape)
    # any other sharding: its own word (these split evenly)
    shard = sharding.shard_shape(tuple(shape))
    return tuple(d // s if s else 1 for d, s in zip(shape, shard, strict=True))


def _itemsize(dtype: Any) -> int:
    # a typed PRNG key (``key<fry>``) is no NumPy dtype; its dtype knows its size
    return (dtype.itemsize if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
            else np.dtype(dtype).itemsize)


def array_bytes_per_device(shape: Sequence[int], dtype: Any, sharding: Any = None) -> int:
    """Bytes of an array of ``shape`` and ``dtype`` on the device holding the most of it under
    ``sharding`` (None: the whole array).

    Examples:
        >>> import jax, numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> mesh = jax.make_mesh((8,), ("data",))
        >>> array_bytes_per_device((10, 4), np.float32, NamedSharding(mesh, P("data")))  # 2 rows
        32
        >>> array_bytes_per_device((10, 4), np.float32)
        160
    """
    parts = split_parts(shape, sharding)
    return math.prod(-(-d // p) for d, p in zip(shape, parts, strict=True)) * _itemsize(dtype)


def bytes_per_device(tree: Any) -> int:
    """Bytes of ``tree``'s arrays one device holds: each array's largest shard under its own
    sharding (whole where it has none), summed. Arrays, `jax.ShapeDtypeStruct`s and NumPy values
    count; other leaves do not.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> mesh = jax.make_mesh((8,), ("data",))
        >>> split = jax.ShapeDtypeStruct((64, 4), jnp.float32,
        ...                              sharding=NamedSharding(mesh, P("data")))
        >>> bytes_per_device({"split": split, "whole": jnp.ones(3), "step": 0})
        140
    """
    total = 0
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
            continue
        total += array_bytes_per_device(tuple(np.shape(leaf)), leaf.dtype,
                                        getattr(leaf, "sharding", None))
    return total


def device_memory(devices: Sequence[Any]) -> dict[str, int] | None:
    """The largest ``bytes_in_use``, ``peak_bytes_in_use`` and ``bytes_limit`` over ``devices``
    (``device.memory_stats()``); None where the backend keeps no statistics (CPU).

    Examples:
        >>> import jax
        >>> device_memory(jax.devices("cpu")) is None
        True
    """
    out: dict[str, int] = {}
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # a backend without statistics may raise instead of returning None
            stats = None
        for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
            if stats and key in stats:
                out[key] = max(out.get(key, 0), int(stats[key]))
    return out or None
