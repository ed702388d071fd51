"""Ragged token exchange: `jax.lax.ragged_all_to_all` where the backend has it, emulated on CPU.

A ragged exchange sends each device's slices of different lengths (the tokens routed to each expert)
to the devices that own them, without padding each slice to a worst case.
`jax.lax.ragged_all_to_all` does it on GPU and TPU; XLA:CPU has no implementation, so
`ragged_all_to_all` here runs the real primitive where the mesh's devices have it
(`has_ragged_exchange`) and otherwise an emulation: every slice padded to ``slice_rows`` rows and
moved by `jax.lax.all_to_all`. The emulation saves no bytes: it exists so the code around the
exchange runs and is tested on every backend, and equals the real one wherever both run.

`exchange_plan` computes the collective's arguments for the common case: slices grouped by
destination, each receiver laying out what it gets grouped by its own slice index (e.g. its local
expert), so the received buffer is sorted for grouped matmuls with no further permutation.

Examples:
    >>> has_ragged_exchange("cpu"), has_ragged_exchange("gpu"), has_ragged_exchange("tpu", "TPU v3")
    (False, True, False)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxdist.replicate.collectives import AxisName

__all__ = ["RAGGED_PLATFORMS", "ExchangePlan", "exchange", "exchange_plan", "has_ragged_exchange",
           "ragged_all_to_all"]

RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")
"""Device platforms implementing `jax.lax.ragged_all_to_all` (and grouped `jax.lax.ragged_dot`)."""


def has_ragged_exchange(platform: str, kind: str = "") -> bool:
    """Whether devices of ``platform`` (``device.platform`` or `jax.default_backend`) and ``kind``
    (``device.device_kind``) run ragged collectives: GPUs, and TPUs from v4 on (not v2, v3)."""
    return platform in RAGGED_PLATFORMS and not kind.startswith(("TPU v2", "TPU v3"))


def exchange(operand: jax.Array, output: jax.Array, plan: ExchangePlan, *, axis_name: AxisName,
             native: bool, slice_rows: int) -> jax.Array:
    """`ragged_all_to_all` of ``operand``'s slices into ``output`` as ``plan`` says (``native``,
    ``slice_rows``: as there): ``output`` with the received rows written in."""
    return ragged_all_to_all(operand, output, plan.send_offsets, plan.send_sizes,
                             plan.output_offsets, plan.recv_sizes, axis_name=axis_name,
                             native=native, slice_rows=slice_rows)


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                      send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array, *,
                      axis_name: AxisName, native: bool, slice_rows: int) -> jax.Array:
    """`jax.lax.ragged_all_to_all` (same arguments, same result) inside `jax.shard_map`.

    Args:
        native: use the real collective (GPU / TPU); False: the emulation by padded all-to-all.
        slice_rows: a static upper bound of every ``send_sizes`` entry: the emulation's slice.
        The rest: as `jax.lax.ragged_all_to_all`.

    Returns:
        ``output`` with the received slices written at ``all_to_all(output_offsets)``,
        ``recv_sizes`` rows each.
    """
    if native:
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                         recv_sizes, axis_name=axis_name)
    step = jnp.arange(slice_rows, dtype=input_offsets.dtype)
    rows = input_offsets[:, None] + step  # (K, slice_rows)
    chunks = jnp.take(operand, jnp.clip(rows, 0, operand.shape[0] - 1), axis=0)
    sent = (step < send_sizes[:, None]).reshape(*rows.shape, *(1,) * (operand.ndim - 1))
    chunks = jnp.where(sent, chunks, jnp.zeros((), operand.dtype))
    # Slice i goes to device i // (K / n); received slot i comes from device i // (K / n).
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)
    where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    targets = jnp.where(step < recv_sizes[:, None], where[:, None] + step, output.shape[0])  # drop
    return output.at[targets.reshape(-1)].set(got.reshape(-1, *operand.shape[1:]), mode="drop")


class ExchangePlan(NamedTuple):
    """The arguments of one ragged exchange and of its way back.

    ``send_offsets``/``send_sizes``: the sender's slices (K = devices x slices per device);
    ``output_offsets``: where each lands on its receiver; ``recv_offsets``/``recv_sizes``: where the
    receiver wrote each received slot (slot i: from device ``i // per_device``, its slice ``i %
    per_device``); ``group_sizes``: the receiver's rows per slot (``(per_device,)``), in buffer
    order (None for the way back, whose rows return to their sources' order); ``return_offsets``:
    where each received slot goes back to on its source (the way back's output offsets)."""

    send_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_offsets: jax.Array
    recv_sizes: jax.Array
    group_sizes: jax.Array | None
    return_offsets: jax.Array

    def back(self) -> ExchangePlan:
        """The plan of the way back: every received slot returned to where its source sent it."""
        return ExchangePlan(self.recv_offsets, self.recv_sizes, self.return_offsets,
                            self.send_offsets, self.send_sizes, None, self.output_offsets)


def exchange_plan(send_sizes: jax.Array, axis_name: AxisName) -> ExchangePlan:
    """The plan of an exchange of contiguous slices whose receivers group what they get by slot.

    Inside `jax.shard_map` over ``axis_name`` (n devices): slice ``i`` of this device's rows
    (``send_sizes[i]`` rows, the slices back to back from row 0) goes to device ``i // (K / n)`` as
    its slot ``i % (K / n)`` (e.g. rows sorted by expert, experts split over the devices in order).
    Each receiver lays out what it gets grouped by slot, sources in order within a slot, from row 0:
    ready for grouped matmuls. Costs three small `jax.lax.all_to_all` of int32 sizes and offsets.

    Args:
        send_sizes: ``(K,)`` integer rows per slice; K a multiple of the devices of ``axis_name``.
        axis_name: the mesh axis (or axes, in order) the exchange runs over.

    Returns:
        The `ExchangePlan` (its `ExchangePlan.back` returns every slot to where it came from).

    Raises:
        ValueError: when K is not a multiple of the devices of ``axis_name``.
    """
    k = send_sizes.shape[0]
    devices = jax.lax.axis_size(axis_name)
    if k % devices:
        raise ValueError(f"send_sizes has {k} slices, which the {devices} devices of "
                         f"axis_name={axis_name!r} do not divide: each device receives the same "
                         "number of slots; pad send_sizes with zeros.")
    per_device = k // devices
    sizes = send_sizes.astype(jnp.int32)
    send_offsets = jnp.cumsum(sizes, dtype=jnp.int32) - sizes
    recv = jax.lax.all_to_all(sizes.reshape(devices, per_device), axis_name, 0, 0,
                              tiled=True)  # [source, slot]
    group_sizes = jnp.sum(recv, 0, dtype=jnp.int32)
    starts = jnp.cumsum(group_sizes, dtype=jnp.int32) - group_sizes
    recv_offsets = starts[None, :] + jnp.cumsum(recv, 0, dtype=jnp.int32) - recv
    output_offsets = jax.lax.all_to_all(recv_offsets, axis_name, 0, 0, tiled=True).reshape(k)
    return_offsets = jax.lax.all_to_all(send_offsets.reshape(devices, per_device), axis_name, 0, 0,
                                        tiled=True)
    return ExchangePlan(send_offsets, sizes, output_offsets, recv_offsets.reshape(k),
                        recv.reshape(k), group_sizes, return_offsets.reshape(k))
