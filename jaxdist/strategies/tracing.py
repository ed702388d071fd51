"""Which traced values are distributed batches, for `Strategy.run` called inside a compiled step.

Eagerly, a batch is recognised by its layout (axis 0 split over the replica axis). Inside a trace (a
``strategy.jit`` step or an on-device loop) values are tracers without a concrete layout, so the code that
traces the step registers the tracers that stand for distributed batches here, for the duration of the trace.
A value derived from a batch inside the step (``x / 255``) is not registered: pass the batch itself to
``strategy.run`` and transform it in the replica function.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["is_traced_batch", "traced_batches"]


class _Registry(threading.local):
    def __init__(self) -> None:
        self.frames: list[tuple[Any, list[Any]]] = []


_registry = _Registry()


@contextlib.contextmanager
def traced_batches(strategy: Any, tracers: Iterable[Any]) -> Iterator[None]:
    """Within the block, ``tracers`` count as batches of ``strategy`` (axis 0 split over its replicas)."""
    _registry.frames.append((strategy, list(tracers)))
    try:
        yield
    finally:
        _registry.frames.pop()


def is_traced_batch(x: Any, strategy: Any) -> bool:
    """True when tracer ``x`` was registered as a distributed batch of ``strategy``."""
    for owner, tracers in reversed(_registry.frames):
        if owner is strategy and any(t is x for t in tracers):
            return True
    return False
