"""Plans: what a step costs on a strategy's layout — memory, FLOPs, collectives, time — without
running it.

``strategy.jit(step).plan(*args)`` (or ``strategy.plan(step, *args, batch_argnums=...)``) lowers and
compiles the step for the strategy's layout and reads the compiled program; the step never runs and
its arguments are never allocated: they may be real values or `jax.ShapeDtypeStruct`s
(``jax.eval_shape(init)``, for a model too big for this machine). Arguments without a layout get the
one the step would give them, so the plan is the program a call would compile. On a mesh without
devices (`plan_mesh`) the program is lowered here and compiled in a subprocess with that many
simulated CPU devices.

This module lays the arguments out, compiles, and names the arguments' bytes by role; the record it
fills, `Plan` (its fields documented there), and the reading of the compiled program (`read_plan`)
live in `jaxdist.costs.plan`, below every package that fills or reads plans. ``replicated`` names
the variables of at least ``min_shard_size`` elements held whole along an FSDP or model axis that
could split them: a rule that matched nothing (a typo, a renamed layer) shows up there before it
shows up as an out-of-memory error.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.costs.memory import array_bytes_per_device, split_parts
from jaxdist.costs.plan import ArrayPlan, Plan, memory_of, read_plan
from jaxdist.replicate.layouts import path_name, spec_axes
from jaxdist.replicate.trees import flax_nnx, is_graph_node
from jaxdist.strategies.input import argument_layouts
from jaxdist.strategies.layout import nnx_layouts
from jaxdist.strategies.plan._plan_mesh import compile_elsewhere, is_plan_mesh

__all__ = ["abstract_argument", "plan_step"]


# ---------------------------------------------------------------------------------------- arguments
def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def abstract_argument(policy: Any, value: Any, batch: bool, where: str) -> Any:
    """``value`` as `jax.ShapeDtypeStruct`s in the layout a call of the step would give it (an nnx
    graph object with abstract state; Python values as they are).

    Raises:
        ValueError: for a batch whose rows the replicas do not divide.
    """
    if is_graph_node(value):
        nnx = flax_nnx()
        graphdef, state = nnx.split(value)
        layouts, _ = nnx_layouts(policy, state)
        values = [jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x),
                                       sharding=layout if isinstance(layout, jax.sharding.Sharding)
                                       else None)
                  for x, layout in zip(jax.tree.leaves(state), layouts, strict=True)]
        return nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(state), values))
    layouts = argument_layouts(policy, value, batch, where)  # what a call places, and where

    def one(x, layout):
        if not _is_array(x):
            return x
        return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x),
                                    sharding=getattr(x, "sharding", None) if layout is None
                                    else layout)

    return jax.tree.map(one, value, layouts, is_leaf=lambda x: x is None)


def _layout_text(sharding: Any) -> str:
    spec = getattr(sharding, "spec", None)
    if spec is None or not any(e is not None for e in spec):
        return "whole"
    return repr(spec)


def _leaves(value: Any) -> list[tuple[Any, Any]]:
    if is_graph_node(value):
        value = flax_nnx().state(value)
    return [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(value) if _is_array(x)]


def _role(name: str, value: Any, path: tuple) -> str:
    """A variable argument's role: its part for a struct (``TrainState.params``) or a dict holding
    ``"params"``; else the argument's name."""
    if not path:
        return name
    first = path[0]
    if isinstance(first, jax.tree_util.GetAttrKey):
        return first.name
    if isinstance(first, jax.tree_util.DictKey) and isinstance(value, dict) and "params" in value:
        return str(first.key)
    return name


