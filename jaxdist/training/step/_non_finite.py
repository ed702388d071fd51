"""Non-finite losses and gradients: detected on the devices, decided at the host's next look, never
saved.

A loss spike that turns the loss or the gradients into ``nan`` / ``inf`` is the most common way a
long run dies. ``Trainer.fit(on_non_finite=...)`` (`NonFinitePolicy`) decides what happens then;
this module is all of it:

* On the device, each train step computes its flag (`step_flag`) and adds its record to the running
  sums (`NonFiniteRecord`); nothing is read per step. Under ``"skip"`` a flagged step keeps its
  state (`keep_if_finite`).
* On the host, at a look (a log window read, a checkpoint), `NonFiniteGuard` reads the windows so
  far (`Window`) and the policy acts.
* Never saved: the trainer refuses a state that `non_finite_leaves` finds, so the rotation of
  checkpoints only ever deletes finite checkpoints older than the newest finite one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["ACTIONS", "COUNT", "FLAG", "MAX_CONSECUTIVE_SKIPS", "MAX_ROLLBACKS", "NonFiniteError",
           "NonFiniteGuard", "NonFinitePolicy", "NonFiniteRecord", "Window", "keep_if_finite",
           "log_values", "non_finite_leaves", "step_flag"]

FLAG = "non_finite"
"""The train step's addend: 1.0 when its loss or gradient norm is not finite, else 0.0."""


class NonFiniteError(FloatingPointError):
    """A training run's loss or gradients (or state) are not finite: ``fit`` stopped, saving none.

    Attributes:
        step: the first step whose loss or gradients were not finite (or whose state was not).
        count: how many steps were not finite when the run stopped.
        checkpoint: the newest checkpoint (all are finite), or None when there is none.
        directory: the checkpoint directory, or None.
        on_every_process: True: every process of a job raises it at the same step, so ``fit`` does
            not report it to the peers as this process's failure (`jaxdist.job`), and a job that
            catches it goes on (e.g. resumes from ``checkpoint``).

    Examples:
        >>> error = NonFiniteError("nan", step=40, count=3, checkpoint=30, directory="/c")
        >>> isinstance(error, FloatingPointError), error.step, error.checkpoint
        (True, 40, 30)
    """

    on_every_process = True

    def __init__(self, message: str, *, step: int, count: int, checkpoint: int | None,
                 directory: str | None):
        super().__init__(message)
        self.step, self.count, self.checkpoint, self.directory = step, count, checkpoint, directory

    def __reduce__(self) -> tuple:  # picklable (keyword-only arguments)
        return _rebuild, (str(self), self.step, self.count, self.checkpoint, self.directory)


def _rebuild(message: str, step: int, count: int, checkpoint: int | None,
             directory: str | None) -> NonFiniteError:
    return NonFiniteError(message, step=step, count=count, checkpoint=checkpoint,
                          directory=directory)


def step_flag(loss: jax.Array, grads: Any) -> jax.Array:
    """1.0 (float32) when ``loss`` or the global norm of ``grads`` is not finite, else 0.0.

    Inside a compiled step over global arrays both are global reductions: every replica and process
    gets the same flag.

    Examples:
        >>> import jax.numpy as jnp
        >>> (float(step_flag(jnp.float32(1.0), {"w": jnp.ones(2)})),
        ...  float(step_flag(jnp.nan, {"w": jnp.ones(2)})))
        (0.0, 1.0)
        >>> float(step_flag(jnp.float32(1.0), {"w": jnp.array([1.0, jnp.inf])}))
        1.0
        >>> # finite, norm > fp16 max
        >>> float(step_flag(jnp.float32(1.0), {"w": jnp.full(4, 300.0, jnp.float16)}))
        0.0
    """
    # Every gradient entry finite (what a finite global norm means, without squaring in the
    # gradients' own dtype: a float16 norm overflows to inf for gradients that are all finite).
    finite = jnp.isfinite(jnp.asarray(loss, jnp.float32))
    for g in jax.tree.leaves(grads):
        finite = finite & jnp.isfinite(g).all()
    return jnp.where(finite, 0.0, 1.0).astype(jnp.float32)


