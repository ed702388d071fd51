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


def _env(strategy="mwms"):
    return launch_env(WORKER_STRATEGY=strategy)


def _command(ckpt, out, *extra):
    out.mkdir(exist_ok=True)
    return [*LAUNCH, "-n", "2", "--cpu-devices", "4", "--timeout", "150", str(WORKER), str(ckpt),
            str(out), str(STEPS), *extra]


def _run(ckpt, out, *extra, strategy="mwms"):
    proc = subprocess.run(_command(ckpt, out, *extra), env=_env(strategy), capture_output=True,
                          text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout


def _params(out):
    with np.load(out / "params.npz") as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_sigterm_to_one_process_stops_both_at_one_step_and_resume_is_bitwise(tmp_path):
    """On HSDP (ShardedStrategy over the user's ('data', 'fsdp') mesh, 'data' across the processes):
    each process saves and restores its own shards; MultiWorkerMirroredStrategy runs the
    stop_training test. The uninterrupted run to compare with runs after the resumed one, in the
    same job (a trainer of its own, from the start): one 2-process job fewer. Slow because of its 2
    jobs of 2 processes (imports, gloo, compiles)."""
    ckpt = tmp_path / "ckpt"
    out = tmp_path / "first"
    proc = subprocess.Popen(
        _command(ckpt, out), env=_env("hsdp"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True
    )
    lines, latency = [], None
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
        latency = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    text = "".join(lines) + rest
    assert proc.returncode == 0, text[-5000:]  # both exited cleanly, after saving
    ends = {int(p): (int(s), flag, names) for p, s, flag, names in END.findall(text)}
    assert set(ends) == {0, 1}, text[-5000:]
    (stop, flag, names), other = ends[0], ends[1]
    # the same step, both preempted, the same checkpoint
    assert other == ends[0] and flag == "True", ends
    assert 3 <= stop < STEPS and names == f"'{stop}'"
    assert "done" not in text  # fit raised SystemExit(0): nothing after it ran
    checkpoints = jd.training.Checkpointer(ckpt)
    assert checkpoints.all_steps() == [stop]  # one checkpoint, complete
    checkpoints.close()
    print(f"stop latency (SIGTERM to process 1 -> both processes exited): {latency:.2f} s, stopped "
          f"after step {stop}")
    assert latency < 60

    (tmp_path / "straight").mkdir()
    resumed = _run(ckpt, tmp_path / "resumed", f"straight={tmp_path / 'straight'}", strategy="hsdp")
    first = re.search(r"^\[0\] step (\d+)$", resumed, re.M)
    assert first and int(first.group(1)) == stop + 1  # resumed where both stopped
    # the resumed run's, then the uninterrupted one's, on both processes
    ends = END.findall(resumed)
    assert len(ends) == 4 and {(int(s), flag) for _, s, flag, _ in ends} == {(STEPS, "False")}, (
        resumed[-3000:]
    )
    assert [int(s) for s in re.findall(r"^\[0\] step (\d+)$", resumed,
                                       re.M)][-STEPS:] == list(range(1, STEPS + 1))
    for a, b in zip(_params(tmp_path / "resumed"), _params(tmp_path / "straight"), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_stop_training_on_one_process_stops_both_after_the_same_step(tmp_path):
    """A callback on process 1 alone sets stop_training: both processes stop after one step and save
    one checkpoint together (a process leaving the loop alone would deadlock the other's next
    collective)."""
    ckpt = tmp_path / "ckpt"
    text = _run(ckpt, tmp_path / "out", "5")
    ends = {int(p): (int(s), flag, names) for p, s, flag, names in END.findall(text)}
    assert set(ends) == {0, 1} and ends[0] == ends[1], text[-3000:]
    stop, flag, names = ends[0]
    # not preempted: fit returned
    assert 5 <= stop <= 8 and flag == "False" and names == f"'{stop}'"
    assert "done" in text
    checkpoints = jd.training.Checkpointer(ckpt)
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
