"""The data and trainer shared by the grain tests and their 2-process worker
(tests/multiprocess/grain_worker.py)."""

import flax.linen as nn
import grain
import numpy as np
import optax

import jaxdist as jd

GLOBAL_BATCH = 16
_rng = np.random.default_rng(0)
X = _rng.normal(size=(128, 8)).astype(np.float32)
Y = X[:, :4].argmax(1).astype(np.int32)


def examples() -> grain.MapDataset:
    """128 shuffled ``(x, y)`` examples: 8 global batches an epoch."""
    return grain.MapDataset.source(np.arange(len(X))).shuffle(seed=1).map(lambda i: (X[i], Y[i]))


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_trainer(strategy) -> jd.training.Trainer:
    return jd.training.Trainer(strategy, nn.Dense(4), optax.adam(1e-2), loss_fn)


def per_process_batches(processes: int, steps: int) -> list:
    """The GLOBAL batches a run of ``examples()[p::processes].batch(GLOBAL_BATCH // processes)`` on
    ``processes`` processes trains on: step k concatenates each process's k-th batch, process 0
    first."""
    per = GLOBAL_BATCH // processes
    shards = [examples()[p::processes].batch(per, drop_remainder=True) for p in range(processes)]
    out = []
    for k in range(steps):
        parts = [shard[k % len(shard)] for shard in shards]
        out.append(tuple(np.concatenate([part[i] for part in parts]) for i in range(2)))
    return out
