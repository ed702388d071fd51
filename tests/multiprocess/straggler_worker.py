"""One process of the straggler test (run through jaxdist.launch by tests/test_hosts.py).

``Trainer.fit`` of a small linear net on 2 processes x 2 CPU devices (MultiWorkerMirroredStrategy),
twice: with neither process slow, then with process 1 sleeping 50 ms in its input before each batch.
Each process prints one JSON line per run: the StragglerWarnings it caught and its
``history.processes``.
"""

import json
import time
import warnings

import jaxdist as jd

strategy = jd.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=10)  # before any computation

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

pid = jax.process_index()
xs = np.random.default_rng(0).normal(size=(8, 16, 8)).astype(np.float32)
# the same global batches everywhere
batches = [(x, x @ np.linspace(-1, 1, 8).astype(np.float32)) for x in xs]


def data(sleep):
    def epoch(_):
        for batch in batches:
            if sleep and pid == 1:
                time.sleep(0.05)
            yield batch

    return epoch


def mse(out, y):
    return ((out[:, 0] - y) ** 2).mean()


for run, sleep in (("even", False), ("slow", True)):
    trainer = jd.training.Trainer(strategy, nn.Dense(1), optax.sgd(0.02), mse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = trainer.fit(data(sleep), steps=30, log_every=10, verbose=0)
    named = [str(w.message) for w in caught if issubclass(w.category, jd.training.StragglerWarning)]
    print("RESULT " + json.dumps({"run": run, "pid": pid, "named": named,
                                  "processes": history.processes}),
          flush=True)
