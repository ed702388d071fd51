"""Published peaks of accelerator chips: the one table `Plan.estimate`, the Trainer's utilisation
and the benchmarks read.

One row per chip (one JAX device is one chip on all of these): the dense bf16 FLOP/s, the HBM
bandwidth, the chip's interconnect bandwidth (NVLink for GPUs, ICI for TPUs: the total of its links
in one direction, as the datasheet gives it), its HBM capacity, and the ``jax.Device.device_kind``
strings it answers to. Vendors quote NVIDIA tensor-core FLOP/s "with sparsity" (2:4 structured); the
dense figure, which training uses, is half of it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

__all__ = ["ACCELERATORS", "Accelerator", "accelerator", "accelerator_of_device",
           "known_peak_flops"]


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """The published peaks of one accelerator chip.

    Attributes:
        name: the key (``"h100"``).
        flops: dense bf16 FLOP/s.
        hbm_bandwidth: HBM bytes/s.
        network_bandwidth: interconnect bytes/s per chip, one direction.
        memory: HBM bytes.
        source: where the numbers come from.
        device_kind: a regular expression matching the lower-cased ``jax.Device.device_kind`` of
            this chip (empty: matched by name only).

    Examples:
        >>> Accelerator("mine", 100e12, 1e12, 1e11, 16 << 30, "measured").flops
        100000000000000.0
    """

    name: str
    flops: float
    hbm_bandwidth: float
    network_bandwidth: float
    memory: int
    source: str
    device_kind: str = ""


ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("a100", 312e12, 2.039e12, 300e9, 80 * 10**9, "NVIDIA A100 80GB SXM datasheet: 312 "
                "TFLOPS bf16, 2,039 GB/s, NVLink 600 GB/s (both directions)", r"\ba100\b"),
    Accelerator("h100-nvl", 835.5e12, 3.9e12, 300e9, 94 * 10**9, "NVIDIA H100 NVL datasheet: 1,671 "
                "TFLOPS bf16 with sparsity, 3.9 TB/s, 94 GB, NVLink 600 GB/s",
                r"\bh100\b.*\bnvl\b"),
    Accelerator("h100-pcie", 756.5e12, 2.0e12, 300e9, 80 * 10**9, "NVIDIA H100 PCIe datasheet: "
                "1,513 TFLOPS bf16 with sparsity, 2 TB/s, NVLink bridge 600 GB/s",
                r"\bh100\b.*\bpcie\b"),
    Accelerator("h100", 989.4e12, 3.35e12, 450e9, 80 * 10**9, "NVIDIA H100 SXM datasheet: 1,979 "
                "TFLOPS bf16 with sparsity, 3.35 TB/s, NVLink 900 GB/s", r"\bh100\b"),
    Accelerator("h200-nvl", 835.5e12, 4.8e12, 450e9, 141 * 10**9, "NVIDIA H200 NVL datasheet: "
                "1,671 TFLOPS bf16 with sparsity, 4.8 TB/s, 141 GB, NVLink 900 GB/s",
                r"\bh200\b.*\bnvl\b"),
    Accelerator("h200", 989.4e12, 4.8e12, 450e9, 141 * 10**9, "NVIDIA H200 SXM datasheet: 1,979 "
                "TFLOPS bf16 with sparsity, 4.8 TB/s, 141 GB, NVLink 900 GB/s", r"\bh200\b"),
    Accelerator("b200", 2.25e15, 8e12, 900e9, 180 * 10**9, "NVIDIA HGX B200 datasheet: 4.5 PFLOPS "
                "bf16 with sparsity, 8 TB/s, 180 GB, NVLink 1.8 TB/s", r"\bb200\b"),
    Accelerator("tpu-v4", 275e12, 1.2e12, 300e9, 32 * 2**30, "Google Cloud TPU v4: 275 TFLOPS "
                "bf16, 1,200 GB/s, 32 GiB, ICI 2,400 Gbps", r"^tpu v4$"),
    Accelerator("tpu-v5e", 197e12, 819e9, 200e9, 16 * 2**30, "Google Cloud TPU v5e: 197 TFLOPS "
                "bf16, 819 GB/s, 16 GiB, ICI 1,600 Gbps", r"^tpu v5 ?(lite|e)$"),
    Accelerator("tpu-v5p", 459e12, 2.765e12, 600e9, 95 * 2**30, "Google Cloud TPU v5p: 459 TFLOPS "
                "bf16, 2,765 GB/s, 95 GiB, ICI 4,800 Gbps", r"^tpu v5p?$"),
    Accelerator("tpu-v6e", 918e12, 1.64e12, 448e9, 32 * 2**30, "Google Cloud TPU v6e (Trillium): "
                "918 TFLOPS bf16, 1,640 GB/s, 32 GiB, ICI 3,584 Gbps", r"^tpu v6 ?(lite|e)$"),
)}
"""The published peaks, by name; for a device, the first row whose ``device_kind`` matches
(`accelerator_of_device`: the NVL and PCIe variants come before the SXM part of the same name)."""


def accelerator(name: str | Accelerator) -> Accelerator:
    """The row of ``name`` (case-insensitive), or ``name`` itself when it is an `Accelerator`.

    Args:
        name: a key of `ACCELERATORS` (``"h100"``, ``"tpu-v5p"``, ...) or an `Accelerator`.

    Returns:
        The `Accelerator`.

    Raises:
        ValueError: for a name not in the table (the message lists the names).

    Examples:
        >>> accelerator("H100").hbm_bandwidth
        3350000000000.0
    """
    if isinstance(name, Accelerator):
        return name
    key = str(name).lower()
    if key not in ACCELERATORS:
        raise ValueError(f"accelerator={name!r} is not in the table of published peaks: use one of "
                         f"{sorted(ACCELERATORS)}, or pass jd.costs.Accelerator(name, flops, "
                         "hbm_bandwidth, network_bandwidth, memory, source) with your own figures.")
    return ACCELERATORS[key]


def accelerator_of_device(device_or_kind: Any) -> Accelerator | None:
    """The row of a device (a ``jax.Device``, or its ``device_kind`` string).

    Args:
        device_or_kind: a ``jax.Device`` or its ``device_kind`` (``"NVIDIA H100 80GB HBM3"``).

    Returns:
        The first `Accelerator` of `ACCELERATORS` whose ``device_kind`` pattern matches, or None.

    Examples:
        >>> (accelerator_of_device("NVIDIA H100 80GB HBM3").name,
        ...  accelerator_of_device("NVIDIA H100 PCIe").name)
        ('h100', 'h100-pcie')
        >>> accelerator_of_device("TPU v5 lite").name, accelerator_of_device("cpu")
        ('tpu-v5e', None)
    """
    kind = str(getattr(device_or_kind, "device_kind", device_or_kind)).strip().lower()
    for row in ACCELERATORS.values():
        if row.device_kind and re.search(row.device_kind, kind):
            return row
    return None


def known_peak_flops(device_kind: str) -> tuple[float, str] | None:
    """The datasheet's dense bf16 peak FLOP/s of one device of ``device_kind``, and its source.

    Args:
        device_kind: ``jax.Device.device_kind``, e.g. ``"NVIDIA H100 80GB HBM3"``.

    Returns:
        ``(flop_per_second, source)``, or None for a device not in `ACCELERATORS` (CPUs among them).

    Examples:
        >>> known_peak_flops("NVIDIA H100 80GB HBM3")[0]
        989400000000000.0
        >>> known_peak_flops("TPU v5 lite")[0], known_peak_flops("cpu")
        (197000000000000.0, None)
    """
    row = accelerator_of_device(device_kind)
    return None if row is None else (row.flops, row.source)
