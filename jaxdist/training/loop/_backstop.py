"""`Backstop`: every thread's stack and the process's end at a set time, even when no Python thread
can run.

A watchdog written in Python runs only when it holds the interpreter lock, which a main thread
inside a C call may keep forever. These timers need no lock:

* `faulthandler.dump_traceback_later` writes every thread's Python stack to stderr from its own C
  thread, on time, under a ``Timeout (H:MM:SS)!`` line.
* On Linux, a POSIX timer (``timer_create`` with ``SIGEV_THREAD``) whose notify function is the C
  library's ``_exit`` ends the process with the watchdog's status (124) ``exit_delay`` seconds
  later, once the stacks are written. Elsewhere (or where the timer cannot be made) faulthandler
  ends the process itself, with its own status, 1.
* On Linux, a second such timer says why first (`SAY_LEAD` seconds before the stacks): its notify
  function is the C library's ``warnx``, handed the reason the watchdog last armed it with (which
  step, how long, the timeout), from a buffer of its own (`REASON_BYTES`): ``python3: [jaxdist
  watchdog] no step finished ...``.

Arming costs two calls (about 80 us); `faulthandler` holds one timer per process: a backstop
replaces any ``dump_traceback_later`` armed elsewhere.
"""

from __future__ import annotations

import ctypes
import faulthandler
import sys
import time

__all__ = ["REASON_BYTES", "SAY_LEAD", "Backstop"]

SAY_LEAD = 0.1
"""Seconds between the reason's line and faulthandler's stacks."""

REASON_BYTES = 1024
"""The longest reason said (in bytes, longer ones are cut)."""

_SIGEV_THREAD = 2  # Linux's <signal.h>
_CLOCK_MONOTONIC = 1  # Linux's <time.h>; time.monotonic() reads the same clock


class _Sigevent(ctypes.Structure):  # Linux's struct sigevent (64 bytes), SIGEV_THREAD's fields
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("function", ctypes.c_void_p), ("attributes", ctypes.c_void_p),
                ("pad", ctypes.c_int * 8)]


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


class _ExitTimer:
    """A POSIX timer that calls ``function(value)`` (default: ``_exit(status)``) on its own C thread
    when it expires (Linux only)."""

    def __init__(self, status: int, function: str = "_exit"):
        libc = ctypes.CDLL(None, use_errno=True)
        self._settime = libc.timer_settime
        self._delete = libc.timer_delete
        event = _Sigevent(value=status, notify=_SIGEV_THREAD,
                          function=ctypes.cast(getattr(libc, function), ctypes.c_void_p).value)
        self._id = ctypes.c_void_p()
        if libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(self._id)) != 0:
            raise OSError(ctypes.get_errno(), "timer_create failed")

    def set(self, at: float | None) -> None:
        """Expire at ``at`` (`time.monotonic` seconds); None: never."""
        spec = _Itimerspec()
        if at is not None:
            seconds = max(at, 1e-3)
            spec.value = _Timespec(int(seconds), int((seconds % 1) * 1e9))
        self._settime(self._id, 1, ctypes.byref(spec), None)  # 1: TIMER_ABSTIME

    def close(self) -> None:
        self._delete(self._id)


def _exit_timer(status: int, function: str = "_exit") -> _ExitTimer | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return _ExitTimer(status, function)
    except (OSError, AttributeError):  # no timer_create (or warnx) here: faulthandler alone
        return None


class _Say:
    """A POSIX timer that writes a reason to stderr on its own C thread (``warnx`` of a buffer it
    owns: no interpreter lock needed), or None where it cannot be made."""

    def __init__(self) -> None:
        self.buffer = ctypes.create_string_buffer(REASON_BYTES)
        # warnx(format): no % in the text
        self.timer = _exit_timer(ctypes.addressof(self.buffer), "warnx")

    def set(self, at: float | None, reason: str = "") -> None:
        if self.timer is None:
            return
        self.timer.set(None)  # never while the text changes
        if at is not None:
            text = reason.replace("%", "%%").encode("utf-8", "replace")[:REASON_BYTES - 1]
            ctypes.memmove(self.buffer, text + b"\0", len(text) + 1)
            self.timer.set(at)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.close()
            self.timer = None


def _stderr() -> object:
    """Where faulthandler writes: ``sys.stderr`` when it is a file (it needs a descriptor), else
    descriptor 2."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return 2


class Backstop:
    """Every thread's stack at ``at`` and the process's end with ``status`` shortly after, with or
    without the interpreter lock (see the module doc). Used by `Watchdog`, from its own thread.

    Args:
        status: the exit status (the POSIX timer's; 1 where faulthandler exits, see ``exits_with``).
        exit_delay: seconds between the stacks and the exit (the stacks are written meanwhile).

    Examples:
        >>> backstop = Backstop(124, exit_delay=1.0)
        >>> backstop.arm(time.monotonic() + 600, "stuck")  # stacks in 600 s, the exit 1 s later
        >>> backstop.cancel()                               # nothing happens
        >>> backstop.close()
    """

    def __init__(self, status: int, exit_delay: float):
        self.status, self.exit_delay = status, exit_delay
        self.armed: float | None = None
        self._timer = _exit_timer(status)
        self._say = _Say()

    @property
    def exits_with(self) -> int:
        """The status the process exits with when the backstop fires: ``status``, or faulthandler's
        1."""
        return self.status if self._timer is not None else 1

    def arm(self, at: float, reason: str = "") -> None:
        """Write ``reason`` (Linux; one line, `SAY_LEAD` seconds before) and the stacks at ``at``
        (`time.monotonic` seconds) and exit ``exit_delay`` later, unless re-armed or cancelled
        before."""
        now = time.monotonic()
        delay = max(at - now, 1e-3)
        if reason:
            self._say.set(max(at - SAY_LEAD, now + 1e-3), reason)
        faulthandler.dump_traceback_later(delay, exit=self._timer is None, file=_stderr())
        if self._timer is not None:
            self._timer.set(at + self.exit_delay)
        self.armed = at

    def cancel(self) -> None:
        """Nothing happens (until armed again)."""
        if self.armed is None:
            return
        if self._timer is not None:
            self._timer.set(None)
        self._say.set(None)
        faulthandler.cancel_dump_traceback_later()
        self.armed = None

    def close(self) -> None:
        """Cancel, and free the timer."""
        self.cancel()
        self._say.close()
        if self._timer is not None:
            self._timer.close()
            self._timer = None
