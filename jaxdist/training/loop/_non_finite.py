"""Non-finite steps, decided on the host: the policy of ``Trainer.fit(on_non_finite=...)`` and the guard that
applies it.

The steps detect and (under ``"skip"``) skip non-finite steps on the devices (`jaxdist.training.step`: each adds
its `NonFiniteRecord` to the running sums). At a look (a log window read, a checkpoint) the host reads the
windows so far (`Window`) and `NonFiniteGuard` decides: ``"stop"`` raises `NonFiniteError` (a
`FloatingPointError`), ``"skip"`` raises it after ``max_consecutive_skips`` skipped steps in a row,
``"rollback"`` goes back to the last checkpoint (at most ``max_rollbacks`` times), ``"continue"`` warns once
and trains on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxdist.training.step import NonFiniteError, NonFiniteRecord

__all__ = [
    "ACTIONS",
    "COUNT",
    "MAX_CONSECUTIVE_SKIPS",
    "MAX_ROLLBACKS",
    "NonFiniteError",
    "NonFiniteGuard",
    "NonFinitePolicy",
    "Window",
    "log_values",
]

ACTIONS = ("stop", "skip", "rollback", "continue")
"""The values of ``on_non_finite``."""

MAX_CONSECUTIVE_SKIPS = 10
"""``"skip"`` stops (as ``"stop"``) after this many skipped steps in a row: isolated bad batches are skipped; a
run whose every step is non-finite from some step on has diverged, and skipping cannot bring it back."""

MAX_ROLLBACKS = 3
"""``"rollback"`` goes back to the last finite checkpoint at most this many times in one ``fit``, then stops."""

COUNT = "non_finite_steps"
"""The log's entry of the non-finite steps in a log window."""


