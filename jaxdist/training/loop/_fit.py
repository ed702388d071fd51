"""The fit loop: steps, log points, evaluations, checkpoints, preemption and callbacks (``Trainer.fit``'s body).

``Trainer.fit`` checks its arguments, restores or builds the state, and hands the loop a `BatchStream` of
`TrainBatch` es (each checked and placed once, at the stream boundary: `jaxdist.training.data._feed`) and a
`FitOptions`. The loop drives the trainer through one typed interface, `FitTarget`: ``train_on_batch`` (one
compiled step per batch, the next batches placed ahead while it runs: `jaxdist.strategies.input.ahead`) or, with
``steps_per_run > 1``, ``train_on_batches`` (one compiled on-device loop, ``strategy.run_steps_on_dataset``,
per ``steps_per_run`` batches); ``step``, ``data_position`` and ``stop_training``; ``pop_running_sums`` and
``step_cost``; ``evaluate``, ``save`` and ``sync_model``.

Three things keep it from slowing the steps down:

* Log points never wait for the devices. At a log point the window's running sums (one small device vector,
  `jaxdist.training.step.PackedSums`) start their copy to the host and the loop goes on dispatching
  steps; the log is emitted (``history.train``, ``on_log``) at the first step end at which they have arrived,
  and at the latest before the next evaluation, checkpoint or the end of ``fit``. So a log comes a step or
  two after the step it describes, with that step's number. Nothing is read back per step. With several
  processes a log is emitted exactly ``READ_LAG`` steps (or loops) after its window closed, on every process
  (it has almost always arrived by then), so that all act on what it says at the same step.
* Non-finite steps (`jaxdist.training.step._non_finite`): each step's flag (its loss or gradient norm is not finite)
  rides in the same sums; the loop acts on it (``on_non_finite``: stop, skip, roll back, continue) when a log
  is emitted and before every checkpoint, whose state is refused if it is not finite.
* The loop reads only the batches it trains on: the stream is cut at the step ``fit`` trains to, so no
  batch is placed that no step uses.
* Nothing waits for a step: the host places the next batches and dispatches the next steps while the
  devices run the current one.
* Checkpoints are written in the background (`Checkpointer`'s ``async_save``): ``on_checkpoint`` comes at
  the first step end after one is complete, a failed write raises there, and ``fit`` ends only when its last
  one is complete. Preemption is agreed by every process without waiting (`jaxdist.training.loop._preemption`).

The data position is the count of batches the steps consumed (never what was read ahead). Every
log is the mean of each metric over the steps since the previous log point, whichever way they ran: the
steps add their metrics to running sums on the devices (``trainer.pop_running_sums``; a token-weighted value
adds its sum and its weight, and the log divides the two sums: the token-weighted mean over the window), and
an on-device loop ends at the next log, evaluation or checkpoint point (``steps_per_run`` is the longest
loop), so the logs, evaluations and checkpoints of ``steps_per_run > 1`` are those of the same training one
step at a time.

After the first step the loop asks the trainer what a step costs (``trainer.step_cost()``, measured once) and
hands it to the callbacks (``on_step_cost``); each log then adds ``tokens_per_sec``, ``mfu``, ``hfu`` and
``peak_bytes_in_use`` where they are known (`jaxdist.costs.step`), from the window's steps, seconds and
summed loss weight: nothing more is computed or read per step.

Where the fit's time goes (`History.time`, and each log row's ``time/<part>``) is measured on the host around
what the loop does (`jaxdist.training.loop._time.FitClock`: three clock reads per step). Process 0 records the
step reached in the checkpoint directory at log points (at most every `PROGRESS_SECONDS`) and when the fit
ends or fails (`jaxdist.training.checkpoints.write_progress`), so that a fit resumed behind it counts the steps
it takes again as ``lost`` (``FitOptions.reached``: one comparison per step), and, beside it, the job's time
over its runs (`jaxdist.training.loop._job_time`: ``History.job_time``). ``profile_steps``
traces a window of steps with `jax.profiler` (`jaxdist.training.loop._profile.StepProfile`: one comparison
per step outside the window).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from time import perf_counter
from typing import Any, Protocol

import jax
from jax.sharding import Mesh

from jaxdist.costs.step import StepCost
from jaxdist.job import data_ended, spans_processes
from jaxdist.strategies.input import ahead
from jaxdist.training.callbacks import Callback, History
from jaxdist.training.checkpoints import Checkpointer, clear_progress, write_progress
from jaxdist.training.data import BatchStream, DataPosition
from jaxdist.training.loop._hosts import HostTimes, check_ratio
from jaxdist.training.loop._job_time import JobTime
from jaxdist.training.loop._logs import Logs
from jaxdist.training.loop._preemption import PreemptionWatcher
from jaxdist.training.loop._profile import NEVER, StepProfile, check_profile
from jaxdist.training.loop._time import FitClock, window_seconds
from jaxdist.training.loop._watchdog import Watchdog
from jaxdist.training.step import NonFiniteError, NonFiniteGuard, NonFinitePolicy, PackedSums, check_int

__all__ = ["READ_AHEAD", "Fit", "FitOptions", "FitTarget", "run_fit"]

READ_AHEAD = 2
"""Batches placed ahead of the step being dispatched (one compiled step per batch)."""

PROGRESS_SECONDS = 5.0
"""The step reached is recorded in the checkpoint directory at a log point at most this often (and at the end)."""

READ_LAG = 2
"""Several processes: a log window is read this many checks (steps, or on-device loops) after it closed, at the
same check on every process, so that every process acts on a non-finite step at the same step."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitOptions:
    """What ``Trainer.fit`` asks of the loop (see ``Trainer.fit`` for each option's meaning).

    Attributes:
        steps: train until ``trainer.step`` reaches this (None: until the stream ends).
        eval_data: batches for ``trainer.evaluate``, or None.
        eval_every: steps between evaluations (None: only at the end, when there is ``eval_data``).
        checkpointer: where checkpoints go, or None for none.
        checkpoint_every: steps between checkpoints (None: only at the end and on preemption).
        log_every: steps between log points.
        callbacks: the callbacks, called in order.
        step_timeout: seconds a step may take before the process exits (`Watchdog`); None: not watched.
        steps_per_run: 1: a compiled step per batch (``train_on_batch``); more: an on-device loop of up to
            this many steps (``train_on_batches``).
        mesh: the mesh whose processes agree on preemption (`PreemptionWatcher`) and read each log window at
            the same step; None: this process alone.
        on_non_finite: the `NonFinitePolicy` for steps whose loss or gradients are not finite.
        straggler_ratio: a process whose input wait is this many times the median process's (and longer by this
            much minus one of a step) is named in a `StragglerWarning` (`jaxdist.training.loop._hosts`); None:
            nobody is named (``History.processes`` is kept either way).
        log_dir: where metric files go; the profile goes to ``<log_dir>/profile``.
        profile_steps: ``(start, stop)``: trace steps ``start ... stop - 1`` (`jaxdist.training.loop._profile`),
            or None.
        profile_processes: the processes that trace: process indices, or ``"all"``.
        clock: the fit's `FitClock` (`History.time`), started when these options are made (``Trainer.fit`` makes
            them first): one per fit.
        reached: the step an earlier run on ``checkpointer``'s directory reached (its progress record, or its
            newest checkpoint before a ``restore_step``): the time of the steps up to it that this fit takes
            again is ``lost``. 0: none.
        config: how the run is configured (`jaxdist.training.loop._config.run_config`), handed to the callbacks'
            ``on_config`` before the first step.

    Raises:
        ValueError: for out-of-range numbers, ``eval_every`` without ``eval_data``, ``eval_data`` given as
            an iterator (it would be read up by the first evaluation), or ``profile_steps`` that are not a
            window of steps, or without ``log_dir``.

    Examples:
        >>> FitOptions(steps=100, log_every=10).log_every
        10
    """

    steps: int | None
    eval_data: Any = None
    eval_every: int | None = None
    checkpointer: Checkpointer | None = None
    checkpoint_every: int | None = None
    log_every: int = 10
    callbacks: tuple[Callback, ...] = ()
    step_timeout: float | None = None
    steps_per_run: int = 1
    mesh: Mesh | None = None
    on_non_finite: NonFinitePolicy = dataclasses.field(default_factory=NonFinitePolicy)
    straggler_ratio: float | None = 1.25
    log_dir: str | os.PathLike | None = None
    profile_steps: tuple[int, int] | None = None
    profile_processes: Any = (0,)
    clock: FitClock = dataclasses.field(default_factory=FitClock, repr=False, compare=False)
    reached: int = 0
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_ratio(self.straggler_ratio)
        if not isinstance(self.on_non_finite, NonFinitePolicy):
            raise ValueError(
                f"on_non_finite={self.on_non_finite!r} must be a NonFinitePolicy: pass NonFinitePolicy.of(...)."
            )
        check_int(self.steps, "steps", 0)
        check_int(self.steps_per_run, "steps_per_run", 1, allow_none=False)
        for name in ("eval_every", "checkpoint_every"):
            check_int(getattr(self, name), name, 1)
        check_int(self.log_every, "log_every", 1, allow_none=False)
        check_int(self.reached, "reached", 0, allow_none=False)
        timeout = self.step_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"step_timeout={timeout!r} must be a number of seconds > 0, or None (not watched).")
        if self.eval_every is not None and self.eval_data is None:
            raise ValueError(f"eval_every={self.eval_every} needs eval_data=... to evaluate on.")
        data = self.eval_data
        if data is not None and isinstance(data, Iterable) and iter(data) is data:
            raise ValueError(
                "eval_data is an iterator, which can be read only once: pass a list of batches or a function "
                "returning a fresh iterable."
            )
        check_profile(self.profile_steps, self.profile_processes, self.log_dir)


