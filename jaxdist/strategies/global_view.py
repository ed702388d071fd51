"""The global view: `Strategy.jit` compiles an unmodified single-device step for the strategy's layout.

The step sees global arrays: whole parameters and the whole global batch; XLA's SPMD partitioner inserts
the collectives, so the step computes what it computes on one device. Where each argument lives is decided
by what the caller declared or what the value carries, never guessed:

* ``batch_argnums`` declares the batch arguments: their arrays are split on axis 0 over the replicas (host
  arrays are placed so; a batch the replicas do not divide is a ValueError that says what to do);
* every other argument is a variable: arrays already on the strategy's mesh keep their layout (a batch from
  a distributed dataset carries its own); arrays not yet there (numpy, or on another device) take the
  strategy's VARIABLE layout (mirrored; FSDP on `ShardedStrategy`). Without any ``batch_argnums`` an
  unplaced array of rank >= 1 might be a batch, so the first one met raises a one-time warning that names
  the declaration;
* nnx graph objects (modules, optimizers, metrics, ``nnx.Rngs``) are accepted as ``nnx.jit`` accepts them:
  their state enters in the variable layout, and their in-place updates are written back after the call.

Outputs get a defined layout: an output with the same structure, shapes and dtypes as a positional argument
(``state -> new_state``) takes that argument's layout (on a policy that splits variables, an argument that
came in whole on every device leaves in the variable layout), so state keeps its layout from step to step; every
other output takes the strategy's variable layout (metrics and gradients: mirrored, or FSDP like their
parameters on `ShardedStrategy`). Layouts are read only when the step is traced: steady-state calls cost what
a hand-written ``jax.jit`` with ``NamedSharding``s costs.

One more rule protects users from an upstream bug: XLA's Shardy partitioner can miscompute conv nets whose
kernels are split while the batch is replicated. A step of a strategy with split variables that receives no
distributed batch therefore gathers its variables at entry (`Strategy.gathers_variables_without_batch`).
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxdist.replicate.layouts import path_name, put
from jaxdist.replicate.trees import abstract, fn_name
from jaxdist.strategies.agreement import agree, fingerprint
from jaxdist.strategies.ambient import computation
from jaxdist.strategies.input import place_batch
from jaxdist.strategies.offload import to_device_memory
from jaxdist.strategies.policy import LayoutPolicy
from jaxdist.strategies.programs import ProgramCache
from jaxdist.strategies.roles import UndeclaredBatchWarning, as_argnums, step_argument_roles

__all__ = ["StrategyFunction"]


def _is_graph_node(x: Any) -> bool:
    return nnx.graph.is_graph_node(x)


class StrategyFunction:
    """A step compiled by ``strategy.jit``: call it like the original function.

    Example:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> step = strategy.jit(lambda w, x: w - 0.1 * x.mean(0), batch_argnums=1)
        >>> step(jnp.ones(2), jnp.ones((4, 2))).tolist()
        [0.8999999761581421, 0.8999999761581421]
    """

    def __init__(
        self,
        policy: LayoutPolicy,
        programs: ProgramCache,
        fn: Callable,
        donate_argnums: int | Sequence[int] | None = None,
        static_argnums: int | Sequence[int] | None = None,
        batch_argnums: int | Sequence[int] | None = None,
    ):
        if not callable(fn):
            raise TypeError(f"fn={fn!r} is not callable: strategy.jit compiles a step function.")
        self._policy = policy
        self._programs = programs
        self._fn = fn
        self._static = as_argnums(static_argnums, "static_argnums")
        self._donate = as_argnums(donate_argnums, "donate_argnums")
        self._batch = None if batch_argnums is None else as_argnums(batch_argnums, "batch_argnums")
        for name, nums in (("donate_argnums", self._donate), ("batch_argnums", self._batch or ())):
            if any(i < 0 for i in nums):
                raise ValueError(f"{name}={nums!r}: use non-negative positions (counted from the first argument).")
            both = sorted(set(nums) & set(self._static))
            if both:
                raise ValueError(
                    f"argument(s) {both} are both in static_argnums and {name}: a static argument is a "
                    "compile-time constant, not an array; drop it from one of them."
                )
        self._local = threading.local()
        self._warned = False
        self._jitted: dict[tuple[int, ...], Callable] = {}  # by positions of nnx graph arguments
        functools.update_wrapper(self, fn)

    @property
    def batch_argnums(self) -> tuple[int, ...] | None:
        """The declared batch arguments (None: not declared)."""
        return self._batch

    # --------------------------------------------------------------------------------------- placing
    def _program(self, nodes: tuple[int, ...]) -> Callable:
        jitted = self._jitted.get(nodes)
        if jitted is None:
            shift = 2  # the inner function takes (nnx_static, nnx_state, *args)
            donate = tuple(i + shift for i in self._donate if i not in nodes)
            if any(i in nodes for i in self._donate):
                donate += (1,)
            jitted = self._jitted[nodes] = jax.jit(
                self._traced, static_argnums=self._static_positions, donate_argnums=donate
            )
        return jitted

    @property
    def _static_positions(self) -> tuple[int, ...]:
        """Static arguments of the inner function ``(nnx_static, nnx_state, *args)``."""
        return (0, *(i + 2 for i in self._static))

    def _place(self, args: tuple, state: Any) -> tuple[tuple, Any]:
        policy = self._policy
        mesh = policy.mesh
        declared = self._batch or ()
        # Fast path: in steady state every array is already on the mesh (host batches aside). Arrays on the mesh
        # keep their layout, except a declared batch that every replica holds whole: it is split (its rows are
        # what the replicas share out; a replicated batch with split variables also walks into an XLA Shardy
        # miscompute). Only the arguments holding an array to move are walked again.
        todo = []
        for i, a in enumerate(args):
            if i in self._static:
                continue
            for x in jax.tree.leaves(a):
                if getattr(getattr(x, "sharding", None), "mesh", None) is mesh:
                    if i in declared and _replicated_rows(x, policy):
                        todo.append(i)  # a declared batch held whole by every replica: split it
                        break
                    continue  # the common case, checked without a method call
                if _needs_placing(x, mesh):
                    todo.append(i)
                    break
        if state is not None and any(_needs_placing(x, mesh) for x in jax.tree.leaves(state)):
            state = self._place_variables(state, "the nnx state", warn=False)
        if not todo:
            return args, state
        placed = list(args)
        for i in todo:
            if i in declared:
                placed[i] = place_batch(policy, args[i], where=f"argument {i} (in batch_argnums)")
            else:
                placed[i] = self._place_variables(args[i], f"argument {i}")
        return tuple(placed), state

    def _place_nnx_defaults(self, state: Any, annotated: list[bool]) -> Any:
        """nnx state Flax put on the ambient mesh replicated by default (no partitioning annotation) takes the
        strategy's variable layout; annotated variables keep the layout their annotation gave them."""
        leaves = jax.tree_util.tree_leaves_with_path(state)
        todo = [
            i for i, ((_, x), a) in enumerate(zip(leaves, annotated, strict=True))
            if not a and isinstance(x, jax.Array) and np.ndim(x) and x.sharding.is_fully_replicated
        ]
        if not todo:
            return state
        flat, treedef = jax.tree.flatten(state)
        for i in todo:
            path, x = leaves[i]
            layout = self._policy.variable_layout(path_name(path), jax.ShapeDtypeStruct(x.shape, x.dtype))
            if not layout.is_fully_replicated:
                flat[i] = put(x, layout)
        return jax.tree.unflatten(treedef, flat)

    def _place_variables(self, tree: Any, where: str, warn: bool = True) -> Any:
        mesh = self._policy.mesh
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        if not any(_needs_placing(x, mesh) for _, x in leaves):
            return tree
        if warn and self._batch is None and not self._warned:
            ranked = [p for p, x in leaves if _needs_placing(x, mesh) and np.ndim(x) >= 1]
            if ranked:
                self._warned = True
                warnings.warn(
                    f"{fn_name(self._fn)}: {where} holds unplaced arrays (e.g. {where}{jax.tree_util.keystr(ranked[0])}"
                    f" of shape {np.shape(_leaf_at(tree, ranked[0]))}) and no argument is declared a batch, so they "
                    "are placed as variables (mirrored: every replica computes on all of their rows). If an "
                    "argument is a batch, declare it: strategy.jit(fn, batch_argnums=(i,)) splits its rows over "
                    "the replicas; pass batch_argnums=() to declare that there is none.",
                    UndeclaredBatchWarning,
                    stacklevel=5,
                )
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x)), tree)
        layouts = self._policy.variable_shardings(shapes)
        return jax.tree.map(lambda x, s: put(x, s) if _needs_placing(x, mesh) else x, tree, layouts)

    # ------------------------------------------------------------------------------------------ calls
    def _split(self, args: tuple) -> tuple[tuple, tuple[int, ...], Any, Any]:
        nodes = tuple(i for i, a in enumerate(args) if i not in self._static and _is_graph_node(a))
        if not nodes:
            return args, nodes, None, None
        graphdef, state = nnx.split(tuple(args[i] for i in nodes))
        if self._policy.splits_variables:  # variables can be split: Flax's default may not fit
            annotated = [
                bool(v.get_metadata().get("out_sharding") or v.get_metadata().get("sharding"))
                for v in jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
            ]
            state = self._place_nnx_defaults(state, annotated)
        plain = tuple(None if i in nodes else a for i, a in enumerate(args))
        return plain, nodes, graphdef, state

    def __call__(self, *args: Any) -> Any:
        plain, nodes, graphdef, state = self._split(args)
        placed, state = self._place(plain, state)
        self._local.args = (placed, state)  # read only if this call traces
        try:
            out = self._program(nodes)((graphdef, nodes), state, *placed)
        finally:
            self._local.args = None
        if not nodes:
            return out
        out, new_state = out
        nnx.update(tuple(args[i] for i in nodes), new_state)  # in-place updates, as nnx.jit
        return out

    def _agree(self, nnx_static: tuple) -> None:
        """A new program is being traced (JAX traces only on a cache miss, so steady-state steps never come
        here): lower it once more for its fingerprint and check that every process compiled the same one
        before it runs (see `jaxdist.strategies.agreement`)."""
        concrete = getattr(self._local, "args", None)
        if concrete is None or getattr(self._local, "agreeing", False):
            return
        placed, state = concrete
        # The same program through a wrapper of its own (JAX refuses to trace a function inside its own trace).
        twin = jax.jit(lambda *a: self._traced(*a), static_argnums=self._static_positions)
        self._local.agreeing = True
        try:
            lowered = twin.lower(nnx_static, state, *placed)
        finally:
            self._local.agreeing = False
        agree(fn_name(self._fn), fingerprint(lowered))

    def lower(self, *args: Any):
        """Lower for these arguments (for inspecting HLO or memory), as ``jax.jit(...).lower``."""
        plain, nodes, graphdef, state = self._split(args)
        placed, state = self._place(plain, state)
        self._local.args = (placed, state)
        try:
            return self._program(nodes).lower((graphdef, nodes), state, *placed)
        finally:
            self._local.args = None

    # --------------------------------------------------------------------------------------- tracing
    def _traced(self, nnx_static: tuple, state: Any, *args: Any) -> Any:
        policy = self._policy
        graphdef, nodes = nnx_static
        if policy.spans_processes:
            self._agree(nnx_static)
        concrete_args, concrete_state = getattr(self._local, "args", None) or (None, None)
        if concrete_args is None:  # traced without concrete values (e.g. jax.eval_shape): layouts unknown
            concrete_args = tuple(None if i in self._static else abstract(a) for i, a in enumerate(args))
            concrete_state = abstract(state)
        if not getattr(self._local, "agreeing", False):  # the agreement's own trace is not a recompile
            self._programs.note_trace(self._fn, _trace_signature(args, self._static))
        # Host-offloaded arguments are copied to device memory at the entry (their memory kind is part of the
        # argument's layout; outputs shaped like them go back, see LayoutPolicy.output_layouts).
        args, state = to_device_memory((args, state))
        skip = set(self._static) | set(nodes)
        batches, variables = step_argument_roles(policy, args, concrete_args, self._batch, skip)
        if not batches and policy.splits_variables:
            args, state = _gather_at_entry(policy, args, concrete_args, state, concrete_state, self._static)
            batches, variables = step_argument_roles(policy, args, concrete_args, self._batch, skip)
        variables.extend(jax.tree.leaves(state))
        with computation(policy, "global", batches, variables), policy.tracing_scope():
            if nodes:
                objects = nnx.merge(graphdef, state)
                call_args = list(args)
                for i, obj in zip(nodes, objects, strict=True):
                    call_args[i] = obj
                out = self._fn(*call_args)
                new_graphdef, new_state = nnx.split(objects)
                if new_graphdef != graphdef:
                    raise ValueError(
                        f"{fn_name(self._fn)} changed the structure of its nnx arguments (added or removed "
                        "variables or submodules): a compiled step may update variables in place, not create "
                        "them; create every variable before the first step."
                    )
            else:
                out = self._fn(*args)
        out = policy.output_layouts(
            out, [c for i, c in enumerate(concrete_args) if i not in self._static and i not in nodes]
        )
        if nodes:
            return out, policy.output_layouts(new_state, [concrete_state])
        return out


