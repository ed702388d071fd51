"""Which host is slow: each process's step time and input wait per log window, compared on process 0.

The real thing runs 2 processes x 2 CPU devices (``python -m jaxdist.launch``, gloo): a run where neither
process is slow names nobody, a run whose process 1 sleeps 50 ms before each batch names process 1. The rule
itself and the single-process figures are checked in this process. Every subprocess wait has a timeout.
"""

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import flax.linen as nn
import numpy as np
import optax
import pytest
from registry import LAUNCH, launch_env

import jaxdist as jd
from jaxdist.training.data import WholeBatch
from jaxdist.training.loop import _hosts
from jaxdist.training.loop._hosts import HostTimes, SameBatches

HERE = Path(__file__).parent


def _trainer():
    return jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1),
                               lambda out, y: ((out[:, 0] - y) ** 2).mean())


def test_history_processes_keeps_each_windows_figures_and_straggler_ratio_is_checked():
    batch = (np.ones((8, 2), np.float32), np.ones(8, np.float32))
    history = _trainer().fit([batch] * 3, steps=6, log_every=3, verbose=0)
    assert [row["step"] for row in history.processes] == [3, 6]
    for row in history.processes:
        assert sorted(row) == ["host", "input_wait", "step", "step_time", "stragglers"]
        assert len(row["step_time"]) == len(row["input_wait"]) == len(row["host"]) == 1  # one process
        assert row["step_time"][0] > 0 and 0 <= row["input_wait"][0] <= row["step_time"][0]
        assert row["stragglers"] == []
    for bad in (1, 0.5, "2", True):
        with pytest.raises(ValueError, match=rf"straggler_ratio={bad!r} must be a number > 1, or None"):
            _trainer().fit([batch], steps=1, verbose=0, straggler_ratio=bad)


def test_a_process_is_named_when_its_input_wait_exceeds_the_median_by_the_ratio_and_matters():
    """The rule on three processes' figures: 1.25x the median input wait AND an excess of at least 0.25 of the
    median step; microseconds of input on a fast pipeline name nobody; a process is named again only after a
    window in which it was not slow."""
    rows = []
    times = HostTimes(spans=False, ratio=1.25, rows=rows)

    def window(step, waits, step_time=0.1):
        times._row(step, [{"host": f"h{p}", "step_time": step_time, "input_wait": w} for p, w in enumerate(waits)])

    with pytest.warns(jd.training.StragglerWarning, match=r"^process 2 \(host h2\) is slow: it waits 60 ms per "
                                                          r"step on its input, 6\.0x the median process's 10 ms"):
        window(10, [0.010, 0.009, 0.060])
    window(20, [0.010, 0.009, 0.070])  # still slow: not named again (the row says so)
    window(30, [20e-6, 10e-6, 80e-6])  # 8x the median, but 70 us of a 100 ms step: nobody
    window(40, [0.010, 0.034, 0.011])  # 3.1x the median, but 23 ms more in a 100 ms step: under 0.25 of it
    with pytest.warns(jd.training.StragglerWarning, match=r"^process 2 "):
        window(50, [0.010, 0.009, 0.060])  # slow again after a window that was not
    assert [row["stragglers"] for row in rows] == [[2], [2], [], [], [2]]
    assert rows[0]["host"] == ["h0", "h1", "h2"] and rows[0]["input_wait"][2] == 0.060


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_process_slow_in_its_input_is_named_on_process_0_and_nobody_when_none_is():
    """Slow because of its 2-process job (both runs in it: even, then process 1 slow in its input)."""
    command = [*LAUNCH, "-n", "2", "--cpu-devices", "2", "--timeout", "200",
               str(HERE / "multiprocess" / "straggler_worker.py")]
    proc = subprocess.run(command, env=launch_env(), capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    results = {(r["run"], r["pid"]): r for r in
               (json.loads(line.split(" ", 2)[2]) for line in proc.stdout.splitlines() if " RESULT " in line)}
    assert len(results) == 4, proc.stdout[-4000:]
    for run in ("even", "slow"):
        assert results[(run, 1)] == {"run": run, "pid": 1, "named": [], "processes": []}  # process 0 collects
    even, slow = results[("even", 0)], results[("slow", 0)]
    assert even["named"] == [] and all(row["stragglers"] == [] for row in even["processes"]), even
    assert [row["step"] for row in even["processes"]] == [10, 20, 30]
    assert all(None not in row["input_wait"] and len(row["input_wait"]) == 2 for row in even["processes"])
    assert len(slow["named"]) == 1 and slow["named"][0].startswith("process 1 (host "), slow
    assert "waits" in slow["named"][0] and "on its input" in slow["named"][0]
    assert any(row["stragglers"] == [1] for row in slow["processes"]), slow
    waits = [row["input_wait"][1] for row in slow["processes"]]  # per step: a window reads ahead of its steps
    assert sum(waits) / len(waits) >= 0.045, waits  # it slept 50 ms before each batch
    print("\n".join(f"{run} run: " + ", ".join(
        f"step {row['step']}: step time " + "/".join(f"{1e3 * t:.1f}" for t in row["step_time"]) + " ms, input "
        + "/".join(f"{1e3 * t:.1f}" for t in row["input_wait"]) + " ms" for row in results[(run, 0)]["processes"])
        for run in ("even", "slow")))


def test_process_0_decides_the_batch_comparison_and_deletes_its_keys_a_block_at_a_time(monkeypatch):
    """Process 0's side of `SameBatches` on a fake store (process 1's fingerprints posted ahead): a verdict per
    point, the keys of 64 points deleted in one call once the next 64 have begun, and a fingerprint that differs
    an error naming the process, the step and the point before. (The real thing: tests/test_job_failures.py.)"""
    store = {}
    monkeypatch.setattr(_hosts, "jax", SimpleNamespace(process_count=lambda: 2, process_index=lambda: 0))
    monkeypatch.setattr(_hosts, "post", store.__setitem__)
    monkeypatch.setattr(_hosts, "gather", lambda prefix, timeout, own: [own, store.get(f"{prefix}/1")])
    monkeypatch.setattr(_hosts, "forget", lambda key: [store.pop(k) for k in list(store) if k.startswith(f"{key}/")])
    pair = (np.arange(32.0).reshape(16, 2), np.arange(16))
    batch = WholeBatch(pair, False, None, pair)
    same = SameBatches(spans=True)
    for n in range(131):  # process 1 passes the same batches up to point 130, then its rows in another order
        store[f"{same._prefix}/{n // 64}/{n % 64}/1"] = (batch if n < 130 else WholeBatch(pair, False, None, (
            pair[0][::-1], pair[1]))).fingerprint()
    for step in range(1, 131):
        same.check(step, [batch])  # an on-device loop's batches: the last one is compared
    same.check(130, batch)  # a step compared already: nothing
    blocks = sorted({key.split("/")[3] for key in store})
    assert blocks == ["2"], blocks  # points 0-63 and 64-127 deleted; 128-130 left
    assert [store[f"{same._prefix}/2/{i}/verdict"] for i in range(2)] == ["alike:"] * 2
    with pytest.raises(jd.training.JobDisagreementError, match=r"passed different global batches at step 131: process "
                       r"1 differs from process 0 \(fingerprints: process 0: \w{8}; process 1: \w{8}\); they agreed "
                       r"at step 130, the check before\. .* Fix: every process passes the same global batch") as error:
        same.check(131, batch)
    assert error.value.on_every_process and store[f"{same._prefix}/2/2/verdict"].startswith("differ:")
