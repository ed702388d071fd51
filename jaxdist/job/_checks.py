"""The processes of one ``fit``: they agree before the first step, end their data and fail together.

In a job of several processes every process runs ``fit`` and meets the others in every step's
collectives and every checkpoint write. A process that does something else (another ``steps=``,
another checkpoint cadence, a ``checkpoint_dir`` the others cannot see, data that ends sooner) or
that raises leaves the others waiting forever, without a word. So (nothing of this in one process):

* `agree_on_fit`, before anything collective: every process's settings are compared with process 0's
  (an error on every process names the setting and each process's value), and process 0 writes a
  token file into ``checkpoint_dir`` that every other process must read back (a directory that is
  not shared is named).
* `failing`: while ``fit`` runs, a peer's failure ends this process and this process's own failure
  is told to its peers before it propagates (`jaxdist.job.FailureMonitor`, `report_failure`). An
  error every process raises at once (its ``on_every_process`` is True: a decision all took
  together, such as a ``NonFiniteError``) waits for nobody and is not told, so the job can catch it
  and go on.
* `data_ended`: when this process's data ends before ``steps``, the processes compare where theirs
  ended (waiting `DATA_END_SECONDS` for the others). Ending at the same batch everywhere is an early
  end like a single process's; else the error says which process ran out (``process 1: its data
  ended after batch 5 of 12``), and the processes still training are ended by their monitors.

Bound: a failing job's processes all exit within about ``POLL_SECONDS + EXIT_SECONDS`` (11 s) of the
failure, ``DATA_END_SECONDS + 11`` s (41 s) when it is the data that ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from jaxdist.job._failure import FailureMonitor, exchange, guard_exit, report_failure
from jaxdist.job._join import spans_processes

__all__ = ["AGREE_SECONDS", "DATA_END_SECONDS", "JobDisagreementError", "agree_on_fit",
           "data_ended", "failing"]

AGREE_SECONDS = 600.0
"""How long a process waits at the start of ``fit`` for the others (they may still be loading data
or compiling); a peer that failed meanwhile ends the wait sooner (`failing`)."""

DATA_END_SECONDS = 30.0
"""How long a process whose data ended waits for the others to reach the end of theirs."""

_TOKEN = ".jaxdist-shared-check"


class JobDisagreementError(RuntimeError):
    """The processes of a job called ``fit`` differently (settings, ``checkpoint_dir``, data
    length): raised on the processes that find it, before the step where they would wait on each
    other forever; the message names the processes and what differs.

    Attributes:
        on_every_process: raised on every process at once (an agreement every process took part in),
            so nobody need be told; False: this process alone found it (peers wait in a collective).

    Examples:
        >>> JobDisagreementError("x", on_every_process=True).on_every_process
        True
    """

    def __init__(self, message: str, *, on_every_process: bool):
        super().__init__(message)
        self.on_every_process = on_every_process


def _spans(mesh: Mesh | None) -> bool:
    return mesh is not None and spans_processes(mesh.devices.flat)


def agree_on_fit(mesh: Mesh | None, settings: Mapping[str, Any],
                 checkpoint_dir: str | os.PathLike | None) -> None:
    """Check that every process of the job runs ``fit`` with the same ``settings`` and one shared
    ``checkpoint_dir``.

    Args:
        mesh: the strategy's mesh (nothing to check unless it spans processes).
        settings: the arguments that must agree (JSON values): steps, cadences, ...
        checkpoint_dir: the checkpoint directory (created here), or None.

    Raises:
        JobDisagreementError: on every process, naming each differing setting with every process's
            value, or the processes that do not see process 0's ``checkpoint_dir``.

    Examples:
        >>> agree_on_fit(None, {"steps": 12}, None)   # one process: nothing to compare
    """
    if not _spans(mesh):
        return
    me = jax.process_index()
    token = secrets.token_hex(8)
    path = None
    if checkpoint_dir is not None:
        path = os.path.join(os.path.abspath(os.fspath(checkpoint_dir)), _TOKEN)
        if me == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(token)
    mine = json.dumps({"settings": dict(settings), "token": token}, sort_keys=True, default=str)
    try:
        values = [json.loads(v) for v in exchange("the start of fit", mine, AGREE_SECONDS)]
        differ = []
        for key in sorted(values[0]["settings"]):
            seen = [v["settings"].get(key) for v in values]
            if any(s != seen[0] for s in seen):
                shown = ", ".join(f"{s!r} on process {p}" for p, s in enumerate(seen))
                differ.append(f"{key}={shown}")
        if differ:
            raise JobDisagreementError(
                f"the processes of this job called fit differently: {'; '.join(differ)}. Every "
                "process must pass the same arguments (they meet in every step and every "
                "checkpoint); nothing has run.",
                on_every_process=True)
        if path is None:
            return
        try:
            with open(path) as f:
                seen_token = f.read()
        except OSError as error:
            seen_token = type(error).__name__
        answer = "ok" if seen_token == values[0]["token"] else seen_token
        answers = exchange("the checkpoint_dir check", answer, AGREE_SECONDS)
    finally:
        if me == 0 and path is not None:
            with contextlib.suppress(OSError):
                os.remove(path)
    blind = [p for p, a in enumerate(answers) if a != "ok"]
    if blind:
        raise JobDisagreementError(
            f"checkpoint_dir={os.fspath(checkpoint_dir)!r} is not one directory shared by the "
            f"processes of this job: process(es) {blind} do not see the file process 0 wrote "
            "there. Every process writes its part of each checkpoint into it: pass a directory on "
            "a filesystem they all mount (NFS, a cluster filesystem) or a bucket (gs://...).",
            on_every_process=True)


@contextlib.contextmanager
def failing(mesh: Mesh | None, step: Callable[[], int],
            checkpoint: Callable[[], int | None] = lambda: None,
            checkpoint_dir: str | os.PathLike | None = None) -> Iterator[None]:
    """Around ``fit``: a peer's failure ends this process; this process's failure is told to the
    peers (not an error whose ``on_every_process`` is True: every process raises that one); a peer
    that dies or stops is said in jaxdist's words (`jaxdist.job.FailureMonitor`'s line).

    Args:
        mesh: the strategy's mesh (nothing happens unless it spans processes).
        step: the current step (named in the reason).
        checkpoint: the newest complete checkpoint's step, or None (named with the step a restart
            resumes from); read from another thread, so it must not wait.
        checkpoint_dir: where the checkpoints are (None: nowhere).

    Examples:
        >>> with failing(None, lambda: 0):   # one process: nothing to watch
        ...     pass
    """
    if not _spans(mesh):
        yield
        return
    guard_exit()
    where = None if checkpoint_dir is None else os.fspath(checkpoint_dir)

    def progress() -> dict:
        return {"step": step(), "checkpoint": checkpoint(), "checkpoint_dir": where}

    with FailureMonitor(progress=progress):
        try:
            yield
        except SystemExit as error:
            if error.code not in (0, None):
                report_failure(f"process {jax.process_index()} exited with status {error.code} at "
                               f"step {step()}")
            raise
        except BaseException as error:
            # one every process raises at once: telling it would end a peer that catches its own
            if not getattr(error, "on_every_process", False):
                report_failure(str(error).rstrip(".") if isinstance(error, JobDisagreementError)
                               else f"process {jax.process_index()} raised "
                                    f"{type(error).__name__}({error}) at step {step()}")
            raise


def data_ended(mesh: Mesh | None, consumed: int, needed: int) -> None:
    """This process's data ended after ``consumed`` of the ``needed`` batches: check that every
    process's did.

    Args:
        mesh: the strategy's mesh (nothing to compare unless it spans processes).
        consumed: the batches this run read before its data ended.
        needed: the batches it needed to reach ``steps``.

    Raises:
        JobDisagreementError: when another process's data ended elsewhere, or it did not reach the
            end of its data within `DATA_END_SECONDS` (it has more), naming who ran out.

    Examples:
        >>> data_ended(None, 5, 12)   # one process: an early end, said by fit
    """
    if not _spans(mesh):
        return
    me = jax.process_index()
    try:
        ends = [int(v) for v in exchange("the end of the data", str(consumed), DATA_END_SECONDS)]
    except TimeoutError as error:
        raise JobDisagreementError(
            f"process {me}: its data ended after batch {consumed} of {needed}, and {error} (its "
            "data goes on): every process must have the data for the same number of steps (pass "
            "each process's part of every batch, or fewer steps).",
            on_every_process=False) from None
    if any(end != consumed for end in ends):
        shown = ", ".join(f"process {p} after batch {end}" for p, end in enumerate(ends))
        raise JobDisagreementError(
            f"the processes' data ended at different batches ({shown}, of {needed}): every process "
            "must have the data for the same number of steps.", on_every_process=True)
