"""The callbacks a Keras user reaches for, on ``fit``'s hooks: `EarlyStopping`, `ModelCheckpoint`,
`LearningRateScheduler` and `DeleteBackups` (``BackupAndRestore(delete_checkpoint=True)``).

Each acts at an epoch's end (or beginning), through the run's `FitControl`: a stop ends the run
before the next epoch on every process; a checkpoint is written by the loop's machinery (timed,
refused when not finite, the watchdog paused). Every process runs the same callbacks on the same
global logs, so they decide alike. Keras' ``BackupAndRestore`` itself is
``fit(checkpoint_dir=...)``.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxdist.training.callbacks import Callback, History
from jaxdist.training.checkpoints import Checkpointer, save_live
from jaxdist.training.step import NonFiniteError

__all__ = ["DeleteBackups", "EarlyStopping", "LearningRateScheduler", "ModelCheckpoint"]

_MIN_WORDS = ("loss", "error", "perplexity", "mse", "mae", "distance")
_MAX_WORDS = ("acc", "auc", "precision", "recall", "f1", "iou", "score")


def _direction(monitor: str, mode: str, who: str) -> str:
    """``mode``, or for ``"auto"`` what the name says (a loss: "min"; an accuracy: "max")."""
    if mode in ("min", "max"):
        return mode
    if mode != "auto":
        raise ValueError(f"{who}(mode={mode!r}): mode must be 'auto', 'min' or 'max'.")
    name = monitor.lower().removeprefix("val_")
    if any(word in name for word in _MIN_WORDS):
        return "min"
    if any(word in name for word in _MAX_WORDS):
        return "max"
    raise ValueError(f"{who}(monitor={monitor!r}, mode='auto') cannot tell whether {monitor!r} "
                     "should go down or up: pass mode='min' (lower is better) or mode='max' "
                     "(higher is better).")


def _monitored(logs: Mapping[str, float], monitor: str, who: str) -> float:
    """The monitored value of an epoch's logs, or a ValueError naming those there are."""
    if monitor not in logs:
        hint = (" The val_ metrics come from an evaluation at the epoch's end: fit(eval_data=..., "
                "eval_every='epoch').") if monitor.startswith("val_") else ""
        raise ValueError(f"{who}(monitor={monitor!r}): the epoch's logs have no {monitor!r}, only "
                         f"{sorted(logs)}.{hint}")
    return float(logs[monitor])


def _say(trainer: Any, line: str) -> None:
    """Print ``line`` on the process that shows progress (process 0)."""
    strategy = getattr(trainer, "strategy", None)
    if strategy is None or strategy.should_save_summary:
        print(line, flush=True)


def _copy(tree: Any) -> Any:
    """A copy of ``tree``'s arrays in their layout (the train step donates the state's)."""
    return jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, tree)


