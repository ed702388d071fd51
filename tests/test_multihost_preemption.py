"""Coordinated preemption: SIGTERM to ONE of several processes stops them all after the same step.

The real thing runs 2 processes x 4 CPU devices (``python -m jaxdist.launch``, gloo): an
uninterrupted run, a run whose process 1 gets SIGTERM, and the same command again, which resumes and
must end bitwise identical to the uninterrupted run. The agreement itself (`jaxdist.training.loop`)
is also checked in this process over 8 local devices, where every check is cheap. Every subprocess
wait has a timeout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from registry import LAUNCH, launch_env

import jaxdist as jd
from jaxdist.training.loop import PreemptionWatcher
from jaxdist.training.loop._preemption import _Agreement

HERE = Path(__file__).parent
ROOT = HERE.parent
WORKER = HERE / "multiprocess" / "preempt_worker.py"
STEPS = 24  # 6 epochs of 4 batches, dropout on: data order and RNG both matter
END = re.compile(r"^\[(\d)\] end (\d+) preempted=(True|False) checkpoints=\[(.*)\]$", re.M)
STOP_END = re.compile(r"^\[(\d)\] stop: end (\d+) preempted=(True|False) checkpoints=\[(.*)\]$",
                      re.M)


def _command(ckpt, out, *extra):
    out.mkdir(exist_ok=True)
    return [*LAUNCH, "-n", "2", "--cpu-devices", "4", "--timeout", "150", str(WORKER), str(ckpt),
            str(out), str(STEPS), *extra]


def _params(out):
    with np.load(out / "params.npz") as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


@pytest.fixture(scope="session")
def stopped_then_resumed(tmp_path_factory):
    """A job whose process 1 alone gets SIGTERM after step 3, then the same command again, which
    resumes, followed in the same job by the uninterrupted run and by the run of
    test_stop_training_on_one_process_stops_both_after_the_same_step (each in a trainer and
    directory of its own: one 2-process job fewer than a job of its own). Slow because of its 2
    jobs of 2 processes (imports, gloo, compiles). ``(tmp, the first job's return code, its output,
    its checkpoints' steps, the stop latency, the resumed job)``."""
    tmp_path = tmp_path_factory.mktemp("multihost_preemption")
    ckpt = tmp_path / "ckpt"
    out = tmp_path / "first"
    proc = subprocess.Popen(
        _command(ckpt, out), env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True
    )
    lines, signalled = [], None
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.strip() == "[1] step 3":  # only process 1 is told
                os.kill(int((out / "pid_1").read_text()), signal.SIGTERM)
                signalled = time.monotonic()
                break
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    if signalled is None:  # the job ended (or hung) before process 1's step 3: say how
        pytest.fail(f"the first job never printed '[1] step 3' (return code {proc.returncode}); "
                    f"its output:\n{(''.join(lines) + rest)[-6000:]}")
    latency = time.monotonic() - signalled
    with jd.training.Checkpointer(ckpt) as checkpoints:
        saved = checkpoints.all_steps()  # what the first job left
    for name in ("straight", "stop"):
        (tmp_path / name).mkdir()
    resumed = subprocess.run(
        _command(ckpt, tmp_path / "resumed", f"straight={tmp_path / 'straight'}",
                 f"stop={tmp_path / 'stop'}"),
        env=launch_env(), capture_output=True, text=True, timeout=200)
    return tmp_path, proc.returncode, "".join(lines) + rest, saved, latency, resumed


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_sigterm_to_one_process_stops_both_at_one_step_and_resume_is_bitwise(stopped_then_resumed):
    """On HSDP (ShardedStrategy over the user's ('data', 'fsdp') mesh, 'data' across the processes):
    each process saves and restores its own shards. The uninterrupted run to compare with runs
    after the resumed one, in the same job (a trainer of its own, from the start)."""
    tmp_path, returncode, text, saved, latency, proc = stopped_then_resumed
    assert returncode == 0, text[-5000:]  # both exited cleanly, after saving
    ends = {int(p): (int(s), flag, names) for p, s, flag, names in END.findall(text)}
    assert set(ends) == {0, 1}, text[-5000:]
    (stop, flag, names), other = ends[0], ends[1]
    # the same step, both preempted, the same checkpoint
    assert other == ends[0] and flag == "True", ends
    assert 3 <= stop < STEPS and names == f"'{stop}'", text[-5000:]
    assert "done" not in text, text[-5000:]  # fit raised SystemExit(0): nothing after it ran
    assert saved == [stop], (saved, text[-5000:])  # one checkpoint, complete
    print(f"stop latency (SIGTERM to process 1 -> both processes exited): {latency:.2f} s, stopped "
          f"after step {stop}")
    assert latency < 60, text[-5000:]

    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    resumed = proc.stdout
    first = re.search(r"^\[0\] step (\d+)$", resumed, re.M)
    # resumed where both stopped
    assert first and int(first.group(1)) == stop + 1, (stop, resumed[-4000:])
    # the resumed run's, then the uninterrupted one's, on both processes
    ends = END.findall(resumed)
    assert len(ends) == 4 and {(int(s), flag) for _, s, flag, _ in ends} == {(STEPS, "False")}, (
        resumed[-3000:]
    )
    assert [int(s) for s in re.findall(r"^\[0\] step (\d+)$", resumed,
                                       re.M)][-STEPS:] == list(range(1, STEPS + 1))
    for a, b in zip(_params(tmp_path / "resumed"), _params(tmp_path / "straight"), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b), (stop, np.abs(a - b).max())


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_stop_training_on_one_process_stops_both_after_the_same_step(stopped_then_resumed):
    """A callback on process 1 alone sets stop_training (on MultiWorkerMirroredStrategy, the last
    run of `stopped_then_resumed`'s resumed job): both processes stop after one step and save one
    checkpoint together (a process leaving the loop alone would deadlock the other's next
    collective)."""
    tmp_path, _, _, _, _, proc = stopped_then_resumed
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    text = proc.stdout
    ends = {int(p): (int(s), flag, names) for p, s, flag, names in STOP_END.findall(text)}
    assert set(ends) == {0, 1} and ends[0] == ends[1], text[-3000:]
    stop, flag, names = ends[0]
    # not preempted: fit returned
    assert 5 <= stop <= 8 and flag == "False" and names == f"'{stop}'"
    assert "[0] stop: done" in text and "[1] stop: done" in text
    checkpoints = jd.training.Checkpointer(tmp_path / "stop" / "ckpt")
    assert checkpoints.all_steps() == [stop]
    checkpoints.close()


# -------------------------------------------------------------------- the agreement, in one process
def test_agreement_stops_every_check_lag_after_a_flag():
    mesh = jax.make_mesh((8,), ("replica",), axis_types=(jax.sharding.AxisType.Auto,))
    agreement = _Agreement(mesh, lag=2)
    flags = [False, False, True, False, False, False]
    seen = [agreement.check(flag, final=False) for flag in flags]
    assert seen == [0, 0, 0, 0, 1, 0]  # the flag of check 2, read at check 4
    assert agreement.check(0, final=False) == 0
    late = _Agreement(mesh, lag=3)
    assert [late.check(flag, final=False) for flag in (0, 2)] == [0, 0]
    # the final check reads everything dispatched: the largest flag
    assert late.check(1, final=True) == 2


def test_stop_training_goes_through_the_agreement(monkeypatch):
    """A callback's stop_training on one process must stop every process after the same step, like a
    signal (leaving the loop alone would deadlock the peers' next collective): it is a flag of the
    agreement."""
    # agree on this mesh
    monkeypatch.setattr(PreemptionWatcher, "spans_processes", property(lambda self: True))
    mesh = jd.MirroredStrategy().mesh
    with PreemptionWatcher(mesh=mesh, lag=2) as watcher:
        seen = [watcher.should_stop(stop_training=flag) for flag in (False, True, False, False)]
        assert seen == [False, False, False, True] and watcher.stopping and not watcher.preempted
    with PreemptionWatcher(mesh=mesh, lag=2) as watcher:
        assert not watcher.should_stop(stop_training=True)
        os.kill(os.getpid(), signal.SIGTERM)
        # the largest reason wins: a signal
        assert watcher.should_stop(final=True) and watcher.preempted


def test_watcher_is_local_on_one_process_and_latches(monkeypatch):
    strategy = jd.MirroredStrategy()
    with PreemptionWatcher(mesh=strategy.mesh) as watcher:
        assert watcher.installed and not watcher.spans_processes
        assert watcher.should_stop() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert watcher.requested and watcher.should_stop() and watcher.should_stop(final=True)
        assert watcher.preempted
    with PreemptionWatcher(mesh=strategy.mesh) as watcher:
        # stops now, no signal
        assert watcher.should_stop(stop_training=True) and not watcher.preempted
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    # a mesh that spans processes goes through the agreement: faked here with a device from "process
    # 1"
    class Remote:
        process_index = 1

    fake = type("FakeMesh", (), {"devices": np.array([jax.devices()[0], Remote()])})()
    assert PreemptionWatcher(mesh=fake).spans_processes


def test_watcher_arguments():
    with pytest.raises(ValueError, match=r"lag=0 must be an int >= 1"):
        PreemptionWatcher(lag=0)
    with pytest.raises(ValueError, match=r"signals=\(\) catches nothing"):
        PreemptionWatcher(signals=())
