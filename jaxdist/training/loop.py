"""The fit loop: steps, log points, evaluations, checkpoints, preemption and callbacks (``Trainer.fit``'s body).

``Trainer.fit`` checks its arguments, restores or builds the state, and hands the loop a `BatchStream` and a
`FitOptions`. The loop drives the trainer only through its public surface: ``train_on_batch`` (one compiled
step per batch, batches placed ahead by ``strategy.experimental_distribute_dataset``'s prefetch thread) or,
with ``steps_per_run > 1``, ``train_on_batches`` (one compiled on-device loop,
``strategy.run_steps_on_dataset``, per ``steps_per_run`` batches); ``step``, ``data_position`` and
``stop_training``; ``evaluate``, ``save`` and ``sync_model``.

Two things keep it from slowing the steps down:

* Log points never wait for the devices. At a log point the window's metrics (device scalars) start their
  copies to the host and the loop goes on dispatching steps; the log is emitted (``history.train``,
  ``on_log``) at the first step end at which they have arrived, and at the latest before the next
  evaluation, checkpoint or the end of ``fit``. So a log comes a step or two after the step it describes,
  with that step's number.
* The loop reads only the batches it trains on: the stream is cut at the step ``fit`` trains to, so the
  prefetch thread neither places batches no step uses nor has to be stopped mid-read.

The data position is the count of batches the steps consumed (never what the prefetcher read ahead). Every
log is the mean of each metric over the steps since the previous log point, whichever way they ran: an
on-device loop returns the metrics of each of its steps, so the logs of ``steps_per_run > 1`` are the
logs of the same training run one step at a time, at the same log points (those inside a loop are emitted
after it). Evaluations and checkpoints due inside an on-device loop happen at its end.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from jaxdist.training.callbacks import Callback, History
from jaxdist.training.checkpoint import Checkpointer
from jaxdist.training.data import BatchStream
from jaxdist.training.preemption import PreemptionWatcher

__all__ = ["FitOptions", "check_int", "run_fit"]


def check_int(value: Any, name: str, minimum: int, allow_none: bool = True) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is an int >= ``minimum`` (or None when allowed).

    Example:
        >>> check_int(None, "eval_every", 1)
        >>> check_int(0, "log_every", 1, allow_none=False)
        Traceback (most recent call last):
        ValueError: log_every=0 must be an int >= 1.
    """
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}{' or None' if allow_none else ''}.")


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

    Raises:
        ValueError: for out-of-range numbers, ``eval_every`` without ``eval_data``, or ``eval_data`` given as
            an iterator (it would be read up by the first evaluation).

    Example:
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

    def __post_init__(self) -> None:
        check_int(self.steps, "steps", 0)
        for name in ("eval_every", "checkpoint_every"):
            check_int(getattr(self, name), name, 1)
        check_int(self.log_every, "log_every", 1, allow_none=False)
        if self.eval_every is not None and self.eval_data is None:
            raise ValueError(f"eval_every={self.eval_every} needs eval_data=... to evaluate on.")
        data = self.eval_data
        if data is not None and isinstance(data, Iterable) and iter(data) is data:
            raise ValueError(
                "eval_data is an iterator, which can be read only once: pass a list of batches or a function "
                "returning a fresh iterable."
            )


def _crossed(before: int, after: int, every: int | None) -> bool:
    return bool(every) and after // every > before // every


class _Logs:
    """The steps since the last log point, and closed log windows whose values are still on their way to the
    host. An entry is ``(metrics, base, lo, hi)``: the metrics of steps ``base+1 .. base+n`` (scalars for one
    step, arrays of shape ``(n,)`` for an on-device loop), of which steps ``lo+1 .. hi`` belong to the window
    (a log point inside an on-device loop splits its entry in two)."""

    def __init__(self, start_step: int, on_log: Callable[[int, dict], None]):
        self._window: list[tuple[Mapping[str, Any], int, int, int]] = []
        self._pending: collections.deque = collections.deque()
        self._on_log = on_log
        self._last = (start_step, time.perf_counter())

    def add(self, metrics: Mapping[str, Any], before: int, after: int) -> None:
        """Record the metrics of steps ``before+1 .. after``."""
        self._window.append((metrics, before, before, after))

    def close_window(self, step: int) -> None:
        """End the window at ``step`` (a step already recorded) and start copying its values to the host."""
        window = [(m, base, lo, min(hi, step)) for m, base, lo, hi in self._window if lo < step]
        self._window = [(m, base, max(lo, step), hi) for m, base, lo, hi in self._window if hi > step]
        if not window:
            return
        for metrics, *_ in window:
            for value in metrics.values():
                copy = getattr(value, "copy_to_host_async", None)
                if copy is not None:
                    copy()
        self._pending.append((step, window))

    def emit_ready(self) -> None:
        """Emit the closed windows whose values have arrived, in order (never waits for the devices)."""
        ready = 0
        while ready < len(self._pending) and _ready(self._pending[ready][1][-1][0]):
            ready += 1
        self._emit(ready)

    def flush(self) -> None:
        """Emit every closed window (waits for the devices)."""
        self._emit(len(self._pending))

    def _emit(self, count: int) -> None:
        if not count:
            return
        windows = [self._pending.popleft() for _ in range(count)]
        # Windows that arrive together share one rate: the time since the last log over their steps.
        now = time.perf_counter()
        seconds = now - self._last[1]
        rate = (windows[-1][0] - self._last[0]) / seconds if seconds > 0 else float("nan")
        self._last = (windows[-1][0], now)
        for step, window in windows:
            self._on_log(step, {**_means(window), "steps_per_sec": rate})


