"""Checkpoints in two tiers: a lost host costs the steps since the last LOCAL save, not the last
persistent one.

The real thing: 2 processes x 4 CPU devices (``python -m jaxdist.launch``, gloo), FSDP across both
processes, the persistent tier every 10 steps and the local tier every 2
(`tests/multiprocess/two_tier_worker.py`). Process 1 is SIGKILLed after step 15 and its local
directory deleted (a fresh host); the restarted job restores step 14 from the local tier, process
1's shards from process 0's copy, and ends bitwise equal to an uninterrupted run. The fault cases
that fall back to the persistent tier are decided by `decide` (checked here case by case, in this
process) and one of them end to end (both local directories lost). Every subprocess wait has a
timeout.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from registry import LAUNCH, launch_env

import jaxdist as jd
from jaxdist.training.checkpoints._local import decide
from jaxdist.training.loop import FitOptions

HERE = Path(__file__).parent
WORKER = HERE / "multiprocess" / "two_tier_worker.py"
STEPS = 20


def _job(tmp_path, out, *extra, expect=0):
    out.mkdir(exist_ok=True)
    command = [*LAUNCH, "-n", "2", "--cpu-devices", "4", "--timeout", "150", "--grace", "5",
               str(WORKER),
               str(tmp_path / "ckpt"), str(tmp_path / "local-{process}"), str(out), str(STEPS),
               *extra]
    proc = subprocess.run(command, env=launch_env(), capture_output=True, text=True, timeout=180)
    text = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == (expect == 0), text[-5000:]
    return text


def _params(out):
    with np.load(out / "params.npz") as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lost_host_restores_the_newest_local_step_and_ends_bitwise(tmp_path):
    """Slow: two 2-process jobs (imports, gloo, compiles): the killed one, and the restart, in which
    the uninterrupted run follows, then, with both local directories gone, a restart from the
    persistent tier (a fresh Trainer: what it restores is decided from the directories alone)."""
    killed = _job(tmp_path, tmp_path / "killed", "kill=15", expect=1)
    # the persistent tier holds 10 (and the job failed by the kill, not before)
    assert jd.training.Checkpointer(tmp_path / "ckpt").all_steps() == [10], killed[-4000:]
    shutil.copytree(tmp_path / "ckpt", tmp_path / "both" / "ckpt")  # for the second restart, below
    shutil.rmtree(tmp_path / "local-1")  # process 1 comes back on a fresh host
    (tmp_path / "straight").mkdir()
    text = _job(tmp_path, tmp_path / "resumed", f"straight={tmp_path / 'straight'}",
                f"both_lost={tmp_path / 'both'}")
    said = ("restored step 14 from the local tier: process 1's shards from process 0's copy; "
            "the persistent tier holds 10")
    assert said in text, text[-4000:]
    first = re.search(r"^\[0\] step (\d+)$", text, re.M)
    assert first and int(first.group(1)) == 15  # 14 restored, not 10
    for a, b in zip(_params(tmp_path / "resumed"), _params(tmp_path / "straight"), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)

    # The same crash with both local directories lost (both copies of every shard): the persistent
    # tier, by name.
    assert (
        "the local tier restores nothing: no process has a complete local step; "
        "the persistent tier holds 10"
        in text
    ), text[-4000:]
    assert int(re.search(r"^\[0\] both lost: step (\d+)$", text, re.M).group(1)) == 11


REC = dict(processes=2, identity="i", layout="l", run="r")


def _decide(records, persistent=10):
    return decide(records, identity="i", layout="l", persistent_step=persistent)


def test_both_copies_present_restore_each_process_from_its_own():
    records = [[dict(REC, step=14, process=0, peer=1)], [dict(REC, step=14, process=1, peer=0)]]
    assert _decide(records) == (14, (0, 1), None)


def test_two_neighbours_lost_fall_back_by_name():
    """Three processes, p holds p and p + 1: losing processes 1 and 2 loses process 2's both
    copies."""
    rec = dict(REC, processes=3)
    step, _, reason = decide([[dict(rec, step=14, process=0, peer=1)], [], []], identity="i",
                             layout="l", persistent_step=10)
    assert step is None and reason.startswith("step 14 lacks the shards of process 2 ")


def test_an_older_step_assembles_when_the_newest_is_incomplete():
    """Process 1's save of step 16 was interrupted (never committed): step 14 is the newest whole
    one."""
    records = [[dict(REC, step=14, process=0, peer=1), dict(REC, step=16, process=0, peer=1)],
               [dict(REC, step=14, process=1, peer=0)]]
    assert _decide(records)[:2] == (16, (0, 0))  # process 0 holds both halves of 16
    # each holding only its own half of 16 ...
    records[0][-1] = dict(REC, step=16, process=0, peer=None)
    # ... of two runs: never mixed
    records[1].append(dict(REC, step=16, process=1, peer=None, run="other"))
    assert _decide(records)[:2] == (14, (0, 1))


@pytest.mark.parametrize(("change", "named"), [
    ({"processes": 4}, "written by 4 processes, this job has 2"),
    ({"identity": "x"}, "belongs to another run (its fingerprint"),
    ({"layout": "x"}, "written with another layout"),
])
def test_another_count_run_or_layout_falls_back_by_name(change, named):
    records = [[dict(REC, step=14, process=0, peer=1, **change)],
               [dict(REC, step=14, process=1, peer=0, **change)]]
    step, _, reason = _decide(records)
    assert step is None and named in reason


def test_a_local_step_older_than_the_persistent_one_is_not_used():
    records = [[dict(REC, step=8, process=0, peer=1)], [dict(REC, step=8, process=1, peer=0)]]
    step, _, reason = _decide(records, persistent=10)
    assert step is None and "older than the persistent tier's" in reason


def test_a_failed_local_save_is_a_warning_and_keeps_no_step(tmp_path, caplog, monkeypatch):
    """A full local disk (the write raises ENOSPC): warned, no step kept, the earlier one intact."""
    strategy = jd.OneDeviceStrategy()
    state = strategy.mirror({"w": np.arange(4.0, dtype=np.float32)})
    local = jd.training.LocalCheckpointer(tmp_path / "local-{process}")
    local.save(0, state)
    local.wait_until_finished()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "savez", full)
    local.save(2, state)
    local.wait_until_finished()
    assert local.all_steps() == [0] and local.failures and local.failures[0][0] == 2
    assert "local checkpoint step 2 could not be written" in caplog.text


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"local_checkpoint_dir": "/tmp/x-{process}"},
     "local_checkpoint_dir='/tmp/x-{process}' needs the other one"),
    ({"local_checkpoint_every": 2}, "local_checkpoint_every=2 needs the other one"),
    ({"local_checkpoint_dir": "/tmp/x", "local_checkpoint_every": 2}, "needs checkpoint_dir=..."),
    ({"local_checkpoint_dir": "/tmp/x", "local_checkpoint_every": 0, "checkpoint_dir": "/tmp/y"},
     "local_checkpoint_every"),
])
def test_local_tier_options_are_checked(kwargs, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        FitOptions(steps=4, **kwargs)
