"""One writer per checkpoint directory: a run claims the directory it saves into, and a second one
is refused.

Two runs saving into one directory (a job started twice, a duplicate pod) lose one run without a
word: each skips the steps the other already wrote. So the first save of a run (``fit`` at its
start) claims the directory: it creates ``.jaxdist-writer.json`` there with ``O_EXCL`` (of two runs
started together exactly one creates it), holding the process id, the host, the time and a run id,
and touches it every `HEARTBEAT_SECONDS` while the run holds it.

A claim is a **live writer** when its process is alive on this host (for another host: when its file
was touched within `STALE_SECONDS`); a second run is then a `CheckpointConflictError`. A claim whose
process is gone is stale: the next run takes it over, with a line on stderr. Checkpointers of one
process share its claim (released when the last one closes); process 0 claims for a whole job.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import threading
import time

__all__ = ["CLAIM_FILE", "HEARTBEAT_SECONDS", "STALE_SECONDS", "CheckpointConflictError", "Claim",
           "live_claim"]

CLAIM_FILE = ".jaxdist-writer.json"
HEARTBEAT_SECONDS = 10.0
"""How often a held claim's file is touched."""
STALE_SECONDS = 60.0
"""A claim of another host not touched for this long is stale (its run is taken to be gone)."""

_HOST = socket.gethostname()
_LOCK = threading.Lock()
_HELD: dict[str, Claim] = {}  # claim file -> this process's claim on it
_BEAT: threading.Thread | None = None


class CheckpointConflictError(RuntimeError):
    """Another run writes (or wrote other contents into) this checkpoint directory.

    Raised by ``Trainer.fit`` at its start and by `jaxdist.training.Checkpointer.save` when another
    live run holds the directory's claim (naming its process, host and start, and the fix), and by
    ``save`` for a step that exists with other contents (saving over it would keep the old state).

    Attributes:
        directory: the checkpoint directory.
        claim: the other run's claim (``pid``, ``host``, ``started``, ``run``), or None.

    Examples:
        >>> error = CheckpointConflictError("x", "/ckpt")
        >>> error.directory, error.claim, isinstance(error, RuntimeError)
        ('/ckpt', None, True)
    """

    def __init__(self, message: str, directory: str, claim: dict | None = None):
        super().__init__(message)
        self.directory, self.claim = directory, claim

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.directory, self.claim)


def _read(path: str) -> tuple[dict | None, float] | None:
    """``(claim or None when unreadable, mtime)``; None when there is no file."""
    try:
        mtime = os.stat(path).st_mtime
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        claim = json.loads(text)
    except ValueError:
        claim = None  # being written (created, not yet filled) or damaged
    return (claim if isinstance(claim, dict) else None), mtime


