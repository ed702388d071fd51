"""Turning the ``devices=`` argument of a strategy into a validated tuple of `jax.Device`."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["resolve_device", "resolve_devices"]

_DEVICE_NAME = re.compile(r"^/?(?:device:)?(?P<platform>[a-zA-Z]+):(?P<index>\d+)$")


def resolve_device(spec: Any, argument: str = "device") -> jax.Device:
    """One device from a `jax.Device`, a global device id, or a name (``"gpu:0"``, ``"/cpu:1"``).

    Raises:
        ValueError: for a name or id that matches no device.
        TypeError: for anything else.

    Examples:
        >>> import jax
        >>> resolve_device("cpu:0") == jax.devices("cpu")[0]
        True
    """
    if isinstance(spec, jax.Device):
        return spec
    if isinstance(spec, int) and not isinstance(spec, bool):
        by_id = {d.id: d for d in jax.devices()}
        if spec not in by_id:
            raise ValueError(f"{argument}={spec!r} is not a device id; the devices are "
                             f"{sorted(by_id)}.")
        return by_id[spec]
    if isinstance(spec, str):
        match = _DEVICE_NAME.match(spec.strip())
        if match:
            platform, index = match["platform"].lower(), int(match["index"])
            try:
                candidates = jax.devices(platform)
            except RuntimeError as err:
                raise ValueError(f"{argument}={spec!r}: no {platform!r} backend here "
                                 f"({err}).") from None
            if index >= len(candidates):
                raise ValueError(f"{argument}={spec!r}: there are only {len(candidates)} "
                                 f"{platform} devices (indices 0..{len(candidates) - 1}).")
            return candidates[index]
        raise ValueError(f"{argument}={spec!r} is not a device name: use e.g. 'cpu:0', 'gpu:1' or "
                         "'/tpu:0'.")
    raise TypeError(f"{argument}={spec!r} (type {type(spec).__name__}) is not a device: pass a "
                    "jax.Device, a device id, or a name like 'gpu:0'.")


def resolve_devices(devices: Sequence[Any] | None,
                    argument: str = "devices") -> tuple[jax.Device, ...]:
    """A non-empty tuple of distinct devices of one backend, in the order given (replica order).

    Args:
        devices: devices, ids or names; None for every device of the default backend (every
            process's, once ``jax.distributed`` connects several).
        argument: how the argument is called in error messages.

    Raises:
        ValueError: for an empty list, a duplicated device, or devices of two backends.

    Examples:
        >>> import jax
        >>> resolve_devices(None) == tuple(jax.devices())
        True
    """
    if devices is None:
        return tuple(jax.devices())
    if isinstance(devices, (str, jax.Device)) or not isinstance(devices, Sequence):
        raise TypeError(f"{argument}={devices!r} must be a list of devices (e.g. ['gpu:0', "
                        "'gpu:1']) or None.")
    resolved = tuple(resolve_device(d, f"{argument}[{i}]") for i, d in enumerate(devices))
    if not resolved:
        raise ValueError(f"{argument}=[] is empty: pass at least one device, or None for all "
                         "devices.")
    seen: dict[jax.Device, int] = {}
    for i, d in enumerate(resolved):
        if d in seen:
            raise ValueError(f"{argument} lists {d} twice (positions {seen[d]} and {i}): each "
                             "replica needs its own device; remove the duplicate.")
        seen[d] = i
    platforms = sorted({d.platform for d in resolved})
    if len(platforms) > 1:
        raise ValueError(f"{argument} mixes backends {platforms}: a strategy's replicas must run "
                         "on one backend; pick devices of one platform (e.g. all of "
                         f"jax.devices({platforms[0]!r})).")
    return resolved
