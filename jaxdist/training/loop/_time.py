"""Where a fit's time went: its wall time split into steps, compile, input, checkpoint, evaluation,
lost and other.

The loop is asynchronous, so the split is of the HOST's time, measured with ``time.perf_counter``
around what the loop does anyway, never with a read from the devices: reading the next batch
(``input``), calling the step (``steps``: its dispatch, and a full dispatch queue), waiting for a
log window's values, the state before a checkpoint or the preemption agreement's read (``waited``,
counted as ``steps``: the devices finishing steps), writing and reading checkpoints
(``checkpoint``) and evaluating (``evaluation``). ``compile`` is what JAX reports through
`jax.monitoring` on the fit's thread from the moment the clock is made, taken out of the part it
happened in. ``lost`` is step time thrown away or spent again: by a rollback, since the checkpoint
it restores, and by a fit that resumes behind the step an earlier run reached (``lose_redone``).
``other`` is the remainder (callbacks, the loop itself, the setup), so that the parts add up to the
wall time exactly. Per step this costs three ``perf_counter`` calls and a few attribute writes.

Example:
    >>> import jax, jax.numpy as jnp
    >>> clock = FitClock()
    >>> with clock.timing("evaluation"):
    ...     _ = jax.jit(lambda x: x + 1)(jnp.ones(3))  # compile time, not evaluation
    >>> clock.close()
    >>> now = perf_counter()
    >>> seconds = clock.totals(now)  # the parts of the wall time up to now: they add up to it
    >>> (list(seconds) == list(KEYS), seconds["compile"] > 0,
    ...  abs(sum(seconds.values()) - clock.wall(now)) < 1e-9)
    (True, True, True)
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from time import perf_counter

import jax

from jaxdist.training.callbacks import TIME_PARTS as KEYS

__all__ = ["COMPILE_EVENTS", "KEYS", "FitClock", "window_seconds"]

COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})
"""The `jax.monitoring` time spans counted as ``compile`` (a trace nested in another one counts
once)."""

_NESTED = 32  # compile spans remembered to drop the ones nested in a later, enclosing one
_CLOCKS: dict[int, weakref.ref] = {}  # thread -> the clock of the fit running on it
_listening = threading.Lock()
_LISTENER: list = []


def _heard(event: str, start: float, end: float, **_: object) -> None:
    """The `jax.monitoring` listener: a compile span goes to the clock of its thread's fit."""
    if event in COMPILE_EVENTS and (ref := _CLOCKS.get(threading.get_ident())) is not None:
        clock = ref()
        if clock is not None:
            clock.compiling(start, end)


def _listen() -> None:
    with _listening:
        if not _LISTENER:  # once per process: it costs nothing but at a compile
            jax.monitoring.register_event_time_span_listener(_heard)
            _LISTENER.append(_heard)


