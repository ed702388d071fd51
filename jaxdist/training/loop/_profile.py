"""A profile of chosen steps: ``fit(profile_steps=(start, stop))`` traces them with `jax.profiler`.

Step ``n`` is the one numbered ``n`` in the logs and ``on_step_end`` (after it, ``trainer.step ==
n``), so ``(start, stop)`` traces steps ``start, ..., stop - 1``: the trace starts before the first
of them is dispatched and stops once the last has finished on the devices (one wait, at the end of
the window). With ``steps_per_run > 1`` a step runs inside an on-device loop, which cannot be cut:
the trace covers the loops that run the steps of the window. A run resumed past ``start`` traces the
window's steps that are left; a fit that ends or fails inside the window stops the trace on its way
out.

The trace goes to ``<log_dir>/profile`` (``plugins/profile/<run>/<host>.xplane.pb``, which xprof and
TensorBoard's profile plugin open, and ``perfetto_trace.json.gz`` for https://ui.perfetto.dev), on
the processes chosen (process 0 by default). In a job of several processes each one's run is its
own, named by process (``<run>`` = ``<time>_process<i>``): JAX names a trace's file by host and its
run by the second it ended, so two processes on one host would overwrite each other's file.

Every traced dispatch carries a step marker, as XProf finds steps
(`jax.profiler.StepTraceAnnotation` ``"train"`` with ``step_num``; an on-device loop's says its
last step in ``last_step``), set between steps: no step outside the window pays for them. A window
the fit never reaches is said when the fit returns.
"""

from __future__ import annotations

import gzip
import json
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax

from jaxdist.training.callbacks import Callback

__all__ = ["StepProfile", "check_profile"]

NEVER = float("inf")


def check_profile(steps: Any, processes: Any, log_dir: Any) -> None:
    """Raise a ValueError naming the argument unless ``profile_steps`` / ``profile_processes`` are
    usable.

    Examples:
        >>> check_profile((3, 5), (0,), "logs")
        >>> check_profile((5, 3), (0,), "logs")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: profile_steps=(5, 3) must be (start, stop), two ints with 1 <= start < stop: ...
    """
    if steps is None:
        return
    if (not isinstance(steps, (tuple, list)) or len(steps) != 2
            or any(isinstance(s, bool) or not isinstance(s, int) for s in steps)
            or not 1 <= steps[0] < steps[1]):
        raise ValueError(f"profile_steps={steps!r} must be (start, stop), two ints with 1 <= start "
                         "< stop: steps start ... stop - 1 are traced (step n is the one after "
                         "which trainer.step == n).")
    if log_dir is None:
        raise ValueError(f"profile_steps={tuple(steps)!r} needs log_dir=...: the trace is written "
                         "to <log_dir>/profile.")
    if processes == "all":
        return
    count = jax.process_count()
    one = isinstance(processes, int) and not isinstance(processes, bool)
    chosen = (processes,) if one else processes
    if (not isinstance(chosen, (tuple, list, set, frozenset)) or not chosen
            or any(isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < count
                   for p in chosen)):
        raise ValueError(
            f"profile_processes={processes!r} must be 'all' or process indices in [0, {count}) "
            "(e.g. (0,), the default: process 0 alone).")


