"""Costs: what a compiled program does per device, what the accelerators can do, the time it takes.

One home for the cost model, below every other package (it imports none of jaxdist): `program_cost`
counts a compiled program's FLOPs (loops multiplied, library calls and kernels costed), bytes
accessed and collectives; `ACCELERATORS` holds the published peaks by chip and device kind;
`roofline` turns the two into a step time. The records of what a step costs live here too:
`jaxdist.costs.plan` holds `jaxdist.Plan` (public as ``jd.Plan``), `jaxdist.costs.step` the
Trainer's `jaxdist.training.StepCost`; `bytes_per_device` is the one count of what a device holds,
`format_bytes` and `format_flops` the one way to print bytes and FLOPs.

Examples:
    >>> import jax, jax.numpy as jnp, jaxdist as jd
    >>> lowered = jax.jit(lambda a, b: a @ b).lower(jnp.ones((8, 4)), jnp.ones((4, 2)))
    >>> cost = jd.program_cost(lowered.compile())
    >>> cost.flops
    128.0
    >>> jd.costs.roofline(cost.flops, cost.bytes_accessed, 0.0, "h100").bound
    'memory'
"""

from jaxdist.costs.memory import bytes_per_device as bytes_per_device
from jaxdist.costs.peaks import ACCELERATORS as ACCELERATORS
from jaxdist.costs.peaks import Accelerator as Accelerator
from jaxdist.costs.peaks import accelerator as accelerator
from jaxdist.costs.peaks import accelerator_of_device as accelerator_of_device
from jaxdist.costs.peaks import known_peak_flops as known_peak_flops
from jaxdist.costs.program import COLLECTIVE_KINDS as COLLECTIVE_KINDS
from jaxdist.costs.program import CollectiveOp as CollectiveOp
from jaxdist.costs.program import ProgramCost as ProgramCost
from jaxdist.costs.program import program_cost as program_cost
from jaxdist.costs.roofline import Estimate as Estimate
from jaxdist.costs.roofline import roofline as roofline
from jaxdist.costs.units import format_bytes as format_bytes
from jaxdist.costs.units import format_flops as format_flops

__all__ = ["ACCELERATORS", "COLLECTIVE_KINDS", "Accelerator", "CollectiveOp", "Estimate",
           "ProgramCost", "accelerator", "accelerator_of_device", "bytes_per_device",
           "format_bytes", "format_flops", "known_peak_flops", "program_cost", "roofline"]