class FitTarget(Protocol):
    """What `run_fit` drives: the operations and the three attributes it needs (a `Trainer` is one).

    Callbacks receive the target as their ``trainer`` argument (and may set ``stop_training``).
    """

    stop_training: bool
    """Set (by a callback) to end the run after the current step."""
    data_position: DataPosition
    """The loop sets it after each step: the position of the last batch a step consumed."""

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        ...

    def train_on_batch(self, batch: Any) -> Mapping[str, Any]:
        """One step on a batch of the stream (a `jaxdist.training.data.TrainBatch`); its metrics."""
        ...

    def train_on_batches(self, batches: Sequence[Any]) -> Mapping[str, Any]:
        """One on-device loop over batches of the stream; every step's metrics, stacked."""
        ...

    def pop_running_sums(self) -> PackedSums:
        """The running sums since the last call (on the devices; read at a log point, never waited for)."""
        ...

    def peek_running_sums(self) -> PackedSums:
        """The same sums, which go on (read before a checkpoint, for the record of non-finite steps)."""
        ...

    def restore(self, checkpoint_dir: Checkpointer, step: int) -> int:
        """Restore checkpoint ``step`` (``on_non_finite="rollback"``)."""
        ...

    def step_cost(self) -> StepCost:
        """What a step costs (measured once, after the first step)."""
        ...

    def evaluate(self, data: Any) -> dict[str, float]:
        """The metrics over ``data``."""
        ...

    def save(self, checkpoint_dir: Checkpointer) -> str:
        """Save a checkpoint of the current step."""
        ...

    def sync_model(self) -> None:
        """Write the trained values back into the user's model."""
        ...


