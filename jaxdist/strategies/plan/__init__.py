"""Plans: what a step will cost (memory, time, layouts) before it runs, on real meshes and meshes
without devices.

The record, `Plan`, lives in `jaxdist.costs.plan` with the other cost records (public as
``jd.Plan``); this room fills plans for a strategy's layout. The search over layouts sits above the
strategy classes (`jaxdist.strategies.search`).
"""

from jaxdist.costs.plan import Plan as Plan
from jaxdist.strategies.plan._plan import plan_step as plan_step
from jaxdist.strategies.plan._plan_mesh import abstract_variables as abstract_variables
from jaxdist.strategies.plan._plan_mesh import compile_elsewhere as compile_elsewhere
from jaxdist.strategies.plan._plan_mesh import is_plan_mesh as is_plan_mesh
from jaxdist.strategies.plan._plan_mesh import plan_mesh as plan_mesh
from jaxdist.strategies.plan._plan_mesh import refuse_to_run as refuse_to_run

__all__ = [
    "Plan", "abstract_variables", "compile_elsewhere", "is_plan_mesh", "plan_mesh", "plan_step",
    "refuse_to_run"
]