class EarlyStopping(Callback):
    """Stop training when a monitored metric has stopped improving (Keras' ``EarlyStopping``).

    At each epoch's end it compares ``logs[monitor]`` with the best so far (an improvement beats it
    by more than ``min_delta``); after ``patience`` epochs without one, it stops the run before the
    next epoch, on every process, with its checkpoint. A resumed run starts counting again (as with
    Keras' ``BackupAndRestore``: the callbacks' state is not in the backup).

    Args:
        monitor: the epoch log to watch: ``"val_loss"`` (the default: needs ``fit(eval_data=...,
            eval_every="epoch")``), ``"loss"``, ``"val_accuracy"``, ...
        min_delta: the smallest change that counts as an improvement.
        patience: epochs without improvement after which training stops.
        mode: ``"min"``, ``"max"``, or ``"auto"`` (min for a loss or error, max for an accuracy,
            AUC, ...).
        baseline: a value the metric must beat: until it does, the epochs count towards
            ``patience``.
        restore_best_weights: at the end of the run, put back the parameters (and model state) of
            the best epoch, kept on the devices (one more copy of the parameters in memory). The
            run's last checkpoint holds the last epoch's, as in Keras.
        start_from_epoch: epochs to let pass before watching (a warm-up).
        verbose: 1: say when it stops and what it restores (on process 0).

    Attributes:
        best: the best value seen; best_epoch: its epoch; stopped_epoch: the epoch it stopped at (0:
            it did not); wait: epochs since the last improvement.

    Raises:
        ValueError: for a mode that is not one of the three (or ``"auto"`` on a name it cannot
            read), a negative patience; at an epoch's end, when the logs have no ``monitor`` (naming
            those they have).

    Examples:
        >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
        >>> x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
        >>> data = [(x[i:i + 16], x[i:i + 16, :1]) for i in range(0, 64, 16)]
        >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.0),
        ...                               lambda out, y: ((out - y) ** 2).mean())  # no progress
        >>> stop = jd.training.EarlyStopping(monitor="loss", patience=2)
        >>> history = trainer.fit(data, epochs=10, verbose=0, callbacks=[stop])
        >>> stop.stopped_epoch, len(history.epochs), trainer.step  # stopped after 3 of 10
        (2, 3, 12)
    """

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 0,
                 mode: str = "auto", baseline: float | None = None,
                 restore_best_weights: bool = False, start_from_epoch: int = 0, verbose: int = 0):
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
            raise ValueError(f"EarlyStopping(patience={patience!r}): patience must be an int >= 0.")
        self.monitor, self.patience, self.baseline = monitor, patience, baseline
        self.mode = _direction(monitor, mode, "EarlyStopping")
        self.min_delta = abs(float(min_delta))
        self.restore_best_weights, self.start_from_epoch = restore_best_weights, start_from_epoch
        self.verbose = verbose
        self._reset()

    def _reset(self) -> None:
        self.wait = self.stopped_epoch = self.best_epoch = 0
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_weights: Any = None

    def _improves(self, value: float, reference: float) -> bool:
        if self.mode == "min":
            return value < reference - self.min_delta
        return value > reference + self.min_delta

    def on_train_begin(self, trainer: Any) -> None:
        self._reset()

    def on_epoch_end(self, trainer: Any, epoch: int, logs: Mapping[str, float]) -> None:
        value = _monitored(logs, self.monitor, "EarlyStopping")
        if self.restore_best_weights and self.best_weights is None:  # the best so far
            self.best_weights, self.best_epoch = self._weights(), epoch
        if epoch < self.start_from_epoch:
            return
        self.wait += 1
        if self._improves(value, self.best):
            self.best, self.best_epoch = value, epoch
            if self.restore_best_weights:
                self.best_weights = self._weights()
            if self.baseline is None or self._improves(value, self.baseline):
                self.wait = 0  # a new best that beats the baseline too
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.control.stop()

    def _weights(self) -> Any:
        state = self.control.live.state
        return _copy((state.params, state.model_state))

    def on_train_end(self, trainer: Any, history: History) -> None:
        if self.stopped_epoch and self.verbose:
            _say(trainer, f"epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None and self.control is not None:
            live = self.control.live
            params, model_state = self.best_weights
            live.state = live.state._replace(params=params, model_state=model_state)
            live.sync()  # an nnx model: in place
            self.best_weights = None
            if self.verbose:
                _say(trainer,
                     f"restoring the weights of the end of the best epoch: {self.best_epoch + 1}")


class ModelCheckpoint(Callback):
    """Keep the best checkpoints by a monitored metric in a directory of their own (Keras'
    ``ModelCheckpoint``, Lightning's ``save_top_k``), beside ``fit``'s own checkpoints (its
    backups), which it never touches.

    At each epoch's end it saves a checkpoint when ``logs[monitor]`` is among the ``keep`` best seen
    (deleting the one it displaces), with the value in its metadata: ``fit``'s kind, which
    ``trainer.restore(directory, step=checkpoint.best_step)`` restores onto any strategy. A resumed
    run reads the values of the checkpoints there and goes on keeping the best.

    Args:
        directory: where the best checkpoints go: not ``fit``'s ``checkpoint_dir``, nor inside it (a
            sibling such as ``"ckpt-best"``).
        monitor: the epoch log it ranks by (``"val_loss"``: needs ``fit(eval_data=...,
            eval_every="epoch")``).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (as `EarlyStopping`).
        keep: how many of the best to keep (Keras' ``save_best_only=True``: 1); None: every epoch's
            (Keras' ``save_best_only=False``).
        verbose: 1: say what it saves (on process 0).

    Attributes:
        best: ``[(step, value), ...]`` of the checkpoints kept, best first.

    Raises:
        ValueError: for ``keep < 1``, a mode it cannot read; when the fit starts, for a
            ``directory`` that is ``fit``'s ``checkpoint_dir`` or inside it; at an epoch's end, when
            the logs have no ``monitor``.

    Examples:
        >>> import os, tempfile, flax.linen as nn, numpy as np, optax, jaxdist as jd
        >>> x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
        >>> data = [(x[i:i + 16], x[i:i + 16, :1]) for i in range(0, 64, 16)]
        >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1),
        ...                               lambda out, y: ((out - y) ** 2).mean())
        >>> root = tempfile.mkdtemp()
        >>> best = jd.training.ModelCheckpoint(os.path.join(root, "best"), keep=2)
        >>> _ = trainer.fit(data, epochs=4, eval_data=data, eval_every="epoch", verbose=0,
        ...                 checkpoint_dir=os.path.join(root, "backup"), callbacks=[best])
        >>> [step for step, value in best.best]  # the loss falls: the last two epochs are the best
        [16, 12]
        >>> trainer.restore(best.directory, step=best.best_step)
        16
    """

    def __init__(self, directory: str | os.PathLike, monitor: str = "val_loss", mode: str = "auto",
                 keep: int | None = 1, verbose: int = 0):
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise ValueError(f"ModelCheckpoint(keep={keep!r}): keep must be an int >= 1, or None "
                             "(every epoch's).")
        self.directory = os.path.abspath(os.fspath(directory))
        self.monitor, self.keep, self.verbose = monitor, keep, verbose
        self.mode = _direction(monitor, mode, "ModelCheckpoint")
        self.best: list[tuple[int, float]] = []
        self._ckpt: Checkpointer | None = None

    @property
    def best_step(self) -> int | None:
        """The step of the best checkpoint kept (read from ``directory`` when this callback has seen
        no fit), or None."""
        if not self.best and self._ckpt is None and os.path.isdir(self.directory):
            with Checkpointer(self.directory, None) as ckpt:
                self.best = self._ranked(ckpt)
        return self.best[0][0] if self.best else None

    def _ranked(self, ckpt: Checkpointer) -> list[tuple[int, float]]:
        """The checkpoints of ``ckpt`` that hold this monitor's value, best first."""
        found = []
        for step in ckpt.all_steps():
            meta = ckpt.meta(step)
            if meta.get("monitor") == self.monitor and isinstance(meta.get("value"), (int, float)):
                found.append((step, float(meta["value"])))
        return sorted(found, key=lambda entry: entry[1], reverse=self.mode == "max")

    def on_train_begin(self, trainer: Any) -> None:
        control = self.control
        backups = None if control is None else control.checkpoint_dir
        if backups is not None:
            backups = os.path.realpath(backups)
            mine = os.path.realpath(self.directory)
            if mine == backups or mine.startswith(backups + os.sep):
                raise ValueError(f"ModelCheckpoint(directory={self.directory!r}) is "
                                 f"{'fit' if mine == backups else 'inside fit'}'s checkpoint_dir="
                                 f"{backups!r}: the best checkpoints would mix with the backups "
                                 "fit resumes from. Pass a directory beside it, e.g. "
                                 f"{backups + '-best'!r}.")
        asynchronous = True if control is None else control.options.async_checkpoints
        self._ckpt = Checkpointer(self.directory, None, async_save=asynchronous)
        self.best = self._ranked(self._ckpt)

    def _better(self, value: float, than: float) -> bool:
        return value < than if self.mode == "min" else value > than

    def on_epoch_end(self, trainer: Any, epoch: int, logs: Mapping[str, float]) -> None:
        value = _monitored(logs, self.monitor, "ModelCheckpoint")
        control, ckpt = self.control, self._ckpt
        step = int(control.live.step)
        if math.isnan(value) or any(s == step for s, _ in self.best):
            return
        full = self.keep is not None and len(self.best) >= self.keep
        if full and not self._better(value, self.best[-1][1]):
            return
        with control.paused("checkpoint"):
            # the one it displaces goes first: the save below is in flight while training goes on
            if full:
                ckpt.delete(self.best.pop()[0])
            try:
                save_live(control.live, ckpt, None, {"monitor": self.monitor, "value": value,
                                                     "epoch": epoch})
            except NonFiniteError as error:
                warnings.warn(f"ModelCheckpoint: {error}", RuntimeWarning, stacklevel=2)
                return
        self.best.append((step, value))
        self.best.sort(key=lambda entry: entry[1], reverse=self.mode == "max")
        if self.verbose:
            _say(trainer, f"epoch {epoch + 1}: {self.monitor} {value:.4g}, saved step {step} to "
                          f"{self.directory}")

    def _close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None

    def on_train_end(self, trainer: Any, history: History) -> None:
        if self.control is not None:
            with self.control.paused("checkpoint"):
                self._close()  # the last save complete
        else:
            self._close()

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self._close()


class LearningRateScheduler(Callback):
    """Set the learning rate at the beginning of every epoch from a function of the epoch (Keras'
    ``LearningRateScheduler``).

    The optimizer must carry its learning rate in its state: build it with
    `optax.inject_hyperparams` and a number, e.g.
    ``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``. The rate replaces the old one on
    the devices (nothing recompiles), is saved in checkpoints with the optimizer state (a run
    resumed inside an epoch goes on with it, as an uninterrupted run) and logged
    (``learning_rate``).

    Args:
        schedule: ``epoch -> rate`` or ``(epoch, rate) -> rate`` (``epoch`` from 0, ``rate`` the
            current one).
        verbose: 1: say each epoch's rate (on process 0).

    Raises:
        ValueError: when the fit starts, for an optimizer whose state has no learning rate to set
            (not built with `optax.inject_hyperparams`), or one whose rate is itself a schedule
            (optax computes it at every step: keep that schedule, or pass a number); at an epoch's
            beginning, for a rate that is not a finite number.

    Examples:
        >>> import flax.linen as nn, numpy as np, optax, jaxdist as jd
        >>> x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
        >>> data = [(x[i:i + 16], x[i:i + 16, :1]) for i in range(0, 64, 16)]
        >>> optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optimizer,
        ...                               lambda out, y: ((out - y) ** 2).mean())
        >>> halve = jd.training.LearningRateScheduler(lambda epoch, lr: lr / 2 if epoch else lr)
        >>> history = trainer.fit(data, epochs=3, verbose=0, callbacks=[halve])
        >>> [round(row["learning_rate"], 4) for row in history.epochs]
        [0.1, 0.05, 0.025]
    """

    def __init__(self, schedule: Callable[..., float], verbose: int = 0):
        if not callable(schedule):
            raise TypeError(f"LearningRateScheduler(schedule={schedule!r}): pass a function epoch "
                            "-> rate, or (epoch, rate) -> rate.")
        self.schedule, self.verbose = schedule, verbose
        try:
            parameters = inspect.signature(schedule).parameters.values()
            self._takes_rate = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                   for p in parameters) >= 2 \
                or any(p.kind == p.VAR_POSITIONAL for p in parameters)
        except (TypeError, ValueError):  # no signature (a builtin): as Keras, try both
            self._takes_rate = None

    def on_train_begin(self, trainer: Any) -> None:
        _rate(self.control.live.state.opt_state)  # refused now, before any step, when there is none
        self._first = True

    def on_epoch_begin(self, trainer: Any, epoch: int) -> None:
        control, live = self.control, self.control.live
        first, self._first = getattr(self, "_first", False), False
        spe = control.steps_per_epoch
        inside = live.step != epoch * spe if spe else control.data_position.index != 0
        if first and inside:  # resumed inside the epoch: its rate is in the state already
            return
        current = _rate(live.state.opt_state)
        if self._takes_rate is None:
            try:
                rate = self.schedule(epoch, current)
            except TypeError:
                rate = self.schedule(epoch)
        else:
            rate = self.schedule(epoch, current) if self._takes_rate else self.schedule(epoch)
        try:
            rate = float(rate)
        except (TypeError, ValueError):
            rate = math.nan
        if not math.isfinite(rate):
            raise ValueError(f"LearningRateScheduler: schedule({epoch}) returned {rate!r}: it must "
                             "return a finite number.")
        live.state = live.state._replace(opt_state=_set_rate(live.state.opt_state, rate))
        if self.verbose:
            _say(trainer, f"epoch {epoch + 1}: learning rate {rate:.4g}")


