"""Causal load balancing for context parallelism: the zig-zag ("dual chunk swap") sequence order.

A sequence split contiguously over ``N`` context devices gives device ``i`` chunks ``2i`` and ``2i +
1`` of ``2 N``; under a causal mask the last device has ``2N - 1`` times the work of the first. The
zig-zag order gives device ``i`` chunks ``i`` and ``2N - 1 - i``, the same work for all. These
helpers run inside `jax.shard_map` over the context axes, on each device's local block."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["positions", "unzigzag", "zigzag"]


def positions(block, n: int, lc: int, zigzag: bool):
    """The sequence positions of the ``lc`` tokens context device ``block`` of ``n`` holds
    (``block`` may be traced), contiguous or in the zig-zag order.

    Examples:
        >>> positions(1, 4, 4, zigzag=False).tolist(), positions(1, 4, 4, zigzag=True).tolist()
        ([4, 5, 6, 7], [2, 3, 12, 13])
    """
    if not zigzag:
        return block * lc + jnp.arange(lc)
    half = lc // 2
    return jnp.concatenate([block * half + jnp.arange(half),
                            (2 * n - 1 - block) * half + jnp.arange(half)])


def _dest(c: int, n: int) -> int:
    """The context device that holds chunk ``c`` of ``2 n`` in the zig-zag order."""
    return c if c < n else 2 * n - 1 - c


def zigzag(x, axis: int, axes, n: int):
    """Contiguous blocks (device ``i``: chunks ``2i``, ``2i + 1``) -> zig-zag (chunks ``i``, ``2n -
    1 - i``): two collective permutes, one per local half, in `jax.shard_map` over ``axes`` (``n``).

    Examples:
        >>> import jax, numpy as np
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> order = jax.shard_map(lambda x: zigzag(x, 0, "context", 4), mesh=mesh,
        ...                       in_specs=P("context"), out_specs=P("context"))
        >>> order(np.arange(8)).tolist()
        [0, 7, 1, 6, 2, 5, 3, 4]
        >>> back = jax.shard_map(lambda x: unzigzag(x, 0, "context", 4), mesh=mesh,
        ...                      in_specs=P("context"), out_specs=P("context"))
        >>> back(order(np.arange(8))).tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
    """
    h0, h1 = jnp.split(x, 2, axis=axis)
    r0 = jax.lax.ppermute(h0, axes, [(i, _dest(2 * i, n)) for i in range(n)])
    r1 = jax.lax.ppermute(h1, axes, [(i, _dest(2 * i + 1, n)) for i in range(n)])
    even = jax.lax.axis_index(axes) % 2 == 0  # got its first chunk from the first permute
    return jnp.concatenate([jnp.where(even, r0, r1), jnp.where(even, r1, r0)], axis=axis)


def unzigzag(x, axis: int, axes, n: int):
    """The inverse of `zigzag`."""
    s0, s1 = jnp.split(x, 2, axis=axis)
    even = jax.lax.axis_index(axes) % 2 == 0
    send0, send1 = jnp.where(even, s0, s1), jnp.where(even, s1, s0)
    h0 = jax.lax.ppermute(send0, axes, [(_dest(2 * i, n), i) for i in range(n)])
    h1 = jax.lax.ppermute(send1, axes, [(_dest(2 * i + 1, n), i) for i in range(n)])
    return jnp.concatenate([h0, h1], axis=axis)
