"""A Keras user's fit (issue 62): epochs as Keras has them, a backup on a default cadence that
bounds what a kill loses, the callbacks Keras users reach for (EarlyStopping, ModelCheckpoint,
LearningRateScheduler, DeleteBackups) and a preempted run that says so. One process here; 2 real
processes: tests/test_keras_multi_worker.py."""

import datetime
import io
import os
import re
import signal
from contextlib import redirect_stdout

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jaxdist as jd
from jaxdist.training.loop import FitOptions

X = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
Y = X @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)
DATA = [(X[i:i + 8], Y[i:i + 8]) for i in range(0, 96, 8)]  # 12 batches: one pass


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _trainer(optimizer=None, strategy=None):
    return jd.training.Trainer(strategy or jd.OneDeviceStrategy(), nn.Dense(1), optimizer
                               or optax.sgd(0.05), _mse)


class Record(jd.training.Callback):
    """Every epoch hook, step end, checkpoint and log, in order."""

    def __init__(self, crash_at=None):
        self.events, self.crash_at = [], crash_at

    def on_epoch_begin(self, trainer, epoch):
        self.events.append(("begin", epoch, trainer.step, self.control.epoch))

    def on_epoch_end(self, trainer, epoch, logs):
        self.events.append(("end", epoch, trainer.step, self.control.epoch, dict(logs)))

    def on_step_end(self, trainer, step, metrics):
        if step == self.crash_at:
            raise RuntimeError(f"killed at step {step}")

    def on_checkpoint(self, trainer, step, path):
        self.events.append(("checkpoint", step))

    def kinds(self, *names):
        return [e[:3] for e in self.events if e[0] in names]


# ------------------------------------------------------------------------------------------- epochs
def test_steps_per_epoch_makes_epochs_of_steps_with_keras_hooks(tmp_path):
    record = Record()
    out = io.StringIO()
    with redirect_stdout(out):
        history = _trainer().fit(DATA, epochs=3, steps_per_epoch=5, log_every=2, eval_data=DATA[:2],
                                 eval_every="epoch", checkpoint_dir=tmp_path / "ck",
                                 checkpoint_every="epoch",
                                 async_checkpoints=False, verbose="lines", callbacks=[record])
    # 15 steps in 3 epochs of 5, over a stream of 12 batches that goes on across its passes (as
    # Keras reads a repeated dataset)
    assert [e[:4] for e in record.events if e[0] in ("begin", "end")] == [
        ("begin", 0, 0, 0), ("end", 0, 5, 0), ("begin", 1, 5, 1), ("end", 1, 10, 1),
        ("begin", 2, 10, 2), ("end", 2, 15, 2)]
    assert record.kinds("checkpoint") == [("checkpoint", 5), ("checkpoint", 10), ("checkpoint", 15)]
    assert [row["epoch"] for row in history.epochs] == [0, 1, 2]
    assert [row["step"] for row in history.epochs] == [5, 10, 15]
    assert set(history.epochs[0]) == {"epoch", "step", "loss", "val_loss"}
    assert history.history["val_loss"] == [row["val_loss"] for row in history.epochs]
    assert history.history["val_loss"][-1] < history.history["val_loss"][0]
    # the epoch's logs: the mean of its steps' losses (windows of 2, 2 and 1 step), the evaluation
    # at its end
    train = history.train
    assert [(row["step"], row["epoch"]) for row in train] == [(2, 0), (4, 0), (5, 0), (6, 1),
                                                            (8, 1), (10, 1),
                                                            (12, 2), (14, 2), (15, 2)]
    first = (2 * train[0]["loss"] + 2 * train[1]["loss"] + train[2]["loss"]) / 5
    assert history.epochs[0]["loss"] == pytest.approx(first, rel=1e-5)
    assert history.epochs[0]["val_loss"] == history.eval[0]["loss"] and history.eval[0]["step"] == 5
    assert [row["step"] for row in history.eval] == [5, 10, 15]  # none more at the end
    lines = out.getvalue().splitlines()
    assert lines[0] == "checkpoints every epoch"
    assert any(re.match(r"step 4/15 epoch 1/3 loss \S+ ", line) for line in lines), lines
    assert any(re.match(r"epoch 2/3 at step 10/15: loss \S+ val_loss \S+$", line)
               for line in lines), lines
    assert all(len(line) <= 80 for line in lines)


