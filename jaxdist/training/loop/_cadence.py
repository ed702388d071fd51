"""When ``fit`` backs a run up: ``checkpoint_every`` read as a `Cadence` (steps, epochs, minutes),
and its default.

``fit(checkpoint_dir=...)`` saves a checkpoint (a backup: what the run resumes from) at the end, on
preemption and on a cadence, so that a run killed without warning (SIGKILL, the OOM killer, a lost
machine) loses a bounded part of its work. ``checkpoint_every`` says when:

* an int N: every N steps;
* ``"epoch"``: at the end of every epoch (Keras' ``BackupAndRestore(save_freq="epoch")``);
* a `datetime.timedelta`: at the first log point after that much time since the last checkpoint
  (process 0's clock decides, and every process saves at the same step: the stop agreement carries
  the request, `jaxdist.training.loop._preemption`);
* None (the default): ``"epoch"`` when the fit counts epochs (``epochs=`` or ``steps_per_epoch=``),
  and in any case every `BACKUP_EVERY` (10 minutes) too, so that a long epoch (or a run without
  epochs) is backed up as well.

Why time: a save costs the host about 0.1 s whatever a small model's size (82 to 113 ms for 32 KiB
as for 516 KiB of state, on 8 CPU devices), so a default counted in steps is too often for quick
steps (every 50 steps took 18 to 29% of such a run) and too rare for slow ones, while 0.1 s every
10 minutes is 0.02%, and a large model's save of seconds stays under 1%. Epochs are where Keras'
``BackupAndRestore`` backs up; to save less often with short epochs, pass a timedelta or a step
count.

A kill loses the steps since the last complete backup: at most one epoch or `BACKUP_EVERY` plus one
log window (whichever is shorter), plus those taken while that backup was being written.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

__all__ = ["BACKUP_EVERY", "Cadence"]

BACKUP_EVERY = datetime.timedelta(minutes=10)
"""The time between backups that ``checkpoint_every=None`` (the default) adds to its epochs (see the
module)."""


@dataclasses.dataclass(frozen=True)
class Cadence:
    """When ``fit`` saves a checkpoint besides the end and a preemption.

    Attributes:
        steps: every this many steps, or None.
        epoch: at the end of every epoch.
        seconds: at the first log point this long after the last checkpoint (or the start), or None.
        default: it is the default (``checkpoint_every=None``).

    Examples:
        >>> Cadence.of(None, counts_epochs=True).describe()
        'every epoch and every 10 min'
        >>> (Cadence.of(50, counts_epochs=False).steps,
        ...  Cadence.of("epoch", counts_epochs=True).describe())
        (50, 'every epoch')
    """

    steps: int | None = None
    epoch: bool = False
    seconds: float | None = None
    default: bool = False

    @classmethod
    def of(cls, every: Any, counts_epochs: bool) -> Cadence:
        """``checkpoint_every`` read (``counts_epochs``: the fit has ``epochs=`` or
        ``steps_per_epoch=``).

        Raises:
            ValueError: for a value that is none of None, an int >= 1, ``"epoch"``, a positive
                `datetime.timedelta`.
        """
        if every is None:
            return cls(epoch=counts_epochs, seconds=BACKUP_EVERY.total_seconds(), default=True)
        if isinstance(every, int) and not isinstance(every, bool) and every >= 1:
            return cls(steps=every)
        if every == "epoch":
            return cls(epoch=True)
        if isinstance(every, datetime.timedelta) and every.total_seconds() > 0:
            return cls(seconds=every.total_seconds())
        raise ValueError(f"checkpoint_every={every!r} must be an int >= 1 (steps), 'epoch', a "
                         "datetime.timedelta > 0 (time), or None (the default: every epoch when "
                         "the fit counts epochs, and every 10 minutes).")

    def describe(self) -> str:
        """In words: ``'every 100 steps'``, ``'every epoch and every 10 min'``."""
        parts = []
        if self.steps:
            parts.append(f"every {self.steps} step{'s' if self.steps != 1 else ''}")
        if self.epoch:
            parts.append("every epoch")
        if self.seconds:
            parts.append(f"every {_duration(self.seconds)}")
        return " and ".join(parts)


def _duration(seconds: float) -> str:
    """``10 min``, ``30 s``, ``1.5 h``."""
    if seconds >= 3600 and seconds % 360 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 6 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"
