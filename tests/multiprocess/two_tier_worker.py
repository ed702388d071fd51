"""One process of the two-tier checkpoint tests (run through jaxdist.launch by
tests/test_two_tier.py).

``Trainer.fit`` of a tiny MLP, FSDP over the 8 devices of 2 processes (each process holds half of
every kernel), with the persistent tier every 10 steps and the local tier every 2. Arguments:
checkpoint_dir, local directory (with ``{process}``), out_dir, steps, then options: ``kill=N``
(process 1 SIGKILLs itself after step N, once process 0's local step N - 1 is complete: a lost
host), ``straight=DIR`` (then an uninterrupted run from the start, no checkpoints, its final
parameters to ``DIR/params.npz``), ``both_lost=DIR`` (then a restart from ``DIR/ckpt`` whose local
directories ``DIR/local-{process}`` are both gone, printing ``both lost: step N``). Prints
``step N`` after every step; process 0 saves the final parameters (gathered) to
``out_dir/params.npz``.
"""

import os
import signal
import sys
import time

import jaxdist as jd

# before any computation: joins the job (FSDP on all 8 devices)
strategy = jd.ShardedStrategy(min_shard_size=1)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from gathering import gather  # noqa: E402

ckpt_dir, local_dir, out_dir, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
options = dict(a.split("=", 1) for a in sys.argv[5:])
kill = int(options.get("kill", 0))
pid = jax.process_index()


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dropout(0.2, deterministic=not train)(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(4)(x)


def data_fn(epoch):  # the same global batches on every process; shuffled per epoch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = x[:, :4].argmax(1).astype(np.int32)
    order = np.random.default_rng((1, epoch)).permutation(64)
    return [(x[order[i : i + 16]], y[order[i : i + 16]]) for i in range(0, 64, 16)]


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class Tell(jd.training.Callback):
    def __init__(self, prefix=""):
        self.prefix = prefix

    def on_step_end(self, trainer, step, metrics):
        print(f"{self.prefix}step {step}", flush=True)
        # a lost host, once process 0's local step before it is written and the persistent step
        # of the tens before it committed (an asynchronous save: on a loaded machine still in
        # flight five steps later)
        if step == kill and pid == 1:
            done = [os.path.join(local_dir.replace("{process}", "0"), str(step - 1)),
                    os.path.join(ckpt_dir, str(step // 10 * 10))]
            deadline = time.monotonic() + 60
            while not all(map(os.path.isdir, done)) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)


trainer = jd.training.Trainer(strategy, MLP(), optax.adam(1e-2), ce, train_kwargs={"train": True})
trainer.fit(data_fn, steps=steps, checkpoint_dir=ckpt_dir, checkpoint_every=10,
            local_checkpoint_dir=local_dir, local_checkpoint_every=2, verbose=0, callbacks=[Tell()])
leaves = jax.tree.leaves(gather(trainer.params))
if pid == 0:
    np.savez(os.path.join(out_dir, "params.npz"), *[np.asarray(a) for a in leaves])
if "straight" in options:
    again = jd.training.Trainer(strategy, MLP(), optax.adam(1e-2), ce, train_kwargs={"train": True})
    again.fit(data_fn, steps=steps, verbose=0)
    leaves = jax.tree.leaves(gather(again.params))
    if pid == 0:
        np.savez(os.path.join(options["straight"], "params.npz"), *[np.asarray(a) for a in leaves])
if "both_lost" in options:
    again = jd.training.Trainer(strategy, MLP(), optax.adam(1e-2), ce, train_kwargs={"train": True})
    again.fit(data_fn, steps=steps, checkpoint_dir=os.path.join(options["both_lost"], "ckpt"),
              checkpoint_every=10,
              local_checkpoint_dir=os.path.join(options["both_lost"], "local-{process}"),
              local_checkpoint_every=2, verbose=0, callbacks=[Tell("both lost: ")])
print("done", flush=True)
