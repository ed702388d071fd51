"""One process of the 2-process grain / one-writer test (run by tests/test_grain_input.py through
jaxdist.launch).

Every process reads only its shard with grain and trains through `Trainer.fit`:

* per-process MapDataset (``examples[p::P].batch(B // P)``): 12 steps uninterrupted, logging to a
  shared ``log_dir`` (only process 0 may write it); then 10 steps with a checkpoint, and a fresh
  trainer and pipeline resuming to 12 (the resumed run must read none of the batches before its
  position);
* ``grain.experimental.ElasticIterator``: 3 steps with a checkpoint, which the test resumes on ONE
  process.

Process 0 saves the results for the test.
"""

import os
import sys

import jax

import jaxdist as jd

# cluster from the JAXDIST_* environment; before any computation
strategy = jd.MultiWorkerMirroredStrategy()

import grain  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from grain_model import GLOBAL_BATCH, examples, make_trainer  # noqa: E402

out = sys.argv[1]
pid, count = jax.process_index(), jax.process_count()
assert count == 2 and strategy.num_hosts == 2

READS: list[int] = []  # per-process element indices the pipeline read (grain threads append)


def per_process():
    def read(index, pair):
        READS.append(index)
        return pair

    return (examples()[pid::count].map_with_index(read)
            .batch(GLOBAL_BATCH // count, drop_remainder=True))


class ClearReads(jd.training.Callback):
    # after the restore and the first-batch peek, before any step
    def on_train_begin(self, trainer):
        READS.clear()


def leaves(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.params)]


# 1. uninterrupted, logging (one writer)
full = make_trainer(strategy)
history = full.fit(per_process(), steps=12, log_every=4, log_dir=os.path.join(out, "logs"),
                   verbose="lines")
assert [row["step"] for row in history.train] == [4, 8, 12], history.train

# 2. stopped at step 10 (epoch 1: 8 batches an epoch), then resumed by a fresh trainer and pipeline
ckpt = os.path.join(out, "ckpt")
make_trainer(strategy).fit(per_process(), steps=10, checkpoint_dir=ckpt, verbose=0)
resumed = make_trainer(strategy)
resumed.fit(per_process(), steps=12, checkpoint_dir=ckpt, verbose=0, callbacks=[ClearReads()])
assert resumed.step == 12
for a, b in zip(leaves(full), leaves(resumed), strict=True):
    assert np.array_equal(a, b), "the resumed run differs from the uninterrupted one"
first_read = min(READS)
assert first_read >= 2 * GLOBAL_BATCH // count, (
    f"the resumed run re-read element {first_read} of epoch 1"
)

# 3. ElasticIterator: a position valid on any process count
elastic = grain.experimental.ElasticIterator(examples(), GLOBAL_BATCH,
                                             grain.sharding.ShardByJaxProcess())
make_trainer(strategy).fit(elastic, steps=3, checkpoint_dir=os.path.join(out, "elastic"), verbose=0)

if pid == 0:
    np.savez(os.path.join(out, "result.npz"), *leaves(full), first_read=first_read)
print(f"process {pid} done", flush=True)
