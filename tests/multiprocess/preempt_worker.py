"""One process of the coordinated-preemption test (run through jaxdist.launch by
tests/test_multihost_preemption.py).

``Trainer.fit`` of a small dropout MLP on 2 processes x 4 CPU devices, on ShardedStrategy with HSDP
over the user's ``("data", "fsdp")`` mesh (the processes connected by hand, as lm1b / MaxText users
do). Arguments: checkpoint_dir ("" for none), out_dir, steps, and optionally ``straight=DIR``: once
fit returned, an uninterrupted run from the start in a trainer of its own (no checkpoints), whose
final parameters go to ``DIR/params.npz``, and ``stop=DIR``: then a run on
MultiWorkerMirroredStrategy (joining the same connection) in a trainer of its own, checkpoints in
``DIR/ckpt``, whose process 1 ALONE sets ``trainer.stop_training`` after step 5, its lines starting
with ``stop: ``. Writes its pid to ``out_dir/pid_<process>`` (the test signals ONE process), prints
``step N`` after every step, ``end STEP preempted=BOOL checkpoints=[...]`` when fit ends and
``done`` when it returned; process 0 saves each run's final parameters to ``params.npz`` in its
directory when fit returns.
"""

import os
import sys

import flax.linen as nn
import jax
import numpy as np
import optax
from gathering import gather

import jaxdist as jd

# HSDP on the user's mesh: 'data' across processes x 'fsdp'; connected by hand. No scenario
# here waits for a dead peer's heartbeats (the launcher stops the job when a process dies), so
# the timeout is long: at 10 s a loaded 2-core machine starved the coordination service and both
# processes were declared dead (1 of ~6 suite runs on 2026-12-02).
jax.distributed.initialize(heartbeat_timeout_seconds=60, **{
    "coordinator_address": os.environ["JAXDIST_COORDINATOR_ADDRESS"],
    "num_processes": int(os.environ["JAXDIST_NUM_PROCESSES"]),
    "process_id": int(os.environ["JAXDIST_PROCESS_ID"]),
})
devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))).reshape(2, 4)
strategy = jd.ShardedStrategy(mesh=jax.sharding.Mesh(devices, ("data", "fsdp")),
                              batch_axes=("data", "fsdp"), fsdp_axes="fsdp", min_shard_size=1)
ckpt_dir, out_dir, steps = sys.argv[1] or None, sys.argv[2], int(sys.argv[3])
straight = [a.split("=", 1)[1] for a in sys.argv[4:] if a.startswith("straight=")]
stopped = [a.split("=", 1)[1] for a in sys.argv[4:] if a.startswith("stop=")]
pid = jax.process_index()
with open(os.path.join(out_dir, f"pid_{pid}"), "w") as f:
    f.write(str(os.getpid()))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dropout(0.3, deterministic=not train)(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(4)(x)


def data_fn(epoch):  # the same global batches on every process; shuffled per epoch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype(np.float32)
    y = x[:, :4].argmax(1).astype(np.int32)
    order = np.random.default_rng((1, epoch)).permutation(128)
    return [(x[order[i : i + 32]], y[order[i : i + 32]]) for i in range(0, 128, 32)]


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class Tell(jd.training.Callback):
    def __init__(self, stop_at, prefix=""):
        self.stop_at, self.prefix = stop_at, prefix

    def on_step_end(self, trainer, step, metrics):
        print(f"{self.prefix}step {step}", flush=True)
        if step == self.stop_at and pid == 1:
            trainer.stop_training = True

    def on_train_end(self, trainer, history):
        names = [os.path.basename(p) for p in history.checkpoints]
        print(f"{self.prefix}end {trainer.step} preempted={history.preempted} checkpoints={names}",
              flush=True)


runs = ([(strategy, ckpt_dir, out_dir, Tell(None))]
        + [(strategy, None, path, Tell(None)) for path in straight]
        # the connection is made: this strategy joins it
        + [(jd.MultiWorkerMirroredStrategy(), os.path.join(path, "ckpt"), path, Tell(5, "stop: "))
           for path in stopped])
for run_strategy, directory, out, tell in runs:
    trainer = jd.training.Trainer(run_strategy, MLP(), optax.adam(1e-2), ce,
                                  train_kwargs={"train": True})
    # SystemExit(0) if preempted
    trainer.fit(data_fn, steps=steps, checkpoint_dir=directory, verbose=0, callbacks=[tell])
    leaves = jax.tree.leaves(gather(trainer.params))  # whole, even if sharded
    if pid == 0:
        np.savez(os.path.join(out, "params.npz"), *[np.asarray(a) for a in leaves])
    print(f"{tell.prefix}done", flush=True)
