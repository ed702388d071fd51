"""Callbacks, the metrics history, progress display and metric files (CSV and TensorBoard).

A `Callback`'s hooks say when each is called. ``fit`` calls a per-step hook only on the callbacks
that override it; ``on_step_end`` receives device scalars (reading one waits for the device).
During ``fit`` a callback's ``control`` is the run's `FitControl`. Setting
``trainer.stop_training = True`` (or ``control.stop()``) ends ``fit`` after the current step (with
a checkpoint when ``checkpoint_dir`` is set); in a multi-process run, set on any process, it ends
``fit`` on all of them after the same step, at most 3 steps later (agreed like a SIGTERM:
`jaxdist.training.loop._preemption`).

The trainer logs every ``log_every`` steps the mean of each metric (token-weighted for a ``(sum,
weight)`` loss) and its rates (`jaxdist.costs.step`); ``on_log`` comes once the devices have the
window's values (usually a step or two later, with the log point's step number), and always before
the next evaluation, checkpoint or the end of ``fit``. `Progress` shows the logs, `CSVLogger` and
`TensorBoardLogger` write them (in a multi-process run on process 0 only).
"""

from __future__ import annotations

import csv
import itertools
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from jaxdist.costs import format_bytes
from jaxdist.costs.step import StepCost

__all__ = ["HOOKS", "TIME_PARTS", "CSVLogger", "Callback", "FitControl", "History", "Progress",
           "TensorBoardLogger", "overriding"]

TIME_PARTS = ("steps", "compile", "input", "checkpoint", "evaluation", "lost", "other")
"""The parts of `History.time`, in the order they are shown (a log row's ``time/<part>`` too)."""


