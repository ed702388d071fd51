"""`OneDeviceStrategy`: everything on one device (tf.distribute.OneDeviceStrategy)."""

from __future__ import annotations

from typing import Any

import jax

from jaxdist.strategies.base import Strategy
from jaxdist.strategies.layout import LayoutPolicy, resolve_device
from jaxdist.strategies.tf_api import StrategyExtended, StrategyV1Names

__all__ = ["OneDeviceStrategy"]


class OneDeviceStrategy(Strategy, StrategyExtended, StrategyV1Names):
    """One replica on one device: the same API as the multi-device strategies, for code that must
    run on both.

    Args:
        device: a `jax.Device`, a device id, or a name like ``"gpu:0"``; None for the first local
            device.
        axis_name: the name ``run`` binds the replica axis to (pmap-era code: ``"batch"``); None:
            ``"replica"``.

    Raises:
        ValueError / TypeError: for a device that does not exist or is not a device.

    Examples:
        >>> import jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy("cpu:0")
        >>> strategy.num_replicas_in_sync
        1
    """

    def __init__(self, device: Any = None, axis_name: str | None = None):
        device = jax.local_devices()[0] if device is None else resolve_device(device, "device")
        super().__init__(LayoutPolicy((device,)), axis_name=axis_name)

    @property
    def device(self):
        """The one device."""
        return self.devices[0]

    def __repr__(self) -> str:
        return f"OneDeviceStrategy(device={self.device})"