def test_epochs_are_passes_over_the_data_without_steps_per_epoch():
    # a list, data_fn: list, generator
    for data in (DATA[:5], lambda epoch: DATA[:5], lambda epoch: iter(DATA[:5])):
        record = Record()
        out = io.StringIO()
        with redirect_stdout(out):
            history = _trainer().fit(data, epochs=3, log_every=2, verbose="lines",
                                     callbacks=[record])
        assert record.kinds("begin", "end") == [("begin", 0, 0), ("end", 0, 5), ("begin", 1, 5),
                                                ("end", 1, 10), ("begin", 2, 10), ("end", 2, 15)]
        assert [row["epoch"] for row in history.train] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert "step 14/15 epoch 3/3" in out.getvalue() or "step 14 epoch 3/3" in out.getvalue()


def test_epoch_hooks_with_steps_per_run_and_skips():
    record = Record()
    trainer = jd.training.Trainer(jd.OneDeviceStrategy(), nn.Dense(1), optax.sgd(0.05), _mse,
                                  steps_per_run=4)
    history = trainer.fit(DATA, epochs=2, steps_per_epoch=6, log_every=4, verbose=0,
                          callbacks=[record])
    # the on-device loops end at the epochs' ends
    assert record.kinds("end") == [("end", 0, 6), ("end", 1, 12)]
    assert trainer.step == 12 and [row["epoch"] for row in history.epochs] == [0, 1]

    class SkipOne(Record):
        def on_step_end(self, trainer, step, metrics):
            if step == 1:
                self.control.skip()  # a pass over the data then ends a step sooner

    record = SkipOne()
    _trainer().fit(DATA[:5], epochs=2, verbose=0, callbacks=[record])
    assert record.kinds("end") == [("end", 0, 4), ("end", 1, 9)]


def test_a_fit_that_counts_no_epochs_sees_them_only_when_a_callback_asks():
    record = Record()  # epoch hooks in a fit of steps: the passes over the data are the epochs
    history = _trainer().fit(DATA, steps=30, verbose=0, callbacks=[record])
    assert record.kinds("begin", "end") == [("begin", 0, 0), ("end", 0, 12), ("begin", 1, 12),
                                            ("end", 1, 24),
                                            # the run stops inside epoch 2: it has no end
                                            ("begin", 2, 24)]
    assert "epoch" not in history.train[0]  # the fit itself does not count them
    # no hook: the loop does not wait at the passes' ends
    history = _trainer().fit(DATA, steps=30, verbose=0)
    assert history.epochs == [] and "epoch" not in history.train[0]


def test_a_resumed_run_begins_with_the_epoch_it_resumes_in(tmp_path):
    crash = Record(crash_at=8)
    with pytest.raises(RuntimeError, match="killed at step 8"):
        _trainer().fit(DATA, epochs=3, steps_per_epoch=5, checkpoint_dir=tmp_path, verbose=0,
                       callbacks=[crash])
    record = Record()
    history = _trainer().fit(DATA, epochs=3, steps_per_epoch=5, checkpoint_dir=tmp_path, verbose=0,
                             callbacks=[record])
    assert record.kinds("begin", "end") == [("begin", 1, 5), ("end", 1, 10), ("begin", 2, 10),
                                            ("end", 2, 15)]
    assert [row["epoch"] for row in history.epochs] == [1, 2]


def test_epoch_options_are_checked():
    with pytest.raises(ValueError, match=r"steps_per_epoch=0 must be an int >= 1"):
        FitOptions(epochs=2, steps_per_epoch=0)
    with pytest.raises(ValueError, match=r"steps_per_epoch=5 needs epochs=N"):
        _trainer().fit(DATA, steps_per_epoch=5, verbose=0)
    with pytest.raises(
        ValueError, match=r"eval_every='epochs' must be an int >= 1 \(steps\), 'epoch', or None"
    ):
        FitOptions(epochs=2, eval_every="epochs", eval_data=DATA)
    with pytest.raises(
        ValueError, match=r"checkpoint_every='epochs' must be an int >= 1 \(steps\), 'epoch', a "
    ):
        FitOptions(epochs=2, checkpoint_every="epochs", checkpoint_dir="ck")
    assert FitOptions(epochs=2, steps_per_epoch=7, steps=10).until == 10  # whichever comes first


