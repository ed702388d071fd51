"""`MirroredStrategy`: synchronous data parallelism over the local devices (tf.distribute.MirroredStrategy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxdist.strategies.base import Strategy
from jaxdist.strategies.devices import resolve_devices
from jaxdist.strategies.extended import StrategyExtended
from jaxdist.strategies.legacy import StrategyV1Names
from jaxdist.strategies.policy import LayoutPolicy

__all__ = ["MirroredStrategy"]


class MirroredStrategy(Strategy, StrategyExtended, StrategyV1Names):
    """One replica per device; parameters mirrored (replicated), batches split over the replicas.

    Args:
        devices: the devices (``jax.Device``, ids or names such as ``"gpu:0"``), in replica order;
            None for every local device of the default backend.
        host_offload: keep ``"opt_state"``, ``"params"`` or ``"all"`` variables in host memory (``"pinned_host"``)
            between steps and stream them to the devices for each step (see `jaxdist.strategies.offload`);
            None: everything in device memory.
        axis_name: the name ``run`` binds the replica axis to (pmap-era code: ``"batch"``); None: ``"replica"``.

    Raises:
        ValueError: for an empty list, a device listed twice, devices of two backends, or an unknown
            ``host_offload`` (or one the devices cannot hold: no ``"pinned_host"`` memory).

    Example:
        >>> import jax, jaxdist as jd
        >>> strategy = jd.MirroredStrategy()
        >>> strategy.num_replicas_in_sync == len(jax.local_devices())
        True
    """

    def __init__(
        self, devices: Sequence[Any] | None = None, host_offload: str | None = None, axis_name: str | None = None
    ):
        policy = LayoutPolicy(resolve_devices(devices, "devices"), host_offload=host_offload)
        super().__init__(policy, axis_name=axis_name)
