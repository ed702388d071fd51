"""One process of the disagreement tests (started twice by tests/test_job_failures.py, directly or through
``python -m jaxdist.launch``).

``Trainer.fit`` on MultiWorkerMirroredStrategy, 2 processes x 4 CPU devices, where process 1 differs from
process 0; every process must say which process and why, and the job must end in bounded time.
Arguments: ``[address pid] cases directory`` (without address and pid: the ``JAXDIST_*`` environment).

``cases`` is a comma-separated list, run in order in the same processes: ``steps`` (12 vs 16), ``cadence``
(checkpoint_every 5 vs 7) and ``dir`` (each process its own checkpoint_dir) are errors on both processes before
the first step (each printed as ``CASE name: message``, and the next case runs); so are ``batches`` (each process
shuffles the batches with its own seed: named at step 1) and ``diverges`` (the same first 4 batches, then process
1's differ: named at the log point of step 6; log_every=3), while ``same`` (both shuffle with one seed) trains
(``CASE same: fit returned``); ``data`` (process 1's data ends after 5 of 12 batches), ``raises`` (a callback of
process 1 raises at step 5) and ``claimed`` (another live run holds the checkpoint_dir: process 0, which claims it
for the job, is refused) end the job.
"""

import sys

import jaxdist as jd

if len(sys.argv) == 5:
    address, process_id, cases, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    strategy = jd.MultiWorkerMirroredStrategy(address, 2, process_id, heartbeat_timeout_seconds=60)
else:
    cases, directory = sys.argv[1], sys.argv[2]
    strategy = jd.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=60)

import flax.linen as nn
import jax
import numpy as np
import optax

from jaxdist.job import _checks

# The "data" case waits this long for process 0 (which has more data) before naming process 1 as the one that ran
# out: the library's 30 s is for real jobs; 5 s proves the same here (process 0 never reaches the exchange).
_checks.DATA_END_SECONDS = 5.0

pid = jax.process_index()
rng = np.random.default_rng(0)
x = rng.normal(size=(16 * 16, 8)).astype(np.float32)
batches = [(x[i : i + 16], x[i : i + 16, :4].argmax(1).astype(np.int32)) for i in range(0, len(x), 16)]


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class Raise(jd.training.Callback):
    def on_step_end(self, trainer, step, metrics):
        if pid == 1 and step == 5:
            raise RuntimeError("a callback failed on purpose")


for case in cases.split(","):
    steps, every, where, data, callbacks, log_every = 12, 5, f"{directory}/{case}", batches, [], 10
    if case in ("batches", "diverges", "same"):  # shuffled: with each process's own seed, or one seed
        data = [batches[i] for i in np.random.default_rng(pid if case == "batches" else 0).permutation(len(batches))]
        if case == "diverges" and pid == 1:
            data = data[:4] + data[4:][::-1]  # steps 1-4 alike, then other batches
        log_every = 3
    if pid == 1:
        if case == "steps":
            steps = 16
        elif case == "cadence":
            every = 7
        elif case == "data":
            data = batches[:5]
        elif case == "raises":
            callbacks = [Raise()]
    if case == "dir":
        where = f"{where}-{pid}"
    trainer = jd.training.Trainer(strategy, nn.Dense(4), optax.adam(1e-2), ce)
    try:
        trainer.fit(iter(data), steps=steps, verbose=0, callbacks=callbacks, checkpoint_dir=where,
                    checkpoint_every=every, log_every=log_every)
    except jd.training.JobDisagreementError as error:
        if not error.on_every_process:
            raise
        print(f"CASE {case}: {error}", flush=True)
    else:
        print(f"CASE {case}: fit returned", flush=True)
