"""``Trainer.fit`` up to its loop: the arguments checked (and agreed across processes), the
checkpoint directory claimed, the state restored or built, the callbacks and stream set up; then
the loop (`jaxdist.training.loop._fit.FitLoop`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import jax

from jaxdist.costs.step import CostOptions
from jaxdist.job import agree_on_fit, failing, spans_processes
from jaxdist.training.callbacks import Callback, CSVLogger, History, Progress, TensorBoardLogger
from jaxdist.training.checkpoints import (
    Checkpointer,
    LocalCheckpointer,
    check_directory,
    read_progress,
    restore_live,
    restore_live_local,
    roll_back,
)
from jaxdist.training.data import BatchStream, global_rows, say_batch_change
from jaxdist.training.loop._config import run_config
from jaxdist.training.loop._fit import FitLoop
from jaxdist.training.loop._hosts import HostTimes
from jaxdist.training.loop._options import FitOptions
from jaxdist.training.loop._profile import StepProfile
from jaxdist.training.loop._time import FitClock
from jaxdist.training.loop._watchdog import Watchdog
from jaxdist.training.step import LiveState, with_ema

__all__ = ["features", "fit"]


def fit(live: LiveState, train_data: Any, options: FitOptions, *, owner: Any = None,
        cost: CostOptions | None = None, settings: Mapping[str, Any] | None = None) -> History:
    """``Trainer.fit`` (see it for what it returns and raises) on ``live``, as ``options`` say;
    ``owner`` is what the callbacks receive as their ``trainer``, ``cost`` the trainer's
    `CostOptions`, ``settings`` its settings for the run's configuration (`run_config`)."""
    clock = FitClock()  # first: building the state, the restore and the setup count in History.time
    if options.steps is None and options.epochs is None:
        if options.steps_per_epoch is not None:
            spe = options.steps_per_epoch
            raise ValueError(f"steps_per_epoch={spe} needs epochs=N (N epochs of {spe} steps) or "
                             "steps=N (train until step N).")
        raise ValueError("fit needs steps=N (train until step N) or epochs=N (N passes over "
                         "train_data).")
    checkpoint_dir = options.checkpoint_dir
    if checkpoint_dir is not None:  # storage trouble before any step, not at the first save
        check_directory(checkpoint_dir, "checkpoint_dir", create=jax.process_index() == 0)
    stream = BatchStream(train_data, None, options.data_epochs, live.batches)
    sample = None
    if live.state is None or live.unchecked is not None:
        sample = stream.peek(live.position.epoch)  # checked; a grain iterator is not advanced
    agreed = {name: getattr(options, name) for name in _AGREED}
    agreed.update(checkpoint_dir=checkpoint_dir is not None,
                  on_non_finite=options.on_non_finite.action)
    mesh = live.strategy.mesh
    ckpt = None

    def newest() -> int | None:  # read by the job's beats (another thread): never waits
        return None if ckpt is None else ckpt.newest_written

    # a process that fails ends the job, saying why
    with failing(mesh, lambda: live.step, newest, checkpoint_dir):
        agree_on_fit(mesh, agreed, checkpoint_dir)  # before anything collective
        ckpt = None if checkpoint_dir is None else Checkpointer(
            checkpoint_dir, options.keep_checkpoints, async_save=options.async_checkpoints)
        local = None if options.local_checkpoint_dir is None else LocalCheckpointer(
            options.local_checkpoint_dir, persistent=checkpoint_dir)
        try:
            with clock.timing("checkpoint"):  # the restore is checkpoint time
                resumed, reached = _restore(live, ckpt, options.restore_step, sample,
                                            checkpoint_dir, local)
            if live.state is None or live.unchecked is not None:
                live.init(sample)
            if live.position_unknown and not isinstance(train_data, Iterator):
                _say_start(live)
            history = History()
            chosen = {name: getattr(options, name) for name in _CONFIG}
            config = run_config(settings or {}, live,
                                chosen | {"on_non_finite": options.on_non_finite.action})
            display, writers = _writers(live, options, checkpoint_dir if resumed else None, stream)
            callbacks = [*features(options, history, spans_processes(mesh.devices.flat)), *display,
                         *options.callbacks, *writers]
            feed = live.feed if options.steps_per_run == 1 else live.loop_feed
            live.steps.skip_non_finite = options.on_non_finite.action == "skip"  # on the devices
            loop = FitLoop(live, BatchStream(stream.data, live.position, options.data_epochs, feed),
                           options, callbacks=callbacks, owner=owner, checkpointer=ckpt,
                           clock=clock, reached=reached, config=config, cost=cost,
                           history=history, local=local)
            history = loop.run()
        finally:
            live.steps.skip_non_finite = False
            if local is not None:
                local.close()
            if ckpt is not None:
                ckpt.close()
    # said on every process (each one's data ended at the same batch)
    if history.data_ended is not None:
        target = (f"steps={options.steps}" if options.until == options.steps
                  else f"{options.until} steps")
        warnings.warn(
            f"fit: train_data ended at step {history.data_ended} of {target}: the run stopped "
            f"there (history.data_ended == {history.data_ended}). An iterator is read once: pass a "
            "list or a data_fn(epoch) (read again each epoch), an iterator with enough batches, or "
            "fewer steps.",
            UserWarning, stacklevel=3)
    if history.preempted and options.on_preemption == "exit":
        raise SystemExit(0)
    return history