@dataclasses.dataclass(frozen=True)
class NonFinitePolicy:
    """What ``Trainer.fit`` does when a step's loss or gradients are not finite (``fit(on_non_finite=...)``
    takes one, or just its ``action``).

    Attributes:
        action: ``"stop"`` (default): raise `NonFiniteError` (a `FloatingPointError`) naming the first bad
            step, the last finite checkpoint and how to resume; nothing more is saved. ``"skip"``: the bad
            steps change nothing (parameters, optimizer and model state kept; the step counter and the data
            move on), the logs count them; ``max_consecutive_skips`` in a row stop as ``"stop"``.
            ``"rollback"``: restore the last finite checkpoint (needs ``checkpoint_dir``) and go on with the
            data from where it is, past the bad batches; at most ``max_rollbacks`` times, then stop.
            ``"continue"``: train on (the old behaviour), with one warning; non-finite states are still
            not saved (a warning each).
        max_consecutive_skips: ``"skip"`` only: skipped steps in a row that stop the run.
        max_rollbacks: ``"rollback"`` only: rollbacks in one ``fit`` before it stops.

    Raises:
        ValueError: for an unknown action or a count < 1.

    Examples:
        >>> NonFinitePolicy.of("skip").max_consecutive_skips
        10
        >>> NonFinitePolicy.of("rollback") == NonFinitePolicy("rollback", max_rollbacks=3)
        True
        >>> NonFinitePolicy("retry")
        Traceback (most recent call last):
        ValueError: on_non_finite='retry' is not a policy: pass one of 'stop', 'skip', 'rollback', 'continue' \
(or a jd.training.NonFinitePolicy).
    """

    action: str = "stop"
    max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS
    max_rollbacks: int = MAX_ROLLBACKS

    def __post_init__(self) -> None:
        if not isinstance(self.action, str) or self.action not in ACTIONS:
            raise ValueError(
                f"on_non_finite={self.action!r} is not a policy: pass one of "
                f"{', '.join(map(repr, ACTIONS))} (or a jd.training.NonFinitePolicy)."
            )
        for name in ("max_consecutive_skips", "max_rollbacks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"NonFinitePolicy({name}={value!r}): it must be an int >= 1.")

    @classmethod
    def of(cls, value: str | NonFinitePolicy) -> NonFinitePolicy:
        """``value`` as a policy: a `NonFinitePolicy` as it is, an action name with the default counts.

        Raises:
            ValueError: for anything else (naming ``on_non_finite``, the value and the choices).
        """
        return value if isinstance(value, NonFinitePolicy) else cls(value)


@dataclasses.dataclass(frozen=True)
class Window:
    """The non-finite steps of one window of steps, read on the host from the running sums (`NonFiniteRecord`).

    Examples:
        >>> import numpy as np
        >>> record = NonFiniteRecord(*np.array([2, 3, 0, 1, 1], np.int32))
        >>> Window.of(record, steps=10)
        Window(steps=10, count=2, first=3, lead=0, run=1, longest=1)
    """

    steps: int
    count: int
    first: int
    lead: int
    run: int
    longest: int

    @classmethod
    def of(cls, record: NonFiniteRecord, steps: Any) -> Window:
        """The window of ``steps`` steps whose record is ``record`` (host values: see ``PackedSums.to_host``)."""
        return cls(int(steps), *(int(v) for v in record))


class NonFiniteGuard:
    """The host's record of the non-finite steps seen at its looks, and the error that names them.

    ``fit`` hands it every log window it reads (`observe`, in step order; before a checkpoint whose open window
    holds non-finite steps it closes that window first); `pending` says whether it saw steps the loop has not
    acted on yet; `error` builds the `NonFiniteError`; `restart` starts over after a rollback.

    Args:
        policy: the `NonFinitePolicy`.
        step: the step the first window starts after.

    Examples:
        >>> guard = NonFiniteGuard(NonFinitePolicy("skip", max_consecutive_skips=3), step=0)
        >>> guard.observe(10, Window(steps=10, count=2, first=8, lead=0, run=2, longest=2))
        >>> guard.pending, guard.first, guard.longest_run
        (True, 9, 2)
        >>> guard.acted()
        >>> guard.observe(20, Window(steps=10, count=1, first=0, lead=1, run=0, longest=1))
        >>> guard.longest_run, guard.too_many_in_a_row, guard.total  # steps 9, 10 and 11 in a row
        (3, True, 3)
    """

    def __init__(self, policy: NonFinitePolicy, step: int):
        self.policy = policy
        self.total = 0  # non-finite steps seen in this fit (skipped ones and rolled-back ones included)
        self.fit_start = step  # a first step that is already not finite points at the inputs
        self.restart(step)

    def restart(self, step: int) -> None:
        """Forget the steps seen (after a rollback to ``step``; `total` stays)."""
        self._start = step  # the step the next window starts after
        self.first: int | None = None  # the first non-finite step since the start (or the last rollback)
        self._trailing = 0  # non-finite steps in a row up to the end of the last window
        self.longest_run = 0
        self._pending = False

    @property
    def pending(self) -> bool:
        """Whether non-finite steps were seen since the loop last acted (`acted`)."""
        return self._pending

    def acted(self) -> None:
        """The loop has acted on the steps seen so far (skipped them, warned)."""
        self._pending = False

    @property
    def too_many_in_a_row(self) -> bool:
        """Whether a run of non-finite steps reached the policy's ``max_consecutive_skips``."""
        return self.longest_run >= self.policy.max_consecutive_skips

    def observe(self, end: int, window: Window | None) -> None:
        """Record the window of steps after the previous window's end up to step ``end``."""
        start, self._start = self._start, end
        if window is None or not window.steps:
            return
        if window.count:
            if self.first is None:
                self.first = start + window.first + 1
            self.total += window.count
            self._pending = True
            self.longest_run = max(self.longest_run, window.longest, self._trailing + window.lead)
        self._trailing = self._trailing + window.steps if window.lead == window.steps else window.run

    def error(self, what: str, checkpoint: int | None, directory: str | None) -> NonFiniteError:
        """The `NonFiniteError` for the steps seen: ``what`` happened (e.g. "the run stopped"), ``checkpoint``
        the newest one in ``directory``."""
        first = self.first if self.first is not None else self._start
        if checkpoint is None:
            where = ("there is no checkpoint to resume from (pass checkpoint_dir=... and checkpoint_every=... to "
                     "keep some)" if directory is None else f"{directory!r} holds no checkpoint before it")
        else:
            where = (f"the last finite checkpoint is step {checkpoint} in {directory!r}: resume from it with "
                     f"fit(..., checkpoint_dir={directory!r}, restore_step={checkpoint})")
        inputs = ""
        if first == self.fit_start + 1:  # nothing trained yet: the data is the likelier cause than the optimizer
            inputs = (" The first step of this fit was not finite, which points at the inputs first: integer labels "
                      "outside the logits' classes (each label must be in [0, number of classes)), NaN or inf in "
                      "the batch, an empty batch; then at the learning rate.")
        message = (
            f"the loss or gradients of step {first} were not finite ({self.total} non-finite step"
            f"{'s' if self.total != 1 else ''} so far); {what}.{inputs} No non-finite state was saved; {where}, with "
            "a lower learning rate, gradient clipping (clip_grad_norm=...), or on_non_finite='skip' / 'rollback'."
        )
        return NonFiniteError(message, step=first, count=self.total, checkpoint=checkpoint, directory=directory)


def log_values(window: Window | None) -> Mapping[str, float]:
    """What a log row adds for ``window``: ``{"non_finite_steps": n}`` when any of its steps was not finite.

    Examples:
        >>> log_values(Window(steps=10, count=2, first=3, lead=0, run=1, longest=1)), log_values(None)
        ({'non_finite_steps': 2}, {})
    """
    return {COUNT: window.count} if window is not None and window.count else {}
