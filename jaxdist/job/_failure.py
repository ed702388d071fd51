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

A process that ends without a word (killed, ``os._exit``, a crash) or stops (SIGSTOP, a machine lost) cannot
report anything, and JAX's own end of the job is a C++ abort Python cannot catch or precede: the coordination
service declares a task dead between ``heartbeat_timeout_seconds / 2`` and ``heartbeat_timeout_seconds`` after
its last heartbeat, and a dead coordinator (process 0) ends the others within milliseconds. (JAX's client takes a
``missed_heartbeat_callback``, but this jaxlib cannot hand it its argument: ``std::bad_cast``, then abort.) So a
monitor opened with ``progress`` (``fit``'s) also keeps a *line*: a TCP connection between process 0 and every
other process (process 0 listens on a port it posts in the key-value store), over which each side sends its
progress (step, newest complete checkpoint) every `BEAT_SECONDS`, and a goodbye when the monitor closes (however
``fit`` ended: a failure that needs telling was posted before):

* a line that closes without a goodbye is a process that ended (a connection closes when its process does,
  whatever killed it; a live process, however slow or stuck, keeps it open): the other side says so at once, in
  jaxdist's words (which process, the last step each reached, the newest checkpoint, restart to resume), and ends
  with status 1 (process 0 first tells the others through the key-value store, as a failure);
* a line silent for `silence_seconds` (under half the heartbeat timeout, so before JAX can act) is a process
  stopped, hung in a C call that holds the interpreter lock, or unreachable: said, with the same facts, and left
  to JAX (whose text follows when its heartbeats stay away too); if it answers again, that is said too.

Where ``JAXDIST_LAUNCH_DIR`` is set (``python -m jaxdist.launch``), each beat also leaves the process's progress
in ``<dir>/<process>.json`` for the launcher's summary.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
from jax._src import distributed as _distributed  # JAX's coordination client (private; orbax reads it too)

__all__ = ["BEAT_SECONDS", "EXIT_SECONDS", "POLL_SECONDS", "FailureMonitor", "exchange", "forget", "guard_exit",
           "post", "read", "report_failure", "set_heartbeat_timeout", "silence_seconds"]

EXIT_SECONDS = 10.0
"""How long a process that failed may take to exit by itself (its traceback printed, its files closed) before it
exits with status 1 regardless."""

POLL_SECONDS = 1.0
"""How often a `FailureMonitor` asks whether a peer failed."""

BEAT_SECONDS = 0.5
"""How often a monitor's line sends this process's progress (and so how soon a silence can be seen)."""

_heartbeat_timeout = 100.0  # JAX's default; the strategies' join sets the job's (`set_heartbeat_timeout`)

_FAILURE_KEY = "jaxdist/failure"
_counter = itertools.count()
_lines = itertools.count()
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


def set_heartbeat_timeout(seconds: float) -> None:
    """Record the job's ``heartbeat_timeout_seconds`` (what the strategies pass to ``jax.distributed``), which
    `silence_seconds` is measured against.

    Examples:
        >>> set_heartbeat_timeout(30); silence_seconds()
        14.0
        >>> set_heartbeat_timeout(100)
    """
    global _heartbeat_timeout
    _heartbeat_timeout = float(seconds)


def silence_seconds() -> float:
    """How long a line may stay silent before its peer is said to be silent: JAX's heartbeats go every half
    heartbeat timeout, so its service may declare a stopped task dead as soon as half the timeout after it
    stopped; the silence is said a beat and a half before that.

    Examples:
        >>> set_heartbeat_timeout(10); silence_seconds()
        4.0
        >>> set_heartbeat_timeout(100)
    """
    return max(2.0, _heartbeat_timeout / 2 - 2 * BEAT_SECONDS)


def _await_acknowledgements(dead: int | None = None) -> None:
    """Wait (at most ``2 * POLL_SECONDS + 1`` s in all) until every other process's monitor (but ``dead``'s)
    has printed the failure; the coordination service's host (process 0) then gives them a moment to exit first."""
    client = _client()
    if client is None:
        return
    me = jax.process_index()
    deadline = time.monotonic() + 2 * POLL_SECONDS + 1.0
    for pid in range(jax.process_count()):
        if pid not in (me, dead):
            with contextlib.suppress(Exception):  # no monitor there (not in fit), or gone: the deadline stands
                client.blocking_key_value_get(f"{_FAILURE_KEY}/seen/{pid}",
                                              max(1, int(1000 * (deadline - time.monotonic()))))
    if me == 0 and any(pid not in (me, dead) for pid in range(jax.process_count())):
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
    """While open, a peer's failure (`report_failure`) ends this process with status 1, naming it; with
    ``progress``, a peer's death or silence is said too (the line: see the module doc).

    Args:
        interval: seconds between two polls.
        progress: this process's progress, ``{"step": int, "checkpoint": int | None, "checkpoint_dir": str |
            None}`` (read on the line's thread every `BEAT_SECONDS`: it must not wait); None: no line.

    Examples:
        >>> with FailureMonitor(progress=lambda: {"step": 0, "checkpoint": None}):   # one process: no thread
        ...     pass
    """

    def __init__(self, interval: float = POLL_SECONDS, progress: Callable[[], dict] | None = None):
        self.interval = interval
        self.progress = progress
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._line: _Line | None = None

    def __enter__(self) -> FailureMonitor:
        client = _client()
        if client is not None:
            self._thread = threading.Thread(target=self._poll, args=(client,), name="jaxdist-failure-monitor",
                                            daemon=True)
            self._thread.start()
            if self.progress is not None:
                self._line = _Line(client, self.progress)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._line is not None:  # with a goodbye, however fit ended: this process leaves, it did not die
            self._line.close()
            self._line = None
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


def _failure_posted(client: Any) -> bool:
    """Whether a process posted a failure (its monitor says it); False too when the store is gone."""
    try:
        client.key_value_try_get(_FAILURE_KEY)
    except Exception:  # not set, or the coordination service is gone
        return False
    return True


def _resume(progress: dict) -> str:
    checkpoint = progress.get("checkpoint")
    if checkpoint is None:
        where = "" if progress.get("checkpoint_dir") else " (fit has no checkpoint_dir)"
        return f"There is no checkpoint{where}: a restart starts over from step 0."
    return f"The newest checkpoint is step {checkpoint}: restart the job to resume from step {checkpoint}."


class _Line:
    """Process 0's connections to every other process, or this process's to process 0, and the thread that
    beats on them and watches them (see the module doc)."""

    def __init__(self, client: Any, progress: Callable[[], dict]):
        self.client, self.progress = client, progress
        self.me, self.count = jax.process_index(), jax.process_count()
        self.key = f"jaxdist/line/{next(_lines)}"
        self.heard: dict[int, float] = {}  # pid -> when its last beat came
        self.peers: dict[int, dict] = {}  # pid -> its last progress
        self.silent: set[int] = set()
        self.links: dict[socket.socket, int | None] = {}  # connected sockets -> their process (None: not said yet)
        self.buffers: dict[socket.socket, bytes] = {}
        self.selector = selectors.DefaultSelector()
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.report = os.environ.get("JAXDIST_LAUNCH_DIR")
        self.reported: dict | None = None
        self.epitaph = b""  # what to say when the coordinator's line closes, ready at every beat (`_beat`)
        self.thread = threading.Thread(target=self._run, name="jaxdist-line", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5.0)
        with self.lock:
            for link in list(self.links):
                with contextlib.suppress(OSError):
                    link.sendall(b'{"bye": true}\n')
                link.close()
            self.links.clear()
            self.selector.close()

    def _run(self) -> None:
        try:
            self._connect()
        except Exception:  # no line (a port nobody can reach, a store gone): JAX's heartbeats stand alone
            return
        beat = 0.0
        while not self.stopping.is_set():
            wait = min(0.25, max(0.0, beat + BEAT_SECONDS - time.monotonic()))  # the stop is seen within 0.25 s
            for key, _ in self.selector.select(timeout=wait):
                if isinstance(key.fileobj, socket.socket) and key.data == "listen":
                    self._accept(key.fileobj)
                else:
                    self._receive(key.fileobj)
            now = time.monotonic()
            if now - beat >= BEAT_SECONDS:
                beat = now
                self._beat()
            self._watch(now)

    def _connect(self) -> None:
        if self.me == 0:
            family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
            server = socket.create_server(("", 0), family=family, dualstack_ipv6=family == socket.AF_INET6)
            server.setblocking(False)
            self.selector.register(server, selectors.EVENT_READ, "listen")
            self.client.key_value_set(self.key, str(server.getsockname()[1]))
            return
        port = None
        while port is None and not self.stopping.is_set():
            with contextlib.suppress(Exception):  # not posted yet: process 0 is not in fit yet
                port = int(self.client.blocking_key_value_get(self.key, 1000))
        if port is None:
            return
        host = _distributed.global_state.coordinator_address.rsplit(":", 1)[0].strip("[]")
        link = socket.create_connection((host, port), timeout=30)
        link.sendall(json.dumps({"process": self.me}).encode() + b"\n")
        self._add(link, 0)

    def _add(self, link: socket.socket, pid: int | None) -> None:
        link.setblocking(False)
        with self.lock:
            self.links[link] = pid
            self.buffers[link] = b""
            self.selector.register(link, selectors.EVENT_READ, "link")
        if pid is not None:
            self.heard[pid] = time.monotonic()

    def _accept(self, server: socket.socket) -> None:
        with contextlib.suppress(BlockingIOError):
            link, _ = server.accept()
            self._add(link, None)

    def _receive(self, link: socket.socket) -> None:
        try:
            data = link.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        pid = self.links.get(link)
        if not data and pid == 0 and not self.stopping.is_set():  # the coordinator: JAX aborts within ms, race it
            os.write(2, self.epitaph)
            _exit_now(None)
        if not data:  # closed without a goodbye: its process ended
            self._drop(link)
            if pid is not None:
                self.heard.pop(pid, None)
                self._died(pid)
            return
        self.buffers[link] += data
        *lines, self.buffers[link] = self.buffers[link].split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "process" in message:
                pid = self.links[link] = message["process"]
            if message.get("bye"):
                self._drop(link)
                self.heard.pop(pid, None)
                return
            if pid is not None:
                self.heard[pid] = time.monotonic()
                if "step" in message:
                    self.peers[pid] = message
                if pid in self.silent:
                    self.silent.discard(pid)
                    print(f"[jaxdist] process {pid} answers again: it was only slow", file=sys.stderr, flush=True)

    def _drop(self, link: socket.socket) -> None:
        with self.lock:
            self.links.pop(link, None)
            self.buffers.pop(link, None)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(link)
            link.close()

    def _beat(self) -> None:
        mine = dict(self.progress())
        message = json.dumps({"process": self.me, **mine}).encode() + b"\n"
        with self.lock:
            links = list(self.links)
        for link in links:
            with contextlib.suppress(OSError):  # a closed line is seen by the reader
                link.sendall(message)
        if self.me != 0:
            self.epitaph = f"[jaxdist] {self._ended(0, mine)}\n".encode()
        if self.report and mine != self.reported:
            self.reported = mine
            with contextlib.suppress(OSError):
                path = os.path.join(self.report, f"{self.me}.json")
                with open(path + ".tmp", "w") as f:
                    json.dump(mine, f)
                os.replace(path + ".tmp", path)

    def _watch(self, now: float) -> None:
        limit = silence_seconds()
        for pid, heard in list(self.heard.items()):
            if now - heard > limit and pid not in self.silent:
                self.silent.add(pid)
                words = self._words(pid, f"has given no sign for {now - heard:.0f} s", "it is stopped, hung in a "
                                    "call that holds the interpreter lock, or its machine is unreachable")
                print(f"[jaxdist] {words}. JAX's coordination service ends the job when its heartbeats stay away for "
                      f"heartbeat_timeout_seconds={_heartbeat_timeout:g} (its text follows). "
                      f"{_resume(self.progress())}", file=sys.stderr, flush=True)

    def _words(self, pid: int, what: str, why: str) -> str:
        """``process 1 <what> (<why>)``, with the last steps reached."""
        who = f"process {pid}" + (" (the coordinator: it hosts the job's coordination service)" if pid == 0 else "")
        steps = {self.me: self.progress().get("step"), **{p: v.get("step") for p, v in self.peers.items()}}
        shown = ", ".join(f"process {p} step {steps[p]}" for p in sorted(steps) if steps[p] is not None)
        return f"{who} {what} ({why}); last steps reached: {shown}"

    def _died(self, pid: int) -> None:
        if self.stopping.is_set():
            return
        # A failing peer posted its reason before its line closed (its monitor, or this one's, says it); the
        # coordinator's end is said at once without asking its store: JAX ends this process within milliseconds.
        if pid != 0 and _failure_posted(self.client):
            return
        said = self._ended(pid, self.progress())
        print(f"[jaxdist] {said}", file=sys.stderr, flush=True)
        if self.me == 0:  # the others learn it from the store, then the coordinator goes
            with contextlib.suppress(Exception):
                self.client.key_value_set(_FAILURE_KEY, f"0\n{said.rsplit(' Process ', 1)[0]}")
            _await_acknowledgements(dead=pid)
        _exit_now(None)

    def _ended(self, pid: int, mine: dict) -> str:
        words = self._words(pid, "ended without a word", "its connection closed: it exited, was killed or crashed")
        return f"{words}. {_resume(mine)} Process {self.me} stops too (exit status 1)."
