"""The Trainer's batch path: each batch checked and placed once at the stream boundary, read ahead
of the step in order, nothing read back per step, and the fit loop driven through its typed
interface alone."""

import threading

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jaxdist as jd
from jaxdist.strategies.input import ahead
from jaxdist.training.data import BatchChecker, BatchFeed, BatchStream, DataPosition, TrainBatch
from jaxdist.training.data import _feed as feed_module
from jaxdist.training.loop import FitOptions, run_fit
from jaxdist.training.step import LiveState


def mse(out, y):
    return ((out[:, 0] - y) ** 2).mean()


def make_trainer(strategy=None, **kwargs):
    return jd.training.Trainer(strategy or jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1), mse,
                               **kwargs)


def batches(n, rows=8):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(rows, 3)).astype(np.float32),
             rng.normal(size=rows).astype(np.float32))
            for _ in range(n)]


def test_each_batch_is_checked_and_placed_once(monkeypatch):
    checked, placed, stepped = [], [], []
    check, place = BatchChecker.__call__, feed_module.place_batch

    def counting_check(self, batch, where, processes=1):
        checked.append(where)
        return check(self, batch, where, processes)

    def counting_place(policy, batch, **kwargs):
        placed.append(kwargs["where"])
        return place(policy, batch, **kwargs)

    monkeypatch.setattr(BatchChecker, "__call__", counting_check)
    monkeypatch.setattr(feed_module, "place_batch", counting_place)
    strategy = jd.MirroredStrategy()
    trainer = make_trainer(strategy)
    train = trainer.train_on_batch

    def spy(batch):
        stepped.append(batch)
        return train(batch)

    monkeypatch.setattr(trainer, "train_on_batch", spy)
    trainer.fit(batches(10), steps=6, verbose=0)
    names = [f"train_data batch {i} of epoch 0" for i in range(6)]
    # the first batch is also previewed once to build the state
    assert checked == [names[0], *names]
    assert placed == names  # once each, and none beyond the last step's batch
    assert all(isinstance(b, TrainBatch) and b.placed for b in stepped)
    assert all(leaf.sharding == strategy.batch_sharding for b in stepped
               for leaf in jax.tree.leaves(b.pair))


def test_read_ahead_raises_a_bad_batch_in_its_place():
    trainer = make_trainer()
    data = [*batches(3), (np.ones((8, 3), np.float32), np.ones(4, np.float32))]
    with pytest.raises(ValueError, match=r"train_data batch 3 of epoch 0 has structure/shapes"):
        trainer.fit(data, steps=5, verbose=0)
    assert trainer.step == 3  # the batches before it were trained on, as without the read-ahead


def test_ahead_reads_depth_batches_ahead_and_stops_its_source():
    reads, closed = [], []

    def source():
        try:
            for i in range(5):
                reads.append(i)
                yield i
        finally:
            closed.append(True)

    it = ahead(source(), 1)
    assert next(it) == 0 and reads == [0, 1]
    assert next(it) == 1 and reads == [0, 1, 2]
    it.close()
    assert closed == [True]
    assert list(ahead(range(3), 0)) == [0, 1, 2]
    for depth in (-1, 1.5, True):
        with pytest.raises(ValueError,
                           match=rf"depth={depth!r} must be an int >= 0 \(batches read ahead"):
            ahead(range(3), depth)


def test_fit_dispatches_every_step_before_any_has_run():
    # Each step stops at a gate (a host callback) that opens once fit has dispatched its last step.
    # Anything in the loop that waits for a step (a metric read, a log, a transfer) would wait at
    # the gate until it times out: then some step reports a closed gate.
    go, opened = threading.Event(), []

    def gate(value):
        opened.append(go.wait(5))
        return value

    def gated(out, y):
        value = jax.lax.stop_gradient(mse(out, y))
        return jax.pure_callback(gate, jax.ShapeDtypeStruct((), value.dtype), value)

    class OpenAtTheEnd(jd.training.Callback):
        def on_step_end(self, trainer, step, metrics):
            if step == 6:
                go.set()

    trainer = make_trainer(metrics={"gated": gated})
    history = trainer.fit(batches(4), steps=6, log_every=2, verbose=0, callbacks=[OpenAtTheEnd()])
    assert len(opened) == 6 and all(opened)
    assert [row["step"] for row in history.train] == [2, 4, 6]


def test_batch_leaves_must_share_their_rows():
    check = BatchChecker(8)
    with pytest.raises(ValueError,
                                         match=r"batch 0 leaf y has 4 rows but leaf x\['a'\] has "
                                               r"8: axis 0 of every leaf "
                                         r"is the batch .* move an array that is not per example "
                                         r"out of the batch"):
        check(({"a": np.ones((8, 2))}, np.ones(4)), "batch 0")
    with pytest.raises(ValueError,
                                         match=r"batch 0 leaf x\[1\] is a scalar: every leaf of a "
                                               r"training batch needs a "
                                         r"batch axis 0"):
        check(((np.ones((8, 2)), np.float32(2.0)), np.ones(8)), "batch 0")
    with pytest.raises(ValueError, match=r"batch 0 has inputs \{\} \(no array\): yield \(x, y\)"):
        check(({}, {}), "batch 0")


def test_only_the_trainers_own_checked_batches_are_taken_as_they_are():
    strategy = jd.MirroredStrategy()
    trainer, other = make_trainer(strategy), make_trainer(strategy)
    other_batch = BatchFeed(strategy, BatchChecker(8))(batches(1, rows=16)[0], "batch")
    trainer.train_on_batch(batches(1)[0])
    with pytest.raises(ValueError,
                       match=r"train_on_batch's batch has structure/shapes \(\(16, 3\) float32"):
        trainer.train_on_batch(other_batch)  # checked by another checker: checked again here
    assert other.train_on_batch(batches(1)[0])["loss"].shape == ()


@pytest.mark.parametrize("steps_per_run", [1, 2])
def test_run_fit_drives_the_live_state_and_callbacks_see_the_run(steps_per_run):
    """The loop drives a LiveState directly (no Trainer); callbacks receive their ``owner`` and see
    the run."""
    live = LiveState(jd.OneDeviceStrategy(), nn.Dense(1), optax.sgd(0.0),
                     lambda out, y: (out[:, 0] * 0 + y).mean())
    data = [(np.ones((4, 2), np.float32), np.full(4, v, np.float32)) for v in (1.0, 2.0, 3.0, 4.0)]
    live.init(data[0])
    seen = []

    class Look(jd.training.Callback):
        def on_step_end(self, trainer, step, metrics):
            seen.append((trainer, step, self.control.step, self.control.epoch))

    history = run_fit(live, BatchStream(data), FitOptions(steps=6, log_every=2,
                                                          steps_per_run=steps_per_run,
                                                          callbacks=[Look()]), owner="owner")
    assert [(row["step"], row["loss"]) for row in history.train] == [(2, 1.5), (4, 3.5), (6, 1.5)]
    assert live.step == 6 and live.position == DataPosition(1, 2)
    assert seen[-1] == ("owner", 6, 6, 1) and len(seen) == (6 if steps_per_run == 1 else 3)
    with pytest.raises(ValueError, match=r"steps_per_run=0 must be an int >= 1\."):
        FitOptions(steps=1, steps_per_run=0)
