"""One process of the tests of a process that dies or stops mid-fit (tests/test_job_deaths.py),
started twice, directly or through ``python -m jaxdist.launch``.

``Trainer.fit`` on MultiWorkerMirroredStrategy, 2 processes x 2 CPU devices,
``heartbeat_timeout_seconds=6`` (a silence of 2 s is said), a synchronous checkpoint every 3 steps.
Arguments: ``[address pid] case directory`` (without address and pid: the ``JAXDIST_*``
environment). At the end of step 8 the victim (process 1; process 0 for ``coordinator``) waits a
beat and a half, so its beats have carried step 8, then: ``exits`` (``os._exit(3)``: no word, no
exit hook), ``killed`` (SIGKILL to itself), ``stopped`` (SIGSTOP to itself; the test or the launcher
ends it) or ``coordinator`` (process 0 SIGKILLs itself). ``exits`` first runs a healthy ``fit`` of 3
steps where step 2 of process 1 takes 3 s and process 1 stays 3 s longer in ``fit`` at its end
(longer than the silence of 2 s: a slow step is no death, and a process gone from ``fit`` said
goodbye; ``FIT DONE`` is printed), then the ``fit`` that resumes from its checkpoint (step 3) and
loses process 1.
"""

import os
import signal
import sys
import time

import jaxdist as jd

if len(sys.argv) == 5:
    address, process_id, case, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    strategy = jd.MultiWorkerMirroredStrategy(address, 2, process_id, heartbeat_timeout_seconds=6)
else:
    case, directory = sys.argv[1], sys.argv[2]
    strategy = jd.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=6)

import flax.linen as nn
import jax
import numpy as np
import optax

pid = jax.process_index()
victim = 0 if case == "coordinator" else 1
rng = np.random.default_rng(0)
x = rng.normal(size=(16 * 8, 4)).astype(np.float32)
batches = [(x[i : i + 8], x[i : i + 8, :2].argmax(1).astype(np.int32)) for i in range(0, len(x), 8)]


class Slow(jd.training.Callback):
    def on_step_end(self, trainer, step, metrics):
        if pid == 1 and step == 2:
            time.sleep(3.0)

    def on_train_end(self, trainer, history):
        if pid == 1:
            time.sleep(3.0)


class Die(jd.training.Callback):
    def on_step_end(self, trainer, step, metrics):
        if pid != victim or step != 8:
            return
        time.sleep(3 * jd.job.BEAT_SECONDS)
        print(f"VICTIM {pid} at step {step}, {time.time():.3f}", flush=True)
        if case == "exits":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGSTOP if case == "stopped" else signal.SIGKILL)


trainer = jd.training.Trainer(
    strategy,
    nn.Dense(2),
    optax.sgd(0.1),
    lambda o, y: optax.softmax_cross_entropy_with_integer_labels(o, y).mean(),
)
if case == "exits":
    trainer.fit(batches, steps=3, verbose=0, callbacks=[Slow()], checkpoint_dir=directory,
                checkpoint_every=3, async_checkpoints=False)
    print("FIT DONE", flush=True)
trainer.fit(batches, steps=1000, verbose=0, callbacks=[Die()], checkpoint_dir=directory,
            checkpoint_every=3, async_checkpoints=False)
