"""A process of a job that dies, exits or stops mid-fit is said in jaxdist's words before JAX's, and
so is the launcher's summary.

Real 2-process jobs (2 x 2 CPU devices, ``heartbeat_timeout_seconds=6``: a silence of 2 s is said,
where JAX acts after 3 to 6 s; a checkpoint every 3 steps; the victim acts after step 8:
tests/multiprocess/deaths_worker.py). Every survivor's output must name the process, the last step
each reached, the newest checkpoint (6) and the restart, before any text of JAX's; a step or an end
of ``fit`` slower than the silence says nothing of the kind. A killed coordinator is said by the
launcher's summary: the survivor's own words race JAX's abort, which wins. Every run is bounded.
"""

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from interpreters import pythons
from registry import LAUNCH, launch_env

from jaxdist.launch import free_port

HERE = Path(__file__).parent
WORKER = HERE / "multiprocess" / "deaths_worker.py"
JAX_TEXT = re.compile(r"Terminating process because|coordination_service|UNAVAILABLE")
GONE = re.compile(r"stopped answering: it ended, was killed or stopped \(silent for \d+\.\d s in "
                  r"the job's key-value store\)")


def _lines(stream, into: list) -> None:
    for line in iter(stream.readline, ""):
        into.append((time.time(), line))


