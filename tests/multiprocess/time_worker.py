"""One process of the 2-process ``History.time`` test (run through jaxdist.launch by
tests/test_training_time.py).

``Trainer.fit`` of a linear net on 2 processes x 2 CPU devices (MultiWorkerMirroredStrategy) whose
every step costs a known time on the devices (a host callback sleeping ``STEP_SLEEP``) and whose
every batch costs a known time to read (``INPUT_SLEEP`` in the data), with stopwatches around both
and around the steps as the loop sees them (from the end of step 1 to the end of the last). Each
process prints one JSON line: ``History.time``, the wall time of ``fit`` and the stopwatches. With a
log directory as argument, a second fit traces steps 3 to 5 on every process into it.
"""

import json
import sys
import time

import jaxdist as jd

strategy = jd.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=10)  # before any computation

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

STEPS, STEP_SLEEP, INPUT_SLEEP = 60, 0.02, 0.004
pid = jax.process_index()
xs = np.random.default_rng(0).normal(size=(STEPS, 16, 8)).astype(np.float32)
# the same global batches everywhere
batches = [(x, x @ np.linspace(-1, 1, 8).astype(np.float32)) for x in xs]
slept = {"input": 0.0}


def data():
    for batch in batches:
        start = time.perf_counter()
        time.sleep(INPUT_SLEEP)
        slept["input"] += time.perf_counter() - start
        yield batch


def mse(out, y):
    # the step's known cost, on the devices' side
    jax.debug.callback(lambda: time.sleep(STEP_SLEEP))
    return ((out[:, 0] - y) ** 2).mean()


class Stopwatch(jd.training.Callback):
    def __init__(self):
        self.ends = {}

    def on_step_end(self, trainer, step, logs):
        if step in (1, STEPS):
            self.ends[step] = time.perf_counter()


watch = Stopwatch()
class Config(jd.training.Callback):
    def on_config(self, trainer, config):
        self.config = config


config = Config()
trainer = jd.training.Trainer(strategy, nn.Dense(1), optax.inject_hyperparams(optax.sgd)(0.02), mse)
start = time.perf_counter()
history = trainer.fit(data(), steps=STEPS, log_every=10, verbose=0, callbacks=[watch, config])
wall = time.perf_counter() - start
print("RESULT " + json.dumps({"pid": pid, "time": history.time, "wall": wall,
                              "input_slept": slept["input"],
                              "loop": watch.ends[STEPS] - watch.ends[1], "steps": STEPS,
                              "step_sleep": STEP_SLEEP, "config": config.config}),
      flush=True)
if len(sys.argv) > 1:
    jd.training.Trainer(strategy, nn.Dense(1), optax.sgd(0.02), mse).fit(
        batches[:8], steps=8, log_every=4, verbose=0, log_dir=sys.argv[1], profile_steps=(3, 6),
        profile_processes="all")
