"""Which host is slow: each process's step time and input wait per log window, compared on process 0.

In a job of several processes every step's collectives wait for the slowest process, so a slow host shows only
as everyone's slow step. What the loop can attribute to a host is the time that host spends before it can join
the step: waiting for its next batch (reading it from ``train_data``, checking and placing it). So each process
times, per log window, its steps (the window's wall time over its steps, as its host saw it) and its input wait
(the time inside the data iterator, per step). A device that is slow shows in every process's step time alike
(use a profile to find it).

`HostTimes` is a fit's callback, which works at its log rows (``on_log``): nothing is exchanged per step. At
each log a process posts its window's figures to the job's key-value store (the coordination service's, which
every process of a ``jax.distributed`` job talks to anyway: no collective, no device); process 0 reads them
at its logs (the processes emit them at the same step), without waiting (a figure not there yet is read at
the next log; at the end of ``fit`` process 0 waits at most `READ_SECONDS` for each, then goes on without it).

A process is named in a `StragglerWarning` when it waits on its input at least ``straggler_ratio`` times as long
as the median process and that excess is at least ``straggler_ratio - 1`` times the median step time (so that
microseconds of input on a fast pipeline name nobody): every step of the job is then that much longer because of
it. A process is named again only after a window in which it was not slow.
"""

from __future__ import annotations

import collections
import itertools
import json
import socket
import statistics
import warnings
from collections.abc import Mapping
from typing import Any

import jax

from jaxdist.job import forget, post, read
from jaxdist.training.callbacks import Callback

__all__ = ["READ_SECONDS", "HostTimes", "StragglerWarning", "check_ratio"]

READ_SECONDS = 10.0
"""How long process 0 waits, at the end of ``fit``, for another process's figures of a window."""

_fits = itertools.count()  # every process of a job runs its fits in the same order: one key prefix per fit


class StragglerWarning(Warning):
    """A process of the job is slow: it waits on its input longer than the others, and every step waits for it.

    Raised on process 0 (at the log point whose window showed it) by ``Trainer.fit``, naming the process index,
    its host, its input wait and step time per step and the median process's. ``History.processes`` keeps the
    figures of every window.

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warnings.warn("process 1 (host node7) is slow", StragglerWarning)
        >>> caught[0].category.__name__
        'StragglerWarning'
    """


