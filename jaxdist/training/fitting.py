"""The body of ``Trainer.fit``: the step loop with logging, evaluation, checkpoints, preemption and callbacks.

Two ways to run the steps: one compiled ``strategy.jit`` step per batch from
``strategy.experimental_distribute_dataset`` (prefetched), or, when ``steps_per_run > 1`` and the strategy has
``run_steps_on_dataset``, one compiled on-device loop per ``steps_per_run`` batches. Either way the data
position is the count of batches the steps consumed (never what the prefetcher read ahead).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from jaxdist.training.data import BatchStream
from jaxdist.training.preemption import PreemptionWatcher

__all__ = ["run_loop"]


def _crossed(before: int, after: int, every: int | None) -> bool:
    return bool(every) and after // every > before // every


def run_loop(trainer, stream, steps, eval_data, eval_every, ckpt, checkpoint_every, log_every, callbacks, history):
    """The body of ``Trainer.fit``: steps, logs, evaluations, checkpoints, preemption, callbacks."""
    def emit(hook: str, *args: Any) -> None:
        for cb in callbacks:
            getattr(cb, hook)(trainer, *args)

    def checkpoint() -> None:
        if ckpt is not None and ckpt.latest_step() != trainer._step:
            path = trainer._save(ckpt)
            history.checkpoints.append(path)
            emit("on_checkpoint", trainer._step, path)

    def run_eval() -> None:
        metrics = trainer.evaluate(eval_data)
        history.eval.append({"step": trainer._step, **metrics})
        emit("on_eval_end", trainer._step, metrics)

    trainer.stop_training = False
    window: list[dict] = []
    last_log = (trainer._step, time.perf_counter())
    consumed = 0
    batches = _batches(trainer, stream, steps)
    with PreemptionWatcher() as watcher:
        emit("on_train_begin")
        try:
            for n, metrics in batches:
                before = trainer._step
                trainer._step += n
                consumed += n
                trainer.data_position = stream.position(consumed)
                window.append(metrics)
                emit("on_step_end", trainer._step, metrics)
                if _crossed(before, trainer._step, log_every) or trainer._step == steps:
                    logs = _summarize(trainer, window, last_log)
                    last_log, window = (trainer._step, time.perf_counter()), []
                    history.train.append({"step": trainer._step, **logs})
                    emit("on_log", trainer._step, logs)
                if _crossed(before, trainer._step, eval_every):
                    run_eval()
                if _crossed(before, trainer._step, checkpoint_every):
                    checkpoint()
                if watcher.requested:
                    history.preempted = True
                if history.preempted or trainer.stop_training:
                    break
        finally:
            batches.close()
        if window:
            logs = _summarize(trainer, window, last_log)
            history.train.append({"step": trainer._step, **logs})
            emit("on_log", trainer._step, logs)
        checkpoint()  # at the end (a no-op when this step is saved already)
        if eval_data is not None and not history.preempted and not (
            history.eval and history.eval[-1]["step"] == trainer._step
        ):
            run_eval()
        trainer._model.sync(trainer._state.params, trainer._state.model_state)
        emit("on_train_end", history)


def _batches(trainer: Any, stream: BatchStream, steps: int | None):
    """Yield ``(steps_taken, metrics)`` after each step (or each on-device loop of steps_per_run)."""
    remaining = (lambda: steps - trainer._step) if steps is not None else (lambda: None)
    if remaining() is not None and remaining() <= 0:
        return
    run_steps = getattr(trainer.strategy, "run_steps_on_dataset", None)
    if trainer.steps_per_run > 1 and run_steps is not None:
        yield from _batches_on_device(trainer, iter(stream), run_steps, remaining)
        return
    iterator = iter(trainer.strategy.experimental_distribute_dataset(stream))
    try:
        for batch in iterator:
            trainer._state, metrics = trainer._train_step(trainer._state, batch)
            yield 1, metrics
            left = remaining()
            if left is not None and left <= 0:
                return
    finally:
        iterator.close()


def _batches_on_device(trainer: Any, host: Iterable, run_steps: Callable, remaining: Callable):
    """steps_per_run > 1: ONE compiled on-device loop (``strategy.run_steps_on_dataset``) per run."""
    if trainer._loop_step is None:
        train_step = trainer._train_step_fn

        def loop_step(ctx, state, *inputs):
            state, metrics = train_step(state, inputs if len(inputs) > 1 else inputs[0])
            for name, value in metrics.items():
                ctx.set_last_step_output(name, value)
            return state

        trainer._loop_step = loop_step
    while True:
        left = remaining()
        n = trainer.steps_per_run if left is None else min(trainer.steps_per_run, left)
        if n <= 0:
            return
        chunk = list(itertools.islice(host, n))
        if not chunk:
            return
        chunk = [tuple(b) if isinstance(b, list) else b for b in chunk]
        ctx = run_steps(trainer._loop_step, iter(chunk), iterations=len(chunk), initial_loop_values=trainer._state,
                        donate=True)
        trainer._state = ctx.loop_values
        yield len(chunk), ctx.last_step_outputs


def _summarize(trainer: Any, window: list[dict], last_log: tuple[int, float]) -> dict[str, float]:
    values = jax.device_get(window)
    names = ["loss", *sorted(k for k in values[0] if k not in ("loss", "learning_rate"))]
    logs = {k: float(np.mean([v[k] for v in values])) for k in names}
    if "learning_rate" in values[0]:  # the current rate, not a mean
        logs["learning_rate"] = float(values[-1]["learning_rate"])
    seconds = time.perf_counter() - last_log[1]
    logs["steps_per_sec"] = (trainer._step - last_log[0]) / seconds if seconds > 0 else float("nan")
    return logs
