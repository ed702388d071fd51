"""A job's processes end together: a process that fails tells the others why, and none waits forever.

In a job of several processes a process that raises (or whose data ends) leaves its peers waiting in their next
collective, and itself waits at exit in ``jax.distributed.shutdown`` for peers that never arrive: the job hangs
without a word. Three pieces, all through the coordination service's key-value store (JAX's, which every
process of a ``jax.distributed`` job already talks to; nothing in a single process):

* `exchange`: every process posts a value under a name and reads every other's, with a timeout; a process that
  does not post in time is named, never waited for. Agreements at the start of a run (same steps, same
  cadence, a shared checkpoint directory) and at the end of the data are built on it.
* `report_failure`: the first process to fail posts its reason (``process 1 raised RuntimeError(...) at step
  5``) and arms a bounded exit: when it has not exited `EXIT_SECONDS` later (its exit blocks on a peer), it
  exits with status 1 anyway. An uncaught exception in a process of such a job is reported too, and the
  process exits with status 1 right after its traceback (`guard_exit`): the interpreter's own exit would wait
  for the peers in ``jax.distributed.shutdown``, and a checkpoint write still in flight needs them too (the
  last complete checkpoint stands; checkpoints are committed atomically).
* `post`, `read` and `forget`: a value one process leaves for another (``fit``'s per-process figures), read
  without waiting or with a timeout.
* `FailureMonitor`: while open, a thread polls for a peer's reason (every `POLL_SECONDS`); when one comes, it
  prints it and ends this process with status 1, wherever the main thread is blocked (a collective, a
  checkpoint write).

So every process of a failing job exits non-zero within about ``POLL_SECONDS + EXIT_SECONDS`` of the failure
(11 s by default), each saying which process failed and why; the launcher (``python -m jaxdist.launch``), SLURM
or Kubernetes sees the exit codes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
from typing import Any

import jax
from jax._src import distributed as _distributed  # JAX's coordination client (private; orbax reads it too)

__all__ = ["EXIT_SECONDS", "POLL_SECONDS", "FailureMonitor", "exchange", "forget", "guard_exit", "post", "read",
           "report_failure"]

EXIT_SECONDS = 10.0
"""How long a process that failed may take to exit by itself (its traceback printed, its files closed) before it
exits with status 1 regardless."""

POLL_SECONDS = 1.0
"""How often a `FailureMonitor` asks whether a peer failed."""

_FAILURE_KEY = "jaxdist/failure"
_counter = itertools.count()
_lock = threading.Lock()
_armed = False
_hooked = False


def _client() -> Any:
    """The coordination service's client of a job of several processes; None in a single process."""
    if jax.process_count() == 1:
        return None
    return _distributed.global_state.client


def exchange(name: str, value: str, timeout: float) -> list[str]:
    """Every process's ``value`` for the n-th exchange (``name`` says what it is), in process order.

    Every process calls it in the same order; in a single process it returns ``[value]``.

    Args:
        name: what is exchanged (in the error).
        value: this process's value.
        timeout: seconds to wait for each other process.

    Returns:
        The values of processes 0, 1, ...

    Raises:
        TimeoutError: naming the first process whose value did not come within ``timeout`` seconds.

    Examples:
        >>> exchange("steps", "12", timeout=1.0)   # one process
        ['12']
    """
    client = _client()
    if client is None:
        return [value]
    with _lock:
        n = next(_counter)
    me = jax.process_index()
    client.key_value_set(f"jaxdist/exchange/{n}/{me}", value)
    out = []
    for pid in range(jax.process_count()):
        try:
            out.append(client.blocking_key_value_get(f"jaxdist/exchange/{n}/{pid}", int(1000 * timeout)))
        except Exception:  # the service's deadline: the peer is elsewhere (stuck, dead, or past this point)
            raise TimeoutError(f"process {pid} did not reach {name!r} within {timeout:g} s") from None
    return out


def post(key: str, value: str) -> None:
    """Post ``value`` under ``key`` in the job's key-value store, for another process to `read` (nothing in a
    single process).

    Examples:
        >>> post("jaxdist/example", "1")   # one process: nobody to read it
    """
    client = _client()
    if client is not None:
        client.key_value_set(key, value)