class History:
    """What ``fit`` returns: the logged metrics.

    Attributes:
        train: one dict per log point: ``{"step": s, "loss": ..., <metrics>, "steps_per_sec":
            ...}``, plus ``"tokens_per_sec"``, ``"mfu"``, ``"hfu"`` and ``"peak_bytes_in_use"``
            where known, and ``"epoch"`` (from 0) when the fit counts epochs (``epochs=`` or
            ``steps_per_epoch=``).
        eval: one dict per evaluation: ``{"step": s, "loss": ..., <metrics>}``.
        epochs: one dict per epoch that ended (what ``on_epoch_end`` got): ``{"epoch": e, "step": s,
            "loss": ..., <metrics>, "val_loss": ..., "val_<metric>": ...}``: the epoch's means, and
            the evaluation at its last step where there was one (``eval_every="epoch"``). Keras'
            ``history.history`` is `history`.
        checkpoints: the paths written.
        preempted: True when a SIGTERM stopped the run early (after saving).
        preempted_by: which signal did (``"SIGTERM"``; ``"SIGTERM (to another process)"`` where
            another process of the job got it), or None.
        step_cost: what one step costs (a `StepCost`: FLOPs and memory per device), None if no step
            ran.
        non_finite_steps: how many steps' loss or gradients were not finite
            (``fit(on_non_finite=...)``; skipped ones and rolled-back ones included); the log rows
            of their windows show ``non_finite_steps`` too.
        rollbacks: one dict per rollback (``on_non_finite="rollback"``): ``{"step": the first
            non-finite step, "restored": the checkpoint's step, "data_position": where the data went
            on}``.
        data_ended: the step at which ``train_data`` ended before ``steps`` (an iterator shorter
            than the run; not the ``epochs`` limit), or None.
        processes: on process 0 (empty on the others), one dict per log window: ``{"step": s,
            "step_time": [seconds per step of process 0, 1, ...], "input_wait": [seconds per step
            each process waited for its next batch], "host": [each process's host name],
            "stragglers": [the processes named in a StragglerWarning]}``; a process whose figures
            did not arrive has None. One entry per list in a single process.
        time: where the fit's wall time went, in seconds (`TIME_PARTS`, in this order): ``"steps"``
            (calling the steps and waiting for the devices to finish them), ``"compile"`` (tracing,
            lowering and compiling, as JAX reports it), ``"input"`` (reading and placing batches),
            ``"checkpoint"`` (writing them, and reading one to resume or roll back),
            ``"evaluation"``, ``"lost"`` (steps thrown away or taken again: those a rollback undid,
            and those a resumed run takes again because an earlier run got past the checkpoint it
            resumes from: a crash after the last checkpoint, or ``restore_step``) and ``"other"``
            (the rest: callbacks, the setup before the first step, the loop itself). They add up to
            the wall time of ``fit``, measured on the host. Each log row has the same parts over its
            window as ``time/<part>`` (its ``time/steps`` counts every step it ran, ``time/lost``
            those taken again and, in the first window after a rollback, those the rollback threw
            away). Empty before ``fit`` ends.
        job_time: with a ``checkpoint_dir``, on process 0: the parts of ``time`` summed over every
            run that wrote to that directory (a crashed run and those that resumed it), and
            ``"restart"``, the gaps between a run that failed (or was preempted) and the next one.
            Empty otherwise.
        job_runs: how many runs ``job_time`` adds up (0 without it).

    Examples:
        >>> h = History()
        >>> h.train.append({"step": 10, "loss": 0.5})
        >>> h.metric("loss")
        [0.5]
        >>> h.time = {"steps": 9.0, "compile": 0.5, "other": 0.5}
        >>> h.goodput
        0.9
    """

    def __init__(self) -> None:
        self.train: list[dict[str, float]] = []
        self.eval: list[dict[str, float]] = []
        self.epochs: list[dict[str, float]] = []
        self.checkpoints: list[str] = []
        self.preempted = False
        self.preempted_by: str | None = None
        self.step_cost: StepCost | None = None
        self.non_finite_steps = 0
        self.rollbacks: list[dict[str, Any]] = []
        self.data_ended: int | None = None
        self.processes: list[dict[str, Any]] = []
        self.time: dict[str, float] = {}
        self.job_time: dict[str, float] = {}
        self.job_runs = 0

    @property
    def goodput(self) -> float:
        """The share of the fit's wall time spent in steps that count: ``time["steps"] /
        sum(time.values())`` (NaN before ``fit`` ends)."""
        total = sum(self.time.values())
        return self.time.get("steps", 0.0) / total if total > 0 else float("nan")

    @property
    def job_goodput(self) -> float:
        """The same share of the job's time, over every run on its checkpoint directory
        (``job_time``; NaN without it)."""
        total = sum(self.job_time.values())
        return self.job_time.get("steps", 0.0) / total if total > 0 else float("nan")

    def metric(self, name: str, split: str = "train") -> list[float]:
        """The values of ``name`` at each log point of ``split`` (``"train"``, ``"eval"`` or
        ``"epochs"``)."""
        return [row[name] for row in getattr(self, split) if name in row]

    @property
    def history(self) -> dict[str, list[float]]:
        """Keras' ``History.history``: ``{name: [its value at the end of each epoch]}`` (``loss``,
        the metrics, ``val_loss``, ...), from `epochs`.

        Examples:
            >>> h = History()
            >>> h.epochs += [{"epoch": 0, "step": 5, "loss": 0.5, "val_loss": 0.6},
            ...              {"epoch": 1, "step": 10, "loss": 0.25, "val_loss": 0.5}]
            >>> h.history
            {'loss': [0.5, 0.25], 'val_loss': [0.6, 0.5]}
        """
        names = [k for row in self.epochs for k in row if k not in ("epoch", "step")]
        return {name: [row.get(name, float("nan")) for row in self.epochs]
                for name in dict.fromkeys(names)}

    def __repr__(self) -> str:
        last = self.train[-1] if self.train else {}
        return f"History(train={len(self.train)} rows, eval={len(self.eval)} rows, last={last})"