def _injected(node: Any) -> bool:
    """Whether ``node`` is an `optax.inject_hyperparams` state with a learning rate."""
    hyper = getattr(node, "hyperparams", None) if hasattr(node, "_fields") else None
    return isinstance(hyper, Mapping) and "learning_rate" in hyper


def _rate(opt_state: Any) -> float:
    """The learning rate an `optax.inject_hyperparams` state carries (the first), or ValueError."""
    found = [node for node in jax.tree.leaves(opt_state, is_leaf=_injected) if _injected(node)]
    if not found:
        raise ValueError(
            "LearningRateScheduler needs a learning rate it can set, and this optimizer's state "
            "carries none: build the optimizer with optax.inject_hyperparams and a number, e.g. "
            "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)."
        )
    if any("learning_rate" in (getattr(node, "hyperparams_states", None) or {}) for node in found):
        raise ValueError(
            "LearningRateScheduler cannot set this optimizer's learning rate: it is an optax "
            "schedule (optax.inject_hyperparams(...)(learning_rate=<a schedule>)), which optax "
            "computes again at every step. Pass a number as the learning rate and let "
            "LearningRateScheduler set it per epoch, or keep the optax schedule without this "
            "callback."
        )
    value = found[0].hyperparams["learning_rate"]
    if isinstance(value, jax.Array):
        value = value.addressable_data(0)  # this process's copy (a global array may span processes)
    return float(np.asarray(jax.device_get(value)))