def _ready(metrics: Mapping[str, Any]) -> bool:
    return all(getattr(v, "is_ready", lambda: True)() for v in metrics.values())


def _means(window: list[tuple[Mapping[str, Any], int, int, int]]) -> dict[str, float]:
    """Each metric's mean over the window's steps (per-step values, in float64); the last learning rate."""
    per_step: dict[str, list[np.ndarray]] = {}
    for metrics, base, lo, hi in window:
        for name, value in jax.device_get(dict(metrics)).items():
            value = np.asarray(value, np.float64)
            per_step.setdefault(name, []).append(value[lo - base : hi - base] if value.ndim else value[None])
    names = ["loss", *sorted(k for k in per_step if k not in ("loss", "learning_rate"))]
    logs = {k: float(np.concatenate(per_step[k]).mean()) for k in names}
    if "learning_rate" in per_step:  # the current rate, not a mean
        logs["learning_rate"] = float(per_step["learning_rate"][-1][-1])
    return logs


def run_fit(trainer: Any, stream: BatchStream, options: FitOptions) -> History:
    """Train ``trainer`` on ``stream`` as ``options`` say; the body of ``Trainer.fit``.

    Args:
        trainer: the `Trainer` (its state exists: ``fit`` built or restored it).
        stream: the training batches from the trainer's data position on, checked and as ``(x, y)``.
        options: the `FitOptions`.

    Returns:
        The `History`; ``history.preempted`` when a SIGTERM stopped the run (after its checkpoint).
    """
    history = History()
    callbacks = options.callbacks

    def emit(hook: str, *args: Any) -> None:
        for cb in callbacks:
            getattr(cb, hook)(trainer, *args)

    def on_log(step: int, logs: dict) -> None:
        history.train.append({"step": step, **logs})
        emit("on_log", step, logs)

    def checkpoint() -> None:
        ckpt = options.checkpointer
        if ckpt is not None and ckpt.latest_step() != trainer.step:
            logs.flush()
            path = trainer.save(ckpt)
            history.checkpoints.append(path)
            emit("on_checkpoint", trainer.step, path)

    def evaluate() -> None:
        logs.flush()
        metrics = trainer.evaluate(options.eval_data)
        history.eval.append({"step": trainer.step, **metrics})
        emit("on_eval_end", trainer.step, metrics)

    trainer.stop_training = False
    logs = _Logs(trainer.step, on_log)
    consumed = 0
    steps = _steps(trainer, stream, options.steps)
    with PreemptionWatcher() as watcher:
        emit("on_train_begin")
        try:
            for n, metrics in steps:
                before = trainer.step - n  # the step(s) just taken advanced trainer.step
                consumed += n
                trainer.data_position = stream.position(consumed)
                logs.add(metrics, before, trainer.step)
                emit("on_step_end", trainer.step, metrics)
                every = options.log_every
                for point in range(before // every * every + every, trainer.step + 1, every):
                    logs.close_window(point)  # every log point, also those inside an on-device loop
                if trainer.step == options.steps:
                    logs.close_window(trainer.step)
                logs.emit_ready()
                if _crossed(before, trainer.step, options.eval_every):
                    evaluate()
                if _crossed(before, trainer.step, options.checkpoint_every):
                    checkpoint()
                if watcher.requested:
                    history.preempted = True
                if history.preempted or trainer.stop_training:
                    break
        finally:
            steps.close()
        logs.close_window(trainer.step)
        logs.flush()
        checkpoint()  # at the end (a no-op when this step is saved already)
        if options.eval_data is not None and not history.preempted and not (
            history.eval and history.eval[-1]["step"] == trainer.step
        ):
            evaluate()
        trainer.sync_model()
        emit("on_train_end", history)
    return history


def _steps(trainer: Any, stream: BatchStream, until: int | None) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """Run steps; yield ``(steps taken, their mean metrics)`` after each step or each on-device loop."""
    if until is not None and until <= trainer.step:
        return
    # Cut the stream at the last batch a step will use: nothing is read, or placed, beyond it.
    source = stream if until is None else itertools.islice(stream, until - trainer.step)
    if trainer.steps_per_run > 1:
        yield from _on_device_loops(trainer, iter(source))
        return
    batches = iter(trainer.strategy.experimental_distribute_dataset(source))
    try:
        for batch in batches:
            yield 1, trainer.train_on_batch(batch)
    finally:
        batches.close()


def _on_device_loops(trainer: Any, host: Iterable) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """steps_per_run > 1: ONE compiled on-device loop per ``steps_per_run`` batches."""
    while True:
        chunk = list(itertools.islice(host, trainer.steps_per_run))
        if not chunk:
            return
        yield len(chunk), trainer.train_on_batches(chunk)
