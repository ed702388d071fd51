"""One process of the non-finite test (run through jaxdist.launch by
tests/test_training_non_finite.py).

``Trainer.fit`` of a small linear net on 2 processes x 4 CPU devices (MultiWorkerMirroredStrategy).
The global batches of steps 15-17 have inputs scaled by 1e30 (an infinite loss). Two runs:
``on_non_finite="rollback"`` (must end finite at step 25, after one rollback to checkpoint 10, going
on into the next epoch of 20 batches), then ``"stop"`` (must raise at a step of the bad window).
Then it resumes the stopped run from the checkpoint its error names, in the same job, under
``"skip"`` (must end finite at step 25, the 3 bad steps skipped). Each process prints ``rollback``,
``stop`` and ``resume`` lines: the test compares the two processes'.
Argument: a directory for the checkpoints.
"""

import hashlib
import os
import sys
import warnings

import jaxdist as jd

strategy = jd.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=10)  # before any computation

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from gathering import gather  # noqa: E402

# (once 35-37 of 50 steps: as much proved with 25 steps, 2 checkpoints fewer per run)
BAD = (15, 16, 17)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.Dense(16)(x))


def data(epoch):  # the same global batches on every process
    xs = np.random.default_rng(epoch).normal(size=(20, 16, 8)).astype(np.float32)
    out = [(x, x @ np.linspace(-1, 1, 8).astype(np.float32)) for x in xs]
    for step in BAD:
        if epoch == 0:
            out[step - 1] = (out[step - 1][0] * 1e30, out[step - 1][1])
    return out


def mse(out, y):
    return ((out[:, 0] - y) ** 2).mean()


pid = jax.process_index()
root = sys.argv[1]
trainer = jd.training.Trainer(strategy, Net(), optax.sgd(0.02), mse)
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    history = trainer.fit(data, steps=25, checkpoint_dir=os.path.join(root, "rollback"),
                          checkpoint_every=10, verbose=0, on_non_finite="rollback")


def summary(trainer):
    """The step, whether the parameters are finite, and their digest (the same on every process)."""
    leaves = jax.tree.leaves(gather(trainer.params))
    digest = hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in leaves)).hexdigest()[:16]
    finite = all(bool(np.isfinite(np.asarray(a)).all()) for a in leaves)
    return f"step={trainer.step} finite={finite} params={digest}"


rollbacks = [(r["step"], r["restored"], r["data_position"].epoch, r["data_position"].index)
             for r in history.rollbacks]
print(f"rollback {summary(trainer)} rollbacks={rollbacks}", flush=True)

trainer = jd.training.Trainer(strategy, Net(), optax.sgd(0.02), mse)
try:
    trainer.fit(data, steps=25, checkpoint_dir=os.path.join(root, "stop"), checkpoint_every=10,
                verbose=0)
except jd.training.NonFiniteError as error:
    print(f"stop error.step={error.step} checkpoint={error.checkpoint} at={trainer.step}",
          flush=True)
    resume_from = error.checkpoint
# what the error says to do, in the same job: resume from its checkpoint, skipping the bad steps
history = trainer.fit(data, steps=25, checkpoint_dir=os.path.join(root, "stop"),
                      checkpoint_every=10, verbose=0, restore_step=resume_from,
                      on_non_finite="skip")
print(f"resume {summary(trainer)} skipped={history.non_finite_steps}", flush=True)
print("done", flush=True)