def _process_started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), from /proc; None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _alive(pid: int, claimed: float) -> bool:
    """Whether the process that made a claim at ``claimed`` is still running on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    started = _process_started(pid)
    return started is None or started <= claimed + 2.0  # a later start: the id was reused


def _live(claim: dict | None, mtime: float) -> bool:
    if claim is None:  # unreadable: a claim being written is live for a moment
        return time.time() - mtime < STALE_SECONDS
    pid, started = claim.get("pid"), claim.get("started")
    if claim.get("host") == _HOST and isinstance(pid, int) and isinstance(started, (int, float)):
        return _alive(pid, float(started))
    return time.time() - mtime < STALE_SECONDS


def _describe(claim: dict | None) -> str:
    if claim is None:
        return "a run whose claim is being written"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(claim.get("started", 0)))
    return (f"run {claim.get('run')} (pid {claim.get('pid')} on host {claim.get('host')}, claimed "
            f"{when})")


def live_claim(directory: str) -> dict | None:
    """The claim of a live writer of ``directory`` (this process's own included), or None.

    Examples:
        >>> import tempfile
        >>> live_claim(tempfile.mkdtemp()) is None
        True
    """
    found = _read(os.path.join(directory, CLAIM_FILE))
    if found is None or not _live(*found):
        return None
    return found[0] or {}


class Claim:
    """This process's claim on a checkpoint directory (see the module docstring), from `acquire`."""

    def __init__(self, path: str, record: dict):
        self.path, self.record, self.count = path, record, 1

    @classmethod
    def acquire(cls, directory: str, argument: str = "checkpoint_dir") -> Claim:
        """Claim ``directory`` for this process's saves (shared with its other checkpointers).

        Raises:
            CheckpointConflictError: when another live run holds it, naming the run and the fix.
        """
        path = os.path.join(directory, CLAIM_FILE)
        with _LOCK:
            held = _HELD.get(path)
            if held is not None and held.holds():
                held.count += 1
                return held
            record = {"pid": os.getpid(), "host": _HOST, "started": time.time(),
                      "run": secrets.token_hex(6), "argv": " ".join(sys.argv)[:200]}
            for _ in range(5):  # another run may claim or release between our steps: look again
                try:
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    found = _read(path)
                    if found is None:
                        continue
                    other, mtime = found
                    if _live(other, mtime):
                        raise CheckpointConflictError(_conflict(directory, argument, other, path),
                                                      directory, other) from None
                    _take_over(path, other, record["run"], directory, argument)
                    continue
                with os.fdopen(fd, "w") as f:
                    json.dump(record, f)
                claim = cls(path, record)
                _HELD[path] = claim
                _start_heartbeat()
                return claim
            raise CheckpointConflictError(f"{argument}={directory!r}: could not claim it (other "
                                          "runs kept claiming and releasing it): run one writer "
                                          "per directory.", directory)

    def holds(self) -> bool:
        """Whether the claim file is still this claim (not removed, not taken over)."""
        found = _read(self.path)
        return (found is not None and found[0] is not None
                and found[0].get("run") == self.record["run"])

    def check(self, argument: str = "directory") -> None:
        """Raise `CheckpointConflictError` unless this process still holds the claim (each save)."""
        if self.holds():
            return
        found = _read(self.path)
        other = None if found is None else found[0]
        directory = os.path.dirname(self.path)
        raise CheckpointConflictError(
            f"{argument}={directory!r} is no longer claimed by this run: "
            + ("its claim file was removed" if found is None
               else f"{_describe(other)} took it over")
            + "; saving on would mix two runs' checkpoints. Fix: run one writer per directory (let "
              "the other run finish, or pass another directory).", directory, other)

    def release(self) -> None:
        """Give the claim up once every checkpointer of this process that shares it has."""
        with _LOCK:
            self.count -= 1
            if self.count > 0:
                return
            if _HELD.get(self.path) is self:
                del _HELD[self.path]
            if self.holds():
                with contextlib.suppress(OSError):
                    os.remove(self.path)


def _conflict(directory: str, argument: str, other: dict | None, path: str) -> str:
    return (f"{argument}={directory!r} is being written by another run: {_describe(other)}. Two "
            "runs saving into one directory lose one run's checkpoints. Fix: wait for that run to "
            f"end, pass another {argument}, or, if that run is gone, remove its claim: rm {path}")


def _take_over(path: str, stale: dict | None, run: str, directory: str, argument: str) -> None:
    """Move the stale claim at ``path`` aside (once: of two runs taking it over, one moves it)."""
    aside = f"{path}.{run}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another run moved it first
    moved = _read(aside)
    if moved is not None and stale is not None and (moved[0] or {}).get("run") != stale.get("run"):
        # a run claimed it between our read and the move: put its claim back, then look again
        with contextlib.suppress(OSError):
            os.link(aside, path)
        with contextlib.suppress(OSError):
            os.remove(aside)
        return
    with contextlib.suppress(OSError):
        os.remove(aside)
    print(f"jaxdist: {argument}={directory!r}: taking over the claim of {_describe(stale)}, which "
          "is no longer running.", file=sys.stderr, flush=True)


def _beat() -> None:
    while True:
        time.sleep(HEARTBEAT_SECONDS)
        with _LOCK:
            paths = list(_HELD)
        for path in paths:
            with contextlib.suppress(OSError):
                os.utime(path)


def _start_heartbeat() -> None:
    global _BEAT
    if _BEAT is None or not _BEAT.is_alive():
        _BEAT = threading.Thread(target=_beat, name="jaxdist-checkpoint-claim", daemon=True)
        _BEAT.start()
