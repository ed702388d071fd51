"""A job's time across restarts: every run that wrote to one checkpoint directory, added up
(``History.job_time``).

A job that crashes and resumes is several ``fit`` runs on one checkpoint directory; what it lost to
the crash is in none of their `History.time`: the gap between the failing run's last record and the
next run's start. So process 0 keeps a record of the runs beside the checkpoints (`JOB_FILE`: each
run's start, last record, parts so far and whether it ended normally), rewritten with the progress
record (written aside, then renamed). ``job_time`` adds up every run's parts and, as ``restart``,
the gaps after runs that failed. A run that ends normally with a checkpoint of its last step ends
the job: the record is removed. The hosts' wall clocks are assumed to agree (NTP); a negative gap
counts as none.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Mapping
from typing import Any

from jaxdist.training.callbacks import TIME_PARTS

__all__ = ["JOB_FILE", "JOB_PARTS", "JobTime"]

JOB_FILE = ".jaxdist-job-time.json"
"""The job's record of its runs, in the checkpoint directory."""

JOB_PARTS = (*TIME_PARTS[:-1], "restart", TIME_PARTS[-1])
"""The parts of ``History.job_time``: `History.time`'s, and ``restart`` (the gaps after runs that
failed)."""


def _runs(path: str) -> list[dict[str, Any]]:
    """The runs recorded at ``path``, oldest first; none when there is no record or it is
    unreadable."""
    try:
        with open(path) as f:
            runs = json.load(f)["runs"]
        return [run for run in runs if isinstance(run, dict) and isinstance(run.get("time"), dict)
                and all(isinstance(run.get(key), (int, float)) for key in ("start", "end"))]
    except (OSError, ValueError, KeyError, TypeError):
        return []


class JobTime:
    """This run's entry in its job's record (see the module); process 0 of a run with a checkpoint
    directory.

    Args:
        directory: the checkpoint directory.
        started: the run's start, ``time.time()`` seconds.

    Examples:
        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> first = JobTime(directory, started=100.0)
        >>> first.record({"steps": 5.0, "other": 1.0}, now=106.0)  # then it crashes
        >>> second = JobTime(directory, started=110.0)                      # 4 s later, resumed
        >>> job, runs = second.totals({"steps": 3.0, "other": 1.0})
        >>> runs, job["steps"], job["restart"], job["other"]
        (2, 8.0, 4.0, 2.0)
    """

    def __init__(self, directory: str | os.PathLike, started: float):
        self.path = os.path.join(os.fspath(directory), JOB_FILE)
        self.id, self.started = secrets.token_hex(8), started
        self.before = _runs(self.path)  # the runs before this one (nothing else writes meanwhile)

    def _entry(self, parts: Mapping[str, float], now: float, ended: bool) -> dict[str, Any]:
        return {"id": self.id, "start": self.started, "end": now, "ended": ended,
                "time": {key: float(value) for key, value in parts.items()}}

    def record(self, parts: Mapping[str, float], *, ended: bool = False,
               now: float | None = None) -> None:
        """Write this run's ``parts`` so far (``History.time``'s) into the record, at ``now``
        (default: the time); ``ended``: the run ended normally. Never an error: a record that cannot
        be written stays as it was."""
        runs = [*self.before, self._entry(parts, time.time() if now is None else now, ended)]
        with contextlib.suppress(OSError):
            with open(self.path + ".tmp", "w") as f:
                json.dump({"runs": runs}, f)
            os.replace(self.path + ".tmp", self.path)

    def totals(self, parts: Mapping[str, float],
               now: float | None = None) -> tuple[dict[str, float], int]:
        """``(job_time, runs)``: every recorded run's parts with this run's ``parts`` now, plus
        ``restart``, the gaps after the runs that did not end normally (`JOB_PARTS`); and how many
        runs there were."""
        mine = self._entry(parts, time.time() if now is None else now, False)
        runs = sorted([*self.before, mine], key=lambda run: run["start"])
        job = dict.fromkeys(JOB_PARTS, 0.0)
        for before, run in zip([None, *runs[:-1]], runs, strict=True):
            for key, value in run["time"].items():
                if key in job and isinstance(value, (int, float)):
                    job[key] += float(value)
            if before is not None and not before.get("ended"):
                job["restart"] += max(run["start"] - before["end"], 0.0)
        return job, len(runs)

    def clear(self) -> None:
        """The job ended (this run ended normally with a checkpoint of its last step): remove the
        record."""
        with contextlib.suppress(OSError):
            os.remove(self.path)
