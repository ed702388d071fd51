"""Pipeline parallelism across processes: the stage axis spans 2 processes x 4 CPU devices.

The worker (``multiprocess/pipeline_worker.py``, through ``python -m jaxdist.launch``) trains the
tiny pipelined LM with dropout on a ``(stage=2, data=4)`` mesh whose stages are the two processes;
here its losses, gradients and parameters are compared with the same model run as a plain scan on
one device.
"""

import subprocess
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
from pipeline_model import PipelineLM, batches, init_state, make_step
from registry import LAUNCH, launch_env

HERE = Path(__file__).parent
ROOT = HERE.parent


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_stage_axis_across_two_processes_trains_like_one_device(tmp_path):
    """Slow because the pipelined LM's step (GPipe schedule, 2 stages across the processes) is the
    costliest compile of the multi-process tests, in each process and for the one-device reference
    here."""
    out = tmp_path / "result.npz"
    proc = subprocess.run(
        [*LAUNCH, "-n", "2", "--cpu-devices", "4", "--timeout", "330",
         str(HERE / "multiprocess" / "pipeline_worker.py"), str(out)],
        env=launch_env(), capture_output=True, text=True, timeout=360,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "[0] process 0 done" in proc.stdout and "[1] process 1 done" in proc.stdout
    with np.load(out) as data:
        result = dict(data)
    # each process holds its stage's half of the layers, FSDP-split over its 4 devices
    np.testing.assert_array_equal(result["layer_share"], [1 / 8] * 4)

    model = PipelineLM(num_layers=4, num_microbatches=2, dropout=0.1)
    # init jitted as in test_pipeline (one program, not flax's eager op-by-op init: the same values,
    # seconds less)
    state, step = jax.jit(lambda: init_state(model))(), jax.jit(make_step(model, True))
    losses, first_grads = [], None
    for batch in batches(3):
        state, (loss, grads) = step(state, batch)
        losses.append(float(loss))
        first_grads = grads if first_grads is None else first_grads
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
    for name, tree in (("params", state[0]), ("grads", first_grads)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(nn.unbox(tree)):
            np.testing.assert_allclose(result[f"{name}{jax.tree_util.keystr(path)}"], leaf,
                                       rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name}{jax.tree_util.keystr(path)}")
