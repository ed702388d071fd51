"""Damaged checkpoints: telling damage from other failures, one clear error, and reads that fail quietly.

A checkpoint whose stored bytes are wrong or missing (tensorstore's checksums catch flipped bytes in its index
files; a file can be missing) fails a read with tensorstore's status and a long JSON spec. Here that becomes
one `CheckpointCorruptedError` naming the step, the directory and the newest older checkpoint that restores,
with the fix; `jaxdist.training.checkpoint.Checkpointer.read` does the search. Failures that are not damage
(memory, network) pass through unchanged.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["CheckpointCorruptedError", "SettlingArrayHandler", "UnsearchedDamage", "damage_summary", "is_damage"]

# tensorstore / absl status codes that mean the stored bytes are wrong or missing (not memory, network, ...).
_DAMAGE_CODES = frozenset({"DATA_LOSS", "NOT_FOUND", "OUT_OF_RANGE", "INVALID_ARGUMENT", "FAILED_PRECONDITION"})


class CheckpointCorruptedError(RuntimeError):
    """A checkpoint whose files cannot be read (damaged, truncated or partly deleted), with the way out.

    Raised by `Checkpointer.restore`, `Checkpointer.meta`, `Checkpointer.data_iterator_state` (all through
    `Checkpointer.read`), ``Trainer.restore`` and ``Trainer.fit``'s resume. The message names the step, the
    directory, a one-line cause, and the newest OLDER checkpoint that restores with the same target (each one
    tried, newest first; not merely present), e.g. ``checkpoint 20 in '/ckpt' is unreadable (DATA_LOSS in
    state/d/1f...: CRC-32C checksum verification failed ...): delete /ckpt/20 to resume from 10, or pass
    restore_step=10.`` The full error from orbax / tensorstore is kept as ``__context__`` (not printed).

    Args:
        step: the unreadable checkpoint's step.
        directory: the checkpoint directory.
        reason: a one-line cause.
        intact_step: the newest older step that restores (None: none does).
        failed: the older steps tried that do not restore either, newest first.
        latest: whether ``step`` is the newest checkpoint (then deleting it, and ``failed``, resumes from
            ``intact_step``).
        step_argument: the argument that picks a step, for the fix (``"step"``; ``fit``: ``"restore_step"``).

    Example:
        >>> error = CheckpointCorruptedError(20, "/c", "DATA_LOSS in state/d/1f", intact_step=10)
        >>> print(error)
        checkpoint 20 in '/c' is unreadable (DATA_LOSS in state/d/1f): delete /c/20 to resume from 10, or pass step=10.
        >>> error.step, error.intact_step, isinstance(error, RuntimeError)
        (20, 10, True)
    """

    def __init__(
        self,
        step: int,
        directory: str,
        reason: str,
        intact_step: int | None = None,
        failed: Sequence[int] = (),
        *,
        latest: bool = True,
        step_argument: str = "step",
    ):
        self.step, self.directory, self.reason = int(step), str(directory), str(reason)
        self.intact_step = None if intact_step is None else int(intact_step)
        self.failed, self.latest, self.step_argument = tuple(int(s) for s in failed), bool(latest), step_argument
        super().__init__(self._message())

    def _message(self) -> str:
        head = f"checkpoint {self.step} in {self.directory!r} is unreadable ({self.reason})"
        failed = ", ".join(map(str, self.failed))
        if self.intact_step is None:
            older = f"no older checkpoint restores ({failed} failed too)" if self.failed else "there is no older one"
            return f"{head}, and {older}: nothing here can resume this run; start again in an empty directory."
        also = f" ({failed} failed too)" if self.failed else ""
        fix = f"pass {self.step_argument}={self.intact_step}"
        if not self.latest:
            return f"{head}; the newest older checkpoint that restores is {self.intact_step}{also}: {fix}."
        doomed = " and ".join(os.path.join(self.directory, str(s)) for s in (self.step, *self.failed))
        return f"{head}: delete {doomed} to resume from {self.intact_step}, or {fix}."

    def __reduce__(self) -> tuple:  # picklable (the constructor does not take the message)
        kwargs = {"latest": self.latest, "step_argument": self.step_argument}
        return _rebuild, (self.step, self.directory, self.reason, self.intact_step, self.failed, kwargs)


def _rebuild(*args: Any) -> CheckpointCorruptedError:
    *positional, kwargs = args
    return CheckpointCorruptedError(*positional, **kwargs)


class UnsearchedDamage(CheckpointCorruptedError):
    """Raised where the damage is found; `Checkpointer.read` replaces it once it has tried the older steps."""

    def _message(self) -> str:
        return f"checkpoint {self.step} in {self.directory!r} is unreadable ({self.reason})."


def is_damage(error: BaseException) -> bool:
    """Whether ``error`` (from reading a checkpoint that passed the fingerprint check) means damaged files."""
    if isinstance(error, (FileNotFoundError, EOFError, UnicodeDecodeError, json.JSONDecodeError)):
        return True
    code = re.match(r"([A-Z_]+): ", str(error))
    return code is not None and code.group(1) in _DAMAGE_CODES


def damage_summary(error: BaseException, step_dir: str) -> str:
    """One short line for ``error``: tensorstore's status, the damaged file (relative to the step directory) and
    its cause, without the JSON specs (about 2 KB) and the chain of drivers that opened it."""
    text = (str(error).strip().splitlines() or [""])[0].split(" [tensorstore_spec", 1)[0]
    code = re.match(r"([A-Z_]+): ", text)
    files = list(re.finditer(r'local file "([^"]+)"', text))
    if code and files:
        path = os.path.relpath(files[-1].group(1), step_dir)
        rest = text[files[-1].end():].lstrip(": ").strip()
        text = f"{code.group(1)} in {path}" + (f": {rest}" if rest else "")
    elif not code:
        text = f"{type(error).__name__}: {text}"
    text = re.sub(r'Error opening "\w+" driver: ', "", text)
    return text if len(text) <= 240 else text[:237] + "..."


async def _settle(before: set[asyncio.Task]) -> None:
    """Wait for the tasks started since ``before`` in this event loop (and those they start) to end."""
    current = asyncio.current_task()
    while pending := asyncio.all_tasks() - before - {current}:
        done, _ = await asyncio.wait(pending)
        for task in done:  # retrieved: no "exception was never retrieved" at exit
            if not task.cancelled():
                task.exception()


class SettlingArrayHandler(ocp.type_handlers.ArrayHandler):
    """orbax's `ArrayHandler` whose failed read raises only once its other reads have ended.

    One damaged file fails one array's read, and orbax's ``asyncio.gather`` raises at once and closes its event
    loop while tensorstore is still reading the other arrays; each of those, on completing, calls back into the
    closed loop and prints ``RuntimeError: Event loop is closed`` (through ``sys.unraisablehook``), during the
    error or at exit. Waiting here, with the loop still open, lets them end quietly.
    """

    async def deserialize(self, infos: Sequence[Any], args: Sequence[Any] | None = None) -> Sequence[jax.Array]:
        before = asyncio.all_tasks()
        try:
            return await super().deserialize(infos, args)
        except Exception:
            await _settle(before)
            raise
