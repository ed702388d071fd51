"""Which host is slow: each process's step time and input wait per log window, compared on process
0.

Every step's collectives wait for the slowest process, so a slow host shows only as everyone's slow
step; what can be attributed to a host is its wait for its next batch. So each process times, per
log window, its step time and its input wait per step (a slow device shows in every process's step
time alike: use a profile). `HostTimes` exchanges them at log points through the job's key-value
store (no collective, no device); process 0 reads them without waiting (at the end of ``fit`` at
most `READ_SECONDS` for each).

A process is named in a `StragglerWarning` when it waits on its input at least ``straggler_ratio``
times as long as the median process and that excess is at least ``straggler_ratio - 1`` times the
median step time (so that microseconds of input on a fast pipeline name nobody). A process is named
again only after a window in which it was not slow.

`SameBatches` checks, through the same store, that every process passes the same global batch.
"""

from __future__ import annotations

import collections
import itertools
import json
import socket
import statistics
import warnings
import zlib
from collections.abc import Mapping
from typing import Any

import jax

from jaxdist.job import AGREE_SECONDS, JobDisagreementError, forget, gather, post, read
from jaxdist.training.callbacks import Callback
from jaxdist.training.data import WholeBatch

__all__ = ["READ_SECONDS", "HostTimes", "SameBatches", "StragglerWarning", "check_ratio"]

READ_SECONDS = 10.0
"""How long process 0 waits, at the end of ``fit``, for another process's figures of a window."""

# every process of a job runs its fits in the same order: one key prefix per fit
_fits = itertools.count()
_inputs = itertools.count()  # the same for `SameBatches`
_BLOCK = 64  # `SameBatches`' keys are deleted a block of this many comparisons at a time (one call)


