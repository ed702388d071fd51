"""The global view: `Strategy.jit` compiles an unmodified single-device step for its layout.

The step sees global arrays (whole parameters, the whole global batch) and XLA's SPMD partitioner
inserts the collectives, so it computes what it computes on one device. Where each argument lives is
declared or carried by the value, never guessed (`jaxdist.strategies.compile._placing`):
``batch_argnums`` arguments are split on axis 0 over the replicas; every other argument is a
variable (an array on the strategy's mesh keeps its layout, any other takes the VARIABLE layout);
nnx graph objects are taken as ``nnx.jit`` takes them, their in-place updates written back. An
output shaped like a positional argument (``state -> new_state``) takes that argument's layout,
every other output the variable layout (`jaxdist.strategies.compile._trace._resolve`). Layouts are
read only when the step is traced.

Calls cost what ``jax.jit`` calls cost (the express path, `StrategyFunction.__call__`): the full
path decides once per argument signature and builds a `jax.jit` program; a later positional call
with arguments of the same types goes straight to it, and JAX's compiled dispatch checks the rest
(shapes, dtypes, weak types, layouts, the trace context). A signature JAX has no program for makes
the trace refuse (`_Refused`, before any of the step's code runs) and the call takes the full path.
What JAX's cache cannot see is read per call only where it exists: the provenance of layouts over
Explicit axes on a policy that splits variables, and host arrays in a job of several processes. A
call with a padded batch (``remainder="pad"``) always takes the full path, its row weights one more
argument (`jaxdist.strategies.compile._trace._padded`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.replicate.trees import flax_nnx, fn_name, is_graph_node
from jaxdist.strategies import ambient
from jaxdist.strategies.compile._agreement import agree, fingerprint
from jaxdist.strategies.compile._cache import ProgramCache, StepPrograms
from jaxdist.strategies.compile._equinox import Static, combine, holds_module, partition
from jaxdist.strategies.compile._placing import ArgumentPlacement
from jaxdist.strategies.compile._signatures import argument_spec, signature_of
from jaxdist.strategies.compile._trace import (
    PADDING,
    Provenance,
    StepTrace,
    enter,
    named,
    padding_argument,
)
from jaxdist.strategies.input import PADDED, all_on_mesh, holds_padded, shardings_of
from jaxdist.strategies.layout import LayoutPolicy, decided, explicit_axes, ran_auto
from jaxdist.strategies.plan import Plan, is_plan_mesh, plan_step, refuse_to_run

__all__ = ["StrategyFunction"]


# whether values of a type are nnx graph nodes (decided by type alone)
_GRAPH_TYPES: dict[type, bool] = {}
_SCALARS = frozenset({bool, int, float, complex})


class _Refused(Exception):
    """An express program was asked for a signature it has no program for (see
    `StrategyFunction.__call__`)."""


def _is_graph_node(x: Any) -> bool:
    known = _GRAPH_TYPES.get(type(x))
    if known is None:
        if flax_nnx() is None:  # no nnx object yet (not kept: nnx may be imported later)
            return False
        known = _GRAPH_TYPES[type(x)] = is_graph_node(x)
    return known


class StrategyFunction:
    """A step compiled by ``strategy.jit``: call it like the original function (`jax.jit`'s shape).

    Besides calling it, ``.trace(*args, **kwargs)``, ``.lower(*args, **kwargs)`` and
    ``.lower(...).compile()`` are `jax.jit`'s ahead-of-time stages for the strategy's layout:
    inspect a program (its HLO, memory and cost analyses) without running it.

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> step = strategy.jit(lambda w, x: w - 0.1 * x.mean(0), batch_argnums=1)
        >>> step(jnp.ones(2), jnp.ones((4, 2))).tolist()
        [0.8999999761581421, 0.8999999761581421]
        >>> step.lower(jnp.ones(2), x=jnp.ones((4, 2))).compile().as_text() is not None
        True
    """

    def __init__(self, policy: LayoutPolicy, programs: ProgramCache, fn: Callable,
                 donate_argnums: int | Sequence[int] | None = None,
                 static_argnums: int | Sequence[int] | None = None,
                 batch_argnums: int | Sequence[int] | None = None, *,
                 static_argnames: str | Sequence[str] | None = None,
                 donate_argnames: str | Sequence[str] | None = None,
                 batch_argnames: str | Sequence[str] | None = None, out_layouts: Any = None,
                 axis_types: jax.sharding.AxisType | None = None, _module_arrays: bool = False):
        if not callable(fn):
            raise TypeError(f"fn={fn!r} is not callable: strategy.jit compiles a step function.")
        self._policy = policy
        self._plan_only = is_plan_mesh(policy.mesh)  # a mesh without devices: plans, never calls
        self._programs = programs
        self._fn = fn
        self._signature = signature_of(fn)
        self._static, self._static_names = argument_spec(
            self._signature, fn, static_argnums, static_argnames, "static")
        self._donate, self._donate_names = argument_spec(
            self._signature, fn, donate_argnums, donate_argnames, "donate")
        if batch_argnums is None and batch_argnames is None:
            self._batch, self._batch_names = None, ()
        else:
            self._batch, self._batch_names = argument_spec(
                self._signature, fn, batch_argnums, batch_argnames, "batch")
        for name, nums, names in (("donate", self._donate, self._donate_names),
                                  ("batch", self._batch or (), self._batch_names)):
            both = sorted(set(nums) & set(self._static)) or sorted(
                set(names) & set(self._static_names))
            if both:
                raise ValueError(f"argument(s) {both} are both static and in "
                                 f"{name}_argnums/{name}_argnames: a static argument is a "
                                 "compile-time constant, not an array; drop it from one of them.")
        if axis_types is not None and not isinstance(axis_types, jax.sharding.AxisType):
            raise ValueError(f"axis_types={axis_types!r} is not a jax.sharding.AxisType: pass None "
                             "(each program decides: the mesh's Explicit axes where the step "
                             "type-checks with them, Auto where not), jax.sharding.AxisType.Auto "
                             "or jax.sharding.AxisType.Explicit.")
        self._axis_types = axis_types
        # Only a mesh with Explicit axes has an axis-type decision to make (read once, here).
        self._decides = bool(policy.roles.explicit_axes) or axis_types is not None
        # (jaxdist's layouts and the user's differ only where it splits over Explicit axes)
        self._provenance = Provenance(policy)
        self._tells_provenance = self._provenance.tells
        self._out_layouts = out_layouts
        self._module_arrays = _module_arrays  # this is the program over Equinox arguments' arrays
        # that program, for calls with Equinox arguments, by the number of positional arguments
        self._modules: dict[int, StrategyFunction] = {}
        # the static part of its outputs, recorded when traced
        self._module_outputs: dict[Static, Static] = {}
        # its programs: the full path's, by nnx positions, and the express path's (`__call__`)
        self._compiled = StepPrograms()
        # What the argument types cannot tell and JAX's cache does not see, read from the leaves on
        # such policies only: the provenance of layouts over Explicit axes, and host arrays in a job
        # of several processes (a process's own rows there, not the global value jax.jit sees).
        self._reads_leaves = self._tells_provenance or policy.spans_processes
        self._place = ArgumentPlacement(policy, fn, self._static, self._static_names, self._batch,
                                        self._batch_names)
        self._trace = StepTrace(policy, programs, fn, self._static, self._static_names, self._batch,
                                self._batch_names, out_layouts, self._provenance, self._agree)
        functools.update_wrapper(self, fn)

    @property
    def batch_argnums(self) -> tuple[int, ...] | None:
        """The declared batch arguments' positions (None: nothing declared)."""
        return self._batch

    # ------------------------------------------------------------------------------------- programs
    def _program(self, nodes: tuple[int, ...]) -> Callable:
        jitted = self._compiled.full.get(nodes)
        if jitted is None:
            shift = 2  # the inner function takes (nnx_static, nnx_state, *args, **kwargs)
            donate = tuple(i + shift for i in self._donate if i not in nodes)
            if any(i in nodes for i in self._donate):
                donate += (1,)
            jitted = self._compiled.full[nodes] = jax.jit(
                named(self._trace, self._fn), static_argnums=self._static_positions,
                donate_argnums=donate, static_argnames=self._static_names,
                donate_argnames=self._donate_names)
        return jitted

    @property
    def _static_positions(self) -> tuple[int, ...]:
        """Static arguments of the inner function ``(nnx_static, nnx_state, *args, **kwargs)``."""
        return (0, *(i + 2 for i in self._static))

    def _bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Keyword arguments for positional parameters become positional (as `jax.jit` resolves
        them), so that ``*_argnums`` and ``*_argnames`` mean an argument however it is passed."""
        if not kwargs or self._signature is None:
            return args, kwargs
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{fn_name(self._fn)}: {error}") from None
        return bound.args, bound.kwargs

    # ---------------------------------------------------------------------------------------- calls
    def _split(self, args: tuple, kwargs: dict) -> tuple[tuple, tuple[int, ...], Any, Any]:
        for k, a in kwargs.items():
            if _is_graph_node(a):
                raise TypeError(f"{fn_name(self._fn)}: nnx object passed as keyword-only argument "
                                f"{k!r}; pass nnx modules, optimizers and metrics positionally (or "
                                "by the name of a positional parameter), so their in-place updates "
                                "are written back.")
        nodes = tuple(i for i, a in enumerate(args) if i not in self._static and _is_graph_node(a))
        if not nodes:
            return args, nodes, None, None
        graphdef, state = flax_nnx().split(tuple(args[i] for i in nodes))
        plain = tuple(None if i in nodes else a for i, a in enumerate(args))
        return plain, nodes, graphdef, state

    def _prepare(self, args: tuple, kwargs: dict) -> tuple:
        args, kwargs = self._bind(args, kwargs)
        plain, nodes, graphdef, state = self._split(args, kwargs)
        placed, kwargs, state = self._place(plain, kwargs, state)
        return args, nodes, graphdef, placed, kwargs, state

    def _with_padding(self, args: tuple, bound_kwargs: dict, kwargs: dict,
                      nodes: tuple[int, ...]) -> dict:
        """The placed ``kwargs`` with the row weights of the padded batches among the call's
        arguments (``args`` / ``bound_kwargs``, as the call got them), for the ``strategy.run``
        inside (`_trace._padded`)."""
        skip = set(self._static) | set(nodes)
        return {**kwargs, PADDING: padding_argument(args, bound_kwargs, skip, self._static_names)}

    def _module_step(self, count: int) -> StrategyFunction:
        """This step over its arguments' arrays, for calls with an Equinox module among their
        ``count`` positional arguments: the non-array leaves of every argument are one static
        argument after them (``eqx.filter_jit``'s rule), so each argument keeps its position and
        name (in the declarations and in what errors and warnings say)."""
        step = self._modules.get(count)
        if step is None:
            fn, outputs = self._fn, self._module_outputs

            def arrays_step(*arrays: Any, **named_arrays: Any) -> Any:
                *arrays, static = arrays
                args, kwargs = combine((tuple(arrays), named_arrays), static)
                out_arrays, outputs[static] = partition(fn(*args, **kwargs))
                return out_arrays

            arrays_step.__name__ = arrays_step.__qualname__ = fn_name(fn)
            step = self._modules[count] = StrategyFunction(
                self._policy, self._programs, arrays_step, donate_argnums=self._donate,
                static_argnums=count, batch_argnums=self._batch,
                donate_argnames=self._donate_names, batch_argnames=self._batch_names or None,
                out_layouts=self._out_layouts, axis_types=self._axis_types, _module_arrays=True)
        return step

    def _call_modules(self, stage: str | None, args: tuple, kwargs: dict) -> Any:
        args, kwargs = self._bind(args, kwargs)
        (arrays, named_arrays), static = partition((args, kwargs))
        step = self._module_step(len(arrays))
        if stage is not None:
            return getattr(step, stage)(*arrays, static, **named_arrays)
        return combine(step(*arrays, static, **named_arrays), self._module_outputs[static])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The express path (module doc): a positional call whose argument types were seen before
        # goes straight to the program the full path built for them (`_express_program`); JAX's
        # dispatch checks the rest in C++, and a call it has no trace for takes the full path below.
        key = refused = None
        # A padded batch takes the full path, its row weights brought in for the strategy.run inside
        # the step (`_trace._padded`). (A dict's truth first: free while none is padded.)
        padded = bool(PADDED) and holds_padded((args, kwargs))
        if not kwargs and not padded:
            key = tuple(map(type, args))
            if self._reads_leaves:
                key = self._leaf_key(key, args)
            entry = self._compiled.express.get(key) if key is not None else None
            if entry is not None:
                program, static = entry
                try:
                    out = program(*args)
                except (_Refused, ValueError):
                    refused = program
                    self._compiled.missed(key)
                else:
                    return (self._provenance.marked(static[1:], out) if self._tells_provenance
                            else out)
        if self._plan_only:
            refuse_to_run(self._policy.mesh, f"calling {fn_name(self._fn)}")
        if not self._module_arrays and holds_module(args, kwargs):
            return self._call_modules(None, args, kwargs)
        bound_kwargs = self._bind(args, kwargs)[1] if padded else None
        args, nodes, graphdef, placed, kwargs, state = self._prepare(args, kwargs)
        static = (graphdef, nodes, self._provenance.key(jax.tree.leaves((placed, kwargs, state))))
        if padded:  # (never the express path: its programs are for calls without the weights)
            kwargs = self._with_padding(args, bound_kwargs, kwargs, nodes)
        express = None if kwargs or nodes else self._express_program(static, placed)
        with (ambient.call(self._trace, (placed, kwargs, state)),
              self._policy.call_scope((placed, kwargs, state))):
            if express is not None:  # (the call's arguments are read only if it traces)
                out = self._provenance.marked(static[1:], self._decided(lambda: express(*placed)))
            else:
                out = self._provenance.marked(static[1:], self._decided(
                    lambda: self._program(nodes)(static, state, *placed, **kwargs)))
        if refused is not None:
            # JAX's dispatch keeps, for the signature the express program refused, an entry that
            # sends every later call of it to Python: dropped now that this call has traced it. A
            # JAX without that method: the program is built anew for the next call (one more trace).
            if not self._compiled.cleared(refused):
                express = None if express is refused else express
        if express is not None and key is not None and not any(
                isinstance(x, (np.ndarray, np.generic)) for i in self._donate if i < len(args)
                for x in jax.tree.leaves(args[i])):
            # (a donated host array is a program of its own to jax.jit: the full path keeps it)
            self._compiled.install(key, express, static)
        if not nodes:
            return out
        out, new_state = out
        flax_nnx().update(tuple(args[i] for i in nodes), new_state)  # in place, as nnx.jit
        return out

    def _leaf_key(self, key: tuple, args: tuple) -> Any:
        """The express path's key on a policy that reads the leaves (`_reads_leaves`): the argument
        types and the provenance of their layouts; None (no express call) where a leaf is off the
        mesh in a job of several processes (a host array there holds a process's own rows)."""
        leaves = jax.tree.leaves(args)
        shardings = shardings_of(leaves)
        if self._policy.spans_processes and not all_on_mesh(leaves, self._policy.mesh, shardings):
            return None
        return key, self._provenance.key(leaves, shardings) if self._tells_provenance else None

    def _express_program(self, static: tuple, placed: tuple) -> Callable | None:
        """The program of a positional call without nnx arguments whose arguments ``placed`` hold
        (the full path's decision made): `jax.jit` of the step, one per static key. It traces only
        inside the full path (`StepTrace` needs the call's values); traced from anywhere else (JAX
        met a signature it has no trace for) it raises `_Refused` before any of the step's code
        runs. JAX reuses a trace for arguments of the same types whatever their layouts, so without
        Explicit axes each array enters constrained to the layout it was traced with (as the full
        path would have placed it). None where a leaf is a tracer or no array."""
        dynamic = tuple(a for i, a in enumerate(placed) if i not in self._static)
        if not all(type(x) in _SCALARS or isinstance(x, jax.ShapeDtypeStruct) or (
                isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))
                   for x in jax.tree.leaves(dynamic)):
            return None
        program = self._compiled.families.get(static)
        if program is None:
            traced, skip = self._trace, set(self._static)
            pin = not explicit_axes(self._policy.mesh)

            def step(*args: Any) -> Any:
                call = ambient.current_call(traced)
                if call is None:
                    raise _Refused
                if pin:
                    args = tuple(a if i in skip else jax.tree.map(enter, a, c)
                                 for i, (a, c) in enumerate(zip(args, call.args[0], strict=True)))
                return traced(static, None, *args)

            program = self._compiled.families[static] = jax.jit(
                named(step, self._fn), static_argnums=self._static, donate_argnums=self._donate)
        return program

    def _agree(self, nnx_static: tuple) -> None:
        """A new program is being traced (JAX traces only on a cache miss, so steady-state steps
        never come here): lower it once more for its fingerprint and check that every process
        compiled the same one before it runs (see `jaxdist.strategies.compile._agreement`)."""
        call = ambient.current_call(self._trace)
        if call is None or call.agreeing:
            return
        placed, kwargs, state = call.args
        # the same program, wrapped anew (JAX refuses to trace a function inside its own trace)
        twin = jax.jit(named(self._trace, self._fn), static_argnums=self._static_positions,
                       static_argnames=self._static_names)
        call.agreeing = True
        try:
            lowered = twin.lower(nnx_static, state, *placed, **kwargs)
        finally:
            call.agreeing = False
        agree(fn_name(self._fn), fingerprint(lowered))

    def trace(self, *args: Any, **kwargs: Any) -> jax.stages.Traced:
        """Trace for these arguments without compiling or running (`jax.jit`'s ``.trace``): the
        program for the strategy's layout. Arguments may be `jax.ShapeDtypeStruct`s (with a
        ``sharding=`` to say where they live).

        Returns:
            A `jax.stages.Traced` (``.jaxpr``, ``.lower()``).
        """
        return self._stage("trace", args, kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Lower for these arguments without running (`jax.jit`'s ``.lower``): ``.as_text()``,
        ``.compile()`` and its ``memory_analysis()`` / ``cost_analysis()`` inspect the program for
        the strategy's layout.

        Returns:
            A `jax.stages.Lowered`.
        """
        return self._stage("lower", args, kwargs)

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The step's `jd.Plan` for these arguments: memory, FLOPs, collectives per device, compiled
        for the strategy's layout; the step never runs and nothing is allocated (see
        `jaxdist.strategies.plan._plan`).

        Arguments may be real values or `jax.ShapeDtypeStruct`s (``jax.eval_shape(init)``); those
        without a layout get the one a call would give them (declared batches split over the batch
        axes, everything else the variable layout). On a plan mesh (`jd.plan_mesh`) the program is
        compiled in a subprocess with that many simulated CPU devices.

        Returns:
            A `jd.Plan`.

        Raises:
            ValueError: for a declared batch whose rows the replicas do not divide.

        Examples:
            >>> import jax, jax.numpy as jnp, jaxdist as jd
            >>> step = jd.MirroredStrategy().jit(lambda w, x: (x @ w).sum(), batch_argnums=1)
            >>> plan = step.plan(jax.ShapeDtypeStruct((16, 4), jnp.float32),
            ...                  jax.ShapeDtypeStruct((64, 16), jnp.float32))
            >>> plan.state_bytes, plan.collectives["all-reduce"].count
            ({'w': 256, 'batch': 512}, 1)
        """
        if not self._module_arrays and holds_module(args, kwargs):
            return self._call_modules("plan", args, kwargs)
        args, kwargs = self._bind(args, kwargs)
        names = list(self._signature.parameters) if self._signature is not None else []
        return plan_step(self._policy, self.trace, args, kwargs, axis_types_of=self.axis_types_of,
                         names=names, batch=self._batch or (), batch_names=self._batch_names,
                         static=self._static, static_names=self._static_names)

    def _stage(self, stage: str, args: tuple, kwargs: dict) -> Any:
        if not self._module_arrays and holds_module(args, kwargs):
            return self._call_modules(stage, args, kwargs)
        # the program a call would run: with the weights
        padded = bool(PADDED) and holds_padded((args, kwargs))
        bound_kwargs = self._bind(args, kwargs)[1] if padded else None
        bound, nodes, graphdef, placed, kwargs, state = self._prepare(args, kwargs)
        static = (graphdef, nodes, self._provenance.key(jax.tree.leaves((placed, kwargs, state))))
        if padded:
            kwargs = self._with_padding(bound, bound_kwargs, kwargs, nodes)
        with (ambient.call(self._trace, (placed, kwargs, state)),
              self._policy.call_scope((placed, kwargs, state))):
            # the program calls run (the same trace: a plan or a cost read after calls traces none)
            express = None if kwargs or nodes else self._express_program(static, placed)
            if express is not None:
                return self._decided(lambda: getattr(express, stage)(*placed))
            return self._decided(
                lambda: getattr(self._program(nodes), stage)(static, state, *placed, **kwargs))

    def _decided(self, call: Callable[[], Any]) -> Any:
        """``call()``, whose trace (if it traces) runs with the axis types decided for the program
        (`jaxdist.strategies.layout._axis_types`)."""
        if not self._decides:
            return call()
        return decided(self._policy.mesh, self._axis_types, call, fn_name(self._fn))

    def axis_types_of(self, traced: jax.stages.Traced) -> dict[str, jax.sharding.AxisType]:
        """The axis types the program ``traced`` (from `trace`) runs with: the mesh's own, or Auto
        for every axis where its Explicit axes run Auto (see
        `jaxdist.strategies.layout._axis_types`)."""
        mesh = self._policy.mesh
        auto = ran_auto(traced.jaxpr)
        return {a: jax.sharding.AxisType.Auto if auto else t
                for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)}
