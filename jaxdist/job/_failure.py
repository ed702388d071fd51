"""A job's processes end together: a failing process tells the others why, and none waits forever.

In a job of several processes a process that raises (or whose data ends) leaves its peers waiting in
their next collective, and itself waits at exit in ``jax.distributed.shutdown`` for peers that never
arrive. Everything here goes through the key-value store of JAX's coordination service, which every
process of a ``jax.distributed`` job already talks to (nothing in a single process):

* `exchange`: every process posts a value under a name and reads every other's, with a timeout (the
  agreements at the start of a run and at the end of the data). `post`, `read`, `forget` and
  `gather`: a value one process leaves for another, or for the one process that decides for all.
* `report_failure`: the first process to fail posts its reason (``process 1 raised RuntimeError(...)
  at step 5``) and exits with status 1 at most `EXIT_SECONDS` later, even when its exit blocks on a
  peer. `guard_exit` does the same for an uncaught exception, right after its traceback (a
  checkpoint write still in flight is lost; the last complete checkpoint stands).
* `FailureMonitor`: while open, a thread polls for a peer's reason (every `POLL_SECONDS`), prints it
  and ends this process with status 1, wherever the main thread is blocked. On process 0, which
  hosts the coordination service (its exit aborts every process still connected, exit status -6),
  it first waits (bounded) until the failing process is on its way out.

So every process of a failing job exits non-zero within about ``POLL_SECONDS + EXIT_SECONDS`` of the
failure (11 s by default), each saying which process failed and why.

A process that ends without a word (killed, ``os._exit``, a crash) or stops (SIGSTOP, a machine
lost) cannot report anything, and JAX's own end of the job is a C++ abort Python cannot catch: the
service declares a task dead between half and all of ``heartbeat_timeout_seconds`` after its last
heartbeat, and a dead coordinator ends the others within milliseconds (JAX's
``missed_heartbeat_callback`` aborts with ``std::bad_cast`` in this jaxlib, and ``get_live_nodes``
is a barrier). So a monitor opened with ``progress`` (``fit``'s) also *beats* through the store: a
daemon thread posts this process's progress (step, newest complete checkpoint, its directory, a beat
counter) under ``jaxdist/beats/<n>/<process>`` every `BEAT_SECONDS`, reads every process's beats in
one ``key_value_dir_get``, and posts a goodbye (``jaxdist/beats/<n>/bye/<process>``) when the
monitor closes, however ``fit`` ended:

* a process whose beat counter has not moved for `silence_seconds` and that said no goodbye stopped
  answering. The first survivor to see it says so in jaxdist's words (which process, the last step
  each reached, "restart the job to resume from step N"), posts it as the job's failure so that
  every process says it, and exits with status 1; so do the others.
* a call to the store that fails is the coordinator gone: the message for it, made ready at every
  beat, is written at once and the process exits with status 1. When the coordinator was killed,
  JAX's abort usually wins this race (its client's ``PollForError`` fails on the same connection,
  on gRPC's thread); the launcher's summary (``python -m jaxdist.launch``) then says it, from the
  progress each beat leaves in ``<JAXDIST_LAUNCH_DIR>/<process>.json``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
from jax._src import (
    distributed as _distributed,  # JAX's coordination client (private; orbax reads it too)
)

__all__ = ["BEAT_SECONDS", "EXIT_SECONDS", "POLL_SECONDS", "FailureMonitor", "exchange", "forget",
           "gather", "guard_exit", "post", "read", "report_failure", "set_heartbeat_timeout",
           "silence_seconds"]

EXIT_SECONDS = 10.0
"""How long a process that failed may take to exit by itself (its traceback printed, its files
closed) before it exits with status 1 regardless."""

POLL_SECONDS = 1.0
"""How often a `FailureMonitor` asks whether a peer failed."""

BEAT_SECONDS = 0.5
"""How often a monitor posts this process's progress and reads the others' (and so how soon a
silence is seen)."""

# JAX's default; the strategies' join sets the job's (`set_heartbeat_timeout`)
_heartbeat_timeout = 100.0

_FAILURE_KEY = "jaxdist/failure"
_counter = itertools.count()
_rounds = itertools.count()
_BEATS_KEY = "jaxdist/beats"
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
            out.append(client.blocking_key_value_get(f"jaxdist/exchange/{n}/{pid}",
                                                     int(1000 * timeout)))
        except Exception:  # the service's deadline: the peer is stuck, dead, or past this point
            raise TimeoutError(
                f"process {pid} did not reach {name!r} within {timeout:g} s") from None
    return out


def post(key: str, value: str) -> None:
    """Post ``value`` under ``key`` for another process to `read` (nothing in a single process).

    Examples:
        >>> post("jaxdist/example", "1")   # one process: nobody to read it
    """
    client = _client()
    if client is not None:
        client.key_value_set(key, value)


def read(key: str, timeout: float | None = None) -> str | None:
    """The value another process posted under ``key``; None when it is not there (within ``timeout``
    seconds; None: without waiting), or in a single process.

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


