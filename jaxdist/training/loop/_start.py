"""``Trainer.fit`` up to its loop: the arguments checked (and, with several processes, agreed), the checkpoint
directory claimed, the state restored (``restore_step``, a resume) or built from the first batch, the writers
and the stream set up; then `run_fit` (the loop, `jaxdist.training.loop._fit`).

`fit_live` takes the trainer (the `FitTarget` the loop drives) and its `LiveState` (the state, step and data
position `jaxdist.training.checkpoints` restores into).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax

from jaxdist.job import agree_on_fit, failing
from jaxdist.training.callbacks import Callback, CSVLogger, History, Progress, TensorBoardLogger
from jaxdist.training.checkpoints import Checkpointer, check_directory, read_progress, restore_live, roll_back
from jaxdist.training.data import BatchStream, global_rows, say_batch_change
from jaxdist.training.loop._config import run_config
from jaxdist.training.loop._fit import FitOptions, FitTarget, run_fit
from jaxdist.training.step import LiveState, NonFinitePolicy, check_int

__all__ = ["fit_live"]


def fit_live(
    trainer: FitTarget,
    live: LiveState,
    steps_per_run: int,
    train_data: Any,
    steps: int | None,
    *,
    epochs: int | None,
    eval_data: Any,
    eval_every: int | None,
    checkpoint_dir: str | os.PathLike | None,
    checkpoint_every: int | None,
    keep_checkpoints: int,
    async_checkpoints: bool,
    log_every: int,
    log_dir: str | os.PathLike | None,
    callbacks: Iterable[Callback],
    verbose: str | int,
    on_preemption: str,
    restore_step: int | None,
    step_timeout: float | None,
    on_non_finite: str | NonFinitePolicy,
    straggler_ratio: float | None,
    profile_steps: tuple[int, int] | None,
    profile_processes: int | Sequence[int] | str,
) -> History:
    """``Trainer.fit`` (see it for every argument, what it returns and raises) on ``trainer`` and its ``live``
    state, with on-device loops of ``steps_per_run`` steps."""
    if steps is None and epochs is None:
        raise ValueError("fit needs steps=N (train until step N) or epochs=N (N passes over train_data).")
    check_int(epochs, "epochs", 0)
    options = FitOptions(steps=steps, eval_data=eval_data, eval_every=eval_every, checkpoint_every=checkpoint_every,
                         log_every=log_every, step_timeout=step_timeout, straggler_ratio=straggler_ratio,
                         log_dir=log_dir, profile_steps=profile_steps,
                         profile_processes=profile_processes)  # checks them
    if on_preemption not in ("exit", "return"):
        raise ValueError(f"on_preemption={on_preemption!r} must be 'exit' or 'return'.")
    check_int(restore_step, "restore_step", 0)
    policy = NonFinitePolicy.of(on_non_finite)
    if policy.action == "rollback" and checkpoint_dir is None:
        raise ValueError(
            "on_non_finite='rollback' needs checkpoint_dir=... (it restores the last finite checkpoint): pass "
            "one (with checkpoint_every=...), or use on_non_finite='skip' or 'stop'."
        )
    if restore_step is not None and checkpoint_dir is None:
        raise ValueError(
            f"restore_step={restore_step} needs checkpoint_dir=... (the directory holding that checkpoint)."
        )
    if checkpoint_dir is not None:  # storage trouble before any step, not at the first save
        check_directory(checkpoint_dir, "checkpoint_dir", create=jax.process_index() == 0)
    stream = BatchStream(train_data, None, epochs, live.batches)  # the first batch, checked, for the state
    sample = None
    if live.state is None or live.unchecked is not None:
        sample = stream.peek(live.position.epoch)  # checked; a grain iterator is not advanced
    settings = {"steps": steps, "epochs": epochs, "checkpoint_every": checkpoint_every, "eval_every": eval_every,
                "log_every": log_every, "restore_step": restore_step, "keep_checkpoints": keep_checkpoints,
                "checkpoint_dir": checkpoint_dir is not None, "on_non_finite": policy.action}
    mesh = live.strategy.mesh
    ckpt = None

    def newest() -> int | None:  # read by the job's beats (another thread): never waits
        return None if ckpt is None else ckpt.newest_written

    with failing(mesh, lambda: live.step, newest, checkpoint_dir):  # a process that fails ends the job, saying why
        agree_on_fit(mesh, settings, checkpoint_dir)  # before anything collective
        ckpt = None if checkpoint_dir is None else Checkpointer(checkpoint_dir, keep_checkpoints,
                                                                 async_save=async_checkpoints)
        try:
            with options.clock.timing("checkpoint"):  # the clock started with the options: the restore is checkpoint
                resumed, reached = _restore(live, ckpt, restore_step, sample, checkpoint_dir)
            if live.state is None or live.unchecked is not None:
                live.init(sample)
            if live.position_unknown and not isinstance(train_data, Iterator):
                _say_start(live)
            callbacks = _writers(live, list(callbacks), steps, verbose, log_dir, checkpoint_dir if resumed else None)
            config = run_config(trainer, live, {**settings, "checkpoint_dir": checkpoint_dir,
                                                "async_checkpoints": async_checkpoints, "step_timeout": step_timeout,
                                                "profile_steps": profile_steps})
            options = dataclasses.replace(options, checkpointer=ckpt, callbacks=tuple(callbacks),
                                          steps_per_run=steps_per_run, mesh=mesh, on_non_finite=policy,
                                          reached=reached, config=config)
            feed = live.feed if steps_per_run == 1 else live.loop_feed
            live.steps.skip_non_finite = policy.action == "skip"  # a step variant that skips on the devices
            history = run_fit(trainer, BatchStream(stream.data, live.position, epochs, feed), options)
        finally:
            live.steps.skip_non_finite = False
            if ckpt is not None:
                ckpt.close()
    if history.data_ended is not None:  # said on every process (each one's data ended at the same batch)
        warnings.warn(
            f"fit: train_data ended at step {history.data_ended} of steps={steps}: the run stopped there "
            f"(history.data_ended == {history.data_ended}). An iterator is read once: pass a list or a "
            "data_fn(epoch) (read again each epoch), an iterator with enough batches, or fewer steps.",
            UserWarning, stacklevel=3)
    if history.preempted and on_preemption == "exit":
        raise SystemExit(0)
    return history


def _restore(live: LiveState, ckpt: Checkpointer | None, restore_step: int | None, sample: Any,
             checkpoint_dir: Any) -> tuple[bool, int]:
    """Claim the directory, then go back to ``restore_step`` or resume from its latest checkpoint when it is
    ahead of ``live``; whether the run resumed from a checkpoint, and the step the runs before it reached
    there (`FitOptions.reached`: the progress record of the last one, a crash after its last checkpoint, or the
    newest checkpoint, which ``restore_step`` goes back from; 0 for a new directory)."""
    if ckpt is None:
        live.loaded = False
        return False, 0
    ckpt.claim()  # one writer per directory: a second live run is refused here, before any step
    ckpt.check_writer()  # another writer's checkpoints: the orbax that reads them, never written over
    latest = ckpt.latest_step() or 0
    reached = max(latest, read_progress(ckpt.directory))
    resumed = restore_step is not None or latest > live.step
    if restore_step is not None:
        roll_back(live, ckpt, restore_step, sample)
    elif latest > live.step:
        if live.loaded:  # the state load_state gave is about to be replaced: say so
            warnings.warn(
                f"fit resumes from checkpoint {latest} of checkpoint_dir={str(checkpoint_dir)!r}, which "
                f"replaces the state load_state gave (step {live.step}); to train on from that state, pass a "
                "checkpoint_dir without later checkpoints (or restore_step= to choose one).",
                UserWarning, stacklevel=4)
        restore_live(live, ckpt, None, sample, "restore_step")
    if resumed:  # the position counts batches: another batch size moves it
        say_batch_change(ckpt.meta(live.step), global_rows(live.batches.signature), live.position)
    live.loaded = False
    return resumed, reached


def _writers(live: LiveState, callbacks: list, steps: int | None, verbose: Any, log_dir: Any,
             resumed_from: Any) -> list:
    """The callbacks with the progress display and the log writers ``verbose`` and ``log_dir`` ask for (on the
    chief, process 0, which alone shows and writes logs)."""
    writer = live.strategy.should_save_summary
    if verbose and writer:  # 1 / True: "auto"; 2: "auto" with the step's whole cost line
        callbacks.insert(0, Progress(steps, "auto" if verbose in (True, 1, 2) else verbose,
                                     details=verbose == 2, resumed_from=resumed_from))
    if log_dir is not None and writer:
        callbacks += [CSVLogger(os.path.join(log_dir, "metrics.csv")), TensorBoardLogger(log_dir)]
    return callbacks


def _say_start(live: LiveState) -> None:
    """After `load_state`: say that ``fit`` reads a list (or ``data_fn``) from its first batch, and how to
    say otherwise (once: setting the data position says where, and ends the warning)."""
    live.position_unknown = False
    warnings.warn(
        f"fit continues the run load_state loaded at step {live.step} from batch 0 of epoch 0 of train_data "
        "(where that run's data stopped is unknown). If train_data starts with the batches that run trained "
        f"on, set trainer.data_position = jd.training.DataPosition(epoch=0, index={live.step}) before fit to "
        "skip them; if it starts with the batches that come next, set trainer.data_position = "
        "jd.training.DataPosition() to say so. Either silences this; an iterator is read on from where it is.",
        UserWarning,
        stacklevel=4,
    )
