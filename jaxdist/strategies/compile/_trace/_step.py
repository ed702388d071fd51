"""The body of a ``strategy.jit`` program: what runs while JAX traces a global-view step.

`StepTrace` is the function a step's `jax.jit` programs trace (`jaxdist.strategies.compile._jit`),
on a cache miss only. In the order it happens:

1. the call's placed values are read from the call being decided on this thread
   (`jaxdist.strategies.ambient`; abstract shapes where the trace has none, as under
   `jax.eval_shape`); in a job of several processes the program is checked to be every process's
   (``agree``: `jaxdist.strategies.compile._agreement`);
2. host-offloaded arguments are copied to device memory; the nnx state's layouts are resolved
   (`jaxdist.strategies.layout.nnx_layouts`); where the program's Explicit axes run Auto
   (`jaxdist.strategies.layout._axis_types`), its arguments are retyped at entry;
3. the arguments enter in their roles (`_roles`): on Explicit axes the variables jaxdist split enter
   typed whole (`_resolve`); a step of split variables without a distributed batch gathers them
   (`_shardy`); the idle-axis check reads the resolved layouts;
4. the step's own code runs (watched for sync-on-read values updated in place and not returned; over
   a split batch through the Shardy guard of grouped convolutions), with JAX's type refusals turned
   into the axis-type decision's retry;
5. the outputs are constrained to their layouts (`_resolve`), and which of them leave in jaxdist's
   own layouts is recorded (`_provenance`); the trace is reported to the program cache (recompile
   warnings).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxdist.replicate.trees import abstract, flax_nnx, fn_name
from jaxdist.strategies import ambient
from jaxdist.strategies.ambient import computation
from jaxdist.strategies.compile._trace._in_place import InPlaceUpdates
from jaxdist.strategies.compile._trace._padded import PADDING, check_handed, padded_leaves
from jaxdist.strategies.compile._trace._provenance import Provenance, own_outputs
from jaxdist.strategies.compile._trace._refs import RefArguments
from jaxdist.strategies.compile._trace._resolve import (
    check_idle,
    constrain,
    constrain_outputs,
    typed_whole,
)
from jaxdist.strategies.compile._trace._roles import carried, step_argument_roles
from jaxdist.strategies.compile._trace._shardy import call_guarded, gather_at_entry
from jaxdist.strategies.layout import (
    auto_region,
    explicit_axes,
    in_host_memory,
    is_variable,
    leave_auto,
    nnx_layouts,
    program_axis_types,
    refusals,
    retyped,
    say,
    to_device_memory,
)

__all__ = ["StepTrace", "enter", "named"]


def named(traced: Callable, fn: Callable) -> Callable:
    """``traced`` under the user's function ``fn``'s name: what compile logs and profiles call the
    program (``jit(train_step)``, as under `jax.jit`)."""

    def program(*args: Any, **kwargs: Any) -> Any:
        return traced(*args, **kwargs)

    program.__qualname__ = fn_name(fn)
    program.__name__ = program.__qualname__.rsplit(".", 1)[-1]
    return program


def enter(traced: Any, concrete: Any) -> Any:
    """An express program's argument ``traced`` constrained at entry to the layout of ``concrete``
    (the value it was traced with, or the `jax.ShapeDtypeStruct` a plan traced it for), where that
    is a `NamedSharding`."""
    sharding = getattr(concrete, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not isinstance(traced, jax.Array):
        return traced
    return jax.lax.with_sharding_constraint(traced, sharding)


class StepTrace:
    """The traced body of one ``strategy.jit`` step, called by its programs as ``(nnx_static,
    nnx_state, *args, **kwargs)``; ``nnx_static``: ``(graphdef, nnx positions, provenance key)``.

    Its calls are decided under ``ambient.call(step_trace, (placed args, kwargs, nnx state))``.

    Args:
        policy: the strategy's `LayoutPolicy`.
        programs: the strategy's `ProgramCache` (told of each trace, for recompile warnings).
        fn: the user's step.
        static / static_names: its static arguments' positions and names.
        batch / batch_names: its declared batch arguments' positions (None: nothing declared) and
            names.
        out_layouts: the caller's declaration of the outputs' layouts (None: jaxdist decides).
        provenance: the step's `Provenance` (which outputs leave in jaxdist's layouts).
        agree: called with ``nnx_static`` when a program of a job of several processes traces,
            before the step's code: checks that every process compiled the same program (the step's
            lowering, `jaxdist.strategies.compile._agreement`).
    """

    def __init__(self, policy: Any, programs: Any, fn: Callable, static: tuple[int, ...],
                 static_names: tuple[str, ...], batch: tuple[int, ...] | None,
                 batch_names: tuple[str, ...], out_layouts: Any, provenance: Provenance,
                 agree: Callable[[tuple], None]):
        self.policy = policy
        self.programs = programs
        self.fn = fn
        self.static, self.static_names = static, static_names
        self.batch, self.batch_names = batch, batch_names
        self.out_layouts = out_layouts
        self.provenance = provenance
        self.agree = agree

    def __call__(self, nnx_static: tuple, state: Any, *args: Any, **kwargs: Any) -> Any:
        policy = self.policy
        graphdef, nodes, _ = nnx_static  # the third: the layouts' provenance (`Provenance.key`)
        if policy.spans_processes:
            self.agree(nnx_static)
        call = ambient.current_call(self)
        concrete_args, concrete_kwargs, concrete_state = (call.args if call is not None
                                                          else (None, None, None))
        # traced without concrete values (e.g. jax.eval_shape): layouts unknown
        if concrete_args is None:
            concrete_args = tuple(None if i in self.static else abstract(a)
                                  for i, a in enumerate(args))
            concrete_kwargs = {k: abstract(v) for k, v in kwargs.items()}
            concrete_state = abstract(state)
        signature = _trace_signature(args, self.static)
        # jax.Ref arguments (JAX's training cookbook's state) enter as the arrays they hold; the
        # step's code gets refs of its own, written back into the caller's after it (`_refs`).
        refs = RefArguments()
        args, kwargs = refs.read(args, kwargs, set(self.static) | set(nodes),
                                 set(self.static_names))
        # host-offloaded arguments enter in device memory (outputs shaped like them go back)
        args, kwargs, state = to_device_memory((args, kwargs, state))
        state_layouts, annotated = nnx_layouts(policy, concrete_state) if nodes else ([], [])
        # The mesh's Explicit axes run Auto inside this program when so decided: arguments retyped
        # at entry, results leave typed by their layouts (jaxdist.strategies.layout._axis_types).
        auto = program_axis_types() is jax.sharding.AxisType.Auto and bool(
            explicit_axes(policy.mesh))
        with auto_region(policy.mesh) if auto else contextlib.nullcontext():
            if auto:
                args, kwargs, state = retyped((args, kwargs, state))
            out, new_state = self._step_in_trace(graphdef, nodes, state, args, kwargs,
                                                 concrete_args, concrete_kwargs, concrete_state,
                                                 state_layouts, annotated, refs)
        if refs:
            out, held = out
            refs.write_back(policy.mesh, held)
        nodes_state = {}
        if nodes:
            keys = [tuple(p) for p, _ in
                    jax.tree_util.tree_leaves_with_path(concrete_state, is_leaf=is_variable)]
            nodes_state = dict(zip(keys, state_layouts, strict=True))
        arguments = [c for i, c in enumerate(concrete_args)
                     if i not in self.static and i not in nodes]
        # which outputs leave in jaxdist's layouts: marked after the call
        with own_outputs() as owned:
            out = constrain_outputs(policy, out, arguments, nodes_state, self.out_layouts)
            if nodes:
                values = [constrain(policy, v, s, host=in_host_memory(c)) for v, s, c in zip(
                    jax.tree.leaves(new_state), state_layouts, jax.tree.leaves(concrete_state),
                    strict=True)]
                out = out, jax.tree.unflatten(jax.tree.structure(new_state), values)
            self.provenance.record(nnx_static[1:], out, owned)
        if call is None or not call.agreeing:  # the agreement's own trace is not a recompile, and a
            # trace refused under Explicit types (dropped, traced again Auto) never gets here
            self.programs.note_trace(self.fn, signature)
            say(policy.mesh, fn_name(self.fn), auto)
        return leave_auto(policy.mesh, out) if auto else out

    def _step_in_trace(self, graphdef, nodes, state, args, kwargs, concrete_args, concrete_kwargs,
                       concrete_state, state_layouts, annotated, refs) -> tuple[Any, Any]:
        """The step's own code, its arguments entered in their roles: ``(out, new nnx state)``."""
        policy = self.policy
        skip = set(self.static) | set(nodes)
        kwargs = dict(kwargs)
        # a padded batch's row weights, for the strategy.run inside (_padded)
        padding = kwargs.pop(PADDING, None)
        padded = padded_leaves(padding, args, kwargs, skip, self.static_names)
        names = [k for k in kwargs if k not in self.static_names]
        declared = None if self.batch is None else (*self.batch, *(
            len(args) + j for j, k in enumerate(names) if k in self.batch_names))
        flat_args = (*args, *(kwargs[k] for k in names))
        flat_concrete = (*concrete_args, *(concrete_kwargs.get(k) for k in names))
        batches, variables = step_argument_roles(policy, flat_args, flat_concrete, declared, skip)
        explicit = explicit_axes(policy.mesh)
        if explicit:  # variables jaxdist split over Explicit axes enter typed whole
            flat_args, state = typed_whole(policy, flat_args, flat_concrete, skip, batches, state,
                                            state_layouts, annotated)
        # On Explicit axes the variables jaxdist split were just typed whole, and the others'
        # layouts are the user's own (as under plain jax.jit): nothing more to gather.
        if not batches and policy.splits_variables and not explicit:
            flat_args, state = gather_at_entry(policy, flat_args, flat_concrete, state,
                                               concrete_state, skip)
            batches, variables = step_argument_roles(policy, flat_args, flat_concrete, declared,
                                                     skip)
        check_idle(policy, flat_concrete, skip, declared, state_layouts, concrete_state)
        args = flat_args[: len(args)]
        kwargs = {**kwargs, **dict(zip(names, flat_args[len(args):], strict=True))}
        variables.extend(jax.tree.leaves(state))
        # Over a split batch the step's grouped convolutions are kept whole along their groups
        # (`_shardy`: an XLA Shardy miscompute of per-example conv gradients).
        split = bool(batches) and policy.num_replicas > 1
        with (computation(policy, "global", batches, variables, padded=padded),
              policy.tracing_scope(), refusals(policy.mesh, fn_name(self.fn))):
            if not nodes:
                if split:
                    return self._guarded(lambda _, a, k: self._watched(a, k, refs, padded), None,
                                         args, kwargs, batches, variables, padded), None
                return self._watched(args, kwargs, refs, padded), None
            nnx = flax_nnx()  # nnx arguments: nnx is imported

            def step(state: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
                objects = nnx.merge(graphdef, state)
                call_args = list(args)
                for i, obj in zip(nodes, objects, strict=True):
                    call_args[i] = obj
                out = self._watched(call_args, kwargs, refs, padded)
                new_graphdef, new_state = nnx.split(objects)
                if new_graphdef != graphdef:
                    raise ValueError(f"{fn_name(self.fn)} changed the structure of its nnx "
                                     "arguments (added or removed variables or submodules): a "
                                     "compiled step may update variables in place, not create "
                                     "them; create every variable before the first step.")
                return out, new_state

            if split:
                return self._guarded(step, state, args, kwargs, batches, variables, padded)
            return step(state, args, kwargs)

    def _watched(self, args: Any, kwargs: dict, refs: RefArguments, padded: list) -> Any:
        """The step's own code, watched for sync-on-read values updated in place but not returned
        and for a padded batch it hands to no ``strategy.run`` (``padded``); with ref arguments
        (``refs``): ``(out, what the step's refs hold after it)``."""
        args, kwargs, inner = refs.wrap(args, kwargs)
        watch = InPlaceUpdates(fn_name(self.fn), args, kwargs)
        out = self.fn(*args, **kwargs)
        watch.check(out)
        check_handed(padded, self.fn)
        return (out, [r[...] for r in inner]) if refs else out

    def _guarded(self, step: Callable, state: Any, args: tuple, kwargs: dict, batches: list,
                 variables: list, padded: list) -> Any:
        """``step(state, args, kwargs)`` through `call_guarded`: its static arguments (Python
        values, not arrays) closed over, and the values it is traced with keep the roles of the
        step's arguments they stand for (what ``strategy.run`` inside the step reads)."""
        static = {i: args[i] for i in self.static if i < len(args)}
        named_static = {k: v for k, v in kwargs.items() if k in self.static_names}
        dynamic = (state, tuple(None if i in static else a for i, a in enumerate(args)),
                   {k: v for k, v in kwargs.items() if k not in named_static})
        outer = jax.tree.leaves(dynamic)

        def pure(state: Any, dynamic: tuple, dynamic_kwargs: dict) -> Any:
            inner = jax.tree.leaves((state, dynamic, dynamic_kwargs))
            full = tuple(static[i] if i in static else a for i, a in enumerate(dynamic))
            with carried(self.policy, outer, inner, batches, variables, padded):
                return step(state, full, {**dynamic_kwargs, **named_static})

        return call_guarded(self.policy, pure, *dynamic)


def _trace_signature(args: tuple, static: tuple[int, ...]) -> tuple:
    statics = tuple(repr(args[i])[:80] for i in static if i < len(args))
    shapes = tuple((tuple(np.shape(x)), str(jax.dtypes.result_type(x)))
                   for i, a in enumerate(args) if i not in static for x in jax.tree.leaves(a))
    return statics, shapes