def _job(case: str, tmp_path: Path, python: str = sys.executable,
         timeout: float = 90) -> list[tuple[int, list]]:
    """Run the worker's ``case`` as a 2-process job; ``[(returncode, [(time, line), ...]), ...]``
    per process, stdout and stderr interleaved as read (a stopped process is killed once its peer
    has ended; anything left at the timeout too)."""
    address = f"127.0.0.1:{free_port()}"
    env = launch_env(JAX_NUM_CPU_DEVICES="2")
    procs = [subprocess.Popen([python, str(WORKER), address, str(i), case, str(tmp_path / "ckpt")],
                              env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    lines = [[], []]
    readers = [threading.Thread(target=_lines, args=(p.stdout, out), daemon=True)
               for p, out in zip(procs, lines, strict=True)]
    for reader in readers:
        reader.start()
    survivor = procs[1 if case == "coordinator" else 0]
    try:
        survivor.wait(timeout=timeout)
        if case != "stopped":
            for p in procs:
                p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)  # the stopped victim, or anything left at the timeout
            p.wait(timeout=30)
        for reader, p in zip(readers, procs, strict=True):
            reader.join(timeout=10)
            p.stdout.close()
    return [(p.returncode, out) for p, out in zip(procs, lines, strict=True)]


def _victim_time(lines: list) -> float:
    line = next(line for _, line in lines if line.startswith("VICTIM"))
    return float(line.rsplit(",", 1)[1])


def _said(lines: list, dead: int) -> tuple[float, int, str]:
    """When and where (line index) the survivor's jaxdist message about ``dead`` came, and its
    text."""
    for index, (when, line) in enumerate(lines):
        if line.startswith(f"[jaxdist] process {dead}"):
            return when, index, line
    raise AssertionError("no jaxdist message:\n" + "".join(line for _, line in lines)[-3000:])


def _text(lines: list) -> str:
    return "".join(line for _, line in lines)[-4000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_healthy_fit_says_nothing_then_a_process_that_exits_is_named_with_the_steps_and_checkpoint(
    tmp_path,
):
    results = _job("exits", tmp_path)
    dead, alive = 1, 0
    code, lines = results[alive]
    when, index, message = _said(lines, dead)
    # the first fit: a slow step, a process slow to leave fit; no word of deaths
    for _, out in results:
        done = [line for _, line in out].index("FIT DONE\n")
        assert not any("[jaxdist]" in line for _, line in out[:done]), _text(out)
    assert not any("[jaxdist]" in line for _, line in lines[:index]), _text(lines)
    assert GONE.search(message), message
    assert f"process {alive} step 9" in message and f"process {dead} step 8" in message, message
    assert "The newest checkpoint is step 6: restart the job to resume from step 6" in message, (
        message
    )
    assert f"Process {alive} stops too (exit status 1)" in message, message
    assert (tmp_path / "ckpt" / "6").is_dir()
    jax_said = [i for i, (_, line) in enumerate(lines) if JAX_TEXT.search(line)]
    assert all(i > index for i in jax_said), _text(lines)  # JAX's text, if any, after jaxdist's
    assert code == 1, _text(lines)
    # The beats stayed still for the silence (2 s) from their last move (up to a beat before the
    # death), seen within a beat: before JAX's 3 to 6 s.
    delay = when - _victim_time(results[dead][1])
    assert 1.4 < delay < 3.0, delay
    assert results[dead][0] == 3
    print(f"exits: process {alive} said it {delay:.3f} s after process {dead} exited")


_SUMMARY = {
    "killed": ["[launch] process 1 killed by SIGKILL at step 8"],
    "stopped": ["[launch] process 1 was stopped (SIGSTOP), then "],
    # The survivors' own words race JAX's abort, which wins (see jaxdist.job._failure): the summary
    # says it.
    "coordinator": ["[launch] process 0 killed by SIGKILL at step 8"],
}


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
# SIGKILL here, SIGSTOP (then SIGCONT) on 3.12, the coordinator
@pytest.mark.parametrize(("python", "case"), [
    pytest.param(*p.values, case, id=f"{p.id}-{case}", marks=p.marks)
    for p, case in zip(pythons(), ["killed", "stopped"], strict=True)] + [
    pytest.param(sys.executable, "coordinator", id="this-coordinator")])
def test_a_process_killed_or_stopped_under_the_launcher_is_said_by_the_survivor_and_the_summary(
    python, case, tmp_path
):
    out = subprocess.run(
        [python, *LAUNCH[1:], "-n", "2", "--cpu-devices", "2", "--timeout", "100",
         "--grace", "6",
         str(WORKER), case, str(tmp_path / "ckpt")], env=launch_env(), capture_output=True,
        text=True, timeout=130)
    text = out.stdout + out.stderr
    # the first process seen to fail
    assert out.returncode in (1, 128 + signal.SIGKILL), text[-3000:]
    for line in _SUMMARY[case]:
        assert line in text, text[-3000:]
    assert (f"[launch] the newest checkpoint is step 6 (in {tmp_path / 'ckpt'}): restart the job "
            "to resume from "
            "step 6") in text, text[-3000:]
    # JAX's abort, or this process's exit after its words (said after JAX's, if at all)
    if case == "coordinator":
        assert re.search(r"\[launch\] process 1 (killed by SIGABRT|exited with status 1).* at step "
                         r"9", text), text
        return
    said = text.index("[0] [jaxdist] process 1 stopped answering")
    assert not JAX_TEXT.search(text[:said]), text[-3000:]
    summary = re.search(r"\[launch\] process 0 exited with status 1 at step 9; it said: process 1 "
                        r"(.*)", text)
    assert summary and GONE.fullmatch(summary[1]), text[-3000:]


def test_the_silence_said_is_under_half_the_heartbeat_timeout():
    from jaxdist import job

    try:
        said = {}
        for timeout in (4, 6, 10, 30, 100):
            job.set_heartbeat_timeout(timeout)
            said[timeout] = job.silence_seconds()
        assert said == {4: 2.0, 6: 2.0, 10: 4.0, 30: 14.0, 100: 49.0}
    finally:
        job.set_heartbeat_timeout(100)


def test_a_process_leaves_the_progress_it_ended_with_for_the_launchers_summary(monkeypatch, tmp_path):
    """A checkpoint that completes after the last beat is in the progress a process leaves at its
    goodbye: the summary of a job whose processes all raised said "no checkpoint was complete" where
    their errors named the checkpoint. A store whose wait ends only at the goodbye: one beat, then
    the goodbye."""
    import json

    from jaxdist.job import _failure as failure

    class Store:
        def __init__(self):
            self.values, self.changed = {}, threading.Condition()

        def key_value_set(self, key, value, allow_overwrite=False):
            with self.changed:
                self.values[key] = value
                self.changed.notify_all()

        def key_value_dir_get(self, prefix):
            with self.changed:
                return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]

        def blocking_key_value_get(self, key, timeout_ms):
            with self.changed:
                self.changed.wait_for(lambda: key in self.values, timeout=30)
                return self.values[key]

    monkeypatch.setenv("JAXDIST_LAUNCH_DIR", str(tmp_path))
    monkeypatch.setattr(failure.jax, "process_index", lambda: 0)
    monkeypatch.setattr(failure.jax, "process_count", lambda: 2)
    progress = {"step": 3, "checkpoint": None, "checkpoint_dir": "/c"}
    beats = failure._Beats(Store(), lambda: dict(progress))
    report = tmp_path / "0.json"
    end = time.monotonic() + 30
    while not report.exists() and time.monotonic() < end:  # the first beat
        time.sleep(0.01)
    assert json.loads(report.read_text())["checkpoint"] is None
    progress.update(step=5, checkpoint=3)  # step 3's save completes
    beats.close()
    assert json.loads(report.read_text()) == {"step": 5, "checkpoint": 3, "checkpoint_dir": "/c"}
