"""The former home of the train step's cost records; they live in `jaxdist.costs` now, with the plans.

`StepCost` and `CostOptions` are in `jaxdist.costs.step` (``jd.training.StepCost`` stays their public name),
the formatters in `jaxdist.costs.units` (``jd.costs.format_bytes``, ``jd.costs.format_flops``) and
`device_memory` in `jaxdist.costs.memory`. The names below keep importing from here.
"""

from jaxdist.costs.memory import device_memory as device_memory
from jaxdist.costs.step import CostOptions as CostOptions
from jaxdist.costs.step import StepCost as StepCost
from jaxdist.costs.step import measure_step_cost as measure_step_cost
from jaxdist.costs.units import format_bytes as format_bytes
from jaxdist.costs.units import format_flops as format_flops

__all__ = [
    "CostOptions",
    "StepCost",
    "device_memory",
    "format_bytes",
    "format_flops",
    "measure_step_cost",
]