def gather(prefix: str, timeout: float, own: str | None = None) -> list[str | None]:
    """The values the processes posted under ``<prefix>/<process index>`` (`post`), in process
    order: one listing of the prefix (``key_value_dir_get``), then a wait of up to ``timeout``
    seconds in all for those not there yet; None for a process whose value did not come. ``own``:
    this process's value, not posted (nothing is read for it). What one process reads to decide for
    all (then it posts the decision for the others to `read`). An empty list in a single process.

    Examples:
        >>> gather("jaxdist/example", timeout=1.0)   # one process
        []
    """
    client = _client()
    if client is None:
        return []
    try:
        found = dict(client.key_value_dir_get(prefix))
    except Exception:  # nothing under it yet
        found = {}
    me, deadline = jax.process_index(), time.monotonic() + timeout
    out = []
    for pid in range(jax.process_count()):
        key = f"{prefix}/{pid}"
        if pid == me and own is not None:
            out.append(own)
        elif key in found:
            out.append(found[key])
        else:
            out.append(read(key, max(0.001, deadline - time.monotonic())))
    return out


def forget(key: str) -> None:
    """Delete ``key`` from the job's key-value store (the store is the coordinator's memory).

    Examples:
        >>> forget("jaxdist/example")   # one process: nothing stored
    """
    client = _client()
    if client is not None:
        with contextlib.suppress(Exception):  # already gone
            client.key_value_delete(key)


