"""Ambient state: what is open on this thread while user code runs or is traced. The one home of it.

jaxdist keeps these "current" things, all per thread, all in `_State` (each field says what it
holds): open scopes, replica contexts being traced, the strategy computations being traced
(`Computation`), ``colocate_vars_with`` targets, gradient clusters and invocations, host regions,
the ``strategy.jit`` calls being decided (`Call`), axis types and owned outputs. Nothing here
decides anything: the modules that own a concept read and push its state through these helpers.

Why per thread and not carried by the values: JAX calls a traced function with abstract values only.
What jaxdist decides once per program (the layouts of the arguments, where their layouts came from,
the axis types) needs the concrete arguments of the call that traces, and the frames that nest
inside it (a ``run`` in a ``jit`` step, a gradient cluster) need the enclosing computation. Passing
them as static arguments would put them in JAX's cache key and cost a decision per call; held here
they are read only while a program traces (a cache miss). Calls on the express path never touch
them; a full-path call (keyword or nnx arguments) pushes its frame and, on Explicit meshes, its axis
types, and reads them only if it traces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Iterator
from typing import Any


@dataclasses.dataclass
class Computation:
    """One strategy program being traced (a ``jit`` step, a ``run`` replica function, a loop).

    Attributes:
        policy: the `LayoutPolicy` it is compiled for.
        kind: ``"global"`` (whole arrays, XLA partitions) or ``"replica"`` (inside shard_map, local
            values).
        counters: per-kind numbering (``outside_compilation`` clusters, gradient uids), shared by
            the frames of one computation (``run`` inside ``jit``).
        batches: the traced values that stand for its batch arguments (declared or carried).
        variables: the traced values that stand for its other array arguments.
        axis_name: the name the replica axis is bound to inside a per-replica computation.
        typed: whether JAX's varying types hold inside it (a per-replica program traced with
            ``check_vma`` off, as ``jax.pmap`` runs it, types every value invariant: each value is
            then the replica's own).
        padded: the traced leaves of a padded batch among its arguments, with their row weights
            (`Padded`).
    """

    policy: Any
    kind: str
    counters: dict[str, int]
    batches: list[Any] = dataclasses.field(default_factory=list)
    variables: list[Any] = dataclasses.field(default_factory=list)
    axis_name: str | tuple[str, ...] | None = None
    typed: bool = True
    padded: list[Padded] = dataclasses.field(default_factory=list)

    def counter(self, kind: str) -> int:
        """The next number (0, 1, ...) of the things of ``kind`` named in this computation.

        Examples:
            >>> frame = Computation(None, "global", {})
            >>> frame.counter("outside_compilation"), frame.counter("outside_compilation")
            (0, 1)
        """
        n = self.counters.get(kind, 0)
        self.counters[kind] = n + 1
        return n


@dataclasses.dataclass
class Padded:
    """A traced leaf of a padded batch (``remainder="pad"``) that a ``strategy.jit`` step got, and
    the traced row weights that came with it (`jaxdist.strategies.compile._trace._padded`).

    Attributes:
        leaf: the traced leaf.
        weights: its traced row weights (1.0 for a real row, 0.0 for a padding row).
        handed: shared by the leaves of one batch: ``[True]`` once a ``strategy.run`` in the step
            took them.
    """

    leaf: Any
    weights: Any
    handed: list[bool]


@dataclasses.dataclass
class Call:
    """A ``strategy.jit`` call being decided on this thread, read by the step's trace if it traces.

    Attributes:
        step: the step called (its `StepTrace`, the body its programs trace: by identity).
        args: ``(placed positional arguments, keyword arguments, nnx state)``.
        agreeing: True while the step is lowered once more for the processes' agreement (not a
            recompile).
    """

    step: Any
    args: tuple
    agreeing: bool = False


class _State(threading.local):
    def __init__(self) -> None:
        self.scopes: list[Any] = []  # strategies whose scope() is open
        self.replicas: list[Any] = []  # ReplicaContexts being traced
        self.computations: list[Computation] = []
        self.colocations: list[tuple[Any, Any]] = []  # (strategy, sharding)
        self.clusters: list[str] = []  # gradient clusters open while tracing
        self.gradient_uids: list[str] = []  # gradient invocations being traced
        self.host_regions = 0  # outside_compilation regions being traced (they do not nest)
        self.calls: list[Call] = []  # strategy.jit calls being decided
        self.axis_types: tuple[Any, bool, str] = (None, True, "")  # (mode, forced, why) of a trace
        # outputs a step's trace constrained to jaxdist's own layouts (compile._trace._provenance)
        self.owned_outputs: dict[int, Any] | None = None


state = _State()
"""This thread's ambient state (read it through the helpers; `jaxdist.gradients` keeps its stacks
here)."""


@contextlib.contextmanager
def _pushed(stack: list[Any], item: Any) -> Iterator[Any]:
    stack.append(item)
    try:
        yield item
    finally:
        stack.pop()


def scope(strategy: Any) -> contextlib.AbstractContextManager[Any]:
    """Push ``strategy`` as the innermost open scope (checks are the caller's)."""
    return _pushed(state.scopes, strategy)


def current_scope() -> Any | None:
    """The strategy of the innermost open scope, or None."""
    return state.scopes[-1] if state.scopes else None


def replica(ctx: Any) -> contextlib.AbstractContextManager[Any]:
    """Mark the code traced inside as replica context ``ctx`` (a `ReplicaContext`)."""
    return _pushed(state.replicas, ctx)


def current_replica() -> Any | None:
    """The `ReplicaContext` of the replica function being traced, or None in cross-replica code."""
    return state.replicas[-1] if state.replicas else None


def in_scope_or_replica() -> bool:
    """True inside some strategy's scope or replica function."""
    return bool(state.scopes or state.replicas)


def current_computation() -> Computation | None:
    """The innermost strategy computation being traced, or None."""
    return state.computations[-1] if state.computations else None


@contextlib.contextmanager
def computation(policy: Any, kind: str, batches: Iterable[Any] = (), variables: Iterable[Any] = (),
                axis_name: str | tuple[str, ...] | None = None, padded: Iterable[Padded] = (),
                typed: bool = True) -> Iterator[Computation]:
    """Trace the block as (part of) a computation of ``policy``; nested frames share counters."""
    outer = current_computation()
    counters = outer.counters if outer is not None else {}
    frame = Computation(policy, kind, counters, list(batches), list(variables), axis_name,
                        typed=typed, padded=list(padded))
    with _pushed(state.computations, frame):
        yield frame


@contextlib.contextmanager
def probe() -> Iterator[None]:
    """An abstract trace done only to learn shapes: it uses up none of the computation's names."""
    frame = current_computation()
    saved = dict(frame.counters) if frame is not None else None
    try:
        yield
    finally:
        if frame is not None:
            frame.counters.clear()
            frame.counters.update(saved)


def replica_axis(default: str) -> str | tuple[str, ...]:
    """The name of the replica axis in the code being traced: the innermost per-replica
    computation's binding (``run(..., axis_name=...)``), else the traced computation's policy's
    batch axes, else ``default``."""
    frame = current_computation()
    if frame is None:
        return default
    return frame.axis_name or frame.policy.replica_axis


def colocation(owner: Any, target: Any) -> contextlib.AbstractContextManager[Any]:
    """Variables ``owner`` creates inside take ``target``'s layout (``colocate_vars_with``)."""
    return _pushed(state.colocations, (owner, target))


def colocation_target(owner: Any) -> Any | None:
    """The layout of the innermost open ``colocate_vars_with`` block of ``owner``, or None."""
    for who, target in reversed(state.colocations):
        if who is owner:
            return target
    return None


def call(step: Any, args: tuple) -> contextlib.AbstractContextManager[Call]:
    """Mark the block as deciding a call of ``step`` on ``args`` (which its trace reads)."""
    return _pushed(state.calls, Call(step, args))


def current_call(step: Any) -> Call | None:
    """The innermost call of ``step`` being decided on this thread, or None (a trace from elsewhere:
    JAX met a signature outside a jaxdist call, or ``jax.eval_shape``)."""
    for frame in reversed(state.calls):
        if frame.step is step:
            return frame
    return None