def _state(policy: Any, arguments: Sequence[tuple[str, Any, bool]]) -> tuple[dict, list, list]:
    """(bytes per role, every array as an `ArrayPlan`, the variables an idle axis could split)."""
    roles: dict[str, int] = {}
    arrays: list[ArrayPlan] = []
    replicated: list[ArrayPlan] = []
    mesh_sizes = dict(policy.mesh.shape)
    could_split = [a for a in (*policy.roles.fsdp_axes, *policy.roles.model_axes)
                   if mesh_sizes[a] > 1]
    min_size = policy.rules.min_shard_size
    for name, value, batch in arguments:
        for path, x in _leaves(value):
            shape, dtype = tuple(np.shape(x)), jax.dtypes.result_type(x)
            sharding = getattr(x, "sharding", None)
            size, parts = (array_bytes_per_device(shape, dtype, sharding),
                           split_parts(shape, sharding))
            role = "batch" if batch else _role(name, value, path)
            roles[role] = roles.get(role, 0) + size
            # a Flax box's value
            where = f"{name}.{path_name(path).removesuffix('/value')}" if path else name
            plan = ArrayPlan(where, shape, str(dtype), _layout_text(sharding), size)
            arrays.append(plan)
            if batch or not shape or math.prod(shape) < min_size:
                continue
            used = spec_axes(getattr(sharding, "spec", None) or ())
            axes = tuple(a for a in could_split if a not in used and any(
                d % (p * mesh_sizes[a]) == 0 for d, p in zip(shape, parts, strict=True)))
            if axes:
                replicated.append(dataclasses.replace(plan, axes=axes))
    return roles, arrays, replicated


# -------------------------------------------------------------------------------------------- plans
def plan_step(policy: Any, trace: Callable[..., jax.stages.Traced], args: tuple, kwargs: dict, *,
              axis_types_of: Callable[[jax.stages.Traced], dict[str, jax.sharding.AxisType]],
              names: Sequence[str], batch: Sequence[int], batch_names: Sequence[str],
              static: Sequence[int], static_names: Sequence[str]) -> Plan:
    """The `Plan` of a step (what ``StrategyFunction.plan`` returns; see the module doc).

    Args:
        policy: the strategy's `LayoutPolicy`.
        trace: the step's ``trace`` (arguments in, `jax.stages.Traced` out).
        axis_types_of: the axis types a traced program runs with.
        args, kwargs: the arguments, bound to the step's positional parameters where named.
        names: the step's positional parameter names (for the roles; ``argument i`` beyond them).
        batch, batch_names: the declared batch arguments.
        static, static_names: the static ones.

    Raises:
        ValueError: for a batch the replicas do not divide.
        RuntimeError: when compiling for a plan mesh fails in its subprocess.
    """
    start = time.perf_counter()
    placed, described = [], []
    for i, a in enumerate(args):
        if i in static:
            placed.append(a)
            continue
        name = names[i] if i < len(names) else f"argument {i}"
        placed.append(abstract_argument(policy, a, i in batch, f"argument {i} ({name!r})"))
        described.append((name, placed[-1], i in batch))
    placed_kwargs = {}
    for k, v in kwargs.items():
        if k in static_names:
            placed_kwargs[k] = v
            continue
        placed_kwargs[k] = abstract_argument(policy, v, k in batch_names, f"argument {k!r}")
        described.append((k, placed_kwargs[k], k in batch_names))
    mesh = policy.mesh
    # lowered for the CPU compiler of the subprocess (a mesh without devices has none)
    if is_plan_mesh(mesh):
        traced = trace(*placed, **placed_kwargs)
        lowered = traced.lower(lowering_platforms=("cpu",))
        module = lowered.as_text(debug_info=True)  # op names kept
        memory, program = compile_elsewhere(module, mesh.size)
        where = f"compiled for {mesh.size} simulated CPU devices in a subprocess"
    else:
        with policy.call_scope():  # traced and lowered on the strategy's mesh, as a call is
            traced = trace(*placed, **placed_kwargs)
            lowered = traced.lower()
            program = lowered.compile()
        module = lowered.as_text(debug_info=True)
        memory = memory_of(program)
        where = f"compiled here ({mesh.devices.flat[0].platform})"
    roles, arrays, replicated = _state(policy, described)
    # the kernels' scopes from this program's own module: a compiled program from JAX's persistent
    # cache carries the op names of another with the same operations
    return read_plan(program, memory=memory, mesh=dict(mesh.shape), state_bytes=roles,
                     largest_arrays=arrays, replicated=replicated,
                     axis_types=axis_types_of(traced), compiled_on=where, started=start,
                     scopes=module)
