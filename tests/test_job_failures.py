"""A job whose processes disagree or fail ends, every process with the reason, in bounded time.

Real processes (2 x 4 CPU devices, gloo): one pair runs the disagreements found at the start of ``fit`` (steps,
checkpoint cadence, a checkpoint_dir each process has to itself), different global batches (named at the first step,
or at the first log point after they start to differ; the same ones train), and then data that ends early on one
process;
another, under ``python -m jaxdist.launch``, a process that raises at step 5. Every wait is bounded.
"""

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from registry import LAUNCH, launch_env
from test_cluster_operations import _two

import jaxdist as jd
from jaxdist import job
from jaxdist.training.checkpoints._claim import CLAIM_FILE

HERE = Path(__file__).parent
WORKER = HERE / "multiprocess" / "disagree_worker.py"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_processes_that_disagree_are_named_at_the_start_and_data_that_ends_early_ends_the_job(tmp_path):
    started = time.monotonic()
    results = _two(WORKER, "steps,cadence,dir,batches,diverges,same,data", tmp_path, timeout=200)
    elapsed = time.monotonic() - started
    for pid, (code, text) in enumerate(results):
        cases = {line.split(":")[0][5:]: line for line in text.splitlines() if line.startswith("CASE ")}
        assert "steps=12 on process 0, 16 on process 1" in cases["steps"], text[-3000:]
        assert "checkpoint_every=5 on process 0, 7 on process 1" in cases["cadence"], text[-3000:]
        assert "is not one directory shared by the processes of this job: process(es) [1]" in cases["dir"]
        # each process shuffling with its own seed: named at the first step, with the fix
        assert "passed different global batches at step 1: process 1 differs from process 0" in cases["batches"]
        assert "seed the shuffle the same on every process" in cases["batches"], cases["batches"]
        assert "they agreed" not in cases["batches"] and "distribute_datasets_from_function" in cases["batches"]
        # alike up to step 4, then not: named at the next log point (log_every=3)
        assert ("passed different global batches at step 6: process 1 differs from process 0 (fingerprints: "
                "process 0: ") in cases["diverges"], cases["diverges"]
        assert "they agreed at step 3, the check before" in cases["diverges"], cases["diverges"]
        assert cases["same"] == "CASE same: fit returned", text[-3000:]
        assert "data" not in cases, text[-3000:]  # the job ended there
        assert code == 1, f"process {pid} exited {code}:\n{text[-3000:]}"
        assert "process 1: its data ended after batch 5 of 12" in text, text[-3000:]
    assert "process 0 stops too (exit status 1)" in results[0][1]
    print(f"both processes exited {elapsed:.1f} s after start")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_process_that_raises_ends_the_job_under_the_launcher(tmp_path):
    started = time.monotonic()
    out = subprocess.run(
        [*LAUNCH, "-n", "2", "--cpu-devices", "4", "--timeout", "150", str(WORKER),
         "raises", str(tmp_path)], env=launch_env(), capture_output=True, text=True, timeout=170)
    elapsed = time.monotonic() - started
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    assert "[launch] timed out" not in text
    assert "RuntimeError: a callback failed on purpose" in text
    assert ("[0] [jaxdist] process 1 raised RuntimeError(a callback failed on purpose) at step 5; process 0 stops "
            "too (exit status 1)") in text, text[-3000:]
    print(f"the job ended {elapsed:.1f} s after start")


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_checkpoint_dir_another_live_run_writes_ends_the_job_at_the_start(tmp_path):
    claimed = tmp_path / "claimed"
    claimed.mkdir()
    (claimed / CLAIM_FILE).write_text(json.dumps(  # this test's process: alive on this host
        {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "run": "other"}))
    results = _two(WORKER, "claimed", tmp_path, timeout=120)
    for pid, (code, text) in enumerate(results):
        assert code == 1, f"process {pid} exited {code}:\n{text[-3000:]}"
        assert "is being written by another run: run other" in text, text[-3000:]
        assert "CASE" not in text  # no fit returned
    assert "CheckpointConflictError: checkpoint_dir=" in results[0][1]  # process 0 claims for the job
    assert "process 0 raised CheckpointConflictError(checkpoint_dir=" in results[1][1], results[1][1][-3000:]
    assert (claimed / CLAIM_FILE).exists() and not any(p.name.isdigit() for p in claimed.iterdir())


def test_one_process_has_nothing_to_agree_and_data_that_ends_early_is_said():
    import flax.linen as nn
    import numpy as np
    import optax

    assert job.exchange("x", "1", timeout=0.1) == ["1"]
    job.agree_on_fit(None, {"steps": 3}, None)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    data = [(x[i : i + 8], (x[i : i + 8, 0] > 0).astype(np.int32)) for i in range(0, 40, 8)]
    trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(2), optax.sgd(0.1),
                                  lambda o, y: optax.softmax_cross_entropy_with_integer_labels(o, y).mean())
    with pytest.warns(UserWarning, match=r"fit: train_data ended at step 5 of steps=12: the run stopped there"):
        history = trainer.fit(iter(data), steps=12, verbose=0)  # said whatever verbose is
    assert trainer.step == 5 and history.data_ended == 5
    history = trainer.fit(data, steps=8, verbose=0)  # a list repeats: no early end
    assert trainer.step == 8 and history.data_ended is None
