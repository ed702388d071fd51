"""Host offloading: variables and/or optimizer state kept in host memory, streamed to the devices per step.

JAX gives every sharding a *memory kind*: ``"device"`` (the default) or ``"pinned_host"`` (the host memory
attached to that device, which accelerators reach by DMA). A strategy created with ``host_offload=`` places the
variables it is told to in ``"pinned_host"`` memory, in their usual layout (mirrored, FSDP, ...): this is
ZeRO-Offload's placement and Graphcore's "variables on the host" in JAX terms. Compiled steps then stream them:

* at the entry of a ``strategy.jit`` step (and of the on-device loop of ``run_steps_on_dataset``) every argument
  in host memory is copied to device memory (``jax.device_put(x, jax.memory.Space.Device)``), so the step's
  code computes on device values exactly as it would without offloading — what it computes never changes;
* outputs shaped like an offloaded argument (``state -> new_state``) go back to host memory at the exit, so
  the state stays offloaded from step to step; other outputs (losses, metrics) stay on the device;
* eager ``strategy.run`` copies offloaded arguments to device memory before the replica program.

Between steps the offloaded state occupies no device memory; during a step it is a temporary. That trades
transfer time for device-memory capacity (XLA overlaps the copies with compute where it can): measure it.

Which variables are *optimizer state* is carried by their type, never guessed from names: subtrees that are
optax states (every optax state is a NamedTuple defined in optax) and ``nnx.OptState`` variables (what
``nnx.Optimizer`` holds). Sync-on-read values are never offloaded: replicas update them in every step, so
they stay in device memory (as Graphcore's IPU strategy keeps them on the IPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from jaxdist.strategies.tracing import computation, role_of

if TYPE_CHECKING:
    from jaxdist.strategies.base import Strategy

__all__ = [
    "HOST_MEMORY_KIND",
    "HOST_OFFLOAD_MODES",
    "in_host_memory",
    "is_optimizer_state",
    "offload_shardings",
    "parse_host_offload",
    "stream_host_memory",
    "to_device_memory",
]

HOST_MEMORY_KIND = "pinned_host"
"""The memory kind offloaded values live in."""

HOST_OFFLOAD_MODES = ("opt_state", "params", "all")
"""``host_offload`` values: optimizer state only, every other variable only, or every variable."""

_HOST_KINDS = ("pinned_host", "unpinned_host")


def parse_host_offload(value: Any, devices: Sequence[Any], argument: str = "host_offload") -> str | None:
    """Validate a ``host_offload`` option against the devices it will run on.

    Args:
        value: None (no offloading) or one of `HOST_OFFLOAD_MODES`.
        devices: the strategy's devices; each must have ``"pinned_host"`` memory.
        argument: the option's name in error messages.

    Returns:
        The mode, or None.

    Raises:
        ValueError: for an unknown mode, or devices without host memory.

    Example:
        >>> import jax
        >>> parse_host_offload("opt_state", jax.devices()[:1])
        'opt_state'
    """
    if value is None:
        return None
    if not isinstance(value, str) or value not in HOST_OFFLOAD_MODES:
        raise ValueError(
            f"{argument}={value!r} is not a host offloading mode: use None (everything in device memory), "
            "'opt_state' (optimizer state in host memory), 'params' (every variable but the optimizer state) "
            "or 'all'."
        )
    for device in devices:
        kinds = sorted(m.kind for m in device.addressable_memories())
        if HOST_MEMORY_KIND not in kinds:
            raise ValueError(
                f"{argument}={value!r} needs {HOST_MEMORY_KIND!r} memory on every device, but {device} has only "
                f"{kinds}: this backend cannot offload; use {argument}=None here."
            )
    return value


def is_optimizer_state(node: Any) -> bool:
    """True for an optimizer-state subtree: an optax state (a NamedTuple defined in optax) or ``nnx.OptState``.

    Example:
        >>> import optax, jax.numpy as jnp
        >>> is_optimizer_state(optax.adam(0.1).init(jnp.zeros(2))[0]), is_optimizer_state((1, 2))
        (True, False)
    """
    if isinstance(node, nnx.OptState):
        return True
    cls = type(node)
    return isinstance(node, tuple) and hasattr(cls, "_fields") and cls.__module__.split(".")[0] == "optax"


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
    """``layouts`` (one sharding per leaf of ``shapes``) with the offloaded leaves moved to host memory.

    Args:
        mode: a `HOST_OFFLOAD_MODES` entry, or None (``layouts`` is returned as it is).
        shapes: the variables (arrays or `jax.ShapeDtypeStruct`s), whose types say what is optimizer state.
        layouts: their device layouts, same structure.

    Example:
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
    return jax.tree.unflatten(
        treedef, [s.with_memory_kind(HOST_MEMORY_KIND) if wanted(m) else s for s, m in zip(flat, mask, strict=True)]
    )


