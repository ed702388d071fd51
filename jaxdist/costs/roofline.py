"""The roofline step time: a step takes at least its FLOPs / peak FLOP/s (compute), its bytes
accessed / HBM bandwidth (memory), and the bytes its collectives send / interconnect bandwidth
(network); the estimate is the largest of the three, and that term is what bounds the step. It
assumes perfect overlap and peak rates: a lower bound on the step time, useful to rank layouts, not
to promise a number."""

from __future__ import annotations

import dataclasses

from jaxdist.costs.peaks import Accelerator, accelerator

__all__ = ["Estimate", "roofline"]


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
        lower_bound_flops: the FLOPs left out custom calls that could not be costed (``compute_s``
            is then a lower bound too).

    Examples:
        >>> print(Estimate("h100", 1e-3, 2e-3, 0.0, 2e-3, "memory"))
        2 ms/step on h100 (memory-bound: compute 1 ms, memory 2 ms, network 0 ms)
    """

    accelerator: str
    compute_s: float
    memory_s: float
    network_s: float
    step_s: float
    bound: str
    lower_bound_flops: bool = False

    def __str__(self) -> str:
        note = ", at least: custom calls not costed" if self.lower_bound_flops else ""
        return (f"{self.step_s * 1e3:.3g} ms/step on {self.accelerator} ({self.bound}-bound: "
                f"compute {self.compute_s * 1e3:.3g} ms{note}, memory {self.memory_s * 1e3:.3g} "
                f"ms, network {self.network_s * 1e3:.3g} ms)")


def roofline(flops: float, bytes_accessed: float, network_bytes: float, chip: str | Accelerator,
             lower_bound_flops: bool = False) -> Estimate:
    """The roofline step time of a step that does ``flops``, touches ``bytes_accessed`` bytes of HBM
    and sends ``network_bytes`` over the interconnect, per device.

    Args:
        flops / bytes_accessed / network_bytes: the step's work per device
            (`jaxdist.costs.program_cost`).
        chip: a name of `jaxdist.costs.ACCELERATORS` or an `Accelerator`.
        lower_bound_flops: whether ``flops`` leaves out custom calls that could not be costed.

    Returns:
        An `Estimate`.

    Raises:
        ValueError: for a chip name not in the table.

    Examples:
        >>> e = roofline(989.4e12, 0.0, 0.0, "h100")
        >>> e.step_s, e.bound
        (1.0, 'compute')
    """
    chip = accelerator(chip)
    terms = {"compute": flops / chip.flops, "memory": bytes_accessed / chip.hbm_bandwidth,
             "network": network_bytes / chip.network_bandwidth}
    bound = max(terms, key=terms.get)
    return Estimate(chip.name, terms["compute"], terms["memory"], terms["network"], terms[bound],
                    bound, lower_bound_flops)
