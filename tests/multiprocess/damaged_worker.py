"""One process of the 2-process damaged-checkpoint test (run by tests/test_damaged_checkpoint.py
through jaxdist.launch): FSDP over both processes' devices, so that each process writes its own part
of the state (``state/ocdbt.process_<i>``). ``write``: fit to step 6, a checkpoint every 3 steps.
``resume``: fit on to step 9 from that directory, after the test removed one process's part of
checkpoint 6; the error is printed on one line. Arguments: checkpoint_dir, write | resume.
"""

import sys

import jaxdist as jd

strategy = jd.ShardedStrategy(min_shard_size=1)  # before any computation: connects the processes

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

directory, phase = sys.argv[1:3]
assert strategy.num_hosts == 2, strategy
x = np.random.default_rng(0).normal(size=(16, 256)).astype(np.float32)
trainer = jd.training.Trainer(strategy, nn.Dense(256), optax.sgd(0.1),
                              lambda o, y: ((o - y) ** 2).mean())
try:
    trainer.fit([(x, x)] * 10, steps=6 if phase == "write" else 9, checkpoint_dir=directory,
                checkpoint_every=3, verbose=0)
except jd.training.CheckpointCorruptedError as error:
    print(f"CheckpointCorruptedError: {error}", flush=True)
    sys.exit(3)
print(f"reached {trainer.step}", flush=True)
