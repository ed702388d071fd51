"""A job's time across restarts: every run that wrote to one checkpoint directory, added up
(``History.job_time``).

A job that crashes and resumes is several ``fit`` runs on one checkpoint directory. Each run's
`History.time` is its own; what the job lost to the crash is in none of them: the time between the
failing run's last record and the start of the next run (the rest of the crash, the scheduler's
restart, the new process's start), and the steps taken again (``lost`` in the resumed run). So
process 0 keeps a record of the runs beside the checkpoints (`JOB_FILE`: one entry per run, its
start and last record in wall-clock seconds, its parts so far and whether it ended normally),
rewritten where the progress record is (at log points at most every few seconds, and when ``fit``
ends or fails; written aside, then renamed into place). ``job_time`` adds up every run's parts and,
as ``restart``, the gaps between them. A run that ends normally with a checkpoint of its last step
ends the job: the record is removed (as the progress record is), and a later ``fit`` on the
directory starts a new job. Only runs that failed or were preempted leave a record for the next one.

A run killed without warning keeps the record of its last log point: the time after it is part of
the gap. Clocks of several hosts: the record is written by process 0 of each run, whose host may
change between runs; their wall clocks are assumed to agree (NTP), and a negative gap counts as
none.
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
        >>> # it crashes after this record
        >>> first.record({"steps": 5.0, "other": 1.0}, now=106.0)
        >>> second = JobTime(directory, started=110.0)                      # 4 s later, resumed
        >>> job, runs = second.totals({"steps": 3.0, "other": 1.0})
        >>> runs, job["steps"], job["restart"], job["other"]
        (2, 8.0, 4.0, 2.0)
    """

    def __init__(self, directory: str | os.PathLike, started: float):
        self.path = os.path.join(os.fspath(directory), JOB_FILE)
        self.id = secrets.token_hex(8)
        self.started = started
        # the job's runs before this one (nothing else writes while it runs)
        self.before = _runs(self.path)

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

    def totals(
        self, parts: Mapping[str, float], now: float | None = None
    ) -> tuple[dict[str, float], int]:
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
