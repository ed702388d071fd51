"""`MirroredStrategy`: synchronous data parallelism over the local devices (tf.distribute.MirroredStrategy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxdist.strategies.base import Strategy
from jaxdist.strategies.devices import resolve_devices

__all__ = ["MirroredStrategy"]


class MirroredStrategy(Strategy):
    """One replica per device; parameters mirrored (replicated), batches split over the replicas.

    Args:
        devices: the devices (``jax.Device``, ids or names such as ``"gpu:0"``), in replica order;
            None for every local device of the default backend.

    Raises:
        ValueError: for an empty list, a device listed twice, or devices of two backends.

    Example:
        >>> import jax, jaxdist as jd
        >>> strategy = jd.MirroredStrategy()
        >>> strategy.num_replicas_in_sync == len(jax.local_devices())
        True
    """

    def __init__(self, devices: Sequence[Any] | None = None):
        super().__init__(resolve_devices(devices, "devices"))
