"""One process of the program-agreement test (started twice by tests/test_cluster_operations.py).

``Trainer.fit`` on MultiWorkerMirroredStrategy, 2 processes x 4 CPU devices, where process 1 builds
its optimizer with another learning rate (a configuration that drifted on one host). Both processes
must fail before the first step with the same error naming process 1. Arguments: coordinator
address, process id. Prints ``step N`` after every step and ``MISMATCH <message>`` when the error
comes; exits 3 then.
"""

import sys

import jaxdist as jd

address, pid = sys.argv[1], int(sys.argv[2])
strategy = jd.MultiWorkerMirroredStrategy(address, 2, pid, heartbeat_timeout_seconds=10)

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


class Tell(jd.training.Callback):
    def on_step_end(self, trainer, step, metrics):
        print(f"step {step}", flush=True)


rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8)).astype(np.float32)
data = [(x[i : i + 16], x[i : i + 16, :4].argmax(1).astype(np.int32)) for i in range(0, 64, 16)]
learning_rate = 1e-2 if pid == 0 else 2e-2  # the drift


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


trainer = jd.training.Trainer(strategy, nn.Dense(4), optax.adam(learning_rate), ce)
try:
    trainer.fit(data, steps=4, verbose=0, callbacks=[Tell()])
except jd.strategies.ProgramMismatchError as error:
    print(f"MISMATCH {error}", flush=True)
    sys.exit(3)
print("no error", flush=True)