def _crossed(before: int, after: int, every: int | None) -> bool:
    return bool(every) and after // every > before // every


class _NoProfile:
    """What ``run_fit`` uses instead of a `StepProfile` when no steps are profiled."""

    due = NEVER

    def check(self, step: int, last: Any = None) -> None:
        return None

    def close(self, last: Any = None) -> None:
        return None

    def finish(self, step: int) -> None:
        return None


class _Unwatched:
    """What ``run_fit`` uses instead of a `Watchdog` when steps are not watched."""

    def __enter__(self) -> _Unwatched:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def beat(self) -> None:
        return None

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def run_fit(trainer: FitTarget, stream: BatchStream, options: FitOptions) -> History:
    """Train ``trainer`` on ``stream`` as ``options`` say; the body of ``Trainer.fit`` (a `Fit` run once).

    Args:
        trainer: the `FitTarget` (a `Trainer` whose state exists: ``fit`` built or restored it).
        stream: the training batches from the trainer's data position on: `TrainBatch` es of the trainer's
            feed (taken as they are; other batches are checked and placed by ``train_on_batch``).
        options: the `FitOptions`.

    Returns:
        The `History`; ``history.preempted`` when a SIGTERM stopped the run (after its checkpoint).

    Examples:
        >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
        >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1),
        ...                               lambda out, y: ((out[:, 0] - y) ** 2).mean())
        >>> batch = (np.ones((8, 2), np.float32), np.ones(8, np.float32))
        >>> _ = trainer.init(batch)
        >>> history = run_fit(trainer, BatchStream([batch] * 6), FitOptions(steps=6, log_every=3))
        >>> trainer.step, [row["step"] for row in history.train]
        (6, [3, 6])
    """
    return Fit(trainer, stream, options).run()


