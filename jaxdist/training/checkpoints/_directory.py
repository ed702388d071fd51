"""A checkpoint directory's own bookkeeping around orbax's steps: what a killed save left unfinished
is removed, and a rollback (`abandon`) is recorded before its deletions, so that the next
checkpointer opened there finishes it (`tidy`) before any step is listed. A fit also records how far
it got (`write_progress`), so that a run resumed after a crash knows which of its steps it takes
again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable

import jax

__all__ = ["PROGRESS_FILE", "abandon", "clear_progress", "read_progress", "tidy", "write_progress"]

_ROLLBACK = ".jaxdist-rollback.json"
PROGRESS_FILE = ".jaxdist-progress.json"
"""The step the last fit in the directory reached, past its newest checkpoint (`write_progress`)."""


def _finish_rollback(directory: str) -> None:
    """Finish a rollback (`Checkpointer.abandon_after`) that was interrupted: delete the steps its
    record abandons, then the record (process 0 only)."""
    record = os.path.join(directory, _ROLLBACK)
    if jax.process_index() != 0 or not os.path.isfile(record):
        return
    try:
        with open(record) as f:
            after = int(json.load(f)["after"])
    except (OSError, ValueError, KeyError, TypeError):  # written partly: nothing deleted yet
        after = None
    if after is not None:
        for name in os.listdir(directory):
            if name.isdigit() and int(name) > after:
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    os.remove(record)


def _remove_unfinished(directory: str) -> None:
    """Remove the step directories a killed save left unfinished (orbax's temporary
    ``*.orbax-checkpoint-tmp*`` names, never listed as steps); by process 0 only, as orbax does."""
    if jax.process_index() != 0 or not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        if ".orbax-checkpoint-tmp" in name:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def tidy(directory: str) -> None:
    """What interrupted runs left in ``directory``: unfinished saves removed, an interrupted
    rollback finished (process 0 only; call it only while no live run holds the directory)."""
    _remove_unfinished(directory)
    _finish_rollback(directory)  # before orbax lists the steps


def abandon(directory: str, step: int, later: list[int], delete: Callable[[int], None]) -> None:
    """Delete the steps ``later`` (after ``step``) with ``delete``, newest first, the decision
    recorded first (``os.replace``) and its record removed once they are gone."""
    record = os.path.join(directory, _ROLLBACK)
    if jax.process_index() == 0:
        with open(record + ".tmp", "w") as f:
            json.dump({"after": int(step), "abandoned": later}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(record + ".tmp", record)
    for s in reversed(later):  # newest first
        delete(s)
    if jax.process_index() == 0:
        os.remove(record)


def _newest_step(directory: str) -> int:
    """The newest complete step directory's number in ``directory`` (0: none), from a listing."""
    try:
        return max((int(name) for name in os.listdir(directory) if name.isdigit()), default=0)
    except OSError:
        return 0


def write_progress(directory: str, step: int) -> None:
    """Record that the fit writing ``directory`` reached ``step`` (`PROGRESS_FILE`: the step, the
    newest checkpoint there then, and the time), replacing the record before with ``os.replace``.
    Never an error: a record that cannot be written is left as it was (it only informs
    `read_progress`).

    Examples:
        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> write_progress(directory, 7)
        >>> read_progress(directory)
        7
    """
    record = os.path.join(directory, PROGRESS_FILE)
    with contextlib.suppress(OSError):
        with open(record + ".tmp", "w") as f:
            json.dump({"step": int(step), "checkpoint": _newest_step(directory),
                       "time": time.time()}, f)
        os.replace(record + ".tmp", record)


_SAID_STALE: set[str] = set()


def read_progress(directory: str) -> int:
    """The step `write_progress` last recorded in ``directory``; 0 when there is no record, it is
    unreadable, or it is not this directory's.

    A record that names a checkpoint newer than any in the directory now was copied in from
    elsewhere, or left by a run whose checkpoints are gone: taken at its word it would count every
    step of the next fit as taken again (``lost``), so it is ignored, with a warning (once per
    directory).

    Examples:
        >>> import tempfile
        >>> read_progress(tempfile.mkdtemp())
        0
    """
    record = os.path.join(directory, PROGRESS_FILE)
    try:
        with open(record) as f:
            info = json.load(f)
        step = info["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        return 0
    based = info.get("checkpoint")  # none in records written before it was kept
    newest = _newest_step(directory)
    if isinstance(based, int) and based > newest and step > newest:
        if record not in _SAID_STALE:
            _SAID_STALE.add(record)
            warnings.warn(
                f"checkpoint_dir={directory!r}: its progress record ({PROGRESS_FILE}) says a run "
                f"reached step {step} after checkpoint {based}, which this directory does not have "
                f"(its newest is {newest or 'none'}): a record copied from another directory, or "
                "left by a run whose checkpoints are gone. It is ignored (no step of this fit "
                "counts as taken again) and replaced by this fit's; delete it to silence this.",
                UserWarning, stacklevel=3)
        return 0
    return step


def clear_progress(directory: str) -> None:
    """Remove the record of `write_progress` (the fit ended with a checkpoint of the step it
    reached); never an error.

    Examples:
        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> write_progress(directory, 7)
        >>> clear_progress(directory)
        >>> read_progress(directory)
        0
    """
    with contextlib.suppress(OSError):
        os.remove(os.path.join(directory, PROGRESS_FILE))