def _set_rate(opt_state: Any, rate: float) -> Any:
    """``opt_state`` with every `optax.inject_hyperparams` learning rate set to ``rate``, in the
    layout of the rate it replaces (each process places its own devices' copies)."""

    def set_one(node: Any) -> Any:
        if not _injected(node):
            return node
        old = node.hyperparams["learning_rate"]
        host = np.full(np.shape(old), rate, dtype=old.dtype)
        new = (jax.make_array_from_callback(host.shape, old.sharding, lambda index: host[index])
               if isinstance(old, jax.Array) else host)
        return node._replace(hyperparams={**node.hyperparams, "learning_rate": new})

    return jax.tree.map(set_one, opt_state, is_leaf=_injected)


class DeleteBackups(Callback):
    """Delete ``fit``'s checkpoints once the run has finished (Keras'
    ``BackupAndRestore(delete_checkpoint=True)``).

    A run that FINISHED leaves its checkpoints, so the same command run again resumes at the end
    and trains nothing. With this callback, a run that ends by reaching its steps or epochs, or by a
    callback's stop (`EarlyStopping`), deletes its checkpoints (and the run's records beside them),
    as Keras does: the same command run again trains from scratch. A preempted or failed run keeps
    them, to resume from. The trainer keeps its state (``trainer.save(...)`` writes it elsewhere).

    Args:
        verbose: 1 (the default): say what it deleted (on process 0).

    Examples:
        >>> import os, tempfile, flax.linen as nn, numpy as np, optax, jaxdist as jd
        >>> data = [(np.ones((8, 2), np.float32), np.zeros((8, 1), np.float32))] * 4
        >>> backup = tempfile.mkdtemp()
        >>> def run():
        ...     trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1),
        ...                                   lambda out, y: ((out - y) ** 2).mean())
        ...     return trainer.fit(data, epochs=2, checkpoint_dir=backup, verbose=0,
        ...                        callbacks=[jd.training.DeleteBackups(verbose=0)])
        >>> first, again = run(), run()  # the second trains from scratch again
        >>> (len(first.epochs), len(again.epochs), [name for name in os.listdir(backup)
        ...                                         if name.isdigit()])
        (2, 2, [])
    """

    def __init__(self, verbose: int = 1):
        self.verbose = verbose

    def on_train_end(self, trainer: Any, history: History) -> None:
        control = self.control
        if control is None or control.checkpoint_dir is None or history.preempted:
            return
        control.delete_checkpoints()
        if self.verbose:
            _say(trainer, f"the run finished: deleted its checkpoints in {control.checkpoint_dir} "
                          "(DeleteBackups; a run again trains from scratch)")
