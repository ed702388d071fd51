"""Metric files: TensorBoard events through tensorboardX, read back; one writer
(``should_save_summary``).

The 2-process check (only process 0 writes, and what it writes are the global values) runs in
tests/test_grain_input.py, in the same launch as the grain resume.
"""

import csv
import types

import flax.linen as nn
import numpy as np
import optax
import pytest
from tfevents import read_events, scalars

import jaxdist as jd


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]


def _trainer():
    return jd.training.Trainer(
        jd.MirroredStrategy(),
        nn.Dense(2),
        optax.adam(1e-2),
        lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out, y).mean(),
        metrics={"accuracy": jd.training.accuracy},
    )


@pytest.mark.timeout(120)
def test_tensorboard_events_read_back_and_resume_purges(tmp_path):
    data, logs = _data(), tmp_path / "logs"
    first = _trainer()
    h1 = first.fit(
        data,
        steps=4,
        log_every=2,
        eval_data=data[:1],
        eval_every=2,
        log_dir=logs,
        checkpoint_dir=tmp_path / "ck",
        verbose=0,
    )
    (path,) = logs.glob("events.out.tfevents.*")
    events = read_events(path)
    assert events[0].file_version == "brain.Event:2"
    got = scalars(events)
    for row in h1.train:
        assert got[("train/loss", row["step"])] == pytest.approx(row["loss"], rel=1e-6)
        assert got[("train/steps_per_sec", row["step"])] == pytest.approx(
            row["steps_per_sec"], rel=1e-6
        )
    for row in h1.eval:
        assert got[("eval/accuracy", row["step"])] == pytest.approx(row["accuracy"], rel=1e-6)
    assert {tag for tag, _ in got} == {
        "train/loss",
        "train/accuracy",
        "train/steps_per_sec",
        "eval/loss",
        "eval/accuracy",
        # each window's seconds by part
        *(f"time/{part}" for part in jd.training.callbacks.TIME_PARTS),
    }

    # A resumed fit opens a second file that tells TensorBoard to drop what came after its
    # checkpoint.
    h2 = _trainer().fit(data, steps=6, log_every=2, log_dir=logs, checkpoint_dir=tmp_path / "ck",
                        verbose=0)
    (second,) = set(logs.glob("events.out.tfevents.*")) - {path}
    events = read_events(second)
    starts = [e.step for e in events if e.HasField("session_log")
              and e.session_log.status == e.session_log.START]
    assert starts == [4]
    assert scalars(events)[("train/loss", 6)] == pytest.approx(h2.train[-1]["loss"], rel=1e-6)
    with open(logs / "metrics.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f) if r["split"] == "train"] == ["2", "4", "6"]


def test_loggers_write_on_the_summary_writer_only(tmp_path):
    def trainer(writer):
        return types.SimpleNamespace(step=0,
                                     strategy=types.SimpleNamespace(should_save_summary=writer))

    for writer in (False, True):
        where = tmp_path / str(writer)
        csv_log, tb = (jd.training.CSVLogger(where / "metrics.csv"),
                       jd.training.TensorBoardLogger(where))
        for cb in (csv_log, tb):
            cb.on_train_begin(trainer(writer))
            # a text value is no scalar: skipped
            cb.on_log(trainer(writer), 1, {"loss": 0.5, "mfu": "n/a"})
            cb.on_eval_end(trainer(writer), 1, {"loss": 0.25})
        tb.close()
        files = sorted(p.name for p in where.glob("*")) if where.exists() else []
        if not writer:
            assert files == [], files
            continue
        assert files[0].startswith("events.out.tfevents.") and files[1] == "metrics.csv"
        assert scalars(read_events(where / files[0])) == {("train/loss", 1): 0.5,
                                                          ("eval/loss", 1): 0.25}


def test_tensorboard_logger_rejects_a_bad_flush_interval(tmp_path):
    with pytest.raises(ValueError, match=r"flush_secs=0 must be a positive number of seconds"):
        jd.training.TensorBoardLogger(tmp_path, flush_secs=0)
