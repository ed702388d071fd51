"""`FitOptions`: ``Trainer.fit``'s keyword arguments as one value, checked once."""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Iterable, Sequence
from typing import Any

from jaxdist.training.callbacks import Callback
from jaxdist.training.loop._cadence import Cadence
from jaxdist.training.loop._hosts import check_ratio
from jaxdist.training.loop._profile import check_profile
from jaxdist.training.step import NonFinitePolicy, check_int

__all__ = ["FitOptions"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitOptions:
    """``Trainer.fit``'s keyword arguments (see it for each one), and the trainer's
    ``steps_per_run``; ``on_non_finite`` is kept as a `NonFinitePolicy`, ``callbacks`` as a tuple.

    Attributes:
        until: the step the run trains to: ``steps``, or ``epochs * steps_per_epoch`` (the smaller
            of the two when both are given); None when only ``epochs`` passes over the data bound
            the run.
        data_epochs: the passes over ``train_data`` that end the run (``epochs`` without
            ``steps_per_epoch``; None with it: an epoch is then ``steps_per_epoch`` steps of a
            stream that goes on across passes).
        counts_epochs: the run counts epochs (``epochs=`` or ``steps_per_epoch=`` given): progress
            lines and ``History`` show them, and the default checkpoint cadence saves at their ends.
        cadence: when checkpoints are saved besides the end and a preemption (`Cadence`; nothing
            without ``checkpoint_dir``).

    Raises:
        ValueError: for out-of-range numbers, ``eval_every`` without ``eval_data``, ``eval_data``
            given as an iterator (it would be read up by the first evaluation), ``profile_steps``
            that are not a window of steps or come without ``log_dir``, an unknown ``on_preemption``
            or ``on_non_finite``, or ``restore_step`` / ``on_non_finite="rollback"`` without
            ``checkpoint_dir``.

    Examples:
        >>> FitOptions(steps=100, log_every=10).on_non_finite.action
        'stop'
        >>> options = FitOptions(epochs=3, steps_per_epoch=70, checkpoint_dir="ckpt")
        >>> options.until, options.data_epochs, options.cadence.describe()
        (210, None, 'every epoch and every 10 min')
    """

    steps: int | None = None
    epochs: int | None = None
    steps_per_epoch: int | None = None
    eval_data: Any = None
    eval_every: int | str | None = None
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint_every: int | str | datetime.timedelta | None = None
    keep_checkpoints: int = 3
    local_checkpoint_dir: str | os.PathLike | None = None
    local_checkpoint_every: int | None = None
    async_checkpoints: bool = True
    log_every: int = 10
    log_dir: str | os.PathLike | None = None
    callbacks: Iterable[Callback] = ()
    verbose: str | int = "auto"
    on_preemption: str = "exit"
    restore_step: int | None = None
    step_timeout: float | None = None
    on_non_finite: str | NonFinitePolicy = "stop"
    straggler_ratio: float | None = 1.25
    profile_steps: tuple[int, int] | None = None
    profile_processes: int | Sequence[int] | str = (0,)
    steps_per_run: int = 1
    until: int | None = dataclasses.field(init=False, default=None)
    data_epochs: int | None = dataclasses.field(init=False, default=None)
    counts_epochs: bool = dataclasses.field(init=False, default=False)
    cadence: Cadence = dataclasses.field(init=False, default=Cadence())

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_non_finite", NonFinitePolicy.of(self.on_non_finite))
        object.__setattr__(self, "callbacks", tuple(self.callbacks))
        check_ratio(self.straggler_ratio)
        for name in ("steps", "epochs", "restore_step"):
            check_int(getattr(self, name), name, 0)
        check_int(self.steps_per_epoch, "steps_per_epoch", 1)
        check_int(self.steps_per_run, "steps_per_run", 1, allow_none=False)
        if self.eval_every != "epoch":
            try:
                check_int(self.eval_every, "eval_every", 1)
            except ValueError:
                raise ValueError(f"eval_every={self.eval_every!r} must be an int >= 1 (steps), "
                                 "'epoch', or None (at the end only).") from None
        counts = self.epochs is not None or self.steps_per_epoch is not None
        object.__setattr__(self, "counts_epochs", counts)
        backed_up = self.checkpoint_dir is not None or self.checkpoint_every is not None
        object.__setattr__(self, "cadence", Cadence.of(self.checkpoint_every, counts)
                           if backed_up else Cadence())
        until = self.steps
        if self.steps_per_epoch is not None and self.epochs is not None:
            by_epochs = self.epochs * self.steps_per_epoch
            until = by_epochs if until is None else min(until, by_epochs)
        object.__setattr__(self, "until", until)
        object.__setattr__(self, "data_epochs",
                           None if self.steps_per_epoch is not None else self.epochs)
        check_int(self.local_checkpoint_every, "local_checkpoint_every", 1)
        check_int(self.log_every, "log_every", 1, allow_none=False)
        timeout = self.step_timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise ValueError(f"step_timeout={timeout!r} must be a number of seconds > 0, or None "
                             "(not watched).")
        if self.eval_every is not None and self.eval_data is None:
            raise ValueError(f"eval_every={self.eval_every} needs eval_data=... to evaluate on.")
        data = self.eval_data
        if data is not None and isinstance(data, Iterable) and iter(data) is data:
            raise ValueError("eval_data is an iterator, which can be read only once: pass a list "
                             "of batches or a function returning a fresh iterable.")
        check_profile(self.profile_steps, self.profile_processes, self.log_dir)
        if self.on_preemption not in ("exit", "return"):
            raise ValueError(f"on_preemption={self.on_preemption!r} must be 'exit' or 'return'.")
        if self.on_non_finite.action == "rollback" and self.checkpoint_dir is None:
            raise ValueError("on_non_finite='rollback' needs checkpoint_dir=... (it restores the "
                             "last finite checkpoint): pass one (with checkpoint_every=...), or "
                             "use on_non_finite='skip' or 'stop'.")
        self._check_local()
        if self.restore_step is not None and self.checkpoint_dir is None:
            raise ValueError(f"restore_step={self.restore_step} needs checkpoint_dir=... (the "
                             "directory holding that checkpoint).")

    def _check_local(self) -> None:
        """The local tier (`jaxdist.training.checkpoints.LocalCheckpointer`) comes with the
        persistent one."""
        local, every = self.local_checkpoint_dir, self.local_checkpoint_every
        if (local is None) != (every is None):
            given = (f"local_checkpoint_dir={local!r}" if every is None
                     else f"local_checkpoint_every={every!r}")
            raise ValueError(f"{given} needs the other one: pass both local_checkpoint_dir=... "
                             "(each process's own directory, e.g. '/mnt/ssd/ckpt-{process}') and "
                             "local_checkpoint_every=N.")
        if local is not None and self.checkpoint_dir is None:
            raise ValueError(f"local_checkpoint_dir={local!r} needs checkpoint_dir=... (the "
                             "persistent tier a restart falls back to when the local copies cannot "
                             "assemble a step).")

    def run_length(self, step: int) -> int:
        """The steps the next dispatch at ``step`` runs: 1, or (``steps_per_run > 1``) an on-device
        loop's, which ends at the next log, evaluation or checkpoint point (and at ``steps``).

        Examples:
            >>> FitOptions(steps=100, log_every=10, steps_per_run=4).run_length(8)
            2
        """
        if self.steps_per_run == 1:
            return 1
        every = (self.log_every, self.eval_every, self.cadence.steps, self.steps_per_epoch,
                 self.local_checkpoint_every)
        stops = [(step // n + 1) * n for n in every if isinstance(n, int) and n]
        if self.until is not None:
            stops.append(max(self.until, step + 1))
        return min(self.steps_per_run, min(stops) - step)