class FitControl:
    """A running ``fit`` as its callbacks see it (a callback's ``control`` during ``fit``): where it
    is, and what a callback may ask of it, which takes effect after the current step.

    Attributes:
        history: the run's `History` so far.
        stopping: the run is stopping (a request to stop, or a SIGTERM, agreed by every process).
        epochs: the epochs the run trains (``fit(epochs=...)``), or None.
        steps_per_epoch: ``fit(steps_per_epoch=...)``, or None (an epoch is one pass over
            ``train_data``).
        checkpoint_dir: where ``fit`` saves its checkpoints (its backups), or None.

    Examples:
        >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
        >>> class StopAt3(jd.training.Callback):
        ...     def on_step_end(self, trainer, step, metrics):
        ...         if self.control.step >= 3:
        ...             self.control.stop()
        >>> trainer = jd.training.Trainer(jd.OneDeviceStrategy(), nn.Dense(1), optax.sgd(0.1),
        ...                               lambda p, y: ((p[:, 0] - y) ** 2).mean())
        >>> data = [(np.ones((4, 2), np.float32), np.zeros(4, np.float32))] * 10
        >>> _ = trainer.fit(data, steps=10, verbose=0, callbacks=[StopAt3()])
        >>> trainer.step
        3
    """

    history: History
    stopping: bool = False
    epochs: int | None = None
    steps_per_epoch: int | None = None
    checkpoint_dir: str | None = None

    @property
    def step(self) -> int:
        """Optimizer steps taken (the trainer's step counter)."""
        raise NotImplementedError

    @property
    def data_position(self) -> Any:
        """How far the steps have read the training data (a `jd.training.DataPosition`)."""
        raise NotImplementedError

    @property
    def epoch(self) -> int:
        """The epoch the steps are in, from 0: with ``steps_per_epoch``, ``step // steps_per_epoch``
        (an epoch is that many steps, whatever the passes over the data); else the pass over the
        training data the steps are reading (``data_position.epoch``). In ``on_epoch_end(trainer,
        epoch, logs)`` it is that ``epoch``."""
        return self.data_position.epoch

    def stop(self) -> None:
        """End the run after the current step (``trainer.stop_training = True``; with a checkpoint
        when ``checkpoint_dir`` is set)."""
        raise NotImplementedError

    def save(self) -> None:
        """Write a checkpoint after the current step (into ``checkpoint_dir``: without one, a
        ValueError)."""
        raise NotImplementedError

    def skip(self, batches: int = 1) -> None:
        """Read the next ``batches`` batches without training on them (the data position moves past
        them)."""
        raise NotImplementedError


class Callback:
    """Base class: override the hooks you need (each does nothing by default).

    A hook receives the trainer first. During ``fit``, ``self.control`` is the run's `FitControl`
    (None otherwise): the step, epoch and history, and stop, save or skip.

    Examples:
        >>> class PrintEval(Callback):
        ...     def on_eval_end(self, trainer, step, metrics):
        ...         print(step, round(metrics["loss"], 2))
        >>> PrintEval().on_eval_end(None, 5, {"loss": 0.123})
        5 0.12
    """

    control: FitControl | None = None
    """The running fit (set by ``fit`` before ``on_train_begin``, None once it has ended)."""

    def on_train_begin(self, trainer: Any) -> None:
        """Before the first step of ``fit`` (after any restore)."""

    def on_config(self, trainer: Any, config: Mapping[str, Any]) -> None:
        """Once per ``fit``, right after ``on_train_begin``: how the run is configured, a flat
        ``{name: JSON scalar}`` (`jaxdist.training.loop._config`), which trackers keep."""

    def on_epoch_begin(self, trainer: Any, epoch: int) -> None:
        """Before the first step of epoch ``epoch`` (from 0; a resumed run begins with the epoch it
        resumes in, as Keras does with ``initial_epoch``). An epoch is ``steps_per_epoch`` steps, or
        one pass over ``train_data``."""

    def on_step_cost(self, trainer: Any, cost: StepCost) -> None:
        """Once per ``fit``, after its first step compiled: what one step costs per device (FLOPs,
        peak FLOP/s, bytes of parameters, optimizer state and temporaries; a `StepCost`)."""

    def on_step_end(self, trainer: Any, step: int, metrics: Mapping[str, Any]) -> None:
        """After each optimizer step; metrics are device scalars. With ``steps_per_run > 1``: after
        each on-device loop, with each metric's values for its steps stacked (device arrays of shape
        ``(n,)``)."""

    def on_log(self, trainer: Any, step: int, logs: Mapping[str, float]) -> None:
        """For every ``log_every`` steps, with the metrics averaged over them (host floats); called
        as soon as the devices have them, without waiting for them."""

    def on_eval_end(self, trainer: Any, step: int, metrics: Mapping[str, float]) -> None:
        """After each evaluation during ``fit``, with metrics averaged over every evaluation
        example."""

    def on_epoch_end(self, trainer: Any, epoch: int, logs: Mapping[str, float]) -> None:
        """After the last step of epoch ``epoch`` (an epoch the run stops inside has no end), with
        the epoch's means of the loss and metrics (over its steps since the run began, for a resumed
        run), the last learning rate where it is logged, and ``val_<name>`` for each metric of an
        evaluation at that step (``eval_every="epoch"``). A checkpoint asked for here
        (``control.save()``) holds the epoch's steps; a stop ends the run before the next epoch, on
        every process. ``fit`` waits for the epoch's metrics only when the run counts epochs or a
        callback overrides an epoch hook."""

    def on_checkpoint(self, trainer: Any, step: int, path: str) -> None:
        """After each checkpoint is written (complete and renamed into place)."""

    def on_pause(self, trainer: Any, part: str) -> None:
        """The loop leaves its steps for ``part``: ``"evaluation"``, or ``"checkpoint"`` (writing
        one, waiting for one in flight, or restoring one)."""

    def on_resume(self, trainer: Any, part: str) -> None:
        """The loop is back to its steps after ``part`` (the ``on_pause`` before)."""

    def on_train_end(self, trainer: Any, history: History) -> None:
        """When ``fit`` ends (normally, stopped, or preempted)."""

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        """When ``fit`` fails with ``error`` (raised on after the callbacks have heard it)."""


HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_"))
"""Every hook of `Callback`, in the order ``fit`` first calls them."""


def overriding(callbacks: Any, hook: str) -> list:
    """The bound ``hook`` of each of ``callbacks`` that overrides `Callback`'s (or any object's
    method of that name): ``fit`` calls only these.

    Examples:
        >>> class Steps(Callback):
        ...     def on_step_end(self, trainer, step, metrics):
        ...         pass
        >>> [type(hook.__self__).__name__ for hook in overriding([Callback(), Steps()],
        ...                                                      "on_step_end")]
        ['Steps']
    """
    base = getattr(Callback, hook)
    return [getattr(cb, hook) for cb in callbacks
            if getattr(type(cb), hook, None) not in (None, base)
            or hook in getattr(cb, "__dict__", {})]


_RATES = {"steps_per_sec": "steps/s", "tokens_per_sec": "tokens/s"}  # shown as "<value> <unit>"


def _value(key: str, value: float | str) -> str:
    if isinstance(value, str):  # already formatted (">=25.00%")
        return value
    if key in ("mfu", "hfu"):
        return f"{value:.2%}"
    if key.endswith("bytes_in_use"):
        return format_bytes(value)
    if key in _RATES:
        return f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"
    return f"{value:.4g}"


_BESIDE = 0.1
"""A log window's rates are labelled with the largest part of its wall time other than steps that
took at least this share of it."""


def _format(logs: Mapping[str, float]) -> str:
    """``loss 0.25 accuracy 0.9 50 steps/s``: the values first, the rates last, each once (a
    window's ``time/<part>`` seconds are left to the files), with the largest part other than the
    steps that took `_BESIDE` of the window or more, so that a rate that swings says why.

    Examples:
        >>> _format({"loss": 0.5, "steps_per_sec": 14.0, "time/steps": 0.1, "time/compile": 0.6,
        ...          "time/other": 0})
        'loss 0.5 14 steps/s (incl. compile 86%)'
    """
    values = [f"{k} {_value(k, v)}" for k, v in logs.items()
              if k != "step" and k not in _RATES and not k.startswith("time/")]
    rates = [f"{_value(k, logs[k])} {unit}" for k, unit in _RATES.items() if k in logs]
    # lost: in steps
    parts = {k[5:]: v for k, v in logs.items() if k.startswith("time/") and k != "time/lost"}
    wall = sum(parts.values())
    beside = sorted(((v / wall, k) for k, v in parts.items() if k != "steps"
                     and v >= _BESIDE * wall), reverse=True) if rates and wall > 0 else []
    if beside:
        rates[-1] += f" (incl. {beside[0][1]} {beside[0][0]:.0%})"
    return " ".join(values + rates)