def in_host_memory(x: Any) -> bool:
    """True for an array (or a traced value) that lives in host memory.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> in_host_memory(jnp.zeros(2)), in_host_memory(jax.device_put(jnp.zeros(2), jax.memory.Space.Host))
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


def _to_host(x: Any) -> Any:
    return x if in_host_memory(x) else jax.device_put(x, jax.memory.Space.Host)


def to_device_memory(tree: Any) -> Any:
    """``tree`` with its host-memory leaves copied to device memory, same layout (``tree`` itself if none is).

    Works on concrete arrays and inside traces.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x = jax.device_put(jnp.ones(2), jax.memory.Space.Host)
        >>> to_device_memory({"x": x})["x"].sharding.memory_kind
        'device'
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not any(in_host_memory(x) for x in leaves):
        return tree
    return jax.tree.unflatten(treedef, [_to_device(x) for x in leaves])


def _signature(tree: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(x), str(jax.dtypes.result_type(x))) for x in leaves)


def _is_graph_node(x: Any) -> bool:
    return nnx.graph.is_graph_node(x)


class HostStreamed:
    """A step that streams its host-memory arguments to the devices (see the module doc).

    Wraps the user's step for ``strategy.jit``: at trace time, arguments in host memory are copied to device
    memory before the step sees them (the copies keep their argument's role: batch or variable), and outputs
    shaped like such an argument are copied back to host memory. Without host-memory arguments the step is
    called as it is. ``func`` is the user's step (as ``functools.partial.func``: programs are attributed to it).
    """

    def __init__(self, strategy: Strategy, fn: Callable, static_argnums: tuple[int, ...] = ()):
        self.func = fn
        # Distinct names: StrategyFunction copies this object's __dict__ onto itself (functools.update_wrapper).
        self._streaming_strategy = strategy
        self._streaming_static = static_argnums
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any) -> Any:
        plain = [i for i, a in enumerate(args) if i not in self._streaming_static and not _is_graph_node(a)]
        nodes = [i for i, a in enumerate(args) if i not in self._streaming_static and _is_graph_node(a)]
        masks = {i: [in_host_memory(x) for x in jax.tree.leaves(args[i])] for i in plain}
        node_states = {i: nnx.state(args[i]) for i in nodes}
        node_masks = {i: [in_host_memory(x) for x in jax.tree.leaves(s)] for i, s in node_states.items()}
        if not any(any(m) for m in (*masks.values(), *node_masks.values())):
            return self.func(*args)
        call_args = list(args)
        batches, variables = [], []
        for i in plain:
            if any(masks[i]):
                leaves, treedef = jax.tree.flatten(args[i])
                moved = [_to_device(x) for x in leaves]
                for old, new in zip(leaves, moved, strict=True):
                    if new is not old:  # the device copy stands for its argument: same role
                        (batches if role_of(old, self._streaming_strategy) == "batch" else variables).append(new)
                call_args[i] = jax.tree.unflatten(treedef, moved)
        for i in nodes:
            if any(node_masks[i]):
                nnx.update(args[i], to_device_memory(node_states[i]))
        with computation(self._streaming_strategy, "global", batches, variables):
            out = self.func(*call_args)
        for i in nodes:  # nnx objects were updated in place: their offloaded variables go back to host memory
            if any(node_masks[i]):
                state = nnx.state(args[i])
                leaves, treedef = jax.tree.flatten(state)
                back = [_to_host(x) if m else x for x, m in zip(leaves, node_masks[i], strict=True)]
                nnx.update(args[i], jax.tree.unflatten(treedef, back))
        # The strategy's output rule: an output shaped like a positional argument takes that argument's layout
        # (the first such argument); so an output shaped like an offloaded argument returns to host memory.
        signatures = [(_signature(args[i]), masks[i]) for i in plain]
        return _outputs_to_host(out, signatures)


def _outputs_to_host(out: Any, signatures: list) -> Any:
    def like_argument(tree):
        sig = _signature(tree)
        for s, mask in signatures:
            if s == sig:
                if not any(mask):
                    return tree
                leaves, treedef = jax.tree.flatten(tree)
                return jax.tree.unflatten(treedef, [_to_host(x) if m else x for x, m in zip(leaves, mask, strict=True)])
        return None

    whole = like_argument(out)
    if whole is not None:
        return whole
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        matched = [like_argument(o) for o in out]
        return tuple(o if m is None else m for m, o in zip(matched, out, strict=True))
    return out


def stream_host_memory(strategy: Strategy, fn: Any, static_argnums: tuple[int, ...] = ()) -> Any:
    """``fn`` wrapped as a `HostStreamed` step (``fn`` unchanged when it is not callable: the caller reports it).

    Example:
        >>> import jaxdist as jd
        >>> step = stream_host_memory(jd.OneDeviceStrategy(), lambda x: x + 1)
        >>> step(1)
        2
    """
    return HostStreamed(strategy, fn, static_argnums) if callable(fn) else fn
