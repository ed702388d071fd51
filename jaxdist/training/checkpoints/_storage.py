"""Storage for checkpoints: checked before the first step, and a failed save said in one error.

* `check_directory`: a checkpoint directory that is ``""`` (it would write step directories into the current
  directory), a regular file, or not writable (read-only, no permission, full) is a ValueError naming the
  argument, the value and the fix, before any training: not at the first save, after the steps up to it.
* `CheckpointSaveError`: a save that fails (a full disk, in a synchronous or an asynchronous save) is one error
  naming the step, the directory, the last intact checkpoint and the fix. orbax reports such a failure from
  each of its threads with a traceback on the ``absl`` logger (hundreds of lines for one full disk);
  `quiet_orbax` moves those records to the ``jaxdist.training.checkpoint`` logger at DEBUG while jaxdist's
  saves run (``logging.getLogger("jaxdist.training.checkpoint").setLevel(logging.DEBUG)`` shows them), and
  the error keeps orbax's exception as ``__context__`` (not printed).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["CheckpointSaveError", "check_directory", "quiet_orbax"]

LOG = logging.getLogger("jaxdist.training.checkpoint")
_ORBAX = os.sep + os.path.join("orbax", "checkpoint") + os.sep


def _reason(error: BaseException) -> tuple[str, str]:
    """``(what happened, fix)`` for an OSError found in ``error``'s chain (full disk, permissions), else generic."""
    seen, cause = set(), error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free space there (or delete old checkpoints), or pass a directory on another disk"
            return "the disk is full", fix
        if isinstance(cause, OSError) and cause.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return "it is not writable", "make it writable, or pass a directory you can write"
        cause = cause.__cause__ or cause.__context__
    return f"{type(error).__name__}: {error}", "fix the cause (disk space, permissions, ...)"


def check_directory(directory: Any, argument: str = "checkpoint_dir", *, create: bool = True,
                    probe: bool = True) -> str:
    """Check that ``directory`` can hold checkpoints; return its absolute path.

    Args:
        directory: the value given (a path).
        argument: the argument's name, for the message.
        create: create it when it does not exist (process 0 of a job; the others check only what exists).
        probe: write and remove a small file in it (a read-only or full filesystem fails here).

    Returns:
        The absolute path.

    Raises:
        ValueError: for ``""``, a value that is not a path, a regular file, a directory that cannot be
            created or written, naming ``argument``, the value and the fix.

    Examples:
        >>> import tempfile
        >>> check_directory(tempfile.mkdtemp()).startswith("/")
        True
        >>> try:
        ...     check_directory("")
        ... except ValueError as error:
        ...     print(str(error)[:57])
        checkpoint_dir='' names no directory (it would put the ch
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"{argument}={directory!r} is not a path: pass a directory path (a str or os.PathLike).")
    text = os.fspath(directory)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"{argument}={text!r} names no directory (it would put the checkpoints into the current directory): pass "
            f"a directory path (e.g. {argument}='checkpoints'), or None for no checkpoints.")
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{argument}={text!r} is a file, not a directory: pass a directory (new or holding "
                         "checkpoints), e.g. its parent directory plus a new name.")
    if not os.path.isdir(path):
        if not create:
            return path
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as error:
            what, fix = _reason(error)
            if isinstance(error, (NotADirectoryError, FileExistsError)):
                what, fix = "a part of its path is a file", "pass a path whose parents are directories"
            raise ValueError(f"{argument}={text!r} cannot be created ({what}; {type(error).__name__}: "
                             f"{error.strerror or error}): {fix}.") from None
    if probe:
        test = os.path.join(path, f".jaxdist-write-check-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            with open(test, "wb") as f:
                f.write(b"\0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        except OSError as error:
            what, fix = _reason(error)
            raise ValueError(f"{argument}={text!r} cannot hold checkpoints ({what}; {type(error).__name__}: "
                             f"{error.strerror or error}): {fix}. Nothing has run.") from None
        finally:
            with contextlib.suppress(OSError):
                os.remove(test)
    return path


class CheckpointSaveError(RuntimeError):
    """Saving a checkpoint failed (a full disk, permissions, ...): its step, directory, the last intact
    checkpoint and the fix, in one message; the underlying error is kept as ``__context__`` (not printed) and
    orbax's own tracebacks go to the ``jaxdist.training.checkpoint`` logger at DEBUG.

    Args:
        step: the step whose save failed.
        directory: the checkpoint directory.
        latest: the newest complete checkpoint's step (None: none).
        error: what failed.
        background: whether it failed in the background (an asynchronous save).

    Examples:
        >>> import errno
        >>> error = CheckpointSaveError(5, "/c", 4, OSError(errno.ENOSPC, "No space left on device"))
        >>> print(str(error)[:67])
        saving checkpoint step 5 in '/c' failed: the disk is full (OSError:
        >>> error.step, error.latest
        (5, 4)
    """

    def __init__(self, step: int, directory: str, latest: int | None, error: BaseException, *,
                 background: bool = False):
        self.step, self.directory, self.latest = int(step), str(directory), latest
        what, fix = _reason(error)
        detail = f"{type(error).__name__}: {error}"
        cause = what if what == detail else f"{what} ({detail})"
        last = ("there is no complete checkpoint" if latest is None
                else f"the last complete checkpoint is step {latest}")
        resume = "to start again" if latest is None else f"to resume from step {latest}"
        where = " in the background" if background else ""
        super().__init__(f"saving checkpoint step {step} in {directory!r} failed{where}: {cause}; {last}. Fix: {fix}, "
                         f"then run again {resume}.")

    def __reduce__(self) -> tuple:
        return _rebuild, (str(self), self.step, self.directory, self.latest)


def _rebuild(message: str, step: int, directory: str, latest: int | None) -> CheckpointSaveError:
    error = CheckpointSaveError.__new__(CheckpointSaveError)
    RuntimeError.__init__(error, message)
    error.step, error.directory, error.latest = step, directory, latest
    return error


class _Quiet(logging.Filter):
    """On the ``absl`` logger: orbax's records while a jaxdist save runs go to `LOG` at DEBUG instead."""

    def __init__(self) -> None:
        super().__init__()
        self.active = 0
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.active or _ORBAX not in record.pathname or record.levelno < logging.WARNING:
            return True
        if LOG.isEnabledFor(logging.DEBUG):
            LOG.debug("orbax: %s", record.getMessage(), exc_info=record.exc_info)
        return False


_FILTER = _Quiet()
logging.getLogger("absl").addFilter(_FILTER)


@contextlib.contextmanager
def quiet_orbax() -> Iterator[None]:
    """While inside: orbax's warnings and errors go to the ``jaxdist.training.checkpoint`` logger at DEBUG
    (a failed save is raised as one `CheckpointSaveError` instead).

    Examples:
        >>> with quiet_orbax():
        ...     pass
    """
    with _FILTER.lock:
        _FILTER.active += 1
    try:
        yield
    finally:
        with _FILTER.lock:
            _FILTER.active -= 1
