"""The fit loop: it drives a `LiveState` through its steps and, at their points, logs, evaluations
and checkpoints; everything else it does is a callback's (``Trainer.fit``'s body, after
`jaxdist.training.loop._start`).

A step (`FitLoop.run_steps`): read the next batch, run the compiled step (or an on-device loop),
call the ``on_step_end`` callbacks, and only at the step of the next point (`FitLoop.due`) do what
is due there (the step's cost, a log window's end, an evaluation, a checkpoint, a callback's
request, an epoch's end, a finished background save); then ask whether to stop (agreed by every
process: `jaxdist.training.loop._preemption`). So a step between points costs the host a handful
of attribute operations besides its batch and its dispatch.

The loop waits neither for logs (a window's sums are copied to the host while steps go on, and the
log is emitted once they have arrived, at the latest before the next evaluation, checkpoint or the
end; with several processes exactly `READ_LAG` checks after the window closed, so that all act on
it at one step), nor for the next batches (placed `READ_AHEAD` ahead), nor for background saves
(``on_checkpoint`` comes at the first step end after one is complete). An epoch's end waits for
the epoch's metrics, once per epoch, and only when the fit counts epochs or a callback has an
epoch hook. A checkpoint on the clock is asked for at a log point; with several processes process
0's clock decides and every process saves after the same step (`PreemptionWatcher.save_agreed`).
Non-finite steps are acted on when a log is emitted and before every checkpoint.

Process 0 records the step reached in the checkpoint directory (at most every `PROGRESS_SECONDS`,
and at the end), so that a fit resumed behind it counts the steps it takes again as ``lost``, and
beside it the job's time over its runs (`jaxdist.training.loop._job_time`).
"""

from __future__ import annotations

import collections
import itertools
import time
import warnings
from collections.abc import Iterable, Mapping
from time import perf_counter
from typing import Any

import jax

from jaxdist.costs.step import CostOptions, StepCost
from jaxdist.job import AGREE_SECONDS, data_ended, exchange, spans_processes
from jaxdist.strategies.input import ahead
from jaxdist.training.callbacks import HOOKS, Callback, FitControl, History, overriding
from jaxdist.training.checkpoints import (
    Checkpointer,
    LocalCheckpointer,
    clear_progress,
    restore_live,
    save_live,
    save_live_local,
    write_progress,
)
from jaxdist.training.data import BatchStream, DataPosition
from jaxdist.training.loop._hosts import SameBatches
from jaxdist.training.loop._job_time import JobTime
from jaxdist.training.loop._logs import Logs, means
from jaxdist.training.loop._options import FitOptions
from jaxdist.training.loop._preemption import PreemptionWatcher
from jaxdist.training.loop._time import FitClock, window_seconds
from jaxdist.training.step import LiveState, NonFiniteError, NonFiniteGuard

__all__ = ["PROGRESS_SECONDS", "READ_AHEAD", "READ_LAG", "FitLoop", "run_fit"]

READ_AHEAD = 2
"""Batches placed ahead of the step being dispatched (one compiled step per batch)."""

PROGRESS_SECONDS = 5.0
"""The step reached is recorded in the checkpoint directory at a log point at most this often (and
at the end)."""

READ_LAG = 2
"""Several processes: a log window is read this many checks (steps, or on-device loops) after it
closed, at the same check on every process, so that every process acts on a non-finite step at the
same step."""

NEVER = float("inf")
_END = object()
_WHERE = "train_on_batch's batch"


