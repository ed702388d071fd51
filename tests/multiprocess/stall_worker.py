"""One process of the step-watchdog test (started twice by tests/test_cluster_operations.py).

``Trainer.fit(..., step_timeout=S)`` on MultiWorkerMirroredStrategy, 2 processes x 4 CPU devices;
process 1 stalls in a callback after step 3 (alive, so no heartbeat fails). Both processes must
print every thread's stack and exit with the watchdog's status. Arguments: coordinator address,
process id, S.
"""

import sys
import time

import jaxdist as jd

address, pid, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
strategy = jd.MultiWorkerMirroredStrategy(address, 2, pid, heartbeat_timeout_seconds=60)

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


class Stall(jd.training.Callback):
    def on_step_end(self, trainer, step, metrics):
        print(f"step {step}", flush=True)
        if step == 3 and pid == 1:
            print("stalling", flush=True)
            time.sleep(1000)


rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8)).astype(np.float32)
data = [(x[i : i + 16], x[i : i + 16, :4].argmax(1).astype(np.int32)) for i in range(0, 64, 16)]


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


trainer = jd.training.Trainer(strategy, nn.Dense(4), optax.adam(1e-2), ce)
trainer.fit(data, steps=1000, verbose=0, callbacks=[Stall()], step_timeout=timeout)
print("fit returned", flush=True)
