"""A profile of chosen steps: ``fit(profile_steps=(start, stop))`` traces them with `jax.profiler`.

Step ``n`` is the one numbered ``n`` in the logs and ``on_step_end`` (after it, ``trainer.step == n``), so
``(start, stop)`` traces steps ``start, ..., stop - 1``: the trace starts before the first of them is dispatched
and stops once the last has finished on the devices (one wait, at the end of the window). With
``steps_per_run > 1`` a step runs inside an on-device loop, which cannot be cut: the trace covers the loops
that run the steps of the window. A run resumed past ``start`` traces the window's steps that are left; a fit
that ends or fails inside the window stops the trace on its way out.

The trace goes to ``<log_dir>/profile`` (``plugins/profile/<run>/<host>.xplane.pb``, which xprof and
TensorBoard's profile plugin open, and ``perfetto_trace.json.gz`` for https://ui.perfetto.dev), on the
processes chosen (process 0 by default).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["StepProfile", "check_profile"]

NEVER = float("inf")


def check_profile(steps: Any, processes: Any, log_dir: Any) -> None:
    """Raise a ValueError naming the argument unless ``profile_steps`` / ``profile_processes`` are usable.

    Examples:
        >>> check_profile((3, 5), (0,), "logs")
        >>> check_profile((5, 3), (0,), "logs")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: profile_steps=(5, 3) must be (start, stop), two ints with 1 <= start < stop: ...
    """
    if steps is None:
        return
    if (not isinstance(steps, (tuple, list)) or len(steps) != 2
            or any(isinstance(s, bool) or not isinstance(s, int) for s in steps) or not 1 <= steps[0] < steps[1]):
        raise ValueError(
            f"profile_steps={steps!r} must be (start, stop), two ints with 1 <= start < stop: steps start ... "
            "stop - 1 are traced (step n is the one after which trainer.step == n).")
    if log_dir is None:
        raise ValueError(f"profile_steps={tuple(steps)!r} needs log_dir=...: the trace is written to "
                         "<log_dir>/profile.")
    if processes == "all":
        return
    count = jax.process_count()
    chosen = (processes,) if isinstance(processes, int) and not isinstance(processes, bool) else processes
    if (not isinstance(chosen, (tuple, list, set, frozenset)) or not chosen
            or any(isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < count for p in chosen)):
        raise ValueError(
            f"profile_processes={processes!r} must be 'all' or process indices in [0, {count}) (e.g. (0,), "
            "the default: process 0 alone).")


class StepProfile:
    """The trace of one window of steps (see the module), driven by the fit loop between steps.

    The loop calls `check` when ``trainer.step`` reaches `due` (one comparison per step otherwise).

    Args:
        start, stop: the window: steps ``start ... stop - 1``.
        directory: where the trace goes (``<log_dir>/profile``).
        run_length: ``step -> the number of steps the next dispatch runs from step`` (1, or an on-device loop's).
    """

    def __init__(self, start: int, stop: int, directory: str | os.PathLike, run_length: Callable[[int], int]):
        self.start, self.stop, self.directory = start, stop, os.fspath(directory)
        self.run_length = run_length
        self.tracing = False
        self.done = False
        self.due = 0.0  # check at the first step (a resumed run may start inside the window)

    @classmethod
    def of(cls, steps: Any, processes: Any, log_dir: Any, run_length: Callable[[int], int]) -> StepProfile | None:
        """The profile ``fit`` asked for on this process, or None."""
        if steps is None:
            return None
        chosen = (processes,) if isinstance(processes, int) else processes
        if processes != "all" and jax.process_index() not in chosen:
            return None
        return cls(steps[0], steps[1], os.path.join(os.fspath(log_dir), "profile"), run_length)

    def check(self, step: int, last: Any = None) -> None:
        """Between steps, at ``step`` (``last``: what the last dispatch returned): start or stop the trace."""
        if self.tracing:
            if step >= self.stop - 1:  # the window's last step is dispatched: let it finish, then stop
                self.close(last)
            return
        if self.done or step >= self.stop - 1:
            self.done, self.due = True, NEVER
            return
        if step + self.run_length(step) < self.start:  # the next dispatch ends before the window
            self.due = max(step + 1, self.start - self.run_length(step))
            return
        try:
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
        except RuntimeError as error:  # another trace is running (the user's): theirs goes on, none here
            warnings.warn(f"profile_steps=({self.start}, {self.stop}): no trace taken, the profiler is busy "
                          f"({type(error).__name__}: another trace is running)", RuntimeWarning, stacklevel=3)
            self.done, self.due = True, NEVER
            return
        self.tracing, self.due = True, self.stop - 1

    def close(self, last: Any = None) -> None:
        """Stop the trace (once the devices have finished ``last``), if one is running; the window is done."""
        self.done, self.due = True, NEVER
        if not self.tracing:
            return
        self.tracing = False
        try:
            if last is not None:
                jax.block_until_ready(last)
        finally:
            jax.profiler.stop_trace()
