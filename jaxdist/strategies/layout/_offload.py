"""Host offloading: variables and/or optimizer state kept in host memory, streamed in per step.

JAX gives every sharding a *memory kind*: ``"device"`` (the default) or ``"pinned_host"`` (the host
memory attached to that device, which accelerators reach by DMA). A strategy created with
``host_offload=`` places the variables it is told to in ``"pinned_host"`` memory, in their usual
layout (mirrored, FSDP, ...; ZeRO-Offload's placement). Compiled steps then stream them:

* at the entry of a ``strategy.jit`` step (and of the on-device loop of ``run_steps_on_dataset``)
  every argument in host memory is copied to device memory, so the step's code computes exactly
  what it computes without offloading;
* outputs shaped like an offloaded argument (``state -> new_state``) go back to host memory at the
  exit, so the state stays offloaded from step to step; other outputs stay on the device;
* eager ``strategy.run`` copies offloaded arguments to device memory before the replica program.

Between steps the offloaded state occupies no device memory; during a step it is a temporary: this
trades transfer time for device-memory capacity (XLA overlaps the copies with compute where it can).

Which variables are *optimizer state* is carried by their type, never guessed from names: subtrees
that are optax states (every optax state is a NamedTuple defined in optax) and ``nnx.OptState``
variables (what ``nnx.Optimizer`` holds). Sync-on-read values are never offloaded: replicas update
them in every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxdist.replicate.trees import flax_nnx

__all__ = ["HOST_MEMORY_KIND", "HOST_OFFLOAD_MODES", "in_host_memory", "is_optimizer_state",
           "offload_shardings", "parse_host_offload", "to_device_memory", "to_host_memory"]

HOST_MEMORY_KIND = "pinned_host"
"""The memory kind offloaded values live in."""

HOST_OFFLOAD_MODES = ("opt_state", "params", "all")
"""``host_offload`` values: optimizer state only, every other variable only, or every variable."""

_HOST_KINDS = ("pinned_host", "unpinned_host")


def parse_host_offload(value: Any, devices: Sequence[Any],
                       argument: str = "host_offload") -> str | None:
    """Validate a ``host_offload`` option against the devices it will run on.

    Args:
        value: None (no offloading) or one of `HOST_OFFLOAD_MODES`.
        devices: the strategy's devices; each must have ``"pinned_host"`` memory.
        argument: the option's name in error messages.

    Returns:
        The mode, or None.

    Raises:
        ValueError: for an unknown mode, or devices without host memory.

    Examples:
        >>> import jax
        >>> parse_host_offload("opt_state", jax.devices()[:1])
        'opt_state'
    """
    if value is None:
        return None
    if not isinstance(value, str) or value not in HOST_OFFLOAD_MODES:
        raise ValueError(f"{argument}={value!r} is not a host offloading mode: use None "
                         "(everything in device memory), 'opt_state' (optimizer state in host "
                         "memory), 'params' (every variable but the optimizer state) or 'all'.")
    for device in devices:
        kinds = sorted(m.kind for m in device.addressable_memories())
        if HOST_MEMORY_KIND not in kinds:
            raise ValueError(f"{argument}={value!r} needs {HOST_MEMORY_KIND!r} memory on every "
                             f"device, but {device} has only {kinds}: this backend cannot offload; "
                             f"use {argument}=None here.")
    return value


def is_optimizer_state(node: Any) -> bool:
    """True for an optimizer-state subtree: an optax state (an optax NamedTuple), ``nnx.OptState``.

    Examples:
        >>> import optax, jax.numpy as jnp
        >>> is_optimizer_state(optax.adam(0.1).init(jnp.zeros(2))[0]), is_optimizer_state((1, 2))
        (True, False)
    """
    nnx = flax_nnx()
    if nnx is not None and isinstance(node, nnx.OptState):
        return True
    cls = type(node)
    return (isinstance(node, tuple) and hasattr(cls, "_fields")
            and cls.__module__.split(".")[0] == "optax")


def _optimizer_mask(shapes: Any) -> list[bool]:
    """One flag per leaf of ``shapes``: whether it belongs to optimizer state."""
    mask: list[bool] = []
    for node in jax.tree.leaves(shapes, is_leaf=is_optimizer_state):
        if is_optimizer_state(node):
            mask.extend([True] * len(jax.tree.leaves(node)))
        else:
            mask.append(False)
    return mask


def offload_shardings(mode: str | None, shapes: Any, layouts: Any) -> Any:
    """``layouts`` (one sharding per leaf of ``shapes``) with the offloaded leaves moved to host
    memory.

    Args:
        mode: a `HOST_OFFLOAD_MODES` entry, or None (``layouts`` is returned as it is).
        shapes: the variables (arrays or `jax.ShapeDtypeStruct`s), whose types say what is optimizer
            state.
        layouts: their device layouts, same structure.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("replica",))
        >>> state = ({"w": jnp.zeros(2)}, optax.sgd(0.1, momentum=0.9).init({"w": jnp.zeros(2)}))
        >>> layouts = jax.tree.map(lambda _: NamedSharding(mesh, P()), state)
        >>> [s.memory_kind for s in jax.tree.leaves(offload_shardings("opt_state", state, layouts))]
        ['device', 'pinned_host']
    """
    if mode is None:
        return layouts
    flat, treedef = jax.tree.flatten(layouts)
    mask = _optimizer_mask(shapes)
    if len(mask) != len(flat):  # a structure the mask cannot follow: everything or nothing
        mask = [mode == "all"] * len(flat)
    wanted = {"all": lambda _: True, "opt_state": lambda m: m, "params": lambda m: not m}[mode]
    return jax.tree.unflatten(treedef, [s.with_memory_kind(HOST_MEMORY_KIND) if wanted(m) else s
                                        for s, m in zip(flat, mask, strict=True)])


def in_host_memory(x: Any) -> bool:
    """True for an array (or a traced value) that lives in host memory.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> (in_host_memory(jnp.zeros(2)),
        ...  in_host_memory(jax.device_put(jnp.zeros(2), jax.memory.Space.Host)))
        (False, True)
    """
    if isinstance(x, jax.core.Tracer):
        return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host
    if isinstance(x, jax.Array):
        return getattr(x.sharding, "memory_kind", None) in _HOST_KINDS
    return False


def _to_device(x: Any) -> Any:
    if not in_host_memory(x):
        return x
    if isinstance(x, jax.core.Tracer):
        return jax.device_put(x, jax.memory.Space.Device)
    return jax.device_put(x, x.sharding.with_memory_kind("device"))


def to_host_memory(x: Any) -> Any:
    """``x`` (traced) moved to host memory, same layout: where an offloaded output goes at exit."""
    return x if in_host_memory(x) else jax.device_put(x, jax.memory.Space.Host)


def to_device_memory(tree: Any) -> Any:
    """``tree`` with its host-memory leaves copied to device memory, same layout (``tree`` itself if
    none is), for concrete arrays and inside traces.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> x = jax.device_put(jnp.ones(2), jax.memory.Space.Host)
        >>> to_device_memory({"x": x})["x"].sharding.memory_kind
        'device'
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not any(in_host_memory(x) for x in leaves):
        return tree
    return jax.tree.unflatten(treedef, [_to_device(x) for x in leaves])
