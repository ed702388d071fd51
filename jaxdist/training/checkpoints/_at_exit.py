"""Checkpointers left open are closed when the program ends, so that every ``save`` that returned is
on disk.

A `Checkpointer` nobody closed may still be writing its last save in orbax's background thread when
the main thread ends (normally, by ``sys.exit`` or with an uncaught exception). `keep_open`
registers it, and `_finish_at_exit` closes every one still open.

Orbax's commit also starts threads (about ten per save with orbax-checkpoint 0.12.8). CPython 3.12.0
to 3.12.2 refuse to start any thread once the interpreter begins to shut down, before the exit hooks
run (python/cpython#113964, fixed in 3.12.3), so a save in flight at exit fails there with "can't
create new thread at interpreter shutdown" and is lost. On those versions `Reserve` starts a few
threads AHEAD, while a save is written, each parked until the interpreter refuses to start one: then
it runs that thread's body instead. On every other Python nothing here starts or parks a thread.

Examples:
    >>> import tempfile, numpy as np, jaxdist as jd
    >>> ckpt = jd.training.Checkpointer(tempfile.mkdtemp())
    >>> _ = ckpt.save(1, {"w": np.zeros(2)})   # no close: the save completes at exit at the latest
"""

from __future__ import annotations

import _thread
import atexit
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["REFUSES_THREADS_AT_EXIT", "Reserve", "forget", "keep_open", "reserve_threads"]

# CPython releases that refuse every new thread from the start of the interpreter's shutdown
REFUSES_THREADS_AT_EXIT = (sys.implementation.name == "cpython"
                           and (3, 12, 0) <= sys.version_info[:3] < (3, 12, 3))

# Threads parked per open checkpointer: orbax 0.12.8 starts 7-12 to commit one save and close its
# manager; twice that leaves room for an orbax that starts more.
SPARES_PER_CHECKPOINTER = 24

# The checkpointers with a save that may still be in flight (see `_finish_at_exit`)
_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()
_AT_EXIT_REGISTERED = False


def _finish_at_exit() -> None:
    """Complete every open checkpointer's save in flight, then close it: runs when the main thread
    ends.

    It must run before ``concurrent.futures`` refuses new work (its own exit hook), since orbax's
    commit schedules work on thread pools: a save finished after that stays a
    ``*.orbax-checkpoint-tmp`` directory. So it is registered with threading's hook, which runs the
    most recently registered first. A save that fails here is one line on stderr (no caller left).
    """
    for ckpt in list(_OPEN):
        try:
            ckpt.close()
        except Exception as error:  # reported; the other checkpointers still finish
            print(f"jaxdist.training.Checkpointer: {error}", file=sys.stderr, flush=True)


def _register_at_exit() -> None:
    global _AT_EXIT_REGISTERED
    if _AT_EXIT_REGISTERED:
        return
    # CPython's hook that runs before thread pools stop; plain atexit (too late for orbax's pools,
    # but it still closes the manager) where an interpreter lacks it.
    register = getattr(threading, "_register_atexit", atexit.register)
    register(_finish_at_exit)
    _AT_EXIT_REGISTERED = True


def keep_open(ckpt: Any) -> None:
    """Close ``ckpt`` (finishing its save) when the program ends, unless `forget` is called."""
    _register_at_exit()
    _OPEN.add(ckpt)


def forget(ckpt: Any) -> None:
    """``ckpt`` is closed: nothing to finish at exit."""
    _OPEN.discard(ckpt)


class Reserve:
    """Threads started while the interpreter allows it, each parked until a thread start is refused;
    then one of them runs the refused thread's body, and ends with it (CPython releases a thread's
    join lock when its OS thread ends, so one running two bodies would leave the first's ``join``
    waiting). Installed as ``threading``'s thread starter by `reserve_threads`.

    Args:
        start: the interpreter's own thread starter (``_thread.start_new_thread``).

    Examples:
        >>> import _thread, threading
        >>> reserve = Reserve(_thread.start_new_thread)
        >>> reserve.top_up(1)
        >>> def refused(function, args):
        ...     raise RuntimeError("refused")
        >>> reserve._start = refused  # as the interpreter does at exit
        >>> ran = threading.Event()
        >>> reserve.start(lambda: ran.set(), ())
        0
        >>> ran.wait(5), reserve.parked
        (True, 0)
    """

    def __init__(self, start: Callable[..., int]):
        self._start = start
        self._lock = threading.Lock()
        self._work: queue.SimpleQueue[tuple[Callable[..., Any], tuple]] = queue.SimpleQueue()
        self._pid = os.getpid()
        self.parked = 0

    def _forked(self) -> None:
        """In a forked child the parked threads do not exist: none to hand work to."""
        if os.getpid() != self._pid:
            self._pid, self.parked, self._work = os.getpid(), 0, queue.SimpleQueue()

    def top_up(self, count: int) -> None:
        """Park threads until ``count`` are parked (none started while the interpreter refuses)."""
        with self._lock:
            self._forked()
            while self.parked < count:
                try:
                    self._start(self._park, ())
                except RuntimeError:  # shutting down already, or out of threads
                    return
                self.parked += 1

    def _park(self) -> None:
        function, args = self._work.get()
        function(*args)

    def start(self, function: Callable[..., Any], args: tuple, *rest: Any) -> int:
        """Start ``function(*args)`` in a new thread, or in a parked one where the start is refused.

        Returns:
            The new thread's identifier, or 0 when a parked thread runs it (``Thread.start`` does
            not use it).

        Raises:
            RuntimeError: when the interpreter refuses and no thread is parked.
        """
        try:
            return self._start(function, args, *rest)
        except RuntimeError:
            with self._lock:
                self._forked()
                if not self.parked or rest:
                    raise
                self.parked -= 1
            self._work.put((function, args))
            return 0


_RESERVE: Reserve | None = None


def reserve_threads() -> None:
    """Before a save is written, where CPython refuses threads at exit: keep enough threads parked
    for every open checkpointer's save in flight to finish at exit (`Reserve`)."""
    global _RESERVE
    if not REFUSES_THREADS_AT_EXIT:
        return
    if _RESERVE is None:
        _RESERVE = Reserve(_thread.start_new_thread)
        # The starter that ``threading.Thread.start`` calls in CPython 3.12 (a module global there).
        threading._start_new_thread = _RESERVE.start  # type: ignore[attr-defined]
    _RESERVE.top_up(SPARES_PER_CHECKPOINTER * max(1, len(_OPEN)))
