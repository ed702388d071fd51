"""One start of a small training job, for the compilation-cache test
(tests/test_cluster_operations.py).

Argument: the cache directory, or ``none`` for no cache. Prints one JSON line: seconds from the
start of the process to the end of the first step, and JAX's compilation-cache events (requests,
hits, misses).
"""

import time

START = time.perf_counter()

import json  # noqa: E402
import sys  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdist as jd  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
if sys.argv[1] != "none":
    jd.configure_compilation_cache(sys.argv[1])
events: dict[str, int] = {}
jax.monitoring.register_event_listener(
    lambda name, **kw: events.__setitem__(name, events.get(name, 0) + 1)
)

rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8)).astype(np.float32)
data = [(x[i : i + 16], x[i : i + 16, :4].argmax(1).astype(np.int32)) for i in range(0, 64, 16)]
first: list[float] = []


class First(jd.training.Callback):
    def on_step_end(self, trainer, step, metrics):
        if step == 1:
            first.append(time.perf_counter() - START)


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(4)])
trainer = jd.training.Trainer(jd.MirroredStrategy(), model, optax.adam(1e-2), ce)
trainer.fit(data, steps=4, verbose=0, callbacks=[First()])
cache_events = {k.rsplit("/", 1)[-1]: v for k, v in events.items() if "compilation_cache" in k}
print(json.dumps({"first_step_s": first[0], "events": cache_events}))
