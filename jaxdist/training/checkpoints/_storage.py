"""Storage for checkpoints: checked before the first step, and a failed save said in one error.

* `check_directory`: a directory that cannot hold checkpoints is a ValueError before any training,
  not at the first save after the steps up to it.
* `CheckpointSaveError`: a failed save (full disk, quota, file-size limit, read-only filesystem, a
  directory removed meanwhile) is one error naming the step, the directory, the cause, the last
  intact checkpoint and the fix. The cause is the OSError in the failure's chain, else what a look
  at the directory and a probe write of our own find (tensorstore reports its writes' failures as
  status text): the message never depends on another library's wording.
* Quiet: orbax reports one failure from each of its threads with a traceback (hundreds of lines for
  one full disk, some after the error is raised), and tensorstore's callbacks into the event loops
  orbax closed print tracebacks too. `quiet_orbax` and `quiet_after_failure` move them to the
  ``jaxdist.training.checkpoint`` logger at DEBUG, where ``setLevel(logging.DEBUG)`` shows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["CheckpointSaveError", "check_directory", "quiet_after_failure", "quiet_orbax"]

LOG = logging.getLogger("jaxdist.training.checkpoint")
_ORBAX = os.sep + os.path.join("orbax", "checkpoint") + os.sep


_NOT_WRITABLE = ("it is not writable", "make it writable, or pass a directory you can write")
_REASONS = {
    errno.ENOSPC: ("the disk is full",
                   "free space there (or delete old checkpoints), or pass a directory on "
                   "another disk"),
    errno.EDQUOT: ("the disk quota is used up",
                   "free space in your quota (delete old checkpoints) or ask for a "
                   "larger one, or pass a directory on another disk"),
    errno.EFBIG: ("a file reached the largest size this process may write (a file-size limit: "
                  "ulimit -f, RLIMIT_FSIZE; or the filesystem's largest file)",
                  "raise the limit (ulimit -f unlimited, or ask for it to be raised), or pass a "
                  "directory on a filesystem that takes larger files"),
    errno.EROFS: _NOT_WRITABLE,
    errno.EACCES: _NOT_WRITABLE,
    errno.EPERM: _NOT_WRITABLE,
}
_VANISHED = ("the directory no longer exists (removed, or its filesystem unmounted, while this run "
             "used it; its checkpoints went with it)",
             "recreate it (or remount it), or pass another directory")


def _os_error(error: BaseException) -> OSError | None:
    """The first OSError with a known cause (`_REASONS`) in ``error``'s chain, or None."""
    seen, cause = set(), error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _REASONS:
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def _probe(path: str) -> OSError | None:
    """Write, sync and remove a small file in ``path``: the OSError that fails it, or None."""
    test = os.path.join(path, f".jaxdist-write-check-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(test, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        return error
    finally:
        with contextlib.suppress(OSError):
            os.remove(test)
    return None


def _reason(error: BaseException) -> tuple[str, str]:
    """``(what happened, fix)`` for a known OSError in ``error``'s chain, else generic ones."""
    found = _os_error(error)
    if found is not None:
        return _REASONS[found.errno]
    return (f"{type(error).__name__}: {_short(error)}",
            "fix the cause (disk space, permissions, ...)")


def _short(error: BaseException) -> str:
    """``error``'s first line, at most 300 characters (tensorstore's carry a 2 KB JSON spec)."""
    text = (str(error).strip().splitlines() or [""])[0]
    return text if len(text) <= 300 else text[:297] + "..."


def describe_failure(error: BaseException, directory: str | None = None) -> tuple[str, str, bool]:
    """``(cause, fix, vanished)`` of a failed save of a checkpoint into ``directory``.

    The cause: the OSError in ``error``'s chain with a known errno; else, when the directory is
    gone, that; else the errno of a probe write into it (`_probe`); else ``error``, shortened.
    ``vanished``: whether the directory no longer exists (its checkpoints with it).

    Examples:
        >>> import errno, tempfile
        >>> describe_failure(OSError(errno.EFBIG, "File too large"))[0][:34]
        'a file reached the largest size th'
        >>> describe_failure(ValueError("OUT_OF_RANGE: ..."), "/no/such/directory")[2]
        True
        >>> # the probe writes fine
        >>> describe_failure(ValueError("OUT_OF_RANGE: x"), tempfile.mkdtemp())[0]
        'ValueError: OUT_OF_RANGE: x'
    """
    found = _os_error(error)
    if found is None and directory is not None:
        if not os.path.isdir(directory):
            return (*_VANISHED, True)
        found = _probe(directory)
        if found is not None and found.errno not in _REASONS:
            found = None
    if found is None:
        what, fix = _reason(error)
        return what, fix, False
    what, fix = _REASONS[found.errno]
    return f"{what} ({type(found).__name__}: [Errno {found.errno}] {found.strerror})", fix, False


def check_directory(directory: Any, argument: str = "checkpoint_dir", *, create: bool = True,
                    probe: bool = True, consequence: str = "Nothing has run.") -> str:
    """Check that ``directory`` can hold checkpoints; return its absolute path.

    Args:
        directory: the value given (a path).
        argument: the argument's name, for the message.
        create: create it when missing (process 0 of a job; the others check only what exists).
        probe: write and remove a small file in it (a read-only or full filesystem fails here).
        consequence: the sentence that ends a failed probe's message (what did not happen).

    Returns:
        The absolute path.

    Raises:
        ValueError: for ``""``, a value that is not a path, a regular file, a directory that cannot
            be created or written, naming ``argument``, the value and the fix.

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
        raise ValueError(f"{argument}={directory!r} is not a path: pass a directory path (a str or "
                         "os.PathLike).")
    text = os.fspath(directory)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"{argument}={text!r} names no directory (it would put the checkpoints into the "
            f"current directory): pass a directory path (e.g. {argument}='checkpoints'), or None "
            "for no checkpoints.")
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{argument}={text!r} is a file, not a directory: pass a directory (new "
                         "or holding checkpoints), e.g. its parent directory plus a new name.")
    if not os.path.isdir(path):
        if not create:
            return path
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as error:
            what, fix = _reason(error)
            if isinstance(error, (NotADirectoryError, FileExistsError)):
                what, fix = ("a part of its path is a file",
                             "pass a path whose parents are directories")
            elif (what, fix) == _NOT_WRITABLE:
                what = "the directory it would be made in is not writable"
            raise ValueError(f"{argument}={text!r} cannot be created ({what}; "
                             f"{type(error).__name__}: {error.strerror or error}): "
                             f"{fix}.") from None
    if probe:
        error = _probe(path)
        if error is not None:
            what, fix = _reason(error)
            raise ValueError(f"{argument}={text!r} cannot hold checkpoints ({what}; "
                             f"{type(error).__name__}: {error.strerror or error}): {fix}. "
                             f"{consequence}") from None
    return path


class CheckpointSaveError(RuntimeError):
    """Saving a checkpoint failed: its step, directory, cause (`describe_failure`), the last intact
    checkpoint and the fix, in one message. The underlying error is kept as ``__context__`` (not
    printed).

    Args:
        step: the step whose save failed.
        directory: the checkpoint directory.
        latest: the newest complete checkpoint's step (None: none).
        error: what failed.
        background: whether it failed in the background (an asynchronous save).
        probe: look at the directory for the cause where ``error``'s chain names none (it exists; a
            probe write).

    Examples:
        >>> import errno
        >>> error = CheckpointSaveError(5, "/c", 4, OSError(errno.ENOSPC, "No space left"))
        >>> print(str(error)[:67])
        saving checkpoint step 5 in '/c' failed: the disk is full (OSError:
        >>> error.step, error.latest
        (5, 4)
    """

    def __init__(self, step: int, directory: str, latest: int | None, error: BaseException, *,
                 background: bool = False, probe: bool = True):
        cause, fix, vanished = describe_failure(error, str(directory) if probe else None)
        latest = None if vanished else latest
        self.step, self.directory, self.latest = int(step), str(directory), latest
        last = ("there is no complete checkpoint" if latest is None
                else f"the last complete checkpoint is step {latest}")
        resume = "from the start" if latest is None else f"to resume from step {latest}"
        where = " in the background" if background else ""
        super().__init__(f"saving checkpoint step {step} in {directory!r} failed{where}: {cause}; "
                         f"{last}. Fix: {fix}, then run again {resume}.")

    def __reduce__(self) -> tuple:
        return _rebuild, (str(self), self.step, self.directory, self.latest)


def _rebuild(message: str, step: int, directory: str, latest: int | None) -> CheckpointSaveError:
    error = CheckpointSaveError.__new__(CheckpointSaveError)
    RuntimeError.__init__(error, message)
    error.step, error.directory, error.latest = step, directory, latest
    return error


class _Quiet(logging.Filter):
    """On the ``absl`` logger: orbax's records while a jaxdist save runs (or for good, once one
    failed) go to `LOG` at DEBUG instead."""

    def __init__(self) -> None:
        super().__init__()
        self.active = 0
        self.pinned = False  # a save failed: orbax's threads may report it at any time from now on
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if (not (self.active or self.pinned) or _ORBAX not in record.pathname
                or record.levelno < logging.WARNING):
            return True
        if LOG.isEnabledFor(logging.DEBUG):
            LOG.debug("orbax: %s", record.getMessage(), exc_info=record.exc_info)
        return False


_FILTER = _Quiet()
logging.getLogger("absl").addFilter(_FILTER)


def _from_orbax(tb: Any) -> bool:
    """Whether a traceback passes through orbax's code."""
    while tb is not None:
        if _ORBAX in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class _QuietAsyncio(logging.Filter):
    """On the ``asyncio`` logger: the exceptions of orbax's tasks and tensorstore's futures that a
    failed save abandoned (reported when collected, often at exit) go to `LOG` at DEBUG: while
    jaxdist's saves run, those raised through orbax's code; once one failed, also those with no
    Python frame (tensorstore's, set from C++). Everything else passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or not (_FILTER.active or _FILTER.pinned):
            return True
        tb = record.exc_info[2]
        if not (_from_orbax(tb) or (_FILTER.pinned and tb is None)):
            return True
        if LOG.isEnabledFor(logging.DEBUG):
            LOG.debug("asyncio: %s", record.getMessage(), exc_info=record.exc_info)
        return False


logging.getLogger("asyncio").addFilter(_QuietAsyncio())


def _closed_loop_callback(unraisable: Any) -> bool:
    """Whether an unraisable exception is asyncio's refusal of a callback into a closed event loop
    (tensorstore's writes completing after orbax closed their loop)."""
    tb = unraisable.exc_traceback
    if not isinstance(unraisable.exc_value, RuntimeError) or tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code is asyncio.base_events.BaseEventLoop._check_closed.__code__


class _QuietUnraisable:
    """``sys.unraisablehook`` while jaxdist saves run or after one failed: closed-loop callbacks go
    to `LOG` at DEBUG; everything else to the hook that was there before."""

    def __init__(self, previous: Any):
        self.previous = previous

    def __call__(self, unraisable: Any) -> None:
        if (_FILTER.active or _FILTER.pinned) and _closed_loop_callback(unraisable):
            LOG.debug("tensorstore callback into a closed event loop (after a failed save)",
                      exc_info=(unraisable.exc_type, unraisable.exc_value,
                                unraisable.exc_traceback))
            return
        self.previous(unraisable)


def _hook_unraisable() -> None:
    if not isinstance(sys.unraisablehook, _QuietUnraisable):
        sys.unraisablehook = _QuietUnraisable(sys.unraisablehook)


@contextlib.contextmanager
def quiet_orbax() -> Iterator[None]:
    """While inside: orbax's warnings and errors, and tensorstore's callbacks into event loops orbax
    closed, go to the ``jaxdist.training.checkpoint`` logger at DEBUG (a failed save is raised as
    one `CheckpointSaveError` instead).

    Examples:
        >>> with quiet_orbax():
        ...     pass
    """
    _hook_unraisable()
    with _FILTER.lock:
        _FILTER.active += 1
    try:
        yield
    finally:
        with _FILTER.lock:
            _FILTER.active -= 1


def quiet_after_failure() -> None:
    """A save failed, and orbax's other threads report it again later (at ``close``, at exit): for
    the rest of the process their records go to DEBUG as inside `quiet_orbax`.

    Examples:
        >>> from jaxdist.training.checkpoints import _storage
        >>> quiet_after_failure()
        >>> _storage._FILTER.pinned
        True
        >>> _storage._FILTER.pinned = False  # (the doctest leaves the process as it found it)
    """
    _hook_unraisable()
    _FILTER.pinned = True