def features(options: FitOptions, history: History, spans: bool) -> list[Callback]:
    """The callbacks that run the operations features ``options`` switch on (called before any
    other): `Watchdog` (``step_timeout``), `StepProfile` (``profile_steps``) and `HostTimes`
    (``straggler_ratio``; it keeps ``history.processes`` either way)."""
    out: list[Callback] = []
    if options.step_timeout is not None:
        out.append(Watchdog(options.step_timeout))
    profile = StepProfile.of(options.profile_steps, options.profile_processes, options.log_dir,
                             options.run_length)
    if profile is not None:
        out.append(profile)
    out.append(HostTimes(spans=spans, ratio=options.straggler_ratio, rows=history.processes))
    return out


_AGREED = ("steps", "epochs", "steps_per_epoch", "checkpoint_every", "eval_every", "log_every",
           "restore_step", "keep_checkpoints", "local_checkpoint_every")
"""The options every process of a job must give alike (`agree_on_fit`), with whether there is a
checkpoint directory and the non-finite policy's action."""

_CONFIG = ("steps", "epochs", "steps_per_epoch", "log_every", "eval_every", "checkpoint_every",
           "keep_checkpoints", "async_checkpoints", "checkpoint_dir", "restore_step",
           "step_timeout", "profile_steps")
"""The options the run's configuration keeps (`run_config`)."""


def _restore(live: LiveState, ckpt: Checkpointer | None, restore_step: int | None, sample: Any,
             checkpoint_dir: Any, local: LocalCheckpointer | None = None) -> tuple[bool, int]:
    """Claim the directory, then go back to ``restore_step`` or resume from its latest checkpoint
    when it is ahead of ``live``; whether the run resumed, and the step the runs before it reached
    there (their progress record or newest checkpoint; 0 for a new directory)."""
    if ckpt is None:
        live.loaded = False
        return False, 0
    ckpt.claim()  # one writer per directory: a second live run is refused here, before any step
    ckpt.check_writer()  # another writer's checkpoints: never written over
    latest = ckpt.latest_step() or 0
    reached = max(latest, read_progress(ckpt.directory))
    resumed = restore_step is not None or latest > live.step
    # the local tier first (every process, collectively), when its newest step is not older
    from_local = (local is not None and restore_step is None
                  and _restore_local(live, local, latest, sample))
    if from_local:
        resumed, reached = True, max(reached, live.step)
    elif restore_step is not None:
        roll_back(live, ckpt, restore_step, sample)
    elif latest > live.step:
        if live.loaded:  # the state load_state gave is about to be replaced: say so
            warnings.warn(
                f"fit resumes from checkpoint {latest} of checkpoint_dir={str(checkpoint_dir)!r}, "
                f"which replaces the state load_state gave (step {live.step}); to train on from "
                "that state, pass a checkpoint_dir without later checkpoints (or restore_step= to "
                "choose one).", UserWarning, stacklevel=4)
        restore_live(live, ckpt, None, sample, "restore_step")
    if resumed and not from_local:  # the position counts batches: another batch size moves it
        say_batch_change(ckpt.meta(live.step), global_rows(live.batches.signature), live.position)
    live.loaded = False
    return resumed, reached


def _restore_local(live: LiveState, local: LocalCheckpointer, latest: int, sample: Any) -> bool:
    """Whether the local tier restored ``live`` (`restore_live_local`)."""
    if live.state is None and sample is None:
        return False
    target = live.state if live.state is not None else with_ema(live.target(sample), live.ema_decay)
    before = live.step
    decision = restore_live_local(live, local, latest or None, target)
    return decision.step is not None and live.step > before


def _writers(live: LiveState, options: FitOptions, resumed_from: Any,
             stream: BatchStream) -> tuple[list, list]:
    """The progress display and the log writers ``verbose`` and ``log_dir`` ask for (on process 0
    only): the display goes before the user's callbacks, the writers after."""
    writer, verbose, log_dir = live.strategy.should_save_summary, options.verbose, options.log_dir
    display, writers = [], []
    if verbose and writer:  # 1 / True: "auto"; 2: "auto" with the step's whole cost line
        mode = "auto" if verbose in (True, 1, 2) else verbose
        display.append(Progress(_total(live, options, stream), mode, details=verbose == 2,
                                resumed_from=resumed_from, epochs=options.epochs,
                                show_epochs=options.counts_epochs,
                                checkpoint_dir=options.checkpoint_dir,
                                cadence=options.cadence.describe(),
                                default=options.cadence.default))
    if log_dir is not None and writer:
        writers += [CSVLogger(os.path.join(log_dir, "metrics.csv")), TensorBoardLogger(log_dir)]
    return display, writers


def _total(live: LiveState, options: FitOptions, stream: BatchStream) -> int | None:
    """The step the run trains to, where it is known before it starts: ``until``, or ``epochs``
    passes over data of a known length (a list) from the data position."""
    total, length = options.until, stream.length
    if options.data_epochs is not None and length:
        position = live.position
        by_epochs = live.step + (options.data_epochs - position.epoch) * length - position.index
        total = by_epochs if total is None else min(total, by_epochs)
    return total


def _say_start(live: LiveState) -> None:
    """After `load_state`: say that ``fit`` reads a list (or ``data_fn``) from its first batch, and
    how to say otherwise (once: setting the data position says where, and ends the warning)."""
    live.position_unknown = False
    warnings.warn(
        f"fit continues the run load_state loaded at step {live.step} from batch 0 of epoch 0 of "
        "train_data (where that run's data stopped is unknown). If train_data starts with the "
        "batches that run trained on, set trainer.data_position = "
        f"jd.training.DataPosition(epoch=0, index={live.step}) before fit to skip them; if it "
        "starts with the batches that come next, set trainer.data_position = "
        "jd.training.DataPosition() to say so. Either silences this; an iterator is read on from "
        "where it is.", UserWarning, stacklevel=4)
