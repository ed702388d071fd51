"""A checkpoint directory's own bookkeeping around orbax's steps: what a killed save left unfinished is removed,
and a rollback (`abandon`) is recorded before its deletions, so that the next checkpointer opened there finishes
it (`tidy`) before any step is listed: no interruption brings an abandoned step back as the newest.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import jax

__all__ = ["abandon", "tidy"]

_ROLLBACK = ".jaxdist-rollback.json"


def _finish_rollback(directory: str) -> None:
    """Finish a rollback (`Checkpointer.abandon_after`) that was interrupted: delete the steps its record
    abandons, then the record (process 0 only)."""
    record = os.path.join(directory, _ROLLBACK)
    if jax.process_index() != 0 or not os.path.isfile(record):
        return
    try:
        with open(record) as f:
            after = int(json.load(f)["after"])
    except (OSError, ValueError, KeyError, TypeError):
        after = None  # unreadable: written partly, so nothing was deleted yet (it is written before)
    if after is not None:
        for name in os.listdir(directory):
            if name.isdigit() and int(name) > after:
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    os.remove(record)


def _remove_unfinished(directory: str) -> None:
    """Remove the step directories a killed save left unfinished (orbax's temporary ``*.orbax-checkpoint-tmp*``
    names, never listed as steps); by process 0 only, as orbax does."""
    if jax.process_index() != 0 or not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        if ".orbax-checkpoint-tmp" in name:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def tidy(directory: str) -> None:
    """What interrupted runs left in ``directory``: unfinished saves removed, an interrupted rollback finished
    (process 0 only; call it only while no live run holds the directory)."""
    _remove_unfinished(directory)
    _finish_rollback(directory)  # before orbax lists the steps


def abandon(directory: str, step: int, later: list[int], delete: Callable[[int], None]) -> None:
    """Delete the steps ``later`` (after ``step``) with ``delete``, newest first, the decision recorded first
    (``os.replace``) and its record removed once they are gone."""
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