def _duration(seconds: float) -> str:
    """``6.19 s``, ``12.5 min``, ``36.2 h``."""
    if seconds < 100:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.3g} min" if seconds < 6000 else f"{seconds / 3600:.3g} h"


def _format_time(seconds: Mapping[str, float], width: int = 80, label: str = "time") -> str:
    """`History.time` in short: the total, the goodput (the share of ``steps``), then the other
    parts' shares, largest first (those under 0.5% left out); on a second line when one would be
    wider than ``width``.

    Examples:
        >>> _format_time({"steps": 9.0, "compile": 0.75, "input": 0.0, "other": 0.25})
        'time 10 s, goodput 90%: compile 8%, other 2%'
        >>> print(_format_time({"steps": 4e3, "compile": 1e3, "input": 1e3, "checkpoint": 1e3,
        ...                     "evaluation": 1e3, "lost": 1e3, "other": 1e3}))
        time 2.78 h, goodput 40%:
          compile 10%, input 10%, checkpoint 10%, evaluation 10%, lost 10%, other 10%
    """
    total = sum(seconds.values())
    if total <= 0:
        return "time 0 s"
    head = f"{label} {_duration(total)}, goodput {seconds.get('steps', 0.0) / total:.0%}"
    shares = sorted(((v / total, k) for k, v in seconds.items()
                     if k != "steps" and v / total >= 0.005), key=lambda share: -share[0])
    if not shares:
        return head
    parts = ", ".join(f"{k} {share:.0%}" for share, k in shares)
    line = f"{head}: {parts}"
    return line if len(line) <= width else f"{head}:\n  {parts}"


