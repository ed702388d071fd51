"""What the code being traced belongs to: the strategy computation frame, and which tracers are batches.

A *computation* is one program a strategy compiles: a ``strategy.jit`` step, a ``strategy.run`` replica
function, an on-device steps loop. While it is traced a `Computation` frame is current; it numbers the
things named per computation (``outside_compilation`` clusters "0", "1", ..., gradient uids "uid", "uid_1",
...) and says whether the code runs in the global view or per replica. ``run`` inside a ``jit`` step is part
of that step's computation.

Eagerly, a batch is recognised by its layout (axis 0 split over the replica axis) or by a declaration
(``batch_argnums``). Inside a trace values are tracers without a concrete layout, so the code that traces a
step registers in the frame which tracers stand for its batch arguments and which for its variables. A value
derived inside the step (``x / 255``) is neither: `role_of` says so (None), and ``strategy.run`` refuses such
an argument unless its role is declared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["Computation", "computation", "current_computation", "probe", "role_of"]


@dataclasses.dataclass
class Computation:
    """One strategy program being traced: its strategy, view, counters and the roles of its argument tracers."""

    strategy: Any
    kind: str  # "global" (whole arrays, XLA partitions) or "replica" (inside shard_map, local values)
    counters: dict[str, int]  # shared by the frames of one computation
    batches: list[Any]
    variables: list[Any] = dataclasses.field(default_factory=list)

    def counter(self, kind: str) -> int:
        """The next number (0, 1, ...) of the things of ``kind`` named in this computation.

        Higher layers name things per computation with it (outside_compilation clusters "0", "1", ...;
        gradient uids "uid", "uid_1", ...); a `probe` trace does not use numbers up.
        """
        n = self.counters.get(kind, 0)
        self.counters[kind] = n + 1
        return n

    def global_batch_size(self) -> int | None:
        """Axis 0 of the registered batches (None when no batch is registered)."""
        for t in self.batches:
            shape = getattr(t, "shape", ())
            if shape:
                return shape[0]
        return None


class _Stack(threading.local):
    def __init__(self) -> None:
        self.frames: list[Computation] = []


_stack = _Stack()


def current_computation() -> Computation | None:
    """The innermost strategy computation being traced, or None."""
    return _stack.frames[-1] if _stack.frames else None


@contextlib.contextmanager
def computation(
    strategy: Any, kind: str, batches: Iterable[Any] = (), variables: Iterable[Any] = ()
) -> Iterator[Computation]:
    """Trace the block as (part of) a computation of ``strategy``; nested frames share the counters.

    ``batches`` / ``variables``: the tracers that stand for the step's batch arguments / its variables.
    """
    outer = current_computation()
    counters = outer.counters if outer is not None else {}
    frame = Computation(strategy, kind, counters, list(batches), list(variables))
    _stack.frames.append(frame)
    try:
        yield frame
    finally:
        _stack.frames.pop()


def role_of(x: Any, strategy: Any) -> str | None:
    """``"batch"`` / ``"variable"`` when tracer ``x`` stands for a batch / variable argument of a computation
    of ``strategy``; None for values derived inside it (their role is unknown)."""
    for frame in reversed(_stack.frames):
        if frame.strategy is strategy:
            if any(t is x for t in frame.batches):
                return "batch"
            if any(t is x for t in frame.variables):
                return "variable"
    return None


@contextlib.contextmanager
def probe() -> Iterator[None]:
    """An abstract trace done only to learn shapes: it must not use up the enclosing computation's names."""
    frame = current_computation()
    saved = dict(frame.counters) if frame is not None else None
    try:
        yield
    finally:
        if frame is not None:
            frame.counters.clear()
            frame.counters.update(saved)