def _replicated_rows(x: Any, policy: LayoutPolicy) -> bool:
    """A declared batch leaf on the mesh that every replica holds whole (its rows are not split)."""
    return (
        isinstance(x, jax.Array) and np.ndim(x) >= 1 and policy.num_replicas > 1
        and x.sharding.is_fully_replicated
    )


def _needs_placing(x: Any, mesh: Any) -> bool:
    if isinstance(x, jax.Array):
        sharding = x.sharding
        own = getattr(sharding, "mesh", None)
        if own is not None and own is not mesh and not own.empty:  # another mesh (say the user's, with Explicit
            return own != mesh  # axes) over the same devices would mix meshes in one program: moved onto ours
        return not (own is mesh or sharding.device_set == set(mesh.devices.flat))
    return isinstance(x, (np.ndarray, np.generic))


def _leaf_at(tree: Any, path: tuple) -> Any:
    for p, x in jax.tree_util.tree_leaves_with_path(tree):
        if p == path:
            return x
    return None


def _trace_signature(args: tuple, static: tuple[int, ...]) -> tuple:
    statics = tuple(repr(args[i])[:80] for i in static if i < len(args))
    shapes = tuple(
        (tuple(np.shape(x)), str(jax.dtypes.result_type(x)))
        for i, a in enumerate(args) if i not in static for x in jax.tree.leaves(a)
    )
    return statics, shapes


def _gather_at_entry(policy, args, concrete_args, state, concrete_state, static) -> tuple[tuple, Any]:
    """Constrain split variables to replicated at entry (the Shardy conv workaround; see module doc)."""
    full = policy.replicated_sharding

    def gather(t, c):
        sharding = getattr(c, "sharding", None)
        if sharding is None or sharding.is_fully_replicated or not np.ndim(t):
            return t
        return jax.lax.with_sharding_constraint(t, full)

    out = tuple(
        a if i in static or c is None else jax.tree.map(gather, a, c) for i, (a, c) in enumerate(zip(
            args, concrete_args, strict=True))
    )
    if state is not None and concrete_state is not None:
        state = jax.tree.map(gather, state, concrete_state)
    return out, state
