"""What the code being traced belongs to: the strategy computation frame, and which tracers are batches.

A *computation* is one program a strategy compiles: a ``strategy.jit`` step, a ``strategy.run`` replica
function, an on-device steps loop. While it is traced a `Computation` frame is current; it numbers the
things named per computation (``outside_compilation`` clusters "0", "1", ..., gradient uids "uid", "uid_1",
...) and says whether the code runs in the global view or per replica. ``run`` inside a ``jit`` step is part
of that step's computation.

Eagerly, a batch is recognised by its layout (axis 0 split over the replica axis). Inside a trace values are
tracers without a concrete layout, so the code that traces a step registers the tracers that stand for
distributed batches in the frame. A value derived from a batch inside the step (``x / 255``) is not
registered: pass the batch itself to ``strategy.run`` and transform it in the replica function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["Computation", "computation", "current_computation", "is_traced_batch", "probe"]


@dataclasses.dataclass
class _Counters:
    clusters: int = 0
    uids: int = 0


@dataclasses.dataclass
class Computation:
    """One strategy program being traced: its strategy, view, counters and registered batch tracers."""

    strategy: Any
    kind: str  # "global" (whole arrays, XLA partitions) or "replica" (inside shard_map, local values)
    counters: _Counters
    batches: list[Any]

    def next_cluster(self) -> str:
        """The next outside_compilation cluster name of this computation: "0", "1", ..."""
        name = str(self.counters.clusters)
        self.counters.clusters += 1
        return name

    def next_uid(self) -> str:
        """The next gradient uid of this computation: "uid", "uid_1", ..."""
        n = self.counters.uids
        self.counters.uids += 1
        return "uid" if n == 0 else f"uid_{n}"

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
def computation(strategy: Any, kind: str, batches: Iterable[Any] = ()) -> Iterator[Computation]:
    """Trace the block as (part of) a computation of ``strategy``; nested frames share the counters."""
    outer = current_computation()
    counters = outer.counters if outer is not None else _Counters()
    frame = Computation(strategy, kind, counters, list(batches))
    _stack.frames.append(frame)
    try:
        yield frame
    finally:
        _stack.frames.pop()


def is_traced_batch(x: Any, strategy: Any) -> bool:
    """True when tracer ``x`` was registered as a distributed batch of ``strategy``."""
    for frame in reversed(_stack.frames):
        if frame.strategy is strategy and any(t is x for t in frame.batches):
            return True
    return False


@contextlib.contextmanager
def probe() -> Iterator[None]:
    """An abstract trace done only to learn shapes: it must not use up the enclosing computation's names."""
    frame = current_computation()
    saved = dataclasses.replace(frame.counters) if frame is not None else None
    try:
        yield
    finally:
        if frame is not None:
            frame.counters.clusters, frame.counters.uids = saved.clusters, saved.uids