# ------------------------------------------------------------------------------ the default cadence
def test_the_default_backs_up_every_epoch_and_says_so(tmp_path):
    record = Record()
    out = io.StringIO()
    with redirect_stdout(out):
        _trainer().fit(DATA, epochs=3, checkpoint_dir=tmp_path, verbose="lines", callbacks=[record])
    assert (
        out.getvalue().splitlines()[0]
        == "checkpoints every epoch and every 10 min (the default checkpoint_every)"
    )
    assert record.kinds("checkpoint") == [("checkpoint", 12), ("checkpoint", 24),
                                          ("checkpoint", 36)]


def test_the_default_without_epochs_backs_up_on_the_clock(tmp_path, monkeypatch):
    monkeypatch.setattr("jaxdist.training.loop._cadence.BACKUP_EVERY",
                        datetime.timedelta(microseconds=1))
    record = Record()
    out = io.StringIO()
    with redirect_stdout(out):
        _trainer().fit(DATA, steps=20, log_every=5, checkpoint_dir=tmp_path / "a", verbose="lines",
                       async_checkpoints=False, callbacks=[record])
    assert (
        out.getvalue().splitlines()[0] == "checkpoints every 1e-06 s (the default checkpoint_every)"
    )
    # at the log points
    assert record.kinds("checkpoint") == [("checkpoint", s) for s in (5, 10, 15, 20)]
    record = Record()
    _trainer().fit(DATA, steps=20, log_every=5, checkpoint_dir=tmp_path / "b", verbose=0,
                   async_checkpoints=False,
                   checkpoint_every=datetime.timedelta(hours=1), callbacks=[record])
    assert record.kinds("checkpoint") == [("checkpoint", 20)]  # the end's only


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_fit_killed_at_any_step_loses_at_most_an_epoch(tmp_path, asynchronous):
    """The default cadence with epochs of 4 steps: a run that dies after any step k resumes from the
    newest epoch end it saved, at most one epoch behind (the failure comes after step k, before its
    epoch-end save when k ends an epoch; a save in flight is complete: fit finishes it when it
    fails). The run resumed from there ends where an uninterrupted one does."""
    steps, per = 12, 4
    straight = _trainer()
    straight.fit(DATA, epochs=steps // per, steps_per_epoch=per, verbose=0)
    for k in range(1, steps + 1):
        directory = tmp_path / f"k{k}"
        with pytest.raises(RuntimeError, match=f"killed at step {k}"):
            _trainer().fit(DATA, epochs=steps // per, steps_per_epoch=per, checkpoint_dir=directory,
                           verbose=0,
                           async_checkpoints=asynchronous, callbacks=[Record(crash_at=k)])
        with jd.training.Checkpointer(directory) as saved:
            newest = max(saved.all_steps(), default=0)
        assert newest % per == 0 and 0 <= k - newest <= per, (k, newest)
        if k in (5, 12):
            resumed = _trainer()
            history = resumed.fit(DATA, epochs=steps // per, steps_per_epoch=per,
                                  checkpoint_dir=directory, verbose=0)
            # the steps after the backup: taken again
            assert resumed.step == steps and history.time["lost"] > 0
            np.testing.assert_array_equal(_flat(resumed), _flat(straight))


# ------------------------------------------------------------------------------------ EarlyStopping
def _flat(trainer):
    return np.concatenate([np.ravel(a) for a in jax.tree.leaves(jax.device_get(trainer.params))])


def test_early_stopping_stops_after_patience_and_restores_the_best_weights():
    class Losses(jd.training.Callback):  # a made-up val_loss per epoch: best at epoch 2
        values = (1.0, 0.8, 0.5, 0.55, 0.52, 0.6, 0.4)

        def on_epoch_end(self, trainer, epoch, logs):
            logs["val_loss"] = self.values[epoch]
            self.params = getattr(self, "params", {})
            self.params[epoch] = _flat(trainer)

    losses, stop = Losses(), jd.training.EarlyStopping(patience=2, restore_best_weights=True,
                                                       verbose=1)
    trainer = _trainer()
    out = io.StringIO()
    with redirect_stdout(out):
        history = trainer.fit(DATA, epochs=7, steps_per_epoch=3, verbose=0,
                              callbacks=[losses, stop])
    assert stop.stopped_epoch == 4 and stop.best_epoch == 2 and stop.best == 0.5
    # stopped at the end of epoch 4: no step of epoch 5
    assert len(history.epochs) == 5 and trainer.step == 15
    np.testing.assert_array_equal(_flat(trainer), losses.params[2])  # the best epoch's weights
    assert "epoch 5: early stopping" in out.getvalue()
    assert "restoring the weights of the end of the best epoch: 3" in out.getvalue()


def test_early_stopping_modes_min_delta_and_baseline():
    def run(stop, values):
        class Feed(jd.training.Callback):
            def on_epoch_end(self, trainer, epoch, logs):
                logs["val_accuracy"] = values[epoch]

        _trainer().fit(DATA, epochs=len(values), steps_per_epoch=1, verbose=0,
                       callbacks=[Feed(), stop])
        return stop.stopped_epoch

    assert jd.training.EarlyStopping("val_accuracy").mode == "max"
    assert run(jd.training.EarlyStopping("val_accuracy", patience=1), [0.5, 0.6, 0.6, 0.7]) == 2
    assert run(jd.training.EarlyStopping("val_accuracy", patience=1, min_delta=0.15),
               [0.5, 0.6, 0.7, 0.9]) == 1
    # below the baseline the epochs count towards patience (Keras: a new best resets the count only
    # past it)
    assert run(jd.training.EarlyStopping("val_accuracy", patience=2), [0.5, 0.5, 0.5, 0.5]) == 2
    assert run(jd.training.EarlyStopping("val_accuracy", patience=2, baseline=0.9),
               [0.5, 0.5, 0.5, 0.5]) == 1
    assert run(jd.training.EarlyStopping("val_accuracy", patience=1, start_from_epoch=2),
               [0.9, 0.1, 0.1, 0.1]) == 3


def test_early_stopping_says_what_is_missing():
    with pytest.raises(ValueError,
                                         match=r"monitor='val_loss'\): the epoch's logs have no "
                                               r"'val_loss', only "
                                         r"\['loss'\]\. The val_ metrics come from "
                                         r".*eval_every='epoch'"):
        _trainer().fit(DATA, epochs=2, verbose=0, callbacks=[jd.training.EarlyStopping()])
    with pytest.raises(
        ValueError, match=r"cannot tell whether 'val_bleu' should go down or up: pass mode='min'"
    ):
        jd.training.EarlyStopping("val_bleu")
    with pytest.raises(ValueError, match=r"mode must be 'auto', 'min' or 'max'"):
        jd.training.EarlyStopping(mode="lowest")


# ---------------------------------------------------------------------------------- ModelCheckpoint
def test_model_checkpoint_keeps_the_best_k_beside_the_backups_and_restores(tmp_path):
    class Feed(jd.training.Callback):  # a made-up val_loss per epoch
        values = (0.9, 0.5, 0.7, 0.4, 0.6, 0.3)

        def on_epoch_end(self, trainer, epoch, logs):
            logs["val_loss"] = self.values[epoch]
            self.params = getattr(self, "params", {})
            self.params[trainer.step] = _flat(trainer)

    feed, best = Feed(), jd.training.ModelCheckpoint(tmp_path / "best", keep=2)
    _trainer().fit(DATA, epochs=4, steps_per_epoch=2, checkpoint_dir=tmp_path / "backup", verbose=0,
                   callbacks=[feed, best])
    assert best.best == [(8, 0.4), (4, 0.5)]
    backups = jd.training.Checkpointer(tmp_path / "backup")
    assert backups.all_steps() == [4, 6, 8]  # every epoch's (keep_checkpoints=3), untouched
    backups.close()
    # a resumed run goes on ranking what is there
    _trainer().fit(DATA, epochs=6, steps_per_epoch=2, checkpoint_dir=tmp_path / "backup", verbose=0,
                   callbacks=[feed, best])
    assert best.best == [(12, 0.3), (8, 0.4)]
    saved = jd.training.Checkpointer(tmp_path / "best")
    assert (
        saved.all_steps() == [8, 12]
        and saved.meta(12)["value"] == 0.3
        and saved.meta(12)["epoch"] == 5
    )
    saved.close()
    fresh = _trainer()  # restorable on any trainer, from the directory alone
    assert jd.training.ModelCheckpoint(tmp_path / "best").best_step == 12
    assert fresh.restore(tmp_path / "best", step=12, batch=DATA[0]) == 12
    np.testing.assert_array_equal(_flat(fresh), feed.params[12])


def test_model_checkpoint_refuses_the_backups_directory(tmp_path):
    for directory in (tmp_path, tmp_path / "best"):
        with pytest.raises(ValueError,
                                             match=r"the best checkpoints would mix with the "
                                                   r"backups fit resumes from. "
                                             r"Pass a directory beside it, e.g. '.*-best'"):
            _trainer().fit(DATA, epochs=1, checkpoint_dir=tmp_path, verbose=0,
                           callbacks=[jd.training.ModelCheckpoint(directory, monitor="loss")])
    best = jd.training.ModelCheckpoint(tmp_path.parent / f"{tmp_path.name}-best", monitor="loss",
                                       keep=None)
    _trainer().fit(DATA, epochs=3, steps_per_epoch=2, checkpoint_dir=tmp_path, verbose=0,
                   callbacks=[best])
    # keep=None: every epoch's (save_best_only=False)
    assert sorted(step for step, _ in best.best) == [2, 4, 6]


# ---------------------------------------------------------------------------- LearningRateScheduler
def test_learning_rate_scheduler_sets_each_epochs_rate_and_resumes_with_it(tmp_path):
    def optimizer():
        return optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)

    def schedule(epoch):  # one argument, as Keras also takes
        return 1e-2 * 0.5 ** epoch

    scheduler = jd.training.LearningRateScheduler(schedule)
    history = _trainer(optimizer()).fit(DATA, epochs=3, steps_per_epoch=4, log_every=2, verbose=0,
                                        callbacks=[scheduler])
    assert [row["learning_rate"] for row in history.epochs] == pytest.approx([1e-2, 5e-3, 2.5e-3])
    assert [row["learning_rate"]
            for row in history.train] == pytest.approx([1e-2] * 2 + [5e-3] * 2 + [2.5e-3] * 2)
    # killed in epoch 1 after a checkpoint inside it (step 6) and resumed there: the rate the
    # schedule set when the epoch began is in the checkpoint and stands (a schedule of the current
    # rate is not applied twice)
    def halve(epoch, lr):
        return lr if epoch == 0 else lr / 2

    with pytest.raises(RuntimeError):
        _trainer(optimizer()).fit(DATA, epochs=3, steps_per_epoch=4, checkpoint_dir=tmp_path,
                                  checkpoint_every=3,
                                  verbose=0, callbacks=[jd.training.LearningRateScheduler(halve),
                                                        Record(crash_at=7)])
    resumed = _trainer(optimizer())
    history = resumed.fit(DATA, epochs=3, steps_per_epoch=4, checkpoint_dir=tmp_path, verbose=0,
                          log_every=1, callbacks=[jd.training.LearningRateScheduler(halve)])
    assert history.train[0]["step"] == 7  # resumed from step 6, inside epoch 1
    assert [row["learning_rate"]
            for row in history.train] == pytest.approx([5e-3] * 2 + [2.5e-3] * 4)
    straight = _trainer(optimizer())
    straight.fit(DATA, epochs=3, steps_per_epoch=4, verbose=0,
                 callbacks=[jd.training.LearningRateScheduler(halve)])
    np.testing.assert_array_equal(_flat(resumed), _flat(straight))