class Progress(Callback):
    """Training progress: a tqdm bar on a terminal, plain lines otherwise (logs, CI), with the loss,
    the metrics and one rate (the trainer's steps/s over the log window; tokens/s where counted). A
    window whose wall time went largely elsewhere than its steps (10% or more) says so after the
    rate: ``14 steps/s (incl. compile 86%)``.

    At the start: how often checkpoints are saved, "resumed from step N (dir)" when ``fit``
    resumed, and the step's cost per device (`StepCost.summary`, or `StepCost.describe` with
    ``details=True``). When the fit counts epochs, each line shows the epoch (``step 35/210 epoch
    1/3 ...``, from 1 as Keras prints them) and each epoch's end has a line of its means. At the end
    of a fit that trained: where the time went (`History.time`); of a preempted one, which signal,
    the step saved and how to resume. MFU and HFU show where the device's peak FLOP/s is known, with
    ">=" before them while a custom call in the step could not be costed (`StepCost.lower_bound`).

    Args:
        total: the step the run trains to (for the bar), or None.
        mode: ``"auto"`` (bar when stderr is a terminal), ``"bar"`` or ``"lines"``.
        stream: where lines (and the bar) go (default: stdout for lines, stderr for the bar).
        details: show the step's whole cost line (`StepCost.describe`) instead of its summary.
        resumed_from: the checkpoint directory ``fit`` restored the state from, or None.
        epochs: the fit's epochs (``fit(epochs=...)``), or None.
        show_epochs: show the epochs (default: when ``epochs`` is given; ``fit`` passes whether it
            counts them).
        checkpoint_dir: where ``fit`` saves its checkpoints, or None.
        cadence: how often, in words (`jaxdist.training.loop.Cadence.describe`); ``default=True``
            after it says it is the default.

    Raises:
        ValueError: for a ``mode`` that is not one of the three.

    Examples:
        >>> import io
        >>> out = io.StringIO()
        >>> p = Progress(total=20, mode="lines", stream=out)
        >>> p.on_log(None, 10, {"loss": 0.25, "accuracy": 0.9, "steps_per_sec": 50.0,
        ...                     "tokens_per_sec": 51200.0})
        >>> out.getvalue()
        'step 10/20 loss 0.25 accuracy 0.9 50 steps/s 51,200 tokens/s\\n'

        With epochs (``fit(epochs=3, steps_per_epoch=10)``):

        >>> p = Progress(total=30, mode="lines", epochs=3)
        >>> p.on_log(None, 15, {"epoch": 1, "loss": 0.5, "steps_per_sec": 40.0})
        step 15/30 epoch 2/3 loss 0.5 40 steps/s
        >>> p.on_epoch_end(None, 1, {"loss": 0.45, "val_loss": 0.5})
        epoch 2/3: loss 0.45 val_loss 0.5
    """

    def __init__(self, total: int | None = None, mode: str = "auto", stream: Any = None, *,
                 details: bool = False, resumed_from: str | os.PathLike | None = None,
                 epochs: int | None = None, show_epochs: bool | None = None,
                 checkpoint_dir: str | os.PathLike | None = None, cadence: str | None = None,
                 default: bool = False):
        if mode not in ("auto", "bar", "lines"):
            raise ValueError(f"mode={mode!r} must be 'auto', 'bar' or 'lines'.")
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.total, self.mode, self.stream, self.details = total, mode, stream, details
        self.resumed_from = None if resumed_from is None else os.fspath(resumed_from)
        self.epochs = epochs
        self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self.cadence, self.default = cadence, default
        # else no epoch hook: fit waits for none
        if epochs is not None if show_epochs is None else show_epochs:
            self.on_epoch_end = self._epoch_line  # type: ignore[method-assign]
        self._bar: Any = None
        self._start_step = 0
        self._cost: StepCost | None = None
        # lines have nothing to do per step: no on_step_end, so fit calls nothing per step
        if mode == "bar":
            self.on_step_end = self._advance  # type: ignore[method-assign]

    def on_train_begin(self, trainer: Any) -> None:
        self._start_step = int(trainer.step) if trainer is not None else 0
        if self.mode == "bar":
            from tqdm import tqdm

            # tqdm's own rate (an average since the bar began, compilation included) is left out:
            # the rate shown is the trainer's, over the last log window.
            layout = ("{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}"
                      if self.total else "{desc} {n_fmt} {elapsed}{postfix}")
            self._bar = tqdm(total=self.total, initial=self._start_step, desc="train", unit="step",
                             bar_format=layout, file=self.stream)
        done = self.total is not None and self._start_step >= self.total  # nothing to train
        if self.checkpoint_dir is not None and self.cadence and not done:
            default = " (the default checkpoint_every)" if self.default else ""
            self._write(f"checkpoints {self.cadence}{default}")
        if self.resumed_from is not None:
            line = f"resumed from step {self._start_step} ({self.resumed_from})"
            if self.total is not None and self._start_step >= self.total:
                line += f": already at steps={self.total}, nothing to train"
            self._write(line)

    def on_step_cost(self, trainer: Any, cost: StepCost) -> None:
        self._cost = cost
        self._write(cost.describe() if self.details else cost.summary())

    def _advance(self, trainer: Any, step: int, metrics: Mapping[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def on_log(self, trainer: Any, step: int, logs: Mapping[str, float]) -> None:
        # a custom call not costed: at least this much (an MFU from flops_per_step= is exact)
        if self._cost is not None and self._cost.lower_bound:
            exact = self._cost.model_flops_source.startswith("flops_per_step")
            bounded = ("hfu",) if exact else ("mfu", "hfu")
            logs = {k: f">={_value(k, v)}" if k in bounded and not isinstance(v, str) else v
                    for k, v in logs.items()}
        # passes of a data_fn(epoch): known once one begins
        if self.total is None and self.control is not None:
            self.total = getattr(self.control, "planned", lambda: None)()
            if self.total is not None and self._bar is not None:
                self._bar.total = self.total
        epoch = ""
        if "epoch" in logs:
            epoch = f"epoch {int(logs['epoch']) + 1}{f'/{self.epochs}' if self.epochs else ''}"
            logs = {k: v for k, v in logs.items() if k != "epoch"}
        if self._bar is not None:
            if epoch:
                self._bar.set_description_str(epoch)
            self._bar.set_postfix_str(_format(logs))
        else:
            total = f"/{self.total}" if self.total else ""
            line = f"step {step}{total} {epoch} " if epoch else f"step {step}{total} "
            print(line + _format(logs), file=self.stream or sys.stdout, flush=True)

    def _epoch_line(self, trainer: Any, epoch: int, logs: Mapping[str, float]) -> None:
        """``on_epoch_end`` (when the fit counts epochs): the epoch's means."""
        at = ""
        if trainer is not None:
            at = f" at step {int(trainer.step)}{f'/{self.total}' if self.total else ''}"
        self._write(f"epoch {epoch + 1}{f'/{self.epochs}' if self.epochs else ''}{at}: "
                    f"{_format(logs)}")

    def on_eval_end(self, trainer: Any, step: int, metrics: Mapping[str, float]) -> None:
        self._write(f"eval at step {step}: {_format(metrics)}")

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream or sys.stdout, flush=True)

    def on_train_end(self, trainer: Any, history: History) -> None:
        trained = trainer is None or int(trainer.step) > self._start_step  # not "nothing to train"
        if history is not None and history.time and trained:
            self._write(_format_time(history.time))
            # a job resumed: its time over every run, the restarts included
            if history.job_runs > 1:
                self._write(_format_time(history.job_time,
                                         label=f"job over {history.job_runs} runs"))
        if history is not None and history.preempted and trainer is not None:
            self._write(self._preempted(int(trainer.step), history))
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _preempted(self, step: int, history: History) -> str:
        """The last line of a preempted fit: which signal, the step saved, how to resume."""
        head = f"preempted by {history.preempted_by or 'a signal'} at step {step}"
        last = history.checkpoints[-1] if history.checkpoints else None
        directory = os.path.dirname(os.path.normpath(last)) if last else self.checkpoint_dir
        if last is not None and os.path.basename(os.path.normpath(last)) == str(step):
            return f"{head}: saved step {step} to {directory}; run again to resume"
        if last is None and self.resumed_from is not None and step == self._start_step:
            return f"{head}: step {step} is saved in {directory} already; run again to resume"
        if directory is None:
            return f"{head}: nothing saved (fit has no checkpoint_dir): a run again starts over"
        since = (f"from step {os.path.basename(os.path.normpath(last))}" if last is not None
                 else "from its newest checkpoint")
        return (f"{head}: its state was not saved (not finite); "
                f"run again to resume {since} in {directory}")


def _writes(trainer: Any) -> bool:
    """One writer: whether this process writes metric files (``strategy.should_save_summary``:
    process 0). A logger used on its own (no trainer) always writes."""
    strategy = getattr(trainer, "strategy", None)
    return strategy is None or bool(strategy.should_save_summary)


class _MetricWriter(Callback):
    """A callback that writes each log point and evaluation as ``_write(split, step, values)``, on
    the one writing process (`_writes`)."""

    def on_log(self, trainer: Any, step: int, logs: Mapping[str, float]) -> None:
        if _writes(trainer):
            self._write("train", step, logs)

    def on_eval_end(self, trainer: Any, step: int, metrics: Mapping[str, float]) -> None:
        if _writes(trainer):
            self._write("eval", step, metrics)

    def _write(self, split: str, step: int, values: Mapping[str, float]) -> None:
        raise NotImplementedError

    @staticmethod
    def scalars(split: str, values: Mapping[str, Any]) -> dict[str, float]:
        """The scalars every writer records for one log point or evaluation: ``{tag: float}``, tags
        ``<split>/<name>`` (``train/loss``), except a window's seconds by part, which keep their own
        name (``time/steps``); booleans, strings and ``step`` are left out.

        Examples:
            >>> _MetricWriter.scalars("train", {"step": 10, "loss": 0.5, "time/steps": 1.25})
            {'train/loss': 0.5, 'time/steps': 1.25}
        """
        return {key if key.startswith("time/") else f"{split}/{key}": float(value)
                for key, value in values.items() if key != "step"
                and isinstance(value, (int, float)) and not isinstance(value, bool)}


class CSVLogger(_MetricWriter):
    """Append training and evaluation metrics to ``path`` as CSV (one row per log point).

    Columns: ``split`` (train / eval), ``step``, then every metric name seen; a new name rewrites
    the file with the wider header, so any CSV reader opens it. In a multi-process run only the
    process whose ``strategy.should_save_summary`` is true (process 0) writes (the values are
    global already).

    Examples:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.csv")
        >>> log = CSVLogger(path)
        >>> log.on_log(None, 1, {"loss": 0.5})
        >>> log.on_eval_end(None, 1, {"loss": 0.4, "accuracy": 0.9})
        >>> with open(path) as f:
        ...     print(f.read().strip())
        split,step,loss,accuracy
        train,1,0.5,
        eval,1,0.4,0.9
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._columns: list[str] = ["split", "step"]
        self._rows: list[dict] = []
        if os.path.exists(self.path):  # resuming: keep what earlier runs wrote
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self._columns = list(reader.fieldnames or self._columns)
                self._rows = list(reader)

    def _write(self, split: str, step: int, logs: Mapping[str, float]) -> None:
        row = {"split": split, "step": step, **{k: v for k, v in logs.items() if k != "step"}}
        new = [k for k in row if k not in self._columns]
        self._rows.append(row)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if new or not os.path.exists(self.path):
            self._columns += new
            with open(self.path, "w", newline="") as f:
                writer = csv.DictWriter(f, self._columns)
                writer.writeheader()
                writer.writerows(self._rows)
        else:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, self._columns).writerow(row)


_files = itertools.count()  # event files this process has opened: part of each file's name


class TensorBoardLogger(_MetricWriter):
    """Write metrics as TensorBoard scalars (``train/loss``, ``eval/accuracy``, ...; a log window's
    ``time/<part>`` seconds under their own name: ``time/steps``, ...) into ``log_dir``.

    The event file is tensorboardX's (`tensorboardX.SummaryWriter`; no TensorFlow needed): open it
    with ``tensorboard --logdir``. It is created at the first value and flushed every ``flush_secs``
    and when ``fit`` ends (`close`). A resumed ``fit`` (starting at step s > 0) opens its file with
    ``purge_step=s``, so TensorBoard hides what an interrupted run logged after its last checkpoint.
    In a multi-process run only process 0 (``strategy.should_save_summary``) writes.

    Args:
        log_dir: the directory (created when missing).
        flush_secs: at most this many seconds between a value and its write to disk.

    Examples:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> tb = TensorBoardLogger(d)
        >>> tb.on_log(None, 1, {"loss": 0.5})
        >>> tb.close()
        >>> [f.startswith("events.out.tfevents.") for f in os.listdir(d)]
        [True]
    """

    def __init__(self, log_dir: str | os.PathLike, flush_secs: float = 10.0):
        if not (isinstance(flush_secs, (int, float)) and flush_secs > 0):
            raise ValueError(f"flush_secs={flush_secs!r} must be a positive number of seconds.")
        self.log_dir = os.fspath(log_dir)
        self.flush_secs = flush_secs
        self._writer: Any = None
        self._purge_step: int | None = None

    def on_train_begin(self, trainer: Any) -> None:
        step = int(trainer.step) if trainer is not None else 0
        self._purge_step = step if step > 0 else None

    def _write(self, prefix: str, step: int, logs: Mapping[str, float]) -> None:
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(self.log_dir, purge_step=self._purge_step,
                                         flush_secs=self.flush_secs,
                                         filename_suffix=f".jaxdist.{os.getpid()}.{next(_files)}")
        now = time.time()
        for tag, value in self.scalars(prefix, logs).items():
            self._writer.add_scalar(tag, value, int(step), walltime=now)

    def on_train_end(self, trainer: Any, history: History) -> None:
        self.close()

    def close(self) -> None:
        """Write everything pending and close the file (a later value opens a new one)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
