"""One process of the dead-peer test: process 1 is SIGKILLed mid-training; process 0 must fail, not
hang."""

import os
import signal
import sys
import time

import jaxdist as jd

address, pid = sys.argv[1], int(sys.argv[2])
strategy = jd.MultiWorkerMirroredStrategy(address, 2, pid, heartbeat_timeout_seconds=5)

import numpy as np  # noqa: E402

step = strategy.jit(lambda w, x: w + x.sum())
w = strategy.mirror(np.float32(0))
for i in range(100000):
    w = step(w, strategy.experimental_distribute_values(np.ones((8, 1), np.float32)))
    w.block_until_ready()
    if i == 3:
        print(f"process {pid} in step loop", flush=True)
        if pid == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