def read(key: str, timeout: float | None = None) -> str | None:
    """The value another process posted under ``key``; None when it is not there (within ``timeout`` seconds;
    None: without waiting), or in a single process.

    Examples:
        >>> read("jaxdist/example") is None   # one process
        True
    """
    client = _client()
    if client is None:
        return None
    try:
        if timeout is None:
            return client.key_value_try_get(key)
        return client.blocking_key_value_get(key, int(1000 * timeout))
    except Exception:  # not posted (yet): the service's NOT_FOUND, or its deadline
        return None


def forget(key: str) -> None:
    """Delete ``key`` from the job's key-value store (read and done with: the store is the coordinator's memory).

    Examples:
        >>> forget("jaxdist/example")   # one process: nothing stored
    """
    client = _client()
    if client is not None:
        with contextlib.suppress(Exception):  # already gone
            client.key_value_delete(key)


def report_failure(reason: str) -> None:
    """Tell the job's other processes that this one fails (``reason`` says how; the first reason stands), and
    arm the bounded exit (`EXIT_SECONDS`). Nothing in a single process.

    Examples:
        >>> report_failure("process 0 raised RuntimeError('x') at step 5")   # one process: nothing to tell
    """
    client = _client()
    if client is None:
        return
    with contextlib.suppress(Exception):  # another process failed first: its reason stands
        client.key_value_set(_FAILURE_KEY, f"{jax.process_index()}\n{reason}")
    _arm_exit()


def _arm_exit() -> None:
    global _armed
    with _lock:
        if _armed:
            return
        _armed = True

    def exit_later() -> None:
        time.sleep(EXIT_SECONDS)
        _exit_now(f"process {jax.process_index()} failed and did not exit within {EXIT_SECONDS:g} s "
                  "(waiting for its peers at exit); exiting with status 1")

    threading.Thread(target=exit_later, name="jaxdist-failure-exit", daemon=True).start()


def _await_acknowledgements() -> None:
    """Wait (at most ``2 * POLL_SECONDS + 1`` s in all) until every other process's monitor has printed the
    failure; the coordination service's host (process 0) then gives them a moment to exit first."""
    client = _client()
    if client is None:
        return
    me = jax.process_index()
    deadline = time.monotonic() + 2 * POLL_SECONDS + 1.0
    for pid in range(jax.process_count()):
        if pid != me:
            with contextlib.suppress(Exception):  # no monitor there (not in fit), or gone: the deadline stands
                client.blocking_key_value_get(f"{_FAILURE_KEY}/seen/{pid}",
                                              max(1, int(1000 * (deadline - time.monotonic()))))
    if me == 0:
        time.sleep(0.5)


def _exit_now(message: str | None) -> None:
    if message is not None:
        print(f"[jaxdist] {message}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(1)  # no cleanup: it would wait for the peers (jax.distributed.shutdown, collective writes)


def guard_exit() -> None:
    """In a job of several processes: an uncaught exception is reported (`report_failure`) after its traceback is
    printed, so the process and its peers exit in bounded time. Installed once; a no-op in a single process.

    Examples:
        >>> guard_exit()   # one process: nothing to guard
    """
    global _hooked
    if _client() is None or _hooked:
        return
    _hooked = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        previous(kind, error, traceback)
        if issubclass(kind, SystemExit):
            return
        me = jax.process_index()
        report_failure(f"process {me} raised {kind.__name__}({error})")  # ``fit`` may have said it better: kept
        _await_acknowledgements()  # the peers' monitors have said why (exiting first would end them mid-collective)
        _exit_now(None)  # now: the interpreter's exit would wait for the peers (jax.distributed.shutdown)

    sys.excepthook = hook


class FailureMonitor:
    """While open, a peer's failure (`report_failure`) ends this process with status 1, naming it.

    Args:
        interval: seconds between two polls.

    Examples:
        >>> with FailureMonitor():   # one process: no thread
        ...     pass
    """

    def __init__(self, interval: float = POLL_SECONDS):
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> FailureMonitor:
        client = _client()
        if client is not None:
            self._thread = threading.Thread(target=self._poll, args=(client,), name="jaxdist-failure-monitor",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval)
            self._thread = None

    def _poll(self, client: Any) -> None:
        me = jax.process_index()
        while not self._stop.wait(self.interval):
            try:
                value = client.key_value_try_get(_FAILURE_KEY)
            except Exception:  # not set: nobody failed
                continue
            pid, _, reason = value.partition("\n")
            if pid == str(me):  # this process's own failure: its main thread is on its way out
                return
            print(f"[jaxdist] {reason}; process {me} stops too (exit status 1)", file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):
                client.key_value_set(f"{_FAILURE_KEY}/seen/{me}", "1")
            _exit_now(None)