class StragglerWarning(Warning):
    """A process of the job is slow: it waits on its input longer than the others, and every step
    waits for it.

    Raised on process 0 (at the log point whose window showed it) by ``Trainer.fit``, naming the
    process index, its host, its input wait and step time per step and the median process's.
    ``History.processes`` keeps the figures of every window.

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
        raise ValueError(f"straggler_ratio={value!r} must be a number > 1, or None (nobody is "
                         "named).")


class HostTimes(Callback):
    """The per-process figures of a fit's log windows (see the module doc): a fit's callback.

    Args:
        spans: whether the fit's devices span processes (the figures then travel through the
            key-value store).
        ratio: the ``straggler_ratio`` (None: figures are kept, nobody is named).
        rows: where process 0 appends one row per window (``History.processes``).

    Examples:
        >>> rows = []
        >>> times = HostTimes(spans=False, ratio=1.25, rows=rows)
        >>> times.on_log(None, 4, {"loss": 0.5, "time/steps": 0.03, "time/input": 0.01,
        ...                        "time/other": 0.0})
        >>> [(row["step"], row["input_wait"], row["stragglers"]) for row in rows]
        [(4, [0.0025], [])]
    """

    def __init__(self, *, spans: bool, ratio: float | None, rows: list[dict[str, Any]]):
        self._spans = spans and jax.process_count() > 1
        self._me = jax.process_index() if spans else 0
        self._count = jax.process_count() if spans else 1
        self._prefix = f"jaxdist/hosts/{next(_fits)}" if spans else ""
        self._ratio, self._rows, self._host = ratio, rows, socket.gethostname()
        self._last = 0  # the step the last window ended at
        self._windows = itertools.count()
        self._pending: collections.deque = collections.deque()  # (window, step, own figures)
        self._named: set[int] = set()  # slow in the last window: not named again until it recovers

    def on_train_begin(self, trainer: Any) -> None:
        self._last = self.control.step if self.control is not None else 0

    def on_log(self, trainer: Any, step: int, logs: Mapping[str, Any]) -> None:
        self.close_window(step, logs)
        self.collect()  # process 0: the other processes' figures of the windows emitted so far

    def on_train_end(self, trainer: Any, history: Any) -> None:
        self.collect(final=True)  # process 0: every window's figures (a peer's, waited for briefly)

    def close_window(self, step: int, logs: Mapping[str, Any]) -> None:
        """A log window ended at ``step`` with the seconds ``logs`` says (``time/<part>``): note
        (and post) its figures."""
        steps, self._last = step - self._last, step
        if steps <= 0:  # the first window after a rollback: its steps are not known here
            return
        window = next(self._windows)  # every process logs the same windows
        wall = sum(v for k, v in logs.items() if k.startswith("time/") and k != "time/lost")
        mine = {"host": self._host, "step_time": wall / steps,
                "input_wait": logs.get("time/input", 0.0) / steps}
        if self._spans and self._me != 0:
            post(f"{self._prefix}/{window}/{self._me}", json.dumps(mine))
        elif self._me == 0:
            self._pending.append((window, step, mine))

    def collect(self, final: bool = False) -> None:
        """Process 0: append the rows of the windows whose figures have all arrived (in order, never
        waiting), and name the slow processes; ``final``: every window, waiting up to `READ_SECONDS`
        for each figure."""
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
                if (f["input_wait"] >= self._ratio * median_wait
                        and excess >= (self._ratio - 1) * median_step):
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
                f"process {pid} (host {f['host']}) is slow: it waits {_ms(f['input_wait'])} per "
                "step on its input, "
                f"{f['input_wait'] / median_wait if median_wait > 0 else float('inf'):.1f}x the "
                f"median process's {_ms(median_wait)} (straggler_ratio={self._ratio:g}); its steps "
                f"take {_ms(f['step_time'])} (median {_ms(median_step)}), and every process waits "
                f"for it in each step's collectives (window ending at step {step}). Speed up its "
                "input (more reader threads, prefetching, a local copy of the data) or move it off "
                "that host.", StragglerWarning, stacklevel=2)
        self._named = set(slow)


class SameBatches:
    """Every process of a fit passes the same global batch: compared at the first step and the log
    points.

    Processes that pass different ones (each shuffling with its own seed) would train on a mix of
    them without a word. Where the batches are `jaxdist.training.data.WholeBatch` es, each process
    posts its batch's fingerprint to the job's key-value store; process 0 reads them all
    (`jaxdist.job.gather`) and posts the verdict, which the others read: two calls to the store per
    process and point (and one more every 64 points, that deletes them). Every process acts on the
    same verdict at the same step: all go on, or all raise. Per-process input (grain) and placed
    batches are not compared; one process has nothing to compare.

    Args:
        spans: whether the fit's devices span processes.

    Raises:
        JobDisagreementError: (from `check`) on every process when the processes' batches differ,
            naming them, the step and the fix; when a process did not reach the comparison within
            `AGREE_SECONDS`, naming it.

    Examples:
        >>> same = SameBatches(spans=False)
        >>> same.check(1, None)   # one process: nothing to compare
        >>> print(disagreement(6, ["a", "a", "b"], 3))  # doctest: +ELLIPSIS, +NORMALIZE_WHITESPACE
        the processes of this job passed different global batches at step 6: process 2 differs from
        process 0 (fingerprints: processes 0, 1: e8b7be43; process 2: 71beeff9); they agreed at
        step 3, the check before. ...
    """

    def __init__(self, spans: bool):
        self._spans = spans and jax.process_count() > 1
        self._prefix = f"jaxdist/batches/{next(_inputs)}" if self._spans else ""
        self._checks = 0
        self._agreed: int | None = None  # the step of the last check, where all were alike

    def check(self, step: int, batch: Any) -> None:
        """Compare the processes' batches of ``step`` (a `WholeBatch`, or an on-device loop's list
        of them: its last); nothing for other batches, or a step already compared."""
        if not self._spans or step == self._agreed:
            return
        if isinstance(batch, list):
            batch = batch[-1] if batch else None
        mine = batch.fingerprint() if isinstance(batch, WholeBatch) else None
        if mine is None:
            return
        me, n = jax.process_index(), self._checks
        self._checks += 1
        where = f"{self._prefix}/{n // _BLOCK}/{n % _BLOCK}"
        if me == 0:  # decides for all
            seen = gather(where, AGREE_SECONDS, own=mine)
            missing = [pid for pid, value in enumerate(seen) if value is None]
            if missing:
                verdict = (f"missing:process{'es' if len(missing) > 1 else ''} "
                           f"{', '.join(map(str, missing))} did not reach the comparison of step "
                           f"{step}'s batches within {AGREE_SECONDS:g} s: every process must run "
                           "the same steps of fit")
            elif any(value != mine for value in seen):
                verdict = "differ:" + disagreement(step, seen, self._agreed)
            else:
                verdict = "alike:"
            post(f"{where}/verdict", verdict)
            # every process read the verdicts of the block before (it posted after them)
            if n % _BLOCK == 0 and n:
                forget(f"{self._prefix}/{n // _BLOCK - 1}")  # its values and verdicts, in one call
        else:
            post(f"{where}/{me}", mine)
            verdict = read(f"{where}/verdict", 2 * AGREE_SECONDS)
            if verdict is None:
                raise JobDisagreementError(f"process {me}: process 0 did not compare step {step}'s "
                                           f"batches within {2 * AGREE_SECONDS:g} s",
                                           on_every_process=False)
        kind, _, message = verdict.partition(":")
        if kind != "alike":
            raise JobDisagreementError(message, on_every_process=kind == "differ")
        self._agreed = step


def disagreement(step: int, seen: list[str], agreed: int | None) -> str:
    """The message of processes whose batches of ``step`` differ (``seen``: each process's
    fingerprint; ``agreed``: the step of the check before, where they were alike, or None)."""
    groups: dict[str, list[int]] = {}
    for pid, value in enumerate(seen):
        groups.setdefault(value, []).append(pid)
    odd = [pid for pid, value in enumerate(seen) if value != seen[0]]
    shown = "; ".join(f"process{'es' if len(p) > 1 else ''} {', '.join(map(str, p))}: "
                      f"{zlib.crc32(value.encode()):08x}" for value, p in groups.items())
    before = "" if agreed is None else f"; they agreed at step {agreed}, the check before"
    return (
        f"the processes of this job passed different global batches at step {step}: "
        f"process{'es' if len(odd) > 1 else ''} {', '.join(map(str, odd))} "
        f"differ{'' if len(odd) > 1 else 's'} from process 0 (fingerprints: {shown}){before}. In a "
        "multi-process fit every process passes the same global batch and places only its own "
        "devices' rows of it, so different batches train on a mix of them and give other numbers. "
        "Fix: every process passes the same global batch: seed the shuffle the same on every "
        "process (e.g. a train_data function of the epoch shuffling with "
        "np.random.default_rng((seed, epoch)), not with the process index); or give each process "
        "its own part of every batch: a grain pipeline sharded by process "
        "(grain.sharding.ShardByJaxProcess()), or strategy.distribute_datasets_from_function(fn), "
        "whose fn(ctx) yields process ctx.input_pipeline_id's rows."
    )


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.3g} ms"
