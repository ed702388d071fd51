"""Plans: what a step will cost (memory, time, layouts) before it runs, on real meshes and meshes without devices.

The record, `Plan`, and the formatters live in `jaxdist.costs` (re-exported here: ``jaxdist.strategies.Plan``
and ``jd.Plan`` are the same class); this room fills plans for a strategy's layout.
"""

from jaxdist.costs.plan import Plan as Plan
from jaxdist.costs.units import format_bytes as format_bytes
from jaxdist.strategies.plan._plan import plan_step as plan_step
from jaxdist.strategies.plan._plan_mesh import abstract_variables as abstract_variables
from jaxdist.strategies.plan._plan_mesh import compile_elsewhere as compile_elsewhere
from jaxdist.strategies.plan._plan_mesh import is_plan_mesh as is_plan_mesh
from jaxdist.strategies.plan._plan_mesh import plan_mesh as plan_mesh
from jaxdist.strategies.plan._plan_mesh import refuse_to_run as refuse_to_run

__all__ = [
    "Plan",
    "abstract_variables",
    "compile_elsewhere",
    "format_bytes",
    "is_plan_mesh",
    "plan_mesh",
    "plan_step",
    "refuse_to_run",
]