class StepProfile(Callback):
    """The trace of one window of steps (see the module): a fit's callback, whose ``on_step_end``
    calls `check` when the step reaches `due` (one comparison per step otherwise).

    Args:
        start, stop: the window: steps ``start ... stop - 1``.
        directory: where the trace goes (``<log_dir>/profile``).
        run_length: ``step -> the number of steps the next dispatch runs from step`` (1, or an
            on-device loop's).
        process: this process's index when the job has several (its run is named by it), else None.
    """

    def __init__(self, start: int, stop: int, directory: str | os.PathLike,
                 run_length: Callable[[int], int], process: int | None = None):
        self.start, self.stop, self.directory = start, stop, os.fspath(directory)
        self.run_length, self.process = run_length, process
        self.run: str | None = None  # the run's folder name, when named by process
        self.tracing = self.done = False
        self.traced = False  # a trace was started (or the profiler was busy: said then)
        self.due = 0.0  # check at the first step (a resumed run may start inside the window)
        self.marker: Any = None  # the open step marker (a StepTraceAnnotation), while tracing

    @classmethod
    def of(cls, steps: Any, processes: Any, log_dir: Any,
           run_length: Callable[[int], int]) -> StepProfile | None:
        """The profile ``fit`` asked for on this process, or None."""
        if steps is None:
            return None
        chosen = (processes,) if isinstance(processes, int) else processes
        if processes != "all" and jax.process_index() not in chosen:
            return None
        process = jax.process_index() if jax.process_count() > 1 else None
        return cls(steps[0], steps[1], os.path.join(os.fspath(log_dir), "profile"), run_length,
                   process)

    def on_train_begin(self, trainer: Any) -> None:
        self.check(self.control.step)  # the window may start at the first step

    def on_step_end(self, trainer: Any, step: int, metrics: Any) -> None:
        if step >= self.due:  # the window starts or ends here
            self.check(step, metrics)

    def on_train_end(self, trainer: Any, history: Any) -> None:
        # a window the fit never reached (not stopped early on request): said
        if not self.control.stopping:
            self.finish(self.control.step)
        self.close()  # a fit that ends inside the window: the trace so far

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self.close()

    def check(self, step: int, last: Any = None) -> None:
        """Between steps, at ``step`` (``last``: what the last dispatch returned): start or stop the
        trace."""
        if self.tracing:
            self.unmark()
            # the window's last step is dispatched: let it finish, then stop
            if step >= self.stop - 1:
                self.close(last)
            else:
                self.mark(step)
            return
        if self.done or step >= self.stop - 1:
            self.done, self.due = True, NEVER
            return
        if step + self.run_length(step) < self.start:  # the next dispatch ends before the window
            self.due = max(step + 1, self.start - self.run_length(step))
            return
        try:
            if self.process is None:
                jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            else:
                # a run of its own, named by process; its Perfetto file written here (JAX's
                # picks the newest run)
                options = jax.profiler.ProfileOptions()
                stamp = time.strftime("%Y_%m_%d_%H_%M_%S")
                options.session_id = self.run = f"{stamp}_process{self.process}"
                jax.profiler.start_trace(self.directory, profiler_options=options)
        except RuntimeError as error:
            # another trace is running (the user's): theirs goes on, none here
            warnings.warn(f"profile_steps=({self.start}, {self.stop}): no trace taken, the "
                          f"profiler is busy ({type(error).__name__}: another trace is running)",
                          RuntimeWarning, stacklevel=3)
            self.done, self.due, self.traced = True, NEVER, True
            return
        self.tracing, self.traced = True, True
        self.mark(step)

    def mark(self, step: int) -> None:
        """Open the marker of the dispatch that runs the steps after ``step``; check again after
        it."""
        steps = self.run_length(step)
        extra = {} if steps == 1 else {"last_step": step + steps}
        self.marker = jax.profiler.StepTraceAnnotation("train", step_num=step + 1, **extra)
        self.marker.__enter__()
        self.due = step + 1

    def unmark(self) -> None:
        """Close the open step marker, if any."""
        marker, self.marker = self.marker, None
        if marker is not None:
            marker.__exit__(None, None, None)

    def finish(self, step: int) -> None:
        """The fit ended at ``step`` (not by an error): a window it never reached is said, once (no
        trace of it was taken). A window before the run's first step (a resumed run past it) is not:
        its run traced it."""
        if self.traced or step >= self.start:
            return
        self.done = True
        warnings.warn(
            f"profile_steps=({self.start}, {self.stop}): no trace taken: this fit ended at step "
            f"{step}, before the window's first step {self.start}. Pass a window within the steps "
            f"the fit runs (e.g. profile_steps=({max(1, step - 1)}, {step + 1})), or more steps.",
            UserWarning, stacklevel=3)

    def close(self, last: Any = None) -> None:
        """Stop the trace (once the devices have finished ``last``), if one is running; the window
        is done."""
        self.done, self.due = True, NEVER
        self.unmark()
        if not self.tracing:
            return
        self.tracing = False
        try:
            if last is not None:
                jax.block_until_ready(last)
        finally:
            jax.profiler.stop_trace()
            if self.run is not None:
                _perfetto(os.path.join(self.directory, "plugins", "profile", self.run))


def _perfetto(run: str) -> None:
    """Write ``perfetto_trace.json.gz`` into the trace folder ``run`` from its ``*.trace.json.gz``
    (what ``start_trace(create_perfetto_trace=True)`` does for the newest folder: the trace without
    its ``metadata``, which Perfetto refuses); nothing when there is none."""
    traces = sorted(name for name in os.listdir(run)
                    if name.endswith(".trace.json.gz")) if os.path.isdir(run) else []
    if not traces:
        return
    with gzip.open(os.path.join(run, traces[0]), "rb") as f:
        trace = json.load(f)
    trace.pop("metadata", None)
    with gzip.open(os.path.join(run, "perfetto_trace.json.gz"), "wb") as f:
        f.write(json.dumps(trace).encode())
