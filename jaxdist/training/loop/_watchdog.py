"""`Watchdog`: a process whose steps stop finishing says why, prints every thread's stack and exits
non-zero.

A peer that is alive but stuck (a hung callback, a dead-locked input pipeline, a collective waiting
for a process that went elsewhere) passes every heartbeat, so the others wait in their next
collective forever. A watchdog thread turns that into an exit a scheduler can act on: when no step
finishes within ``timeout`` seconds (the first, which compiles, gets ``first_timeout``), it writes
why and every thread's Python stack (`faulthandler`) to stderr and exits with ``exit_code`` (124,
as ``timeout(1)``), so SLURM / Kubernetes restart the job from the last complete checkpoint.

Every process runs its own watchdog, each tripping ``timeout`` seconds after its own last step.
Process 0 hosts the job's coordination service, whose end kills every peer at once: it waits
``min(timeout, 10)`` seconds more before exiting, so the others write their own stacks first.

The watchdog's thread runs only when it gets the interpreter lock, which a main thread inside a C
call may keep. So a `Backstop` (`faulthandler` and a C timer, which need no lock) is armed
``slack`` seconds (``min(timeout / 2, 10)``) past the deadline: behind such a call the stacks come
``slack / 2`` to ``slack`` seconds late, after the watchdog's reason, and the process exits
``min(slack, 1)`` seconds after (Linux; elsewhere faulthandler exits with status 1, without the
reason). The first step's end arms it, the watchdog's thread re-arms it: the other steps pay
nothing. A process has one `faulthandler` timer (pytest's too): the watchdog takes it while it
watches.

``Trainer.fit(..., step_timeout=S)`` adds one as a callback, which does not watch evaluations and
checkpoint writes (``on_pause`` to ``on_resume``). Off by default: only the user knows how long a
step may take, and a watchdog that trips on a slow but healthy step kills a good run; set it to a
few times your slowest step.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxdist.training.callbacks import Callback
from jaxdist.training.loop._backstop import Backstop

__all__ = ["Watchdog"]


# the process ends here: no cleanup that could block on the stuck collective
def _exit(code: int) -> None:
    os._exit(code)


class Watchdog(Callback):
    """Exits the process when no step finishes within ``timeout`` seconds (see the module doc); as a
    fit's callback, it watches that fit's steps.

    Args:
        timeout: seconds allowed between two finished steps (> 0).
        first_timeout: seconds allowed for the first step, which compiles; None: ``max(10 * timeout,
            600)``.
        exit_code: the process's exit status when it trips (non-zero).
        on_trip: called with the message instead of printing stacks and exiting (for tests and for
            loops that handle it themselves); it runs on the watchdog's thread, and no `Backstop` is
            armed.
        step: returns the step reached, named in the messages; None: the number of `beat` s (in a
            fit: the fit's step).

    Raises:
        ValueError: for a timeout that is not a positive number, or an exit code of 0.

    Examples:
        >>> import time
        >>> tripped = []
        >>> with Watchdog(0.2, first_timeout=0.2, on_trip=tripped.append) as dog:
        ...     for step in range(3):
        ...         dog.beat()   # a step finished
        ...     time.sleep(0.6)  # then nothing
        >>> tripped[0].split(":")[0]
        'no step finished in 0.2 s after step 3 (step_timeout=0.2 s)'
    """

    def __init__(self, timeout: float, *, first_timeout: float | None = None, exit_code: int = 124,
                 on_trip: Callable[[str], Any] | None = None,
                 step: Callable[[], int] | None = None):
        for name, value in (("timeout", timeout), ("first_timeout", first_timeout)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or value <= 0):
                raise ValueError(f"{name}={value!r} must be a number of seconds > 0.")
        if not isinstance(exit_code, int) or exit_code == 0:
            raise ValueError(f"exit_code={exit_code!r} must be a non-zero int: the scheduler must "
                             "see a failure.")
        self.timeout = float(timeout)
        self.first_timeout = (float(first_timeout) if first_timeout is not None
                              else max(10 * self.timeout, 600.0))
        self.exit_code, self.on_trip = exit_code, on_trip
        self._step = self._given_step = step
        self.steps = self._paused = 0
        self._deadline = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tripped: str | None = None
        self.slack = min(self.timeout / 2, 10.0)
        self._backstop: Backstop | None = None
        self._arming = threading.Lock()  # taken before _lock: the backstop follows the pauses

    def start(self) -> Watchdog:
        """Start watching (the first step's allowance starts now)."""
        with self._lock:
            self._deadline = time.monotonic() + self.first_timeout
        if self.on_trip is None:
            exit_delay = min(self.slack, 1.0) + self._last_delay()
            self._backstop = Backstop(self.exit_code, exit_delay)
            with self._arming:
                self._rearm()
            self.beat = self._first_beat  # type: ignore[method-assign]  # the first step's end arms the backstop
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="jaxdist-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._arming:
            if self._backstop is not None:
                self._backstop.close()
                self._backstop = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def beat(self) -> None:
        """A step finished: the next one has ``timeout`` seconds."""
        with self._lock:
            self.steps += 1
            self._deadline = time.monotonic() + self.timeout

    def _first_beat(self) -> None:
        """`beat`, the first time with a backstop: it arms the backstop for the second step at once
        (the watchdog's thread might not run again before it: a step that holds the interpreter
        lock)."""
        self.__dict__.pop("beat", None)  # the plain beat from now on
        self.beat()
        with self._arming:
            self._rearm()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Not watched inside (evaluation, checkpoint writes); the next step has ``timeout`` seconds
        after."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def pause(self) -> None:
        """Stop watching until `resume` (pauses nest)."""
        with self._arming:
            with self._lock:
                self._paused += 1
            if self._backstop is not None:
                self._backstop.cancel()

    def resume(self) -> None:
        """Watch again after a `pause`: the next step has ``timeout`` seconds from now."""
        with self._arming:
            with self._lock:
                self._paused -= 1
                self._deadline = time.monotonic() + self.timeout
            self._rearm()

    # ------------------------------------------------------------------------- as a fit's callback
    def on_train_begin(self, trainer: Any) -> None:
        control = self.control
        self._step = self._given_step or (None if control is None else (lambda: control.step))
        self.start()

    def on_step_end(self, trainer: Any, step: int, metrics: Any) -> None:
        self.beat()

    def on_pause(self, trainer: Any, part: str) -> None:
        self.pause()

    def on_resume(self, trainer: Any, part: str) -> None:
        self.resume()

    def on_train_end(self, trainer: Any, history: Any) -> None:
        self.stop()

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self.stop()

    def _last_delay(self) -> float:
        """Process 0 of a job hosts its coordination service, whose end kills every peer: it exits
        last."""
        last = jax.process_count() > 1 and jax.process_index() == 0
        return min(self.timeout, 10.0) if last else 0.0

    def _rearm(self) -> None:
        """Arm the backstop ``slack`` past the deadline when it is armed less than ``slack / 2``
        past it (so once per ``slack / 2`` seconds while steps finish) or more than ``slack`` (the
        first step's allowance, after the first step); cancel it while paused. Holds ``_arming``."""
        if self._backstop is None:
            return
        with self._lock:
            deadline, paused, steps = self._deadline, self._paused, self.steps
        armed = self._backstop.armed
        if paused:
            self._backstop.cancel()
        elif armed is None or not self.slack / 2 <= armed - deadline <= self.slack:  # early, late
            self._backstop.arm(deadline + self.slack, self._reason(steps, backstop=True))

    def _watch(self) -> None:
        interval = min(1.0, self.timeout / 10)
        while not self._stop.wait(interval):
            with self._lock:
                late = not self._paused and time.monotonic() > self._deadline
            if late:
                self._trip()
                return
            with self._arming:
                self._rearm()

    def _reason(self, steps: int, backstop: bool = False) -> str:
        """Why the process exits when no step finishes after the ``steps``-th: said by the
        watchdog's thread, or by the backstop (armed ``slack / 2`` to ``slack`` past the deadline,
        by then step ``steps`` is the last one the watchdog saw: the steps since its last arming are
        not named)."""
        allowed = self.first_timeout if steps == 0 else self.timeout
        step = self._step() if self._step is not None else steps
        late = f"{allowed + self.slack / 2:g} s or more" if backstop else f"{allowed:g} s"
        seen = "the last one the watchdog saw; " if backstop else ""
        if steps == 0:
            what = (f"no step finished in {late} after step {step}, where this watch began (the "
                    f"first step, compilation included, gets first_timeout={self.first_timeout:g} "
                    f"s; step_timeout={self.timeout:g} s)")
        else:
            what = (f"no step finished in {late} after step {step} "
                    f"({seen}step_timeout={self.timeout:g} s)")
        if backstop:
            status = self._backstop.exits_with if self._backstop is not None else self.exit_code
            return (f"[jaxdist watchdog] {what}, and the watchdog's thread could not run: the "
                    "interpreter lock is held (a C call that keeps it?); stacks follow. Exiting "
                    f"with status {status} so the scheduler restarts the job; it resumes from the "
                    "last complete checkpoint.")
        return (f"{what}: a peer may be stuck or dead (or this process is); stacks follow. Exiting "
                f"with status {self.exit_code} so the scheduler restarts the job; it resumes from "
                "the last complete checkpoint.")

    def _trip(self) -> None:
        message = self.tripped = self._reason(self.steps)
        # this thread does the rest: the backstop must not end the process meanwhile
        with self._arming:
            if self._backstop is not None:
                self._backstop.cancel()
        if self.on_trip is not None:
            self.on_trip(message)
            return
        print(f"[jaxdist watchdog] {message}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        time.sleep(self._last_delay())  # the coordination service's host goes last
        _exit(self.exit_code)