def keep_if_finite(flag: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``flag`` is 0.0, else ``old`` (optax's ``apply_if_finite``, as a select).

    Examples:
        >>> import jax.numpy as jnp
        >>> keep_if_finite(jnp.float32(1.0), {"w": jnp.array(jnp.nan)},
        ...                {"w": jnp.array(2.0)})["w"].tolist()
        2.0
    """
    return optax.tree.where(flag == 0.0, new, old)


class NonFiniteRecord(NamedTuple):
    """The non-finite steps of a window of steps, as the running sums carry them on the devices
    (`jaxdist.training.RunningSums.non_finite`): enough for the host to find the first bad step and
    the runs of bad steps across windows (`NonFiniteGuard`). Every field is an int32 count.

    Attributes:
        count: how many steps were not finite.
        first: how many steps came before the first non-finite one (0 when none was).
        lead: how many non-finite steps in a row open the window.
        run: how many close it (so far).
        longest: the longest run of non-finite steps in it.

    Records compose (`then`): the record of a window is that of its first part followed by that of
    the rest, so each step adds its own record (`of_step`) inside the compiled step.

    Examples:
        >>> import jax.numpy as jnp
        >>> record, steps = NonFiniteRecord.zeros(), 0
        >>> for flag in (0.0, 1.0, 1.0, 0.0, 1.0):
        ...     record = record.then(NonFiniteRecord.of_step(jnp.float32(flag)), steps, 1)
        ...     steps += 1
        >>> [int(v) for v in record]  # 3 bad; first after 1 step; none opens; 1 closes; 2 in a row
        [3, 1, 0, 1, 2]
    """

    count: Any
    first: Any
    lead: Any
    run: Any
    longest: Any

    @classmethod
    def zeros(cls) -> NonFiniteRecord:
        """The record of no steps (host zeros, int32)."""
        return cls(*(np.zeros((), np.int32) for _ in cls._fields))

    @classmethod
    def of_step(cls, flag: jax.Array | None) -> NonFiniteRecord:
        """The record of one step whose `step_flag` is ``flag`` (None: no flag, finite)."""
        if flag is None:
            return cls.zeros()
        bad = (jnp.asarray(flag) > 0).astype(jnp.int32)
        return cls(bad, jnp.zeros((), jnp.int32), bad, bad, bad)

    def then(self, later: NonFiniteRecord, steps: Any, later_steps: Any) -> NonFiniteRecord:
        """The record of this window (``steps`` steps) followed by ``later`` (``later_steps``)."""
        count, first, lead, run, longest = self
        count2, first2, lead2, run2, longest2 = later
        return NonFiniteRecord(
            count + count2,
            jnp.where((count == 0) & (count2 > 0), steps + first2, first),
            jnp.where(lead == steps, lead + lead2, lead),
            jnp.where(run2 == later_steps, run + run2, run2),
            jnp.maximum(jnp.maximum(longest, longest2), run + lead2),
        )


def _kinds(tree: Any, name: str) -> list[tuple[str, jax.Array, bool]]:
    """``(path, leaf, only_nan)`` for the floating leaves of one part of a state."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.inexact):
            out.append((f".{name}{jax.tree_util.keystr(path)}", leaf, name == "opt_state"))
    return out


def _all_finite(leaves: list[jax.Array], only_nan: tuple[bool, ...]) -> jax.Array:
    return jnp.stack([jnp.any(jnp.isnan(x) if nan else ~jnp.isfinite(x))
                      for x, nan in zip(leaves, only_nan, strict=True)])


_PROGRAM = jax.jit(_all_finite, static_argnums=1)


def non_finite_leaves(state: Any) -> list[str]:
    """The paths of ``state``'s leaves (a `TrainState`) that hold a NaN, or an infinity in the
    parameters or model state, read on the devices (one program; only one flag per leaf comes back).

    The optimizer state may hold infinities by design (``optax.contrib.reduce_on_plateau`` starts
    its best value at ``inf``), so only NaN counts there; a diverged optimizer state makes the
    parameters non-finite with it. Every process of a job gets the same answer (global reductions).

    Args:
        state: a `TrainState` (``params``, ``opt_state`` and ``model_state`` are read).

    Returns:
        The non-finite leaves' paths (e.g. ``".params['Dense_0']['kernel']"``); empty: all finite.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxdist.training.step._functions import TrainState
        >>> state = TrainState(jnp.int32(0), {"w": jnp.array([1.0, jnp.nan])},
        ...                    (jnp.array(jnp.inf),), {}, None)
        >>> non_finite_leaves(state)
        [".params['w']"]
    """
    leaves = [*_kinds(state.params, "params"), *_kinds(state.model_state, "model_state"),
              *_kinds(state.opt_state, "opt_state")]
    if not leaves:
        return []
    with jax.set_mesh(None):  # the arrays' own shardings decide (a strategy's scope may be open)
        flags = np.asarray(_PROGRAM([leaf for _, leaf, _ in leaves],
                                    tuple(nan for _, _, nan in leaves)))
    return [path for (path, _, _), bad in zip(leaves, flags, strict=True) if bad]


# The host's part: the policy, and the guard that applies it at each look.

ACTIONS = ("stop", "skip", "rollback", "continue")
"""The values of ``on_non_finite``."""

MAX_CONSECUTIVE_SKIPS = 10
"""``"skip"`` stops (as ``"stop"``) after this many skipped steps in a row: isolated bad batches are
skipped; a run whose every step is non-finite from some step on has diverged, and skipping cannot
bring it back."""

MAX_ROLLBACKS = 3
"""``"rollback"`` goes back to the last finite checkpoint at most this many times in a ``fit``."""

COUNT = "non_finite_steps"
"""The log's entry of the non-finite steps in a log window."""


@dataclasses.dataclass(frozen=True)
class NonFinitePolicy:
    """What ``Trainer.fit(on_non_finite=...)`` does when a step's loss or gradients are not finite.

    Attributes:
        action: ``"stop"`` (default): raise `NonFiniteError` (a `FloatingPointError`) naming the
            first bad step, the last finite checkpoint and how to resume; nothing more is saved.
            ``"skip"``: the bad steps change nothing (parameters, optimizer and model state kept;
            the step counter and the data move on), the logs count them; ``max_consecutive_skips``
            in a row stop as ``"stop"``. ``"rollback"``: restore the last finite checkpoint (needs
            ``checkpoint_dir``) and go on with the data from where it is, past the bad batches; at
            most ``max_rollbacks`` times, then stop. ``"continue"``: train on, with one
            warning; non-finite states are still not saved (a warning each).
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
        ValueError: on_non_finite='retry' is not a policy: pass one of 'stop', 'skip', 'rollback', \
'continue' (or a jd.training.NonFinitePolicy).
    """

    action: str = "stop"
    max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS
    max_rollbacks: int = MAX_ROLLBACKS

    def __post_init__(self) -> None:
        if not isinstance(self.action, str) or self.action not in ACTIONS:
            raise ValueError(f"on_non_finite={self.action!r} is not a policy: pass one of "
                             f"{', '.join(map(repr, ACTIONS))} (or a jd.training.NonFinitePolicy).")
        for name in ("max_consecutive_skips", "max_rollbacks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"NonFinitePolicy({name}={value!r}): it must be an int >= 1.")

    @classmethod
    def of(cls, value: str | NonFinitePolicy) -> NonFinitePolicy:
        """``value`` as a policy: a `NonFinitePolicy` as is, an action name with default counts.

        Raises:
            ValueError: for anything else (naming ``on_non_finite``, the value and the choices).
        """
        return value if isinstance(value, NonFinitePolicy) else cls(value)


@dataclasses.dataclass(frozen=True)
class Window:
    """The non-finite steps of one window, read on the host from the sums' `NonFiniteRecord`.

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
        """The window of ``steps`` steps with ``record`` (host values: ``PackedSums.to_host``)."""
        return cls(int(steps), *(int(v) for v in record))


class NonFiniteGuard:
    """The host's record of the non-finite steps seen at its looks, and the error that names them.

    ``fit`` hands it every log window it reads, in step order (`observe`); `pending` says whether
    it saw steps the loop has not acted on; `error` builds the `NonFiniteError`; `restart` starts
    over after a rollback.

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
        self.total = 0  # non-finite steps seen in this fit (skipped and rolled back included)
        self.fit_start = step  # a first step that is already not finite points at the inputs
        self.restart(step)

    def restart(self, step: int) -> None:
        """Forget the steps seen (after a rollback to ``step``; `total` stays)."""
        self._start = step  # the step the next window starts after
        self.first: int | None = None  # the first non-finite step since the start (or rollback)
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
        self._trailing = (self._trailing + window.steps if window.lead == window.steps
                          else window.run)

    def error(self, what: str, checkpoint: int | None, directory: str | None) -> NonFiniteError:
        """The `NonFiniteError` for the steps seen: ``what`` happened (e.g. "the run stopped"),
        ``checkpoint`` the newest one in ``directory``."""
        first = self.first if self.first is not None else self._start
        if checkpoint is None:
            where = ("there is no checkpoint to resume from (pass checkpoint_dir=... and "
                     "checkpoint_every=... to keep some)" if directory is None
                     else f"{directory!r} holds no checkpoint before it")
        else:
            where = (f"the last finite checkpoint is step {checkpoint} in {directory!r}: resume "
                     f"from it with fit(..., checkpoint_dir={directory!r}, "
                     f"restore_step={checkpoint})")
        inputs = ""
        if first == self.fit_start + 1:  # nothing trained yet: the data is the likelier cause
            inputs = (" The first step of this fit was not finite, which points at the inputs "
                      "first: integer labels outside the logits' classes (each label must be in "
                      "[0, number of classes)), NaN or inf in the batch, an empty batch; then at "
                      "the learning rate.")
        message = (f"the loss or gradients of step {first} were not finite ({self.total} "
                   f"non-finite step{'s' if self.total != 1 else ''} so far); {what}.{inputs} No "
                   f"non-finite state was saved; {where}, with a lower learning rate, gradient "
                   "clipping (clip_grad_norm=...), or on_non_finite='skip' / 'rollback'.")
        return NonFiniteError(message, step=first, count=self.total, checkpoint=checkpoint,
                              directory=directory)


def log_values(window: Window | None) -> Mapping[str, float]:
    """What a log row adds for ``window``: ``{"non_finite_steps": n}`` when any step was not finite.

    Examples:
        >>> (log_values(Window(steps=10, count=2, first=3, lead=0, run=1, longest=1)),
        ...  log_values(None))
        ({'non_finite_steps': 2}, {})
    """
    return {COUNT: window.count} if window is not None and window.count else {}