class FitClock:
    """The host time of one fit, by part (see the module).

    The loop writes ``phase`` (what the fit's thread is doing) and adds to ``input`` and ``steps``
    itself around each batch and step (the cheapest way, per step); the rarer parts use `timing`. A
    compile span JAX reports on the clock's thread (from when it is made until `close`) is moved
    from its phase to ``compile``.

    Args:
        started: ``time.perf_counter()`` when the fit began (default: now).
    """

    __slots__ = ("__weakref__", "_marks", "_restored", "_spans", "_thread", "compiled", "input",
                 "lost", "phase", "seconds", "started", "steps")

    def __init__(self, started: float | None = None):
        self.started = perf_counter() if started is None else started
        self.phase = "other"
        self.input = 0.0  # seconds reading (and placing) batches
        self.steps = 0.0  # seconds in steps and waiting for them, those later lost included
        self.lost = 0.0  # of ``steps``, the seconds of steps thrown away
        self.seconds = {"checkpoint": 0.0, "evaluation": 0.0, "waited": 0.0}  # `timing`'s parts
        self.compiled: dict[str, float] = {}  # compile seconds by the phase they happened in
        self._spans: list[tuple[float, float]] = []
        self._thread = threading.get_ident()
        self._marks: dict[int, float] = {}  # checkpoint step -> step seconds when it was saved
        self._restored = 0.0  # step seconds at the last loss (what came before is counted already)
        self.open()

    def open(self) -> None:
        """Hear the compiles of this thread (again, after `close`)."""
        _listen()
        _CLOCKS[self._thread] = weakref.ref(self)

    def close(self) -> None:
        """Stop hearing compiles (the fit is over)."""
        ref = _CLOCKS.get(self._thread)
        if ref is not None and ref() is self:
            del _CLOCKS[self._thread]

    # ------------------------------------------------------------------------------------ measuring
    def compiling(self, start: float, end: float) -> None:
        """JAX spent ``start ... end`` (``time.time``) tracing, lowering or compiling, on this
        clock's thread."""
        # A trace nested in another (a jitted function called inside the one being traced) is
        # reported first: the enclosing span replaces it.
        inner = [span for span in self._spans if start <= span[0] and span[1] <= end]
        seconds = (end - start) - sum(e - s for s, e in inner)
        kept = [span for span in self._spans if span not in inner][-_NESTED:]
        self._spans = [*kept, (start, end)]
        self.compiled[self.phase] = self.compiled.get(self.phase, 0.0) + seconds

    @contextlib.contextmanager
    def timing(self, part: str) -> Iterator[None]:
        """Count the time inside as ``part`` (``"checkpoint"``, ``"evaluation"``, or ``"waited"``:
        waiting for the devices to finish steps, counted as ``steps``); nested inside another part,
        taken out of it."""
        outer, self.phase = self.phase, part
        start = perf_counter()
        try:
            yield
        finally:
            self.phase = outer
            self.add(part, perf_counter() - start)

    def add(self, part: str, seconds: float) -> None:
        """Count ``seconds`` just spent as ``part`` (one of `timing`'s), taken out of the phase they
        were in."""
        self.seconds[part] += seconds
        if self.phase in self.seconds:
            self.seconds[self.phase] -= seconds

    def waited(self, seconds: float) -> None:
        """The fit's thread waited ``seconds`` for the devices to finish steps."""
        self.add("waited", seconds)

    def _stepped(self) -> float:
        """Seconds of steps so far (compiles out, waits for the devices in), later lost included."""
        compiled = self.compiled
        return (self.steps - compiled.get("steps", 0.0)
                + self.seconds["waited"] - compiled.get("waited", 0.0))

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` holds the state of the steps measured so far."""
        self._marks[step] = self._stepped()

    def rolled_back(self, step: int) -> float:
        """The state went back to checkpoint ``step``: the seconds of the steps since, lost."""
        return self._lose(self._marks.get(step, 0.0))  # 0: a checkpoint from before this fit

    def lose_redone(self) -> float:
        """The steps measured so far (since the last rollback or call) were taken before, by an
        earlier run that got further than the checkpoint this fit resumed from: lost; their
        seconds."""
        return self._lose(0.0)

    def _lose(self, since: float) -> float:
        since = max(since, self._restored)  # what came before the last loss is counted already
        now = self._stepped()
        lost = max(now - since, 0.0)
        self.lost += lost
        self._restored = now
        return lost

    # -------------------------------------------------------------------------------------- reading
    def wall(self, now: float | None = None) -> float:
        """Seconds since the fit began."""
        return (perf_counter() if now is None else now) - self.started

    def gross(self) -> dict[str, float]:
        """Every part's seconds so far but ``other``; ``steps`` includes those later ``lost``."""
        compiled = self.compiled
        return {
            "steps": self._stepped(),
            "compile": float(sum(compiled.values())),
            "input": self.input - compiled.get("input", 0.0),
            "checkpoint": self.seconds["checkpoint"] - compiled.get("checkpoint", 0.0),
            "evaluation": self.seconds["evaluation"] - compiled.get("evaluation", 0.0),
            "lost": self.lost,
        }

    def totals(self, now: float | None = None) -> dict[str, float]:
        """`History.time`: the parts of the wall time since the fit began (`KEYS`, adding up)."""
        parts = self.gross()
        parts["steps"] = max(parts["steps"] - parts["lost"], 0.0)
        wall = self.wall(now)
        parts["other"] = max(wall - sum(parts.values()), 0.0)
        return {key: parts[key] for key in KEYS}


def window_seconds(before: tuple[float, dict[str, float]],
                   after: tuple[float, dict[str, float]]) -> dict[str, float]:
    """A log window's ``time/<part>`` values from two `FitClock.gross` snapshots ``(perf_counter,
    gross)``: the seconds of each part in the window (``time/steps`` including steps a rollback
    threw away, shown in ``time/lost`` of the first window after it) and ``time/other``, the rest of
    the window's wall time.

    Examples:
        >>> zero = dict.fromkeys(KEYS[:-1], 0.0)
        >>> window_seconds((0.0, zero), (2.0, {**zero, "steps": 1.5}))["time/other"]
        0.5
    """
    parts = {key: after[1][key] - before[1][key] for key in KEYS[:-1]}
    busy = sum(value for key, value in parts.items() if key != "lost")
    parts["other"] = max(after[0] - before[0] - busy, 0.0)
    return {f"time/{key}": parts[key] for key in KEYS}
