"""The log windows of a fit: their running sums copied to the host in the background, emitted in
order.

A log point closes a window (`Logs.close_window`): its sums (one small device vector, a
`PackedSums`) start their copy to the host and the loop goes on dispatching steps; the window's row
(each metric's mean over it, steps/s, the non-finite steps, the rates of its `StepCost`) is emitted
once they have arrived.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable

import jax

from jaxdist.training.step import PackedSums, RunningSums, Window, log_values

__all__ = ["Logs", "means"]


class Logs:
    """Closed log windows whose sums are still on their way to the host, emitted in order once they
    arrive.

    A watcher thread waits for each window's sums (it only blocks; the main thread never does) and
    notes when they were ready: that is when the window's steps were done, which gives each log its
    steps/s.

    Each emitted window also goes to ``watch(step, window)`` (its non-finite steps' flags,
    `Window`), where ``fit`` decides what to do about them. So that several processes decide at the
    same step, a ``lag`` makes the emission deterministic: a window closed at check ``c`` (a step,
    or an on-device loop) is emitted at check ``c + lag``, waiting for its sums if they have not
    arrived (they almost always have), and never earlier. Without a lag (one process) a window is
    emitted as soon as its sums arrive.

    ``waited(seconds)``, when given, hears how long the main thread waited for a window's sums (the
    devices finishing steps; `jaxdist.training.loop._time`); ``add(sums)`` each emitted window's
    host `RunningSums` (``fit`` adds them up per epoch).
    """

    def __init__(self, start_step: int, on_log: Callable[[int, dict], None],
                 rates: Callable[[int, float, float | None], dict] | None = None,
                 watch: Callable[[int, Window | None], None] | None = None, lag: int | None = None,
                 waited: Callable[[float], None] | None = None,
                 add: Callable[[RunningSums], None] | None = None):
        self.pending: collections.deque = collections.deque()  # [step, sums, ready or None, check]
        self._on_log, self._watch, self._lag = on_log, watch, lag
        self._waited, self._add = waited, add
        self._rates = rates  # (steps, seconds, summed loss weight) -> tokens_per_sec, mfu, ...
        self._last = (start_step, time.perf_counter())
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._watcher: threading.Thread | None = None

    def close_window(self, step: int, sums: PackedSums, check: int = 0) -> None:
        """End a window at ``step`` (check ``check``) with the trainer's running sums over it; start
        copying them to the host (one vector)."""
        if (copy := getattr(sums.vector, "copy_to_host_async", None)) is not None:
            copy()
        entry = [step, sums, None, check]
        self.pending.append(entry)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._wait, name="jaxdist-log-watcher",
                                             daemon=True)
            self._watcher.start()
        self._queue.put(entry)

    def _wait(self) -> None:
        while (entry := self._queue.get()) is not None:
            with contextlib.suppress(Exception):  # a failed step raises in the main thread
                jax.block_until_ready(entry[1])
            entry[2] = time.perf_counter()

    def emit_ready(self, check: int = 0) -> None:
        """Emit the closed windows whose sums have arrived, in order (never waits for the devices);
        with a lag, the windows closed ``lag`` checks before ``check`` (waiting for them if
        needed)."""
        if self._lag is None:
            while self.pending and self.pending[0][2] is not None:
                self._emit_first()
        else:
            while self.pending and self.pending[0][3] <= check - self._lag:
                self._emit_first()

    def flush(self) -> None:
        """Emit every closed window (waits for the devices)."""
        while self.pending:
            self._emit_first()

    def restart(self, step: int) -> None:
        """Windows start again after ``step`` (a rollback moved it back; none may be pending)."""
        self._last = (step, time.perf_counter())

    def _emit_first(self) -> None:
        entry = self.pending.popleft()
        if entry[2] is None:
            start = time.perf_counter()
            jax.block_until_ready(entry[1])
            now = time.perf_counter()
            entry[2] = entry[2] or now
            if self._waited is not None:
                self._waited(now - start)
        self._emit(*entry[:3])

    def close(self) -> None:
        """Stop the watcher thread and wait for it: a thread still inside JAX when the interpreter
        exits makes the process abort ("terminate called without an active exception", status 134)
        after a good run."""
        if self._watcher is not None:
            self._queue.put(None)
            self._watcher.join(timeout=30)
            self._watcher = None

    def _emit(self, step: int, packed: PackedSums, ready: float) -> None:
        seconds, steps = ready - self._last[1], step - self._last[0]
        self._last = (step, ready)
        sums = packed.to_host()  # one transfer for the whole window
        window = Window.of(sums.non_finite, sums.steps)
        if window.steps:
            if self._add is not None:
                self._add(sums)
            logs = means(sums)
            loss_weight = None if sums.loss_weight is None else float(sums.loss_weight)
            logs.update(log_values(window))
            logs["steps_per_sec"] = steps / seconds if seconds > 0 else float("nan")
            if self._rates is not None:
                logs.update(self._rates(steps, seconds, loss_weight))
            self._on_log(step, logs)
        if self._watch is not None:
            self._watch(step, window)


def means(sums: RunningSums) -> dict[str, float]:
    """A log row's metrics from host sums: each metric's mean over the window (``"loss"`` first,
    then by name; a token-weighted one: its summed sums over its summed weights, NaN for weight 0)
    and the last learning rate (the current rate, not a mean)."""
    names = ["loss", *sorted(n for n in sums.names if n != "loss")]
    logs = {name: sums.mean(name) for name in names}
    if sums.learning_rate is not None:
        logs["learning_rate"] = float(sums.learning_rate)
    return logs