class Fit:
    """One run of the fit loop: its state (the history, the non-finite guard, the data consumed, the log
    windows) and its steps as methods: `checkpoint`, `roll_back` (with `look` and `act`, the non-finite
    policy), `evaluate`, `close_window` (logging) and `run`, the loop that calls them. Used once: ``run``.

    Args:
        trainer: the `FitTarget`.
        stream: the training batches (see `run_fit`).
        options: the `FitOptions`.
    """

    def __init__(self, trainer: FitTarget, stream: BatchStream, options: FitOptions):
        self.trainer, self.stream, self.options = trainer, stream, options
        self.history = History()
        self.policy = options.on_non_finite
        self.guard = NonFiniteGuard(self.policy, trainer.step)
        self.rollbacks = 0
        self.warned = False
        self.refused: int | None = None  # the step whose save "continue" skipped (its state is not finite)
        self.cost: StepCost | None = None
        self.consumed = self.checks = 0
        self.clock = options.clock
        self.windows: collections.deque = collections.deque()  # (step, clock snapshot) of each closed window
        self.logged = (self.clock.started, dict.fromkeys(self.clock.gross(), 0.0))  # the last window logged
        # An earlier run got to step ``reached`` (it crashed after its last checkpoint, or restore_step went back):
        # the steps up to it are taken again, their time is lost (`FitClock.redone`, at the step that reaches it
        # and at each window closed before).
        self.redo = options.reached if options.reached > trainer.step else NEVER
        # Process 0 records how far the run got, in the checkpoint directory (`write_progress`), for the next run.
        self.recorder = options.checkpointer is not None and jax.process_index() == 0
        self.recorded = float("-inf")  # when (perf_counter) it last did
        # ... and the job's time over its runs, beside it (`jaxdist.training.loop._job_time`).
        self.job = JobTime(options.checkpointer.directory, time.time() - self.clock.wall()) if self.recorder \
            else None
        self.ended = False  # the run ended normally (not failed, not preempted): no restart follows it
        self.saved_at_end = False  # the fit ended with a checkpoint of its last step (no record needed then)
        profile = StepProfile.of(options.profile_steps, options.profile_processes, options.log_dir,
                                 lambda step: _run_length(step, options))
        self.profile = _NoProfile() if profile is None else profile

    def emit(self, hook: str, *args: Any) -> None:
        for cb in self.options.callbacks:
            getattr(cb, hook)(self.trainer, *args)

    def on_log(self, step: int, logs: dict) -> None:
        while self.windows:  # the snapshot of this window (windows without steps are not logged: skipped)
            closed, snapshot = self.windows.popleft()
            if closed == step:
                logs.update(window_seconds(self.logged, snapshot))
                self.logged = snapshot
                break
        self.history.train.append({"step": step, **logs})
        self.emit("on_log", step, logs)
        self.hosts.collect()  # process 0: the other processes' figures of the windows emitted so far

    def checkpoint(self) -> None:
        trainer, ckpt = self.trainer, self.options.checkpointer
        if ckpt is None:
            return
        with self.dog.paused(), self.clock.timing("checkpoint"):  # waits for an asynchronous save in flight
            latest = ckpt.latest_step()
        if trainer.step in (latest, self.refused):
            return
        self.logs.flush()
        self.look()  # before every checkpoint: the open window's flags too (it is closed only if it holds any)
        with self.dog.paused(), self.clock.timing("checkpoint"):  # checkpoint writes are not watched
            if ckpt.latest_step() == trainer.step:  # rolled back to a checkpoint
                return
            self.written(wait=True)  # the save in flight first (the next save would wait for it anyway)
            try:
                trainer.save(ckpt)  # a no-op when this step is being written already; refuses a non-finite state
                self.clock.saved(trainer.step)
            except NonFiniteError as error:
                if self.policy.action != "continue":
                    raise
                self.refused = trainer.step
                warnings.warn(f"{error} (on_non_finite='continue': training goes on)", RuntimeWarning, stacklevel=4)
            self.written()  # a synchronous save: now; an asynchronous one: at a later step end, once complete

    def look(self) -> None:
        """Read the open window's flags (a checkpoint is next); if any step in it was not finite, close it."""
        with self.clock.timing("waited"):  # the devices finish the steps dispatched
            sums = self.trainer.peek_running_sums().to_host()
        if sums.non_finite.count:
            self.close_window()
            self.logs.flush()
        self.act()

    def act(self) -> bool:
        """Act on the non-finite steps the looks found (at a point every process reaches at the same step);
        True when the run rolled back."""
        guard, policy = self.guard, self.policy
        if not guard.pending:
            return False
        self.history.non_finite_steps = guard.total
        if policy.action == "continue":
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"the loss or gradients of step {guard.first} were not finite; on_non_finite='continue' trains "
                    "on (non-finite states are not saved)", RuntimeWarning, stacklevel=4)
            guard.acted()
            return False
        if policy.action == "skip":
            if guard.too_many_in_a_row:
                raise self.stop(f"{guard.longest_run} steps in a row were not finite (on_non_finite='skip' stops "
                                f"at max_consecutive_skips={policy.max_consecutive_skips}: the run has diverged)")
            guard.acted()  # skipped on the devices; the logs count them
            return False
        if policy.action == "rollback":
            if self.rollbacks >= policy.max_rollbacks:
                raise self.stop(
                    f"the run stopped after {self.rollbacks} rollback{'s' if self.rollbacks != 1 else ''} "
                    f"(on_non_finite='rollback' rolls back at most max_rollbacks={policy.max_rollbacks} times)")
            self.roll_back()
            return True
        raise self.stop("the run stopped (on_non_finite='stop')")

    def stop(self, what: str) -> NonFiniteError:
        ckpt = self.options.checkpointer
        latest = None if ckpt is None else ckpt.latest_step()  # waits for the save in flight: complete
        return self.guard.error(what, latest, None if ckpt is None else ckpt.directory)

    def roll_back(self) -> None:
        """Restore the newest checkpoint before the first bad step; the data goes on from where it is."""
        trainer, ckpt, bad = self.trainer, self.options.checkpointer, self.guard.first
        self.close_window()
        self.logs.flush()  # every step so far is logged (their flags belong to this rollback)
        with self.dog.paused(), self.clock.timing("checkpoint"):
            self.written(wait=True)
            good = [] if ckpt is None else [s for s in ckpt.all_steps() if s < bad]
            if not good:
                raise self.stop("there is no checkpoint before it to roll back to, so the run stopped")
            trainer.restore(ckpt, good[-1])
        self.clock.rolled_back(good[-1])  # the steps since that checkpoint: lost
        self.rollbacks += 1
        trainer.data_position = self.stream.position(self.consumed)  # past the bad batches (and those after them)
        self.history.rollbacks.append({"step": bad, "restored": good[-1], "data_position": trainer.data_position})
        trainer.pop_running_sums()
        self.logs.restart(trainer.step)
        self.guard.restart(trainer.step)
        warnings.warn(
            f"the loss or gradients of step {bad} were not finite: rolled back to checkpoint {good[-1]} (rollback "
            f"{self.rollbacks} of at most {self.policy.max_rollbacks}); training goes on with the data after the "
            f"batches read so far, skipping them", RuntimeWarning, stacklevel=5)

    def written(self, wait: bool = False) -> None:
        """``on_checkpoint`` for the saves complete by now; raises for one that failed in the background."""
        if self.options.checkpointer is not None:
            for step, path in self.options.checkpointer.poll(wait):
                self.history.checkpoints.append(path)
                self.emit("on_checkpoint", step, path)

    def evaluate(self) -> None:
        self.logs.flush()
        if self.act():  # rolled back: this evaluation point comes again, at its step
            return
        with self.dog.paused(), self.clock.timing("evaluation"):  # longer than a step: not watched
            metrics = self.trainer.evaluate(self.options.eval_data)
        self.history.eval.append({"step": self.trainer.step, **metrics})
        self.emit("on_eval_end", self.trainer.step, metrics)

    def close_window(self) -> None:
        if self.redo is not NEVER:  # every step so far was taken before, by an earlier run
            self.clock.redone()
        now = perf_counter()
        self.windows.append((self.trainer.step, (now, self.clock.gross())))
        if self.recorder and now - self.recorded >= PROGRESS_SECONDS:
            self.record()
            self.recorded = now
        self.logs.close_window(self.trainer.step, self.trainer.pop_running_sums(), self.checks)
        self.hosts.close_window(self.trainer.step, self.consumed)

    def redone(self) -> None:
        """The step an earlier run reached is reached again: the steps up to here are lost (`FitClock.redone`)."""
        self.clock.redone()
        self.redo = NEVER

    def record(self) -> None:
        """Record the step reached in the checkpoint directory (process 0; never an error); once the fit has
        ended with a checkpoint of that step, which says as much, remove the record."""
        if self.recorder:
            directory = self.options.checkpointer.directory
            if self.saved_at_end:
                clear_progress(directory)
            else:
                write_progress(directory, self.trainer.step)
            if self.saved_at_end and self.ended:  # the job ended here: a later fit is a new one
                self.job.clear()
            else:
                self.job.record(self.clock.totals(), ended=self.ended)

    def rates(self, steps: int, seconds: float, loss_weight: float | None) -> dict:
        return {} if self.cost is None else self.cost.rates(steps, seconds, loss_weight)

    def run(self) -> History:
        """The loop: steps, and at their points the logs, evaluations and checkpoints; the `History`."""
        trainer, stream, options, history = self.trainer, self.stream, self.options, self.history
        trainer.stop_training = False
        trainer.pop_running_sums()  # the windows start here
        spans = options.mesh is not None and spans_processes(options.mesh.devices.flat)
        # Several processes act on a window at the same step, and a rollback moves the data past the same batches
        # in every run of the same job: the windows are read a fixed READ_LAG steps after they close.
        fixed = spans or self.policy.action == "rollback"
        clock, profile = self.clock, self.profile
        clock.open()  # heard since the options were made; again if they serve a second run
        self.logs = Logs(trainer.step, self.on_log, self.rates, self.guard.observe, lag=READ_LAG if fixed else None,
                         waited=clock.waited)
        self.hosts = HostTimes(spans=spans, ratio=options.straggler_ratio, rows=history.processes,
                               waited=lambda: clock.input)  # each process's input wait per log window
        self.hosts.start()
        source = iter(stream)
        self.dog = (Watchdog(options.step_timeout, step=lambda: trainer.step) if options.step_timeout is not None
                    else _Unwatched())
        try:
            with PreemptionWatcher(mesh=options.mesh, waited=clock.waited) as watcher, self.dog:  # agreed by all
                self.emit("on_train_begin")
                self.emit("on_config", dict(options.config))
                profile.check(trainer.step)  # the window may start at the first step
                while True:  # one round, and one more after each rollback at the end
                    steps = _steps(trainer, source, options, clock)
                    try:
                        for n, metrics in steps:
                            self.dog.beat()  # a step finished (a callback that stalls from here on trips the watchdog)
                            step = trainer.step
                            if step >= profile.due:  # the profile's window starts or ends here
                                profile.check(step, metrics)
                            if step >= self.redo:  # the step an earlier run reached: the steps up to it were lost
                                self.redone()
                            before = step - n  # the step(s) just taken advanced trainer.step
                            self.consumed += n
                            self.checks += 1
                            trainer.data_position = stream.position(self.consumed)
                            if self.cost is None:  # once: the step is compiled now (measuring finds it in JAX's cache)
                                self.cost = history.step_cost = trainer.step_cost()
                                self.emit("on_step_cost", self.cost)
                            self.emit("on_step_end", step, metrics)
                            if _crossed(before, step, options.log_every) or step == options.steps:
                                self.close_window()
                            self.logs.emit_ready(self.checks)
                            if self.act():  # rolled back: the log, evaluation and checkpoint points come again
                                continue
                            self.written()
                            if _crossed(before, trainer.step, options.eval_every):
                                self.evaluate()
                            if _crossed(before, trainer.step, options.checkpoint_every):
                                self.checkpoint()
                            if watcher.should_stop(stop_training=trainer.stop_training):  # agreed by every process
                                break
                    finally:
                        steps.close()
                    # The data ended first: on every process? (before any collective)
                    if (options.steps is not None and trainer.step < options.steps and stream.epochs is None
                            and not watcher.stopping):
                        data_ended(options.mesh, self.consumed, self.consumed + options.steps - trainer.step)
                        history.data_ended = trainer.step
                    if not watcher.stopping:  # a signal since the last check
                        watcher.should_stop(final=True, stop_training=trainer.stop_training)
                    self.close_window()
                    self.logs.flush()
                    if not self.act() or watcher.stopping:  # rolled back at the end: train to the end again
                        break
                self.hosts.collect(final=True)  # process 0: every window's figures (a peer's, waited for briefly)
                if not watcher.stopping:  # a window the fit never reached (not stopped early on request): said
                    profile.finish(trainer.step)
                history.preempted = watcher.preempted
                history.non_finite_steps = self.guard.total
                self.checkpoint()  # at the end (a no-op when this step is saved already)
                with self.dog.paused(), clock.timing("checkpoint"):
                    self.written(wait=True)  # fit returns (or exits on preemption) once its last checkpoint is complete
                if options.eval_data is not None and not history.preempted and not (
                    history.eval and history.eval[-1]["step"] == trainer.step
                ):
                    self.evaluate()
                trainer.sync_model()
                history.time = clock.totals()  # for on_train_end (and again once the fit is over)
                self.job_time()
                self.emit("on_train_end", history)
                ckpt = options.checkpointer
                with clock.timing("checkpoint"):
                    self.saved_at_end = ckpt is not None and ckpt.latest_step() == trainer.step  # none in flight
                self.ended = not history.preempted
        finally:
            self.record()  # how far this run got (a run that fails: the next one knows what it takes again)
            clock.close()
            profile.close()  # a fit that ends or fails inside the window: the trace so far
            self.logs.close()  # the watcher thread
            del self.logs  # no cycle (self -> logs -> self.on_log) keeps the run's objects alive after it
            close = getattr(source, "close", None)
            if close is not None:
                close()
        history.time = clock.totals()
        self.job_time()
        return history

    def job_time(self) -> None:
        """``History.job_time`` (process 0, with a checkpoint directory): this run's time with the runs before."""
        if self.job is not None:
            self.history.job_time, self.history.job_runs = self.job.totals(self.history.time)


