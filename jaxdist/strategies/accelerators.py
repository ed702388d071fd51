"""Published peaks of the accelerators a plan can be estimated for, and the roofline step time.

One row per accelerator, per chip (one JAX device is one chip on all of these): the dense bf16 FLOP/s,
the HBM bandwidth, the chip's interconnect bandwidth (NVLink for GPUs, ICI for TPUs: the total of its links
in one direction, as the datasheet gives it), and its HBM capacity. Vendors quote NVIDIA tensor-core FLOP/s
"with sparsity"; the dense figure, which training uses, is half of it.

The roofline (`roofline`): a step takes at least its FLOPs / peak FLOP/s (compute), its bytes accessed / HBM
bandwidth (memory), and the bytes its collectives send / interconnect bandwidth (network); the estimate is
the largest of the three, and that term is what bounds the step. It assumes perfect overlap and peak rates:
a lower bound on the step time, useful to rank layouts, not to promise a number.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ACCELERATORS", "Accelerator", "Estimate", "accelerator", "roofline"]


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
    """

    name: str
    flops: float
    hbm_bandwidth: float
    network_bandwidth: float
    memory: int
    source: str


ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("a100", 312e12, 2.039e12, 300e9, 80 * 10**9,
                "NVIDIA A100 80GB SXM datasheet: 312 TFLOPS bf16, 2,039 GB/s, NVLink 600 GB/s (both directions)"),
    Accelerator("h100", 989.4e12, 3.35e12, 450e9, 80 * 10**9,
                "NVIDIA H100 SXM datasheet: 1,979 TFLOPS bf16 with sparsity, 3.35 TB/s, NVLink 900 GB/s"),
    Accelerator("h200", 989.4e12, 4.8e12, 450e9, 141 * 10**9,
                "NVIDIA H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity, 4.8 TB/s, 141 GB, NVLink 900 GB/s"),
    Accelerator("b200", 2.25e15, 8e12, 900e9, 180 * 10**9,
                "NVIDIA HGX B200 datasheet: 4.5 PFLOPS bf16 with sparsity, 8 TB/s, 180 GB, NVLink 1.8 TB/s"),
    Accelerator("tpu-v4", 275e12, 1.2e12, 300e9, 32 * 2**30,
                "Google Cloud TPU v4: 275 TFLOPS bf16, 1,200 GB/s, 32 GiB, ICI 2,400 Gbps"),
    Accelerator("tpu-v5e", 197e12, 819e9, 200e9, 16 * 2**30,
                "Google Cloud TPU v5e: 197 TFLOPS bf16, 819 GB/s, 16 GiB, ICI 1,600 Gbps"),
    Accelerator("tpu-v5p", 459e12, 2.765e12, 600e9, 95 * 2**30,
                "Google Cloud TPU v5p: 459 TFLOPS bf16, 2,765 GB/s, 95 GiB, ICI 4,800 Gbps"),
    Accelerator("tpu-v6e", 918e12, 1.64e12, 448e9, 32 * 2**30,
                "Google Cloud TPU v6e (Trillium): 918 TFLOPS bf16, 1,640 GB/s, 32 GiB, ICI 3,584 Gbps"),
)}


def accelerator(name: str | Accelerator) -> Accelerator:
    """The row of ``name`` (case-insensitive), or ``name`` itself when it is an `Accelerator`.

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
        raise ValueError(
            f"accelerator={name!r} is not in the table of published peaks: use one of {sorted(ACCELERATORS)}, "
            "or pass jd.strategies.Accelerator(name, flops, hbm_bandwidth, network_bandwidth, memory, source) "
            "with your own figures."
        )
    return ACCELERATORS[key]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A roofline step time (see the module doc).

    Attributes:
        accelerator: the accelerator's name.
        compute_s: FLOPs / peak FLOP/s.
        memory_s: bytes accessed / HBM bandwidth.
        network_s: bytes the collectives send / interconnect bandwidth.
        step_s: the largest of the three.
        bound: which term bounds the step: ``"compute"``, ``"memory"`` or ``"network"``.
    """

    accelerator: str
    compute_s: float
    memory_s: float
    network_s: float
    step_s: float
    bound: str

    def __str__(self) -> str:
        return (f"{self.step_s * 1e3:.3g} ms/step on {self.accelerator} ({self.bound}-bound: compute "
                f"{self.compute_s * 1e3:.3g} ms, memory {self.memory_s * 1e3:.3g} ms, network "
                f"{self.network_s * 1e3:.3g} ms)")


def roofline(flops: float, bytes_accessed: float, network_bytes: float, chip: str | Accelerator) -> Estimate:
    """The roofline step time of a step that does ``flops``, touches ``bytes_accessed`` bytes of HBM and
    sends ``network_bytes`` over the interconnect, per device.

    Examples:
        >>> e = roofline(989.4e12, 0.0, 0.0, "h100")
        >>> e.step_s, e.bound
        (1.0, 'compute')
    """
    chip = accelerator(chip)
    terms = {
        "compute": flops / chip.flops,
        "memory": bytes_accessed / chip.hbm_bandwidth,
        "network": network_bytes / chip.network_bandwidth,
    }
    bound = max(terms, key=terms.get)
    return Estimate(chip.name, terms["compute"], terms["memory"], terms["network"], terms[bound], bound)