def test_learning_rate_scheduler_refuses_an_optimizer_without_a_rate_to_set():
    with pytest.raises(ValueError,
                                         match=r"needs a learning rate it can "
                                               r"set.*optax\.inject_hyperparams\(optax\.adam\)"
                                         r"\(learning_rate=1e-3\)"):
        _trainer(optax.adam(1e-2)).fit(
            DATA, epochs=1, verbose=0, callbacks=[jd.training.LearningRateScheduler(lambda e: 1e-2)]
        )
    scheduled = optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.linear_schedule(1e-2, 0.0, 10)
    )
    with pytest.raises(
        ValueError, match=r"it is an optax schedule .* which optax computes again at every step"
    ):
        _trainer(scheduled).fit(DATA, epochs=1, verbose=0,
                                callbacks=[jd.training.LearningRateScheduler(lambda e: 1.0)])
    with pytest.raises(ValueError,
                       match=r"schedule\(0\) returned nan: it must return a finite number"):
        _trainer(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)).fit(
            DATA, epochs=1, verbose=0,
            callbacks=[jd.training.LearningRateScheduler(lambda e: "fast")])


def test_learning_rate_scheduler_on_a_sharded_optimizer_state():
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    trainer = _trainer(optimizer, jd.ShardedStrategy(min_shard_size=1))
    history = trainer.fit(DATA, epochs=2, steps_per_epoch=2, verbose=0,
                          callbacks=[jd.training.LearningRateScheduler(lambda e, lr: lr * 0.1)])
    assert [row["learning_rate"] for row in history.epochs] == pytest.approx([1e-3, 1e-4])
    rate = trainer.state.opt_state.hyperparams["learning_rate"]
    assert rate.sharding.is_fully_replicated and len(rate.sharding.device_set) == jax.device_count()


