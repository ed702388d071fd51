"""A Keras user's fit on 2 real processes (2 x 4 CPU devices, ``python -m jaxdist.launch``, gloo):
the default backup every epoch bounds what a SIGKILL of a worker loses, and the resumed job ends
bitwise where an uninterrupted one does; a time cadence saves at the same steps on every process; a
preempted job says so in its log (tests/multiprocess/keras_worker.py). Every subprocess wait has a
timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from registry import LAUNCH, launch_env

import jaxdist as jd

HERE = Path(__file__).parent
WORKER = HERE / "multiprocess" / "keras_worker.py"
EPOCH, STEPS = 8, 24


def _command(ckpt: Path, out: Path, *extra: str) -> list[str]:
    out.mkdir(exist_ok=True)
    return [*LAUNCH, "-n", "2", "--cpu-devices", "4", "--timeout", "150", str(WORKER), str(ckpt),
            str(out), *extra]


def _until(proc: subprocess.Popen, act, deadline: float = 150) -> str:
    """Read ``proc``'s output; ``act(line, lines)`` may signal a process (returns True once it has).
    The text."""
    lines: list[str] = []
    acted = False
    try:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if not acted:
                acted = act(line, lines)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return "".join(lines) + rest


def _params(out: Path) -> list[np.ndarray]:
    with np.load(out / "params.npz") as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


def _steps(text: str, process: int) -> list[int]:
    return [int(s) for s in re.findall(rf"^\[{process}\] step (\d+)$", text, re.M)]


@pytest.fixture(scope="session")
def killed_then_resumed(tmp_path_factory):
    """A job whose process 1 gets SIGKILL in epoch 2 (after epoch 1's backup is complete), then the
    same command again, which resumes, followed in the same job by the uninterrupted run and by the
    run of test_a_stop_at_an_epochs_end_on_one_process_ends_both_there (each in a trainer and
    directory of its own: one 2-process job fewer than a job of its own). Slow because of its 2
    jobs of 2 processes (imports, gloo, compiles). ``(tmp, killed job's output, its return code,
    its newest checkpoint, resumed job)``."""
    tmp = tmp_path_factory.mktemp("keras_killed")
    ckpt, out = tmp / "ckpt", tmp / "first"
    proc = subprocess.Popen(_command(ckpt, out), env=launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    # once epoch 1's backup is complete, 3 steps into epoch 2
    def kill(line: str, lines: list[str]) -> bool:
        step = re.match(r"^\[1\] step (\d+)$", line.strip())
        if step and int(step.group(1)) >= EPOCH + 3 and "[1] checkpoint 8\n" in lines:
            os.kill(int((out / "pid_1").read_text()), signal.SIGKILL)
            return True
        return False

    text = _until(proc, kill)
    with jd.training.Checkpointer(ckpt) as saved:
        newest = saved.latest_step()  # what the killed job left
    for name in ("straight", "stop"):
        (tmp / name).mkdir()
    resumed = subprocess.run(_command(ckpt, tmp / "resumed", f"straight={tmp / 'straight'}",
                                      f"stop={tmp / 'stop'}"),
                             env=launch_env(), capture_output=True, text=True, timeout=200)
    return tmp, text, proc.returncode, newest, resumed


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_worker_killed_mid_epoch_resumes_from_the_epochs_backup_bitwise(killed_then_resumed):
    """SIGKILL to process 1 in epoch 2 (after epoch 1's backup is complete): the job fails, its
    directory holds the epoch's backup, and the same command resumes there and ends with the
    parameters of an uninterrupted run."""
    tmp_path, text, returncode, newest, resumed = killed_then_resumed
    ckpt = tmp_path / "ckpt"
    assert returncode != 0, text[-3000:]  # a worker died: the job failed
    reached = max(_steps(text, 0) + _steps(text, 1))
    head = [line[4:] for line in text.splitlines()
            if line.startswith("[0] ") and not re.match(r"(step|checkpoint) \d+$", line[4:])]
    assert head[0] == "checkpoints every epoch and every 10 min (the default checkpoint_every)", (
        head[:3]
    )
    complete = [int(s) for s in re.findall(r"^\[0\] checkpoint (\d+)$", text, re.M)]
    # the newest backup is an epoch's end, at least the newest process 0 saw complete; the kill lost
    # at most an epoch, and the steps taken while the next epoch's backup was in flight (a loaded
    # machine: the kill comes late)
    assert newest is not None and newest % EPOCH == 0 and newest >= max(complete, default=EPOCH), (
        newest,
        complete,
    )
    assert 0 <= reached - newest <= EPOCH or (reached - newest <= 2 * EPOCH
                                              and newest + EPOCH not in complete)

    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-2000:]
    assert f"[0] resumed from step {newest} ({ckpt})" in resumed.stdout
    first = _steps(resumed.stdout, 0)
    # resumed at the backup, to the end
    assert first[0] == newest + 1 and first[STEPS - newest - 1] == STEPS
    assert re.search(rf"^\[0\] epoch 3/3 at step {STEPS}/{STEPS}: loss \S+ accuracy \S+$",
                     resumed.stdout, re.M)
    for a, b in zip(_params(tmp_path / "resumed"), _params(tmp_path / "straight"), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_checkpoints_on_the_clock_agree_and_a_preempted_job_says_so(tmp_path):
    """``checkpoint_every=timedelta(milliseconds=1)``: process 0's clock asks at each log point,
    every process saves after the same step. A callback with an epoch hook on process 0 alone (the
    fit counts no epochs): both processes watch the passes' ends. SIGTERM to process 1 stops both
    after one step and saves it; process 0's log ends with which signal, the step saved and how to
    resume."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    proc = subprocess.Popen(_command(ckpt, out, "clock"), env=launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def term(line: str, lines: list[str]) -> bool:
        if line.strip() == "[1] step 13":
            os.kill(int((out / "pid_1").read_text()), signal.SIGTERM)
            return True
        return False

    text = _until(proc, term)
    assert proc.returncode == 0, text[-4000:]  # both saved and exited 0
    saves = [
        [int(s) for s in re.findall(rf"^\[{p}\] checkpoint (\d+)$", text, re.M)] for p in (0, 1)
    ]
    # the clock's saves, then the preemption's
    assert saves[0] == saves[1] and len(saves[0]) >= 3, saves
    stop = saves[0][-1]
    assert (
        13 <= stop < STEPS
        and f"[0] end {stop} preempted=True" in text
        and f"[1] end {stop} preempted=True" in text
    )
    assert text.splitlines().count(f"[0] preempted by SIGTERM (to another process) at step {stop}: "
                                   f"saved step {stop} "
                                   f"to {ckpt}; run again to resume") == 1, text[-3000:]
    assert "[0] checkpoints every 0.001 s" in text
    # 5 batches a pass
    assert "[0] pass 0 ended at step 5\n" in text and "[0] pass 1 ended at step 10\n" in text


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_stop_at_an_epochs_end_on_one_process_ends_both_there(killed_then_resumed):
    """Process 1 alone asks to stop in ``on_epoch_end`` of epoch 0: both processes end at that step
    (the epoch's end is an agreement every process reaches at once), with ModelCheckpoint's
    collective save there and DeleteBackups deleting the backups of a run a callback stopped (it
    finished). Its run is the last of the resumed job of `killed_then_resumed`."""
    tmp_path, _, _, _, proc = killed_then_resumed
    stop = tmp_path / "stop"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    text = proc.stdout
    assert (
        f"[0] stop: end {EPOCH} preempted=False" in text
        and f"[1] stop: end {EPOCH} preempted=False" in text
    ), text[-3000:]
    steps = [int(s) for s in re.findall(r"^\[[01]\] stop: step (\d+)$", text, re.M)]
    assert max(steps) == EPOCH  # not a step of epoch 1
    assert f"[0] the run finished: deleted its checkpoints in {stop / 'ckpt'}" in text
    assert not [name for name in os.listdir(stop / "ckpt") if name.isdigit()]
    with jd.training.Checkpointer(stop / "best") as best:
        assert best.all_steps() == [EPOCH] and best.meta(EPOCH)["monitor"] == "loss"
