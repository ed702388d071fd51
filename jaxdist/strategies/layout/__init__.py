"""Layout: which layout does this value get? The layout policy and everything it reads.

A `LayoutPolicy` (``_policy``) is the one place layouts are decided: the devices a ``devices=``
argument names (``_devices``), the mesh and its axis roles (``_meshes``), the rules that split
variables (``_rules``), the layouts of an nnx state's Variables (``_nnx``), the axis types a program
is traced with (``_axis_types``), the role a value has or carries (``_roles``), whose layout a
variable carries (``_provenance``) and memory kinds (``_offload``). Nothing here compiles, traces or
runs a step: the verbs above take the policy and apply it (``input`` places arguments; ``compile``
compiles, and its ``_trace`` room applies these answers while a ``strategy.jit`` step traces).
"""

from jaxdist.strategies.layout._axis_types import auto_region as auto_region
from jaxdist.strategies.layout._axis_types import decided as decided
from jaxdist.strategies.layout._axis_types import explicit_axes as explicit_axes
from jaxdist.strategies.layout._axis_types import in_trace as in_trace
from jaxdist.strategies.layout._axis_types import initializer as initializer
from jaxdist.strategies.layout._axis_types import leave_auto as leave_auto
from jaxdist.strategies.layout._axis_types import program_axis_types as program_axis_types
from jaxdist.strategies.layout._axis_types import ran_auto as ran_auto
from jaxdist.strategies.layout._axis_types import refusals as refusals
from jaxdist.strategies.layout._axis_types import retyped as retyped
from jaxdist.strategies.layout._axis_types import runs_auto as runs_auto
from jaxdist.strategies.layout._axis_types import say as say
from jaxdist.strategies.layout._axis_types import shape_scope as shape_scope
from jaxdist.strategies.layout._axis_types import trace_mesh as trace_mesh
from jaxdist.strategies.layout._axis_types import untyped as untyped
from jaxdist.strategies.layout._devices import resolve_device as resolve_device
from jaxdist.strategies.layout._devices import resolve_devices as resolve_devices
from jaxdist.strategies.layout._meshes import ROLES as ROLES
from jaxdist.strategies.layout._meshes import axis_roles as axis_roles
from jaxdist.strategies.layout._meshes import short_form_mesh as short_form_mesh
from jaxdist.strategies.layout._nnx import nnx_layouts as nnx_layouts
from jaxdist.strategies.layout._offload import HOST_MEMORY_KIND as HOST_MEMORY_KIND
from jaxdist.strategies.layout._offload import HOST_OFFLOAD_MODES as HOST_OFFLOAD_MODES
from jaxdist.strategies.layout._offload import in_host_memory as in_host_memory
from jaxdist.strategies.layout._offload import parse_host_offload as parse_host_offload
from jaxdist.strategies.layout._offload import to_device_memory as to_device_memory
from jaxdist.strategies.layout._offload import to_host_memory as to_host_memory
from jaxdist.strategies.layout._policy import IdleAxisWarning as IdleAxisWarning
from jaxdist.strategies.layout._policy import LayoutPolicy as LayoutPolicy
from jaxdist.strategies.layout._policy import colocated_layout as colocated_layout
from jaxdist.strategies.layout._provenance import declared as declared
from jaxdist.strategies.layout._provenance import is_own as is_own
from jaxdist.strategies.layout._provenance import mark as mark
from jaxdist.strategies.layout._provenance import own as own
from jaxdist.strategies.layout._roles import Role as Role
from jaxdist.strategies.layout._roles import UndeclaredBatchWarning as UndeclaredBatchWarning
from jaxdist.strategies.layout._roles import classify as classify
from jaxdist.strategies.layout._roles import mark_placed_batch as mark_placed_batch
from jaxdist.strategies.layout._roles import traced_role as traced_role
from jaxdist.strategies.layout._rules import LAYERS as LAYERS
from jaxdist.strategies.layout._rules import annotation as annotation
from jaxdist.strategies.layout._rules import is_annotated as is_annotated
from jaxdist.strategies.layout._rules import is_box as is_box
from jaxdist.strategies.layout._rules import is_variable as is_variable
from jaxdist.strategies.layout._rules import logical_names as logical_names
from jaxdist.strategies.layout._rules import unboxed as unboxed

__all__ = ["HOST_MEMORY_KIND", "HOST_OFFLOAD_MODES", "IdleAxisWarning", "LAYERS", "LayoutPolicy",
           "ROLES", "Role", "UndeclaredBatchWarning", "annotation", "auto_region", "axis_roles",
           "classify", "colocated_layout", "decided", "declared", "explicit_axes", "in_host_memory",
           "in_trace", "is_annotated", "is_box", "is_own", "is_variable", "leave_auto",
           "logical_names", "mark", "mark_placed_batch", "nnx_layouts", "own", "parse_host_offload",
           "resolve_device", "resolve_devices", "program_axis_types", "ran_auto", "refusals",
           "retyped", "say", "shape_scope", "short_form_mesh", "to_device_memory", "to_host_memory",
           "trace_mesh", "traced_role", "unboxed", "untyped"]