# ------------------------------------------------------------------------------------ DeleteBackups
def test_delete_backups_after_a_finished_run_and_keep_them_after_a_preemption(tmp_path):
    def run(*callbacks, **kwargs):
        return _trainer().fit(DATA, epochs=2, steps_per_epoch=3, checkpoint_dir=tmp_path, verbose=0,
                              callbacks=[*callbacks, jd.training.DeleteBackups(verbose=0)],
                              **kwargs)

    first = run()
    assert first.checkpoints and not [n for n in os.listdir(tmp_path) if n.isdigit()
                                      or n.startswith(".jaxdist-")]
    again = run()  # trains from scratch, as Keras does
    assert [row["step"] for row in again.epochs] == [3, 6] and again.job_runs == 1

    class Preempt(jd.training.Callback):
        def on_step_end(self, trainer, step, metrics):
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    preempted = run(Preempt(), on_preemption="return")
    assert preempted.preempted and os.path.isdir(tmp_path / "4")  # kept: the run resumes from it
    resumed = run()
    assert [row["step"] for row in resumed.epochs] == [6]


# --------------------------------------------------------------------------------------- preemption
def test_a_preempted_run_says_which_signal_the_step_saved_and_how_to_resume(tmp_path):
    class Preempt(jd.training.Callback):
        def on_step_end(self, trainer, step, metrics):
            if step == 7:
                os.kill(os.getpid(), signal.SIGTERM)

    out = io.StringIO()
    with redirect_stdout(out):
        history = _trainer().fit(DATA, steps=20, checkpoint_dir=tmp_path, verbose="lines",
                                 on_preemption="return", callbacks=[Preempt()])
    assert history.preempted and history.preempted_by == "SIGTERM"
    assert out.getvalue().splitlines()[-1] == ("preempted by SIGTERM at step 7: saved step 7 to "
                                               f"{tmp_path}; run again to resume")
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        _trainer().fit(DATA, steps=20, verbose="lines", callbacks=[Preempt()])
    assert out.getvalue().splitlines()[-1] == ("preempted by SIGTERM at step 7: nothing saved (fit "
                                               "has no checkpoint_dir): a run again starts over")