def _steps(trainer: FitTarget, source: Iterator, options: FitOptions,
           clock: FitClock) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """Run steps on the batches of ``source`` until ``trainer.step`` reaches ``options.steps`` (or ``source``
    ends); yield ``(steps taken, their metrics)`` after each step or each on-device loop. ``clock`` hears the
    seconds spent reading batches and in steps (`FitClock`: two sums and its phase, per step)."""
    until = options.steps
    while until is None or trainer.step < until:
        # Cut the stream at the last batch a step will use: nothing is read, or placed, beyond it. A rollback
        # moves the step back: another cut then takes the batches for the steps that are left.
        cut = source if until is None else itertools.islice(source, until - trainer.step)
        ran = 0
        if options.steps_per_run > 1:
            for n, metrics in _on_device_loops(trainer, cut, options, clock):
                ran += n
                yield n, metrics
        else:
            # Batch n+READ_AHEAD is read (and placed) before step n is dispatched: its transfer overlaps the
            # steps still running. Nothing here waits for a step, so the host stays ahead of the devices.
            batches = ahead(cut, READ_AHEAD)
            try:
                for taken in _timed(clock, functools.partial(next, batches, _END), trainer.train_on_batch, _one):
                    ran += 1  # counted here: a rollback between steps moves trainer.step back
                    yield taken
            finally:
                batches.close()
        if not ran or until is None:  # the data ended
            return


