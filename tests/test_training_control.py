"""The callbacks' richer hooks: a callback sees the run (`FitControl`) and can stop it, save or skip
batches; the loop pauses its callbacks around evaluations and checkpoints, tells them of a failure,
and calls a per-step hook only on the callbacks that override it."""

import flax.linen as nn
import numpy as np
import optax
import pytest

import jaxdist as jd
from jaxdist.training.callbacks import overriding


def _trainer():
    return jd.training.Trainer(jd.OneDeviceStrategy(), nn.Dense(1), optax.sgd(0.0),
                               lambda out, y: (out[:, 0] * 0 + y).mean())


def _data(n=6):
    return [(np.ones((4, 2), np.float32), np.full(4, float(i), np.float32)) for i in range(n)]


class Record(jd.training.Callback):
    def __init__(self, act=None):
        self.events, self.act = [], act

    def on_step_end(self, trainer, step, metrics):
        self.events.append(("step", step, self.control.epoch, self.control.data_position.index))
        if self.act is not None:
            self.act(self.control, step)

    def on_pause(self, trainer, part):
        self.events.append(("pause", part))

    def on_resume(self, trainer, part):
        self.events.append(("resume", part))

    def on_checkpoint(self, trainer, step, path):
        self.events.append(("checkpoint", step))

    def on_exception(self, trainer, error):
        self.events.append(("exception", type(error).__name__))


def test_a_callback_sees_the_run_and_can_skip_batches_and_stop():
    def act(control, step):
        if step == 1:
            control.skip(2)  # batches 1 and 2 are read, not trained on
        if step == 3:
            control.stop()

    record, trainer = Record(act), _trainer()
    history = trainer.fit(_data(), steps=10, log_every=1, verbose=0, callbacks=[record])
    steps = [e for e in record.events if e[0] == "step"]
    assert steps == [("step", 1, 0, 1), ("step", 2, 0, 4), ("step", 3, 0, 5)]
    assert trainer.step == 3 and trainer.data_position == jd.training.DataPosition(0, 5)
    # the skipped batches' 1 and 2: not seen
    assert [row["loss"] for row in history.train] == [0.0, 3.0, 4.0]
    assert record.control is None  # the fit is over
    with pytest.raises(ValueError, match=r"control.skip\(batches=0\): batches must be an int >= 1"):
        trainer.fit(_data(), steps=4, verbose=0,
                    callbacks=[Record(lambda control, step: control.skip(0))])


def test_a_callback_can_save_now_and_hears_the_pauses(tmp_path):
    record = Record(lambda control, step: control.save() if step == 2 else None)
    _trainer().fit(_data(), steps=4, verbose=0, checkpoint_dir=tmp_path / "ck", eval_data=_data(1),
                   async_checkpoints=False, callbacks=[record])
    # asked at 2; the end's at 4
    assert [e[1] for e in record.events if e[0] == "checkpoint"] == [2, 4]
    pauses = [e for e in record.events if e[0] in ("pause", "resume")]
    assert ("pause", "evaluation") in pauses and ("pause", "checkpoint") in pauses
    assert pauses.count(("pause", "checkpoint")) == pauses.count(("resume", "checkpoint"))
    with pytest.raises(ValueError, match=r"control.save\(\) needs fit\(checkpoint_dir=...\)"):
        _trainer().fit(_data(), steps=2, verbose=0,
                       callbacks=[Record(lambda control, step: control.save())])


def test_a_failing_fit_tells_its_callbacks_and_a_watchdog_is_a_callback():
    def fail(control, step):
        raise RuntimeError("boom")

    record, dog = Record(fail), jd.training.Watchdog(60)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer().fit(_data(), steps=3, verbose=0, callbacks=[dog, record])
    assert record.events[-1] == ("exception", "RuntimeError")
    assert dog._thread is None  # stopped by on_exception
    dog = jd.training.Watchdog(60)
    _trainer().fit(_data(), steps=3, verbose=0, callbacks=[dog])
    assert dog.steps == 3 and dog._thread is None


def test_only_the_callbacks_that_override_a_hook_are_called_for_it():
    lines, bar = jd.training.Progress(mode="lines"), jd.training.Progress(mode="bar")
    record = Record()
    assert overriding([jd.training.Callback(), lines, bar, record],
                      "on_step_end") == [bar.on_step_end,
                                         record.on_step_end]
    assert overriding([object()], "on_step_end") == []  # not a callback: nothing to call