def check_ratio(value: Any) -> None:
    """Raise a ValueError naming ``straggler_ratio`` unless ``value`` is a number > 1 or None.

    Examples:
        >>> check_ratio(1.25)
        >>> check_ratio(1)
        Traceback (most recent call last):
        ValueError: straggler_ratio=1 must be a number > 1, or None (nobody is named).
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 1:
        raise ValueError(f"straggler_ratio={value!r} must be a number > 1, or None (nobody is named).")


class HostTimes(Callback):
    """The per-process figures of a fit's log windows (see the module doc): a fit's callback.

    Args:
        spans: whether the fit's devices span processes (the figures then travel through the key-value store).
        ratio: the ``straggler_ratio`` (None: figures are kept, nobody is named).
        rows: where process 0 appends one row per window (``History.processes``).

    Examples:
        >>> rows = []
        >>> times = HostTimes(spans=False, ratio=1.25, rows=rows)
        >>> times.on_log(None, 4, {"loss": 0.5, "time/steps": 0.03, "time/input": 0.01, "time/other": 0.0})
        >>> [(row["step"], row["input_wait"], row["stragglers"]) for row in rows]
        [(4, [0.0025], [])]
    """

    def __init__(self, *, spans: bool, ratio: float | None, rows: list[dict[str, Any]]):
        self._spans = spans and jax.process_count() > 1
        self._me = jax.process_index() if spans else 0
        self._count = jax.process_count() if spans else 1
        self._prefix = f"jaxdist/hosts/{next(_fits)}" if spans else ""
        self._ratio = ratio
        self._rows = rows
        self._host = socket.gethostname()
        self._last = 0  # the step the last window ended at
        self._windows = itertools.count()
        self._pending: collections.deque = collections.deque()  # (window, step, this process's figures)
        self._named: set[int] = set()  # slow in the last window: not named again until it recovers

    def on_train_begin(self, trainer: Any) -> None:
        self._last = self.control.step if self.control is not None else 0

    def on_log(self, trainer: Any, step: int, logs: Mapping[str, Any]) -> None:
        self.close_window(step, logs)
        self.collect()  # process 0: the other processes' figures of the windows emitted so far

    def on_train_end(self, trainer: Any, history: Any) -> None:
        self.collect(final=True)  # process 0: every window's figures (a peer's, waited for briefly)

    def close_window(self, step: int, logs: Mapping[str, Any]) -> None:
        """A log window ended at ``step`` with the seconds ``logs`` says (``time/<part>``): note (and post) its
        figures."""
        steps, self._last = step - self._last, step
        if steps <= 0:  # the first window after a rollback: its steps are not known here
            return
        window = next(self._windows)  # every process logs the same windows
        wall = sum(v for k, v in logs.items() if k.startswith("time/") and k != "time/lost")
        mine = {"host": self._host, "step_time": wall / steps, "input_wait": logs.get("time/input", 0.0) / steps}
        if self._spans and self._me != 0:
            post(f"{self._prefix}/{window}/{self._me}", json.dumps(mine))
        elif self._me == 0:
            self._pending.append((window, step, mine))

    def collect(self, final: bool = False) -> None:
        """Process 0: append the rows of the windows whose figures have all arrived (in order, never waiting),
        and name the slow processes; ``final``: every window, waiting up to `READ_SECONDS` for each figure."""
        while self._pending:
            window, step, mine = self._pending[0]
            figures = [mine]
            for pid in range(1, self._count):
                text = read(f"{self._prefix}/{window}/{pid}", READ_SECONDS if final else None)
                figure = None if text is None else json.loads(text)
                if figure is None and not final:
                    return  # not there yet: at the next log point
                figures.append(figure)
            self._pending.popleft()
            for pid in range(1, self._count):
                forget(f"{self._prefix}/{window}/{pid}")
            self._row(step, figures)

    def _row(self, step: int, figures: list[dict[str, Any] | None]) -> None:
        known = [f for f in figures if f is not None]
        median_wait = statistics.median(f["input_wait"] for f in known)
        median_step = statistics.median(f["step_time"] for f in known)
        slow = []
        if self._ratio is not None and len(known) > 1:
            for pid, f in enumerate(figures):
                if f is None:
                    continue
                excess = f["input_wait"] - median_wait
                if f["input_wait"] >= self._ratio * median_wait and excess >= (self._ratio - 1) * median_step:
                    slow.append(pid)
        self._rows.append({
            "step": step,
            "step_time": [None if f is None else f["step_time"] for f in figures],
            "input_wait": [None if f is None else f["input_wait"] for f in figures],
            "host": [None if f is None else f["host"] for f in figures],
            "stragglers": slow,
        })
        for pid in slow:
            if pid in self._named:
                continue
            f = figures[pid]
            warnings.warn(
                f"process {pid} (host {f['host']}) is slow: it waits {_ms(f['input_wait'])} per step on its input, "
                f"{f['input_wait'] / median_wait if median_wait > 0 else float('inf'):.1f}x the median process's "
                f"{_ms(median_wait)} (straggler_ratio={self._ratio:g}); its steps take {_ms(f['step_time'])} "
                f"(median {_ms(median_step)}), and every process waits for it in each step's collectives "
                f"(window ending at step {step}). Speed up its input (more reader threads, prefetching, a local "
                "copy of the data) or move it off that host.", StragglerWarning, stacklevel=2)
        self._named = set(slow)


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.3g} ms"