_END = object()


def _one(batch: Any) -> int:
    return 1


def _timed(clock: FitClock, read: Callable[[], Any], run: Callable[[Any], Any],
           count: Callable[[Any], int]) -> Iterator[tuple[int, Any]]:
    """``(count(batches), run(batches))`` for each ``batches = read()`` until it returns ``_END``: the reading
    timed as ``input``, the running as ``steps`` (two clock reads per step; the clock's phase says where a
    compile happens)."""
    while True:
        clock.phase = "input"
        start = perf_counter()
        got = read()
        read_at = perf_counter()
        clock.input += read_at - start
        if got is _END:
            clock.phase = "other"
            return
        clock.phase = "steps"
        metrics = run(got)
        clock.steps += perf_counter() - read_at
        clock.phase = "other"
        yield count(got), metrics


def _run_length(step: int, options: FitOptions) -> int:
    """The steps the next dispatch at ``step`` runs: 1, or (``steps_per_run > 1``) an on-device loop's, which
    ends at the next log, evaluation or checkpoint point (and at ``options.steps``)."""
    if options.steps_per_run == 1:
        return 1
    stops = [(step // every + 1) * every for every in
             (options.log_every, options.eval_every, options.checkpoint_every) if every]
    if options.steps is not None:
        stops.append(max(options.steps, step + 1))
    return min(options.steps_per_run, min(stops) - step)


def _on_device_loops(
    trainer: FitTarget, host: Iterator, options: FitOptions, clock: FitClock
) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """steps_per_run > 1: ONE compiled on-device loop per ``steps_per_run`` batches. A loop ends at the next
    log, evaluation or checkpoint point, so that they see the same steps as one step at a time would."""
    def chunk() -> Any:
        return list(itertools.islice(host, _run_length(trainer.step, options))) or _END

    yield from _timed(clock, chunk, trainer.train_on_batches, len)
