"""One process of the Keras-fit tests (run through jaxdist.launch by
tests/test_keras_multi_worker.py).

``Trainer.fit`` of a small MLP on 2 processes x 4 CPU devices (MultiWorkerMirroredStrategy), in
Keras' terms: ``epochs=3, steps_per_epoch=EPOCH`` over data shuffled per pass, backed up into
``checkpoint_dir`` on the default cadence (every epoch), with progress lines on process 0.
Arguments: checkpoint_dir, out_dir, then options: ``clock`` (``steps=24`` without epochs,
checkpoint_every=timedelta(milliseconds=1): the time cadence, agreed across the processes; and a
callback with an epoch hook on process 0 alone, which prints ``pass E ended at step S`` at the end
of each pass over the data), ``straight=DIR`` (once fit returned, an uninterrupted run from the
start in a trainer of its own, without checkpoints, whose final parameters go to
``DIR/params.npz``), ``stop=DIR`` (then a run in a trainer of its own, checkpoints in ``DIR/ckpt``,
that process 1 ALONE stops at the end of epoch 0, in ``on_epoch_end``; with a ``ModelCheckpoint`` of
the loss into ``DIR/best`` and ``DeleteBackups``; its lines start with ``stop: ``). Writes its pid
to ``out_dir/pid_<process>``, prints ``step N`` after every step, ``checkpoint N`` when a checkpoint
is complete and ``end STEP preempted=BOOL`` when fit ends; process 0 saves each run's final
parameters to ``params.npz`` in its directory.
"""

import datetime
import os
import sys

import jaxdist as jd

strategy = jd.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=10)  # before any computation

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from gathering import gather  # noqa: E402

EPOCH = 8
ckpt_dir, out_dir = sys.argv[1], sys.argv[2]
clock = "clock" in sys.argv[3:]
straight = [a.split("=", 1)[1] for a in sys.argv[3:] if a.startswith("straight=")]
stopped = [a.split("=", 1)[1] for a in sys.argv[3:] if a.startswith("stop=")]
pid = jax.process_index()
with open(os.path.join(out_dir, f"pid_{pid}"), "w") as f:
    f.write(str(os.getpid()))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dropout(0.2, deterministic=not train)(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(4)(x)


# the same global batches on every process; shuffled per pass (5 batches: passes and
def data_fn(epoch):
    rng = np.random.default_rng(0)  # epochs of 8 steps do not line up)
    x = rng.normal(size=(160, 8)).astype(np.float32)
    y = x[:, :4].argmax(1).astype(np.int32)
    order = np.random.default_rng((1, epoch)).permutation(160)
    return [(x[order[i : i + 32]], y[order[i : i + 32]]) for i in range(0, 160, 32)]


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class Tell(jd.training.Callback):
    def __init__(self, stop=False):
        self.stop, self.prefix = stop, "stop: " if stop else ""

    def on_step_end(self, trainer, step, metrics):
        print(f"{self.prefix}step {step}", flush=True)

    def on_checkpoint(self, trainer, step, path):
        print(f"{self.prefix}checkpoint {step}", flush=True)

    def on_epoch_end(self, trainer, epoch, logs):
        if self.stop and epoch == 0 and pid == 1:
            self.control.stop()

    def on_train_end(self, trainer, history):
        print(f"{self.prefix}end {trainer.step} preempted={history.preempted}", flush=True)


# on process 0 only: every process must still watch the epochs' ends
class ChiefPasses(jd.training.Callback):
    def on_epoch_end(self, trainer, epoch, logs):
        print(f"pass {epoch} ended at step {trainer.step}", flush=True)


runs = ([(ckpt_dir, out_dir, False)] + [(None, path, False) for path in straight]
        + [(os.path.join(path, "ckpt"), path, True) for path in stopped])
for directory, out, stop in runs:
    trainer = jd.training.Trainer(strategy, MLP(), optax.adam(1e-2), ce,
                                  train_kwargs={"train": True},
                                  metrics={"accuracy": jd.training.accuracy})
    every = datetime.timedelta(milliseconds=1) if clock else None
    callbacks = [Tell(stop)]
    if stop:
        callbacks += [jd.training.ModelCheckpoint(os.path.join(out, "best"), monitor="loss"),
                      jd.training.DeleteBackups()]
    length = {"steps": 3 * EPOCH} if clock else {"epochs": 3, "steps_per_epoch": EPOCH}
    if clock and pid == 0:
        callbacks.append(ChiefPasses())
    trainer.fit(data_fn, **length, checkpoint_dir=directory, checkpoint_every=every, log_every=4,
                # SystemExit(0) if preempted
                verbose="lines" if directory else 0, callbacks=callbacks)
    leaves = jax.tree.leaves(gather(trainer.params))
    if pid == 0:
        np.savez(os.path.join(out, "params.npz"), *[np.asarray(a) for a in leaves])
    print("done", flush=True)