def report_failure(reason: str) -> None:
    """Tell the job's other processes that this one fails (``reason`` says how; the first reason
    stands), and arm the bounded exit (`EXIT_SECONDS`). Nothing in a single process.

    Examples:
        >>> # one process: nothing to tell
        >>> report_failure("process 0 raised RuntimeError('x') at step 5")
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
        _exit_now(f"process {jax.process_index()} failed and did not exit within {EXIT_SECONDS:g} "
                  "s (waiting for its peers at exit); exiting with status 1")

    threading.Thread(target=exit_later, name="jaxdist-failure-exit", daemon=True).start()


def set_heartbeat_timeout(seconds: float) -> None:
    """Record the job's ``heartbeat_timeout_seconds`` (what the strategies pass to
    ``jax.distributed``), which `silence_seconds` is measured against.

    Examples:
        >>> set_heartbeat_timeout(30); silence_seconds()
        14.0
        >>> set_heartbeat_timeout(100)
    """
    global _heartbeat_timeout
    _heartbeat_timeout = float(seconds)


def silence_seconds() -> float:
    """How long a process's beats may stay still before it is said to have stopped answering (it
    ended, was killed or stopped): as long as possible while still before JAX's own verdict, which
    may come half the heartbeat timeout after a task went silent; the silence is said two beats
    before that (one beat to see it, one to spare), and never under 2 s.

    It cannot fire in a healthy job: the beats come from a daemon thread, which a slow step, a
    compilation, a collective, a checkpoint write or a sleep never holds (all release the
    interpreter lock); only one C call keeping the lock longer than this (14 s at the strategies'
    default ``heartbeat_timeout_seconds=30``) could silence a live process.

    Examples:
        >>> set_heartbeat_timeout(10); silence_seconds()
        4.0
        >>> set_heartbeat_timeout(100)
    """
    return max(2.0, _heartbeat_timeout / 2 - 2 * BEAT_SECONDS)


def _await_acknowledgements(dead: int | None = None) -> None:
    """Wait (at most ``2 * POLL_SECONDS + 1`` s in all) until every other process's monitor (but
    ``dead``'s) has printed the failure; the coordination service's host (process 0) then gives them
    a moment to exit first."""
    client = _client()
    if client is None:
        return
    me = jax.process_index()
    deadline = time.monotonic() + 2 * POLL_SECONDS + 1.0
    for pid in range(jax.process_count()):
        if pid not in (me, dead):
            with contextlib.suppress(Exception):  # no monitor there, or gone: the deadline stands
                client.blocking_key_value_get(f"{_FAILURE_KEY}/seen/{pid}",
                                              max(1, int(1000 * (deadline - time.monotonic()))))
    if me == 0 and any(pid not in (me, dead) for pid in range(jax.process_count())):
        time.sleep(0.5)
    elif me != 0:  # process 0's monitor waits for this before it exits (`_acknowledge`)
        with contextlib.suppress(Exception):
            client.key_value_set(f"{_FAILURE_KEY}/leaving/{me}", "1")


def _acknowledge(client: Any, me: int, teller: str) -> None:
    """Say this process's monitor has printed the failure ``teller`` (a process index) posted. On
    the coordination service's host (process 0) first wait (bounded) until the teller is on its way
    out: process 0's exit ends the service, and with it, within a millisecond, every process still
    connected (JAX's abort, exit status -6), the teller among them."""
    with contextlib.suppress(Exception):
        client.key_value_set(f"{_FAILURE_KEY}/seen/{me}", "1")
    if me != 0 or teller in ("", str(me)):
        return
    with contextlib.suppress(Exception):  # a teller that died first: the deadline stands
        client.blocking_key_value_get(f"{_FAILURE_KEY}/leaving/{teller}",
                                      int(1000 * (2 * POLL_SECONDS + 2.0)))
    time.sleep(0.5)


def _exit_now(message: str | None) -> None:
    if message is not None:
        print(f"[jaxdist] {message}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    # no cleanup: it would wait for the peers (jax.distributed.shutdown, collective writes)
    os._exit(1)


def guard_exit() -> None:
    """In a job of several processes: an uncaught exception is reported (`report_failure`) after its
    traceback is printed, so the process and its peers exit in bounded time. Installed once; a no-op
    in a single process.

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
        # ``fit`` may have posted it better: the first reason stands
        report_failure(f"process {jax.process_index()} raised {kind.__name__}({error})")
        # the peers' monitors have said why (exiting first would end them mid-collective)
        _await_acknowledgements()
        # now: the interpreter's exit would wait for the peers (jax.distributed.shutdown)
        _exit_now(None)

    sys.excepthook = hook


class FailureMonitor:
    """While open, a peer's failure (`report_failure`) ends this process with status 1, naming it;
    with ``progress``, a peer that ends or stops is said too (the beats: see the module doc).

    Args:
        interval: seconds between two polls.
        progress: this process's progress, ``{"step": int, "checkpoint": int | None,
            "checkpoint_dir": str | None}`` (read on the beats' thread every `BEAT_SECONDS`: it must
            not wait); None: no beats.

    Examples:
        >>> # one process: no thread
        >>> with FailureMonitor(progress=lambda: {"step": 0, "checkpoint": None}):
        ...     pass
    """

    def __init__(self, interval: float = POLL_SECONDS, progress: Callable[[], dict] | None = None):
        self.interval = interval
        self.progress = progress
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats: _Beats | None = None

    def __enter__(self) -> FailureMonitor:
        client = _client()
        if client is not None:
            self._thread = threading.Thread(target=self._poll, args=(client,),
                                            name="jaxdist-failure-monitor", daemon=True)
            self._thread.start()
            if self.progress is not None:
                self._beats = _Beats(client, self.progress)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._beats is not None:
            self._beats.close()
            self._beats = None
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval)
            self._thread = None

    def _poll(self, client: Any) -> None:
        me = jax.process_index()
        while not self._stop.wait(self.interval):
            value = _failure_posted(client)
            if value is None:  # nobody failed
                continue
            if value.partition("\n")[0] == str(me):  # this process's own: it is on its way out
                return
            _stop_too(client, me, value)


def _failure_posted(client: Any) -> str | None:
    """The failure a process posted (``"<pid>\\n<reason>"``); None when there is none, or the store
    is gone."""
    try:
        return client.key_value_try_get(_FAILURE_KEY)
    except Exception:  # not set, or the coordination service is gone
        return None


def _stop_too(client: Any, me: int, value: str) -> None:
    """Say the failure another process posted (``value``, as `_failure_posted` reads it),
    acknowledge it (`_acknowledge`) and exit with status 1."""
    teller, _, reason = value.partition("\n")
    print(f"[jaxdist] {reason}; process {me} stops too (exit status 1)", file=sys.stderr,
          flush=True)
    _acknowledge(client, me, teller)
    _exit_now(None)


def _resume(progress: dict) -> str:
    checkpoint = progress.get("checkpoint")
    if checkpoint is None:
        where = "" if progress.get("checkpoint_dir") else " (fit has no checkpoint_dir)"
        return f"There is no checkpoint{where}: a restart starts over from step 0."
    return (f"The newest checkpoint is step {checkpoint}: restart the job to resume from step "
            f"{checkpoint}.")


class _Beats:
    """This process's beats in the job's key-value store, and the thread that posts them and watches
    every other process's (see the module doc)."""

    def __init__(self, client: Any, progress: Callable[[], dict]):
        self.client, self.progress = client, progress
        self.me, self.count = jax.process_index(), jax.process_count()
        self.prefix = f"{_BEATS_KEY}/{next(_rounds)}/"  # the n-th fit: the same n everywhere
        self.beats = 0
        self.seen: dict[int, tuple[int, float]] = {}  # pid -> (last beat counter, when it moved)
        self.peers: dict[int, dict] = {}  # pid -> its last progress
        self.gone: set[int] = set()  # the peers that said goodbye
        self.stopping = threading.Event()
        self.report = os.environ.get("JAXDIST_LAUNCH_DIR")
        self.reported: dict | None = None
        self.reporting = threading.Lock()
        # what to say when the coordinator stops answering, ready at every beat (`_beat`)
        self.epitaph = b""
        self.thread = threading.Thread(target=self._run, name="jaxdist-beats", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Post the goodbye (it also wakes the thread, which waits on it), stop, and leave the last
        progress for the launcher's summary (a checkpoint completed since the last beat)."""
        self.stopping.set()
        with contextlib.suppress(Exception):  # the store is gone: nobody is left to read it
            self.client.key_value_set(f"{self.prefix}bye/{self.me}", "1", allow_overwrite=True)
        self.thread.join(timeout=5.0)
        self._report(dict(self.progress()))

    def _run(self) -> None:
        bye = f"{self.prefix}bye/{self.me}"
        while not self.stopping.is_set():
            mine = dict(self.progress())
            try:
                self._beat(mine)
                entries = self.client.key_value_dir_get(self.prefix)
            except Exception:  # the store is gone
                return self._store_failed()
            self._watch(entries)
            try:  # wait one beat, or until this process's goodbye (`close`)
                self.client.blocking_key_value_get(bye, int(1000 * BEAT_SECONDS))
                return None
            except Exception as error:
                if "DEADLINE_EXCEEDED" not in str(error):  # else the wait's end: the next beat
                    return self._store_failed()
        return None

    def _store_failed(self) -> None:
        """A call to the coordinator's store failed: unless leaving (or process 0's own store
        ending), write the message made ready at the last beat and exit (see the module doc)."""
        if not self.stopping.is_set() and self.me != 0:
            os.write(2, self.epitaph)
            _exit_now(None)

    def _beat(self, mine: dict) -> None:
        self.beats += 1
        self.client.key_value_set(f"{self.prefix}{self.me}",
                                  json.dumps({"beat": self.beats, **mine}), allow_overwrite=True)
        if self.me != 0:
            self.epitaph = f"[jaxdist] {self._ended(0, mine)}\n".encode()
        self._report(mine)

    def _report(self, mine: dict) -> None:
        """This process's progress in the launcher's directory (``JAXDIST_LAUNCH_DIR``), when it
        changed; from the beats' thread, and once more at `close` (one writer at a time)."""
        with self.reporting:
            if not self.report or mine == self.reported:
                return
            self.reported = mine
            with contextlib.suppress(OSError):
                path = os.path.join(self.report, f"{self.me}.json")
                with open(path + ".tmp", "w") as f:
                    json.dump(mine, f)
                os.replace(path + ".tmp", path)

    def _watch(self, entries: list[tuple[str, str]]) -> None:
        """Every other process's beat, from one read of the store: a counter that moved is a process
        alive; one still for `silence_seconds` (measured from when this process saw it move) without
        a goodbye is a process that ended or stopped."""
        now = time.monotonic()
        beats = {}
        for key, value in entries:
            name = key[len(self.prefix):]
            if name.startswith("bye/"):
                self.gone.add(int(name[4:]))
            elif name.isdigit() and int(name) != self.me:
                beats[int(name)] = json.loads(value)
        for pid, beat in beats.items():
            self.peers[pid] = beat
            last = self.seen.get(pid)
            if last is None or last[0] != beat["beat"]:
                self.seen[pid] = (beat["beat"], now)
        limit = silence_seconds()
        for pid, (_, moved) in sorted(self.seen.items()):
            if pid not in self.gone and now - moved > limit:
                self._died(pid, now - moved)

    def _words(self, pid: int, what: str) -> str:
        """``process 1 <what>``, with the last steps reached."""
        who = f"process {pid}" + (" (the coordinator: it hosts the job's coordination service)"
                                  if pid == 0 else "")
        steps = {p: v.get("step") for p, v in self.peers.items()}
        steps[self.me] = self.progress().get("step")
        shown = ", ".join(f"process {p} step {i}" for p, i in sorted(steps.items())
                          if i is not None)
        return f"{who} {what}; last steps reached: {shown}"

    def _died(self, pid: int, silent: float) -> None:
        if self.stopping.is_set():
            return
        said = self._ended(pid, self.progress(), silent)
        try:  # the first process to tell it posts it: every other process's monitor says it too
            self.client.key_value_set(_FAILURE_KEY, f"{self.me}\n{said.rsplit(' Process ', 1)[0]}")
        except Exception:
            # posted already (another survivor, or a failure): said as the monitor says it
            value = _failure_posted(self.client)
            if value is not None:
                _stop_too(self.client, self.me, value)
        print(f"[jaxdist] {said}", file=sys.stderr, flush=True)
        _await_acknowledgements(dead=pid)
        _exit_now(None)

    def _ended(self, pid: int, mine: dict, silent: float | None = None) -> str:
        how = "" if silent is None else f" for {silent:.1f} s"
        words = self._words(pid, f"stopped answering: it ended, was killed or stopped (silent{how} "
                                 "in the job's key-value store)")
        return f"{words}. {_resume(mine)} Process {self.me} stops too (exit status 1)."
