"""ShardedStrategy across processes: FSDP over 2 processes x 4 CPU devices, HSDP on the user's mesh.

The worker (``multiprocess/sharded_worker.py``, through ``python -m jaxdist.launch``) trains the MLP
and the tiny LM both ways; here the results are compared with single-device training, the per-device
share of a sharded variable is checked, and the 2 x 4 HSDP checkpoint is restored on one process (8
devices, Sharded) and on one device.
"""

import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
from multiprocess_model import (
    batches,
    init_state,
    lm_batches,
    lm_init_state,
    lm_train_step,
    train_step,
)
from registry import LAUNCH, launch_env

import jaxdist as jd

pytestmark = pytest.mark.multiprocess  # every test here reads one 2-process run

HERE = Path(__file__).parent
ROOT = HERE.parent


def _reference(init, step_fn, data):
    state = init(jax.random.key(0))
    step = jax.jit(step_fn)
    losses = []
    for batch in data:
        state, loss = step(state, batch)
        losses.append(float(loss))
    return state, np.array(losses)


@pytest.fixture(scope="session")
def worker_run(tmp_path_factory):
    """The one 2-process run every test here reads. Slow (~45 s on 2 loaded cores) because each
    process compiles 4 trainings (FSDP and HSDP, of the MLP and of the LM) and the checks on the
    other meshes; it runs once."""
    tmp = tmp_path_factory.mktemp("sharded_mp")
    out, ckpt = tmp / "result.npz", tmp / "checkpoints"
    proc = subprocess.run(
        [*LAUNCH, "-n", "2", "--cpu-devices", "4", "--timeout", "250",
         str(HERE / "multiprocess" / "sharded_worker.py"), str(out), str(ckpt)],
        env=launch_env(), capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "[0] process 0 done" in proc.stdout and "[1] process 1 done" in proc.stdout
    with np.load(out) as data:
        return dict(data), ckpt


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
@pytest.mark.parametrize("model", ["mlp", "lm"])
def test_two_processes_train_like_one_device(worker_run, layout, model):
    result, _ = worker_run
    init, step_fn, data = {
        "mlp": (init_state, train_step, batches(steps=10)),
        "lm": (lm_init_state, lm_train_step, lm_batches()),
    }[model]
    state, losses = _reference(init, step_fn, data)
    np.testing.assert_allclose(result[f"{layout}/{model}/losses"], losses, rtol=1e-5)
    # The optimizer is registry.adam (eps = learning rate): rounding noise of the all-reduce's
    # summation order stays at noise level instead of being amplified into full Adam steps where a
    # gradient is ~0.
    for path, leaf in jax.tree_util.tree_leaves_with_path(state[0]):
        np.testing.assert_allclose(result[f"{layout}/{model}/params{jax.tree_util.keystr(path)}"],
                                   leaf, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.timeout(300)
def test_each_device_holds_its_share_of_a_sharded_variable(worker_run):
    result, _ = worker_run
    # FSDP over all 8 devices
    np.testing.assert_array_equal(result["fsdp/kernel_fraction"], [1 / 8] * 4)
    # split within a process only
    np.testing.assert_array_equal(result["hsdp/kernel_fraction"], [1 / 4] * 4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", ["sharded-1x8", "one-device"])
def test_a_2x4_hsdp_checkpoint_restores_on_another_topology(worker_run, target):
    _, ckpt_dir = worker_run
    strategy = (
        jd.ShardedStrategy(min_shard_size=1) if target == "sharded-1x8" else jd.OneDeviceStrategy()
    )
    shapes = jax.eval_shape(lm_init_state, jax.random.key(0))
    shardings = strategy.variable_shardings(shapes)
    target_tree = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                               shapes, shardings)
    ckpt = jd.training.Checkpointer(ckpt_dir)
    restored, meta = ckpt.restore(target_tree)
    ckpt.close()
    assert meta["step"] == 8 and meta["mesh"] == "data=2,fsdp=4"
    state, _ = _reference(lm_init_state, lm_train_step, lm_batches())
    for a, b, s in zip(jax.tree.leaves(restored), jax.tree.leaves(state),
                       jax.tree.leaves(shardings), strict=True):
        assert a.sharding == s  # laid out for THIS strategy
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