def _next(step: int, every: int | None) -> float:
    """The first multiple of ``every`` after ``step`` (NEVER without ``every``)."""
    return (step // every + 1) * every if every else NEVER


def run_fit(live: LiveState, stream: BatchStream, options: FitOptions, **run: Any) -> History:
    """Train ``live`` on ``stream`` as ``options`` say (a `FitLoop` run once); ``run``: `FitLoop`'s
    other arguments.

    Returns:
        The `History`; ``history.preempted`` when a SIGTERM stopped the run (after its checkpoint).

    Examples:
        >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
        >>> from jaxdist.training.step import LiveState
        >>> live = LiveState(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1),
        ...                  lambda out, y: ((out[:, 0] - y) ** 2).mean())
        >>> batch = (np.ones((8, 2), np.float32), np.ones(8, np.float32))
        >>> _ = live.init(batch)
        >>> history = run_fit(live, BatchStream([batch] * 6), FitOptions(steps=6, log_every=3))
        >>> live.step, [row["step"] for row in history.train]
        (6, [3, 6])
    """
    return FitLoop(live, stream, options, **run).run()


class FitLoop(FitControl):
    """One run of the fit loop (used once: `run`), and the `FitControl` its callbacks see.

    Args:
        live: the `LiveState` it trains (its state exists: ``fit`` built or restored it).
        stream: the training batches from the data position on (`TrainBatch` es of the live state's
            feed are taken as they are; others are checked and placed by the step).
        options: the `FitOptions`.
        callbacks: every callback, in the order they are called (``fit``'s: the features its options
            switch on, the progress display, ``options.callbacks``, the log writers); default:
            ``options.callbacks``.
        owner: what the callbacks receive as their ``trainer`` (``fit``'s `Trainer`).
        checkpointer: where checkpoints go (``options.checkpoint_dir``, opened), or None.
        clock: the fit's `FitClock` (``fit`` starts it first); default: one started now.
        reached: the step an earlier run on ``checkpointer``'s directory reached: the steps up to it
            that this fit takes again are ``lost``. 0: none.
        config: how the run is configured (`jaxdist.training.loop._config.run_config`, for
            ``on_config``).
        cost: the trainer's `CostOptions` (for the step's cost, `StepCost`).
        history: the `History` to fill (default: a new one).
    """

    def __init__(self, live: LiveState, stream: BatchStream, options: FitOptions, *,
                 callbacks: Iterable[Any] | None = None, owner: Any = None,
                 checkpointer: Checkpointer | None = None, clock: FitClock | None = None,
                 reached: int = 0, config: Mapping[str, Any] | None = None,
                 cost: CostOptions | None = None, history: History | None = None,
                 local: LocalCheckpointer | None = None):
        self.live, self.stream, self.options, self.owner = live, stream, options, owner
        self.callbacks = tuple(options.callbacks if callbacks is None else callbacks)
        # only those that do something
        self.hooks = {hook: overriding(self.callbacks, hook) for hook in HOOKS}
        self.ckpt, self.config = checkpointer, dict(config or {})
        self.cost_options = cost or CostOptions()
        self.local = local  # the local tier, saved every ``local_checkpoint_every`` steps
        self.history = history if history is not None else History()
        self.clock = clock if clock is not None else FitClock()
        self.policy = options.on_non_finite
        self.guard = NonFiniteGuard(self.policy, live.step)
        self.rollbacks, self.warned = 0, False
        self.refused: int | None = None  # the step whose save "continue" skipped (not finite)
        self.cost: StepCost | None = None
        self.batches = self.checks = 0  # batches the steps consumed; steps (or loops) made
        self.placed = 0  # the batches the data position was last set after
        self.due = 0.0  # the step of the next point (0: the first step's end, for its cost)
        self.in_flight = False  # a checkpoint is being written (reported once complete)
        self.save_asked, self.skip_asked, self.stopping = False, 0, False
        self.windows: collections.deque = collections.deque()  # (step, snapshot, epoch) per window
        self.logged = (self.clock.started, dict.fromkeys(self.clock.gross(), 0.0))  # last logged
        # An earlier run reached step ``reached`` (a crash after its last checkpoint, restore_step):
        # the steps up to it are taken again, their time lost (`FitClock.lose_redone`).
        self.redo = reached if reached > live.step else NEVER
        # process 0 records how far the run got (`write_progress`) and the job's time
        self.recorder = checkpointer is not None and jax.process_index() == 0
        self.recorded = float("-inf")  # when (perf_counter) it last did
        self.job = JobTime(checkpointer.directory,
                           time.time() - self.clock.wall()) if self.recorder else None
        self.ended = False  # the run ended normally (not failed, not preempted): no restart follows
        self.saved_at_end = False  # with a checkpoint of its last step (no record needed then)
        mesh = live.strategy.mesh
        self.spans = spans_processes(mesh.devices.flat)
        self.watcher = PreemptionWatcher(mesh=mesh, waited=self.clock.waited)
        self.same = SameBatches(self.spans)  # the processes' batches, compared at log points
        self.until = options.until  # steps, or epochs x steps_per_epoch, or None
        self.eval_steps = options.eval_every if isinstance(options.eval_every, int) else None
        # FitControl: what the callbacks may read
        self.epochs, self.steps_per_epoch = options.epochs, options.steps_per_epoch
        self.checkpoint_dir = None if checkpointer is None else checkpointer.directory
        # Epochs' ends are points only when something looks at them, on every process alike (an
        # epoch's end agrees on a stop: an epoch hook on one process, a chief's logger say, counts).
        self.watch_epochs = (options.counts_epochs or options.eval_every == "epoch" or bool(
            self.hooks["on_epoch_begin"] or self.hooks["on_epoch_end"]))
        if self.spans:
            said = exchange("the epochs' hooks", "1" if self.watch_epochs else "0", AGREE_SECONDS)
            self.watch_epochs = "1" in said
        self.epoch_no = 0  # the epoch the steps are in
        self.epoch_end: float = NEVER  # the step it ends at, once known
        self.epoch_sums: Any = None  # the host sums of its windows emitted so far
        self.begin_pending = False  # on_epoch_begin is due before the next step
        self.closed = -1  # the step of the last window closed
        # Checkpoints on a clock: the next one is due this long after the last (a log point checks).
        self.backup_seconds = options.cadence.seconds if checkpointer is not None else None
        self.saved_at = 0.0  # perf_counter of the last checkpoint (or of the start)
        self.save_request = False  # process 0 asks the others to save at the next check
        self.save_wanted = False  # a save is due on the clock and not taken yet
        self.deleted = False  # the checkpoints were deleted at the end (`delete_checkpoints`)

    # ----------------------------------------------------------------------------------- FitControl
    @property
    def step(self) -> int:
        return self.live.step

    @property
    def data_position(self) -> DataPosition:
        self.place()
        return self.live.position

    @property
    def epoch(self) -> int:
        return self.epoch_no if self.watch_epochs else self.data_position.epoch

    def stop(self) -> None:
        self.live.stop_training = True

    def save(self) -> None:
        if self.ckpt is None:
            raise ValueError("control.save() needs fit(checkpoint_dir=...): there is nowhere to "
                             "save.")
        self.save_asked, self.due = True, 0

    def skip(self, batches: int = 1) -> None:
        if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
            raise ValueError(f"control.skip(batches={batches!r}): batches must be an int >= 1.")
        self.skip_asked, self.due = self.skip_asked + batches, 0

    # ------------------------------------------------------------------------------------- the run
    def emit(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on the callbacks that override it, with the data position up to date."""
        if self.hooks[hook]:
            self.place()
            for call in self.hooks[hook]:
                call(self.owner, *args)

    def place(self) -> None:
        """Set the live state's data position after the batches consumed (lazily, not per step)."""
        if self.placed != self.batches:
            self.live.position = self.stream.position(self.batches)
            self.placed = self.batches

    def run(self) -> History:
        """The loop: steps, and at their points the logs, evaluations and checkpoints."""
        live, options, history = self.live, self.options, self.history
        clock, watcher = self.clock, self.watcher
        live.stop_training = False
        live.sums("fit")  # the windows start here
        # Several processes act on a window at the same step, and a rollback moves the data past the
        # same batches in every run of a job: windows are read READ_LAG steps after they close.
        fixed = self.spans or self.policy.action == "rollback"
        clock.open()  # heard since the clock was made; again if it serves a second run
        self.logs = Logs(live.step, self.on_log, self.rates, self.guard.observe,
                         lag=READ_LAG if fixed else None, waited=clock.waited,
                         add=self.add_sums if self.watch_epochs else None)
        if self.watch_epochs:
            spe = options.steps_per_epoch
            self.epoch_no = live.step // spe if spe else live.position.epoch
            self.stream.on_length = self.heard_length
            self.begin_pending = True
        self.source = iter(self.stream)
        self.saved_at = perf_counter()
        self.schedule(live.step)
        self.due = 0  # the first step's end: its cost
        for cb in self.callbacks:
            if isinstance(cb, Callback):
                cb.control = self
        try:
            with watcher:  # SIGTERM: a request to stop, agreed by every process
                self.emit("on_train_begin")
                self.emit("on_config", dict(self.config))
                self.begin_epoch()
                while True:  # one round, and one more after each rollback at the end
                    self.run_steps()
                    if (self.watch_epochs and not watcher.stopping and not self.stopping
                            and live.step >= self.find_epoch_end() and self.epoch_point()):
                        continue  # an epoch that ended with the data, rolled back
                    # The data ended first: on every process? (before any collective)
                    if (self.until is not None and live.step < self.until
                            and self.stream.epochs is None and not watcher.stopping):
                        data_ended(live.strategy.mesh, self.batches,
                                   self.batches + self.until - live.step)
                        history.data_ended = live.step
                    if not watcher.stopping:  # a signal since the last check
                        watcher.should_stop(final=True, stop_training=live.stop_training)
                    self.stopping = watcher.stopping
                    self.close_window()
                    self.logs.flush()
                    # rolled back at the end: train to the end again
                    if not self.handle_non_finite() or watcher.stopping:
                        break
                history.preempted, history.preempted_by = watcher.preempted, watcher.cause
                history.non_finite_steps = self.guard.total
                self.checkpoint()  # at the end (a no-op when this step is saved already)
                with self.paused("checkpoint"):  # fit returns once its last one is complete
                    self.report_saved(wait=True)
                evaluated = history.eval and history.eval[-1]["step"] == live.step
                if options.eval_data is not None and not history.preempted and not evaluated:
                    self.evaluate()
                live.sync()
                history.time = clock.totals()  # for on_train_end (and again once the fit is over)
                self.job_time()
                self.emit("on_train_end", history)
                with self.paused("checkpoint"):
                    self.saved_at_end = (self.ckpt is not None and not self.deleted
                                         and self.ckpt.latest_step() == live.step)
                self.ended = not history.preempted
        except BaseException as error:
            for call in self.hooks["on_exception"]:
                call(self.owner, error)
            raise
        finally:
            # how far this run got (a run that fails: the next one knows what it takes again)
            self.record()
            clock.close()
            self.logs.close()  # the watcher thread
            # no cycle (self -> logs -> self.on_log) keeps the run's objects alive after it
            del self.logs
            if (close := getattr(self.source, "close", None)) is not None:
                close()
            self.place()
            for cb in self.callbacks:
                if isinstance(cb, Callback) and cb.control is self:
                    cb.control = None
        history.time = clock.totals()
        self.job_time()
        return history

    def run_steps(self) -> None:
        """Steps until the live step reaches ``until`` (or the data ends, or the run stops)."""
        live, clock, logs, watcher = self.live, self.clock, self.logs, self.watcher
        step_end, until = self.hooks["on_step_end"], self.until
        one = self.options.steps_per_run == 1
        while until is None or live.step < until:
            # Cut the stream at the last batch a step will use: nothing is read, or placed, beyond
            # it. A rollback moves the step back: another cut then takes the batches for the steps
            # that are left.
            cut = self.source if until is None else itertools.islice(self.source, until - live.step)
            # Batch n + READ_AHEAD is read (and placed) before step n is dispatched: its transfer
            # overlaps the steps still running.
            self.reader = ahead(cut, READ_AHEAD) if one else cut
            ran = 0
            try:
                while True:
                    clock.phase = "input"  # 1. read the next batch (or an on-device loop's batches)
                    start = perf_counter()
                    batch = next(self.reader, _END) if one else (self.chunk() or _END)
                    read = perf_counter()
                    clock.input += read - start
                    if batch is _END:
                        clock.phase = "other"
                        break
                    clock.phase = "steps"  # 2. run the step on it
                    metrics = live.train(batch, _WHERE) if one else live.train_loop(batch)
                    clock.steps += perf_counter() - read
                    clock.phase = "other"
                    n = 1 if one else len(batch)
                    ran += n  # counted here: a rollback between steps moves the step back
                    self.batches += n
                    self.checks += 1
                    step = live.step
                    # 3. a point is due at this step (rare): it calls on_step_end too
                    if step >= self.due:
                        if self.points(step - n, step, metrics, batch):
                            continue  # rolled back: the points come again
                    else:
                        if step_end:  # 3. the callbacks that look at every step
                            self.place()
                            for call in step_end:
                                call(self.owner, step, metrics)
                            # one asked to save or skip
                            if not self.due and self.points(step - n, step, None):
                                continue
                        if logs.pending:  # 4. the logs whose values have arrived
                            logs.emit_ready(self.checks)
                            if self.guard.pending and self.handle_non_finite():
                                continue
                    # 5. stop? (a signal or stop_training; with several processes, agreed by all,
                    # with a save process 0 asked for on its clock)
                    if self.spans or watcher.requested or live.stop_training:
                        stop = watcher.should_stop(stop_training=live.stop_training,
                                                   save=self.save_request)
                        if watcher.save_agreed:  # every process saves after the next step
                            self.save_asked, self.due, self.save_wanted = True, 0, False
                        self.save_request = False
                        if stop:
                            self.stopping = True
                            return
            finally:
                if one:
                    self.reader.close()
            if not ran or until is None:  # the data ended
                return

    def chunk(self) -> list:
        """An on-device loop's batches: up to the next point or epoch end."""
        step = self.live.step
        n = self.options.run_length(step)
        if self.watch_epochs and self.find_epoch_end() > step:
            n = min(n, int(self.epoch_end - step))
        return list(itertools.islice(self.reader, n))

    def points(self, before: int, step: int, metrics: Any, batch: Any = None) -> bool:
        """What is due at ``step`` (after the steps from ``before``, which returned ``metrics`` from
        ``batch``), ``on_step_end`` unless ``metrics`` is None; True when the run rolled back."""
        options, live = self.options, self.live
        if self.cost is None or _crossed(before, step, options.log_every) or step == self.until:
            # the first step and the log points: every process's batch alike
            self.same.check(step, batch)
        if step >= self.redo:  # the step an earlier run reached: the steps up to it were lost
            self.clock.lose_redone()
            self.redo = NEVER
        if self.cost is None:  # once: the step is compiled now (measuring finds it in JAX's cache)
            self.cost = self.history.step_cost = live.step_cost(self.cost_options)
            self.emit("on_step_cost", self.cost)
        if metrics is not None:
            self.emit("on_step_end", step, metrics)
        if self.skip_asked:
            self.skip_batches()
        if _crossed(before, step, options.log_every) or step == self.until:
            self.close_window()
            if self.backup_seconds is not None and not self.save_wanted:
                self.on_the_clock()
        self.logs.emit_ready(self.checks)
        if self.handle_non_finite():
            return True
        self.report_saved()
        if _crossed(before, live.step, self.eval_steps):
            self.evaluate()
        if self.watch_epochs and live.step >= self.find_epoch_end() and self.epoch_point():
            return True
        if _crossed(before, live.step, options.cadence.steps) or self.save_asked:
            self.save_asked = False
            self.checkpoint()
        if self.local is not None and _crossed(before, live.step, options.local_checkpoint_every):
            self.place()  # the data position after this step's batches goes with it
            # the devices finish the steps dispatched: steps, not the save
            with self.clock.timing("waited"):
                jax.block_until_ready(live.state)
            with self.paused("checkpoint"):
                save_live_local(live, self.local)
        self.schedule(live.step)
        self.begin_epoch()
        return False

    def schedule(self, step: int) -> None:
        """The step of the next point after ``step``: a log window's end, an evaluation, a
        checkpoint, an epoch's end, the last step, the step an earlier run reached; every step while
        a checkpoint is in flight."""
        options = self.options
        due = min(_next(step, options.log_every), _next(step, self.eval_steps),
                  _next(step, options.cadence.steps), _next(step, options.local_checkpoint_every),
                  self.redo)
        if self.watch_epochs:
            due = min(due, self.find_epoch_end())
        if self.until is not None:
            due = min(due, self.until)
        self.due = step + 1 if self.in_flight or self.skip_asked or self.save_asked else due

    def skip_batches(self) -> None:
        """Read the batches a callback asked to skip, without a step (`FitControl.skip`)."""
        if not self.options.steps_per_epoch:
            self.epoch_end = NEVER  # a pass over the data now ends fewer steps ahead
        while self.skip_asked:
            self.skip_asked -= 1
            if next(self.reader, _END) is _END:  # the data (or the run's cut of it) ended
                self.skip_asked = 0
                return
            self.batches += 1

    # --------------------------------------------------------------------------------------- epochs
    def find_epoch_end(self) -> float:
        """The step the current epoch ends at (NEVER while a pass's length is unknown)."""
        if self.epoch_end is NEVER:
            spe = self.options.steps_per_epoch
            if spe:
                self.epoch_end = (self.epoch_no + 1) * spe
            else:
                end = self.stream.epoch_end(self.epoch_no)
                if end is not None:
                    self.epoch_end = self.live.step + end - self.batches
        return self.epoch_end

    def planned(self) -> int | None:
        """The step the run trains to, as far as it is known now: ``until``, or the end of its last
        pass over the data when the current one's length is known (the passes left taken as long as
        it)."""
        data_epochs, spe = self.options.data_epochs, self.options.steps_per_epoch
        if self.until is not None or data_epochs is None or spe or not self.watch_epochs:
            return self.until
        end = self.find_epoch_end()
        length = self.stream.epoch_end(self.epoch_no)
        # (the passes before the start: minus the start's index)
        before = self.stream.epoch_end(self.epoch_no - 1)
        if end is NEVER or length is None or before is None:
            return None
        return int(end) + (data_epochs - self.epoch_no - 1) * (length - before)

    def heard_length(self, epoch: int) -> None:
        """The stream knows pass ``epoch``'s length now: a point at the next step places its end."""
        if epoch == self.epoch_no and self.epoch_end is NEVER:
            self.due = 0

    def add_sums(self, sums: Any) -> None:
        """A log window's host sums, emitted: added to its epoch's."""
        self.epoch_sums = sums if self.epoch_sums is None else self.epoch_sums.then(sums)

    def epoch_point(self) -> bool:
        """The current epoch's last step is taken: close its window, evaluate (``eval_every=
        "epoch"``), end it (`end_epoch`); True when the run rolled back instead."""
        if self.closed != self.live.step:
            self.close_window()  # the epoch's last window ends with it
        if self.options.eval_every == "epoch":
            self.evaluate()
        return self.end_epoch()

    def end_epoch(self) -> bool:
        """The end of the current epoch (its last step is taken): its metrics read,
        ``on_epoch_end``, the checkpoint the cadence asks for, a stop asked for there settled on
        every process; True when the run rolled back instead (a non-finite step in the epoch's last
        window)."""
        live = self.live
        if self.closed != live.step:
            self.close_window()
        self.logs.flush()  # the epoch's last window: the one wait for the devices per epoch
        if self.handle_non_finite():
            return True
        epoch, sums = self.epoch_no, self.epoch_sums
        logs = {} if sums is None else means(sums)
        last = self.history.eval[-1] if self.history.eval else None
        if last is not None and last["step"] == live.step:
            logs.update({f"val_{name}": value for name, value in last.items() if name != "step"})
        self.history.epochs.append({"epoch": epoch, "step": live.step, **logs})
        self.emit("on_epoch_end", epoch, logs)
        if self.options.cadence.epoch:
            self.save_asked = True
        self.epoch_no, self.epoch_end = epoch + 1, NEVER
        self.epoch_sums, self.begin_pending = None, True
        # a stop asked for at the epoch's end
        if self.spans or self.watcher.requested or live.stop_training:
            # takes effect now: every process agrees at this step (blocking, once per epoch), on a
            # save asked for on the clock too
            self.watcher.should_stop(final=self.spans, stop_training=live.stop_training,
                                     save=self.save_request)
            self.save_request = False
            if self.watcher.save_agreed:
                self.save_asked, self.save_wanted = True, False
        return False

    def begin_epoch(self) -> None:
        """``on_epoch_begin`` of the next step's epoch, when due and the run goes on."""
        if not self.begin_pending or self.watcher.stopping:
            return
        data_epochs, step = self.options.data_epochs, self.live.step
        if ((self.until is not None and step >= self.until)
                or (data_epochs is not None and self.epoch_no >= data_epochs)):
            return  # the run ends here
        self.begin_pending = False
        self.emit("on_epoch_begin", self.epoch_no)

    def delete_checkpoints(self) -> None:
        """Delete every checkpoint of the fit's directory and its records of the run (a finished
        job: a run again starts from scratch; `jaxdist.training.DeleteBackups`). Called from
        ``on_train_end``, on every process."""
        if self.ckpt is None:
            return
        with self.paused("checkpoint"):
            self.report_saved(wait=True)
            for step in self.ckpt.all_steps():
                self.ckpt.delete(step)
        self.deleted = True

    # ----------------------------------------------------------------------------------------- logs
    def on_log(self, step: int, logs: dict) -> None:
        epoch = None
        # the snapshot of this window (windows without steps are not logged: skipped)
        while self.windows:
            closed, snapshot, epoch = self.windows.popleft()
            if closed == step:
                logs.update(window_seconds(self.logged, snapshot))
                self.logged = snapshot
                break
        if self.options.counts_epochs and epoch is not None:
            logs = {"epoch": epoch, **logs}
        self.history.train.append({"step": step, **logs})
        self.emit("on_log", step, logs)

    def close_window(self) -> None:
        if self.redo is not NEVER:  # every step so far was taken before, by an earlier run
            self.clock.lose_redone()
        now = perf_counter()
        self.closed = self.live.step
        self.windows.append((self.live.step, (now, self.clock.gross()), self.epoch_no))
        if self.recorder and now - self.recorded >= PROGRESS_SECONDS:
            self.record()
            self.recorded = now
        self.logs.close_window(self.live.step, self.live.sums("fit"), self.checks)

    def on_the_clock(self) -> None:
        """At a log point: is a checkpoint due on the clock? One process saves now; with several,
        process 0's clock decides, and asks every process to save after the same step (through the
        stop agreement)."""
        if perf_counter() - self.saved_at < self.backup_seconds:
            return
        if not self.spans:
            self.save_asked = True
        elif jax.process_index() == 0:
            self.save_request = self.save_wanted = True

    def rates(self, steps: int, seconds: float, loss_weight: float | None) -> dict:
        return {} if self.cost is None else self.cost.rates(steps, seconds, loss_weight)

    # --------------------------------------------------------------------- evaluations, checkpoints
    def paused(self, part: str) -> Any:
        """The loop leaves its steps for ``part`` (``"evaluation"`` or ``"checkpoint"``): timed as
        such, and said to the callbacks (``on_pause`` / ``on_resume``: the watchdog looks away)."""
        return _Paused(self, part)

    def evaluate(self) -> None:
        self.logs.flush()
        if self.handle_non_finite():  # rolled back: this evaluation point comes again, at its step
            return
        with self.paused("evaluation"):
            metrics = self.live.evaluate(self.options.eval_data)
        self.history.eval.append({"step": self.live.step, **metrics})
        self.emit("on_eval_end", self.live.step, metrics)

    def checkpoint(self) -> None:
        live, ckpt = self.live, self.ckpt
        if ckpt is None:
            return
        with self.paused("checkpoint"):  # waits for an asynchronous save in flight
            latest = ckpt.latest_step()
        if live.step in (latest, self.refused):
            return
        self.logs.flush()
        self.check_finite()  # before every checkpoint: the open window's flags too
        with self.paused("checkpoint"):
            if ckpt.latest_step() == live.step:  # rolled back to a checkpoint
                return
            # the save in flight first (the next save would wait for it anyway)
            self.report_saved(wait=True)
            self.place()
            try:
                # a no-op when this step is being written; refuses a non-finite state
                save_live(live, ckpt, None)
                self.clock.saved(live.step)
                self.in_flight = True
                self.saved_at, self.save_wanted = perf_counter(), False
            except NonFiniteError as error:
                if self.policy.action != "continue":
                    raise
                self.refused = live.step
                warnings.warn(f"{error} (on_non_finite='continue': training goes on)",
                              RuntimeWarning, stacklevel=4)
            # a synchronous save: now; an asynchronous one: at a later step end, once complete
            self.report_saved()

    def report_saved(self, wait: bool = False) -> None:
        """``on_checkpoint`` for the saves complete by now; raises for one that failed."""
        if self.ckpt is not None and (self.in_flight or wait):
            done = self.ckpt.poll(wait)
            for step, path in done:
                self.history.checkpoints.append(path)
                self.emit("on_checkpoint", step, path)
            if done or wait:
                self.in_flight = False

    # ----------------------------------------------------------------------------- non-finite steps
    def check_finite(self) -> None:
        """Read the open window's flags (a checkpoint is next); if any step in it was not finite,
        close it, then act on what was found."""
        with self.clock.timing("waited"):  # the devices finish the steps dispatched
            sums = self.live.sums("fit", pop=False).to_host()
        if sums.non_finite.count:
            self.close_window()
            self.logs.flush()
        self.handle_non_finite()

    def handle_non_finite(self) -> bool:
        """Act on the non-finite steps found (at a point every process reaches at the same step);
        True when the run rolled back."""
        guard, policy = self.guard, self.policy
        if not guard.pending:
            return False
        self.history.non_finite_steps = guard.total
        if policy.action == "continue":
            if not self.warned:
                self.warned = True
                warnings.warn(f"the loss or gradients of step {guard.first} were not finite; "
                              "on_non_finite='continue' trains on (non-finite states are not "
                              "saved)", RuntimeWarning, stacklevel=4)
            guard.acted()
            return False
        if policy.action == "skip":
            if guard.too_many_in_a_row:
                raise self.failure(f"{guard.longest_run} steps in a row were not finite "
                                   "(on_non_finite='skip' stops at max_consecutive_skips="
                                   f"{policy.max_consecutive_skips}: the run has diverged)")
            guard.acted()  # skipped on the devices; the logs count them
            return False
        if policy.action == "rollback":
            if self.rollbacks >= policy.max_rollbacks:
                raise self.failure(
                    f"the run stopped after {self.rollbacks} "
                    f"rollback{'s' if self.rollbacks != 1 else ''} (on_non_finite='rollback' rolls "
                    f"back at most max_rollbacks={policy.max_rollbacks} times)")
            self.roll_back()
            return True
        raise self.failure("the run stopped (on_non_finite='stop')")

    def failure(self, what: str) -> NonFiniteError:
        # waits for the save in flight: complete
        latest = None if self.ckpt is None else self.ckpt.latest_step()
        return self.guard.error(what, latest, None if self.ckpt is None else self.ckpt.directory)

    def roll_back(self) -> None:
        """Restore the newest checkpoint before the first bad step; the data goes on from here."""
        live, ckpt, bad = self.live, self.ckpt, self.guard.first
        self.close_window()
        self.logs.flush()  # every step so far is logged (their flags belong to this rollback)
        with self.paused("checkpoint"):
            self.report_saved(wait=True)
            if not (good := [] if ckpt is None else [s for s in ckpt.all_steps() if s < bad]):
                raise self.failure("there is no checkpoint before it to roll back to, so the run "
                                   "stopped")
            restore_live(live, ckpt, good[-1], None)
        self.clock.rolled_back(good[-1])  # the steps since that checkpoint: lost
        self.rollbacks += 1
        live.position = self.stream.position(self.batches)  # past the bad batches
        self.placed = self.batches
        if self.watch_epochs:  # the step went back: where the epoch ends, in steps, again
            self.epoch_end = NEVER
            if self.options.steps_per_epoch:
                self.epoch_no = live.step // self.options.steps_per_epoch
        self.history.rollbacks.append({"step": bad, "restored": good[-1],
                                       "data_position": live.position})
        live.sums("fit")
        self.logs.restart(live.step)
        self.guard.restart(live.step)
        self.schedule(live.step)
        warnings.warn(
            f"the loss or gradients of step {bad} were not finite: rolled back to checkpoint "
            f"{good[-1]} (rollback {self.rollbacks} of at most {self.policy.max_rollbacks}); "
            "training goes on with the data after the batches read so far, skipping them",
            RuntimeWarning, stacklevel=5)

    # -------------------------------------------------------------------------------------- records
    def record(self) -> None:
        """Record the step reached in the checkpoint directory (process 0; never an error); once the
        fit has ended with a checkpoint of that step, which says as much, remove the record."""
        if self.recorder:
            directory, finished = self.ckpt.directory, self.saved_at_end or self.deleted
            if finished:
                clear_progress(directory)
            else:
                write_progress(directory, self.live.step)
            if finished and self.ended:  # the job ended here: a later fit is a new one
                self.job.clear()
            else:
                self.job.record(self.clock.totals(), ended=self.ended)

    def job_time(self) -> None:
        """``History.job_time`` (process 0, with a checkpoint directory): this run's and before."""
        if self.job is not None:
            self.history.job_time, self.history.job_runs = self.job.totals(self.history.time)


def _crossed(before: int, after: int, every: int | None) -> bool:
    return bool(every) and after // every > before // every


class _Paused:
    """`FitLoop.paused`: the clock's part, and ``on_pause`` / ``on_resume`` around it."""

    def __init__(self, loop: FitLoop, part: str):
        self.loop, self.part, self.timing = loop, part, loop.clock.timing(part)

    def __enter__(self) -> None:
        self.loop.emit("on_pause", self.part)
        self.timing.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.timing.__exit__(*exc)
        finally:
            self.loop.emit("on_resume", self.part)
