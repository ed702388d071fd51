"""grain input: per-process shards, the iterator state in checkpoints, resuming (also on another
process count).

One 2-process launch (tests/multiprocess/grain_worker.py, 2 processes x 2 CPU devices) checks the
grain resume AND the one-writer logging; this process then checks what it wrote against
single-process training.
"""

import csv
import subprocess
import sys
import threading
import time
from pathlib import Path

import grain
import jax
import numpy as np
import pytest
from grain_model import GLOBAL_BATCH, examples, make_trainer, per_process_batches
from registry import LAUNCH, launch_env
from tfevents import read_events, scalars

import jaxdist as jd
from jaxdist.training.data import BatchChecker, IteratorSnapshot, save_args

HERE = Path(__file__).parent


def _leaves(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.params)]


def _assert_equal(a, b):
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_processes_resume_grain_exactly_and_log_once(tmp_path):
    """Slow because its one 2-process job runs 4 fits (logged, checkpointed, resumed, elastic), each
    a fresh trainer that traces and compiles its step, with grain's reader threads beside them on 2
    cores."""
    launch = [*LAUNCH, *"-n 2 --cpu-devices 2 --timeout 200".split()]
    worker = [str(HERE / "multiprocess" / "grain_worker.py"), str(tmp_path)]
    proc = subprocess.run([*launch, *worker], env=launch_env(), capture_output=True, text=True,
                          timeout=230)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert "[0] process 0 done" in out and "[1] process 1 done" in out
    # (The worker asserted that the resumed run equals the uninterrupted one bitwise and re-read
    # nothing.)

    # One writer: process 0 printed the progress and wrote one CSV and one event file.
    assert "[0] step 4/12 loss" in out and "[0] step 12/12 loss" in out
    assert "[0] per device:" in out
    assert "[1] step" not in out and "[1] per device:" not in out
    logs = tmp_path / "logs"
    (events_file,) = logs.glob("events.out.tfevents.*")
    with open(logs / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["4", "8", "12"]

    # ... and the values are the global ones: those of one process training on the same global
    # batches.
    with np.load(tmp_path / "result.npz") as saved:  # closed here, not when the collector runs
        result = {name: saved[name] for name in saved.files}
    reference = make_trainer(jd.OneDeviceStrategy())
    history = reference.fit(per_process_batches(2, 12), steps=12, log_every=4, verbose=0)
    want = [row["loss"] for row in history.train]
    np.testing.assert_allclose([float(r["loss"]) for r in rows], want, rtol=1e-5)
    tb = scalars(read_events(events_file))
    np.testing.assert_allclose([tb[("train/loss", s)] for s in (4, 8, 12)], want, rtol=1e-5)
    for got, ref in zip([result[f"arr_{i}"] for i in range(len(result) - 1)],
                        _leaves(reference), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)

    # Each process saved its own iterator state.
    states = sorted(p.name
                    for p in (tmp_path / "ckpt" / "10" / "data_iterator").glob("process_*.json"))
    assert states == ["process_0-of-2.json", "process_1-of-2.json"]

    # One process now: a per-process state cannot move to another process count -> a clear error ...
    with pytest.raises(
        ValueError,
        match=r"input iterator state of 2 processes .* this run has 1.* Fix: resume with 2 "
        r"processes, or .*grain\.experimental\.ElasticIterator",
    ):
        make_trainer(jd.MirroredStrategy()).fit(
            examples().batch(GLOBAL_BATCH), steps=14, checkpoint_dir=tmp_path / "ckpt", verbose=0
        )
    # ... while evaluating the checkpoint (no input to resume) works on any process count.
    evaluator = make_trainer(jd.MirroredStrategy())
    assert evaluator.restore(tmp_path / "ckpt", batch=per_process_batches(1, 1)[0]) == 12
    for got, ref in zip(_leaves(evaluator),
                        [result[f"arr_{i}"] for i in range(len(result) - 1)], strict=True):
        np.testing.assert_array_equal(got, ref)

    # ElasticIterator's position is valid on any process count: resume the 2-process run's step 3 on
    # one process; every global batch holds the same examples as one process reading them all.
    def elastic():
        return grain.experimental.ElasticIterator(examples(), GLOBAL_BATCH,
                                                  grain.sharding.ShardOptions(0, 1))

    resumed = make_trainer(jd.MirroredStrategy())
    resumed.fit(elastic(), steps=6, checkpoint_dir=tmp_path / "elastic", verbose=0)
    whole = make_trainer(jd.MirroredStrategy())
    whole.fit(elastic(), steps=6, verbose=0)
    assert resumed.step == 6
    for got, ref in zip(_leaves(resumed), _leaves(whole), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_grain_datasets_train_like_the_same_numpy_batches():
    batches = examples().batch(GLOBAL_BATCH)  # 8 batches: 10 steps cross an epoch
    as_list = [batches[i] for i in range(len(batches))]
    numpy_run, grain_run = make_trainer(jd.MirroredStrategy()), make_trainer(jd.MirroredStrategy())
    elastic_run, reference = (make_trainer(jd.OneDeviceStrategy()),
                              make_trainer(jd.OneDeviceStrategy()))
    numpy_run.fit(as_list, steps=10, verbose=0)
    grain_run.fit(batches, steps=10, verbose=0)
    _assert_equal(grain_run, numpy_run)
    # An iterator (read once) is peeked for the state's shapes without losing its first batch.
    elastic_run.fit(
        grain.experimental.ElasticIterator(examples(), GLOBAL_BATCH, grain.sharding.NoSharding()),
        steps=6, verbose=0
    )
    reference.fit(as_list[:6], steps=6, verbose=0)
    _assert_equal(elastic_run, reference)


def test_a_grain_loader_resumes_from_its_saved_state(tmp_path):
    def loader():
        source = [examples()[i] for i in range(len(examples()))]  # (x, y) records
        sampler = grain.samplers.IndexSampler(len(source), shuffle=True, seed=3, num_epochs=None)
        return grain.DataLoader(
            data_source=source, sampler=sampler, operations=[grain.transforms.Batch(16)],
            worker_count=0
        )

    whole = make_trainer(jd.OneDeviceStrategy())
    whole.fit(loader(), steps=9, verbose=0)
    make_trainer(jd.OneDeviceStrategy()).fit(loader(), steps=5, checkpoint_dir=tmp_path, verbose=0)
    # The saved state is the loader's after exactly 5 batches, whatever the prefetch thread had read
    # ahead.
    it = iter(loader())
    for _ in range(5):
        next(it)
    ckpt = jd.training.Checkpointer(tmp_path)
    assert ckpt.data_iterator_state() == it.get_state()
    ckpt.close()
    resumed = make_trainer(jd.OneDeviceStrategy())
    resumed.fit(loader(), steps=9, checkpoint_dir=tmp_path, verbose=0)
    _assert_equal(resumed, whole)


def test_distributed_iterator_state_is_exact_despite_prefetch():
    strategy = jd.MirroredStrategy()

    def dataset_fn(ctx):
        return examples()[ctx.input_pipeline_id :: ctx.num_input_pipelines].batch(GLOBAL_BATCH)

    want = [np.asarray(b[0]) for b in examples().batch(GLOBAL_BATCH)]
    it = iter(strategy.distribute_datasets_from_function(dataset_fn, prefetch=3))
    np.testing.assert_array_equal(next(it)[0], want[0])
    after_one = it.get_state()
    np.testing.assert_array_equal(next(it)[0], want[1])
    deadline = time.monotonic() + 10
    while it._ahead.queued() < 3 and time.monotonic() < deadline:  # let the thread read ahead
        time.sleep(0.01)
    assert it.get_state() == {"next_index": 2}
    later = iter(strategy.distribute_datasets_from_function(dataset_fn))
    later.set_state(it.get_state())
    np.testing.assert_array_equal(next(later)[0], want[2])
    it.set_state(after_one)  # back: the batches in flight are dropped
    np.testing.assert_array_equal(next(it)[0], want[1])
    it.close()
    later.close()


def test_errors_name_the_argument_and_the_fix(tmp_path):
    strategy = jd.MirroredStrategy()
    plain = iter(strategy.experimental_distribute_dataset([np.zeros((8, 2), np.float32)] * 2))
    with pytest.raises(TypeError,
                       match=r"get_state\(\): this dataset's iterator \(list_iterator\) has no "
                             r"get_state"):
        plain.get_state()
    with pytest.raises(TypeError, match=r"set_state\(state\): .* read the data with grain"):
        plain.set_state({"next_index": 0})
    plain.close()
    ckpt = jd.training.Checkpointer(tmp_path)
    with pytest.raises(TypeError,
                       match=r"data_iterator=<object .*> \(type object\) has no get_state\(\): "
                             r"pass the"):
        ckpt.save(1, {"w": np.zeros(2)}, data_iterator=object())
    with pytest.raises(TypeError, match=r"state \{'when': .*\} is not JSON-serializable"):
        ckpt.save(1, {"w": np.zeros(2)}, data_iterator=IteratorSnapshot({"when": object()}))
    assert ckpt.all_steps() == []
    ckpt.close()
    # Per-process batches are checked as the global batch they form.
    with pytest.raises(
        ValueError,
        match=r"has 6 rows on this process \(12 over 2 processes\), which 8 replicas x "
        r"grad_accum_steps=1 do not divide: .* multiple of 8 \(e\.g\. 16\)",
    ):
        BatchChecker(8)((np.zeros((6, 2)), np.zeros(6)), "train_data batch 0 of epoch 0",
                        processes=2)
    check = BatchChecker(8)
    x, _ = check((np.zeros((4, 2)), np.zeros(4)), "batch", processes=2)
    # global signature
    assert x.shape == (4, 2) and [shape for shape, _ in check.signature[1]] == [(8, 2), (8,)]
    # A grain batch the replicas do not divide.
    with pytest.raises(ValueError,
                       match=r"train_data batch 0 of epoch 0 has 12 rows, which 8 replicas"):
        make_trainer(strategy).fit(examples().batch(12), steps=2, verbose=0)


def test_rare_error_paths(monkeypatch):
    from jaxdist.strategies.input import _read_ahead
    from jaxdist.training.data import BatchStream

    class Stuck:  # a stateful source whose read does not return until released
        def __init__(self):
            self.release, self.n = threading.Event(), 0

        def __iter__(self):
            return self

        def __next__(self):
            self.release.wait(30)
            self.n += 1
            return np.zeros((8, 2), np.float32)

        def get_state(self):
            return {"n": self.n}

        def set_state(self, state):
            self.n = state["n"]

    monkeypatch.setattr(_read_ahead, "STOP_SECONDS", 0.2)
    source = Stuck()
    it = iter(jd.MirroredStrategy().experimental_distribute_dataset(source))
    with pytest.raises(RuntimeError,
                       match=r"still reading from the dataset after 0\.2 s: .* check the dataset"):
        it.set_state({"n": 0})
    source.release.set()
    it.close()

    with pytest.raises(ValueError,
                       match=r"a data_iterator item that jaxdist did not write: b'\{\"x\": 1\}'"):
        IteratorSnapshot().set_state(b'{"x": 1}')

    monkeypatch.setitem(sys.modules, "grain.checkpoint", None)  # as if grain were not installed
    with pytest.raises(ImportError, match=r"pip install 'jaxdist\[grain\]'"):
        # what Checkpointer.save(..., data_iterator=) calls
        save_args(IteratorSnapshot({"next_index": 1}))

    # per-process batches need a feed to be placed
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError,
                                         match=r"BatchStream\(check=None\) cannot place "
                                               r"per-process .* on 2 processes: "
                                         r"pass check= a jaxdist\.training\.data\.BatchFeed"):
        next(iter(BatchStream(examples().batch(8))))
