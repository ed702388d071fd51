"""Mixture of experts across processes and across checkpoints: `jd.nn.MoE` still equals one device.

The MoE LM of tests/test_moe.py (dropping, ``capacity_factor=1.0``; and dropless through the ragged
path on ``(data=2, expert=4)``) trains with `jd.ShardedStrategy(..., expert_axes="expert")` where
the expert axis spans 2 processes x 4 CPU devices (the tokens' all-to-all crosses the processes,
over gloo), and a checkpoint written under expert parallelism 4 restores on one device and on expert
parallelism 2; both continue like an uninterrupted one-device run (fp32, rtol 1e-5).

Run as a script (``python -m jaxdist.launch -n 2 --cpu-devices 4 tests/test_moe_distributed.py
initial.npz out.npz``), this file is the 2-process test's worker: it starts from the initial state
in ``initial.npz`` (the leaves of ``initial_state()``, which the test computes for its reference
anyway: the MoE init's compile is ~3 s per process) and process 0 saves the losses, the final
parameters (gathered) and the last step's router metrics of every mesh in ``out.npz``.
"""

import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
from registry import LAUNCH, adam, launch_env
from test_moe import EXPERTS, MoELM, _tokens, make_step

import jaxdist as jd

MODEL = MoELM(capacity_factor=1.0)  # dropping: tokens beyond an expert's capacity drop
TX = adam(1e-2)


step = make_step(MODEL, TX)
# Dropless through the ragged path (its exchange emulated on CPU): counts, offsets and rows cross
# the processes.
dropless_step = make_step(MoELM(capacity_factor=None, ragged=True), TX)


# one program: flax's eager init dispatches (and on CPU compiles) every operation on its own
@jax.jit
def initial_state():
    # weights only: jd.nn.MoE sows nothing at init
    params = MODEL.init(jax.random.key(0), _tokens()[:2])
    return params, TX.init(params)


def start(strategy, initial=None):
    """The initial ``(params, opt_state)`` (``initial``, else ``initial_state()``): plain arrays for
    None, else placed by ``strategy``."""
    params, opt_state = initial_state() if initial is None else initial
    if strategy is None:
        return params, opt_state
    return strategy.create_variables(lambda: params), strategy.create_variables(lambda: opt_state)


def train(strategy, state, steps, train_step=step):
    """``steps`` steps of ``train_step`` on the same batch from ``state``: ``(state, losses, last
    metrics)``."""
    run = jax.jit(train_step) if strategy is None else strategy.jit(train_step, batch_argnums=2)
    tokens, losses, metrics = _tokens(), [], None
    for _ in range(steps):
        *state, loss, metrics = run(*state, tokens)
        losses.append(float(loss))
    return tuple(state), losses, metrics


def assert_close(got, want, what=""):
    got, want = nn.unbox(got), nn.unbox(want)
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                            strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{what}{jax.tree_util.keystr(path)}")


def expert_share(params):
    """How many experts the addressable devices hold of each stacked expert weight (the set of their
    counts)."""
    moe = nn.unbox(params)["params"]["MoE_0"]
    return {
        name: {s.data.shape[0] for s in moe[name].addressable_shards}
        for name in ("wi_gate", "wi_up", "wo")
    }


def each_expert_weight(count):
    return {"wi_gate": {count}, "wi_up": {count}, "wo": {count}}


# -------------------------------------------------------------------------- 2 processes x 4 devices
WORKER_MESHES = ("data2_expert4", "expert8")
STEPS = 3


def save_initial(path) -> None:
    """The leaves of ``initial_state()`` in ``path`` (the worker's starting point)."""
    np.savez(path, *(np.asarray(leaf) for leaf in jax.tree.leaves(initial_state())))


def load_initial(path: str):
    """``initial_state()`` as `save_initial` wrote it: its boxes (logical axes) from a trace."""
    structure = jax.tree.structure(jax.eval_shape(initial_state))
    with np.load(path) as data:
        return jax.tree.unflatten(structure, [data[f"arr_{i}"] for i in range(len(data.files))])


def worker(initial_path: str, out_path: str) -> None:
    # before any computation: connects the processes (JAXDIST_* from jaxdist.launch)
    jd.initialize_cluster()
    from jax.sharding import AxisType, Mesh

    sys.path.insert(0, str(Path(__file__).parent / "multiprocess"))
    from gathering import gather

    pid = jax.process_index()
    local = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
             for p in (0, 1)]
    # (data=2, expert=4): expert devices 0, 1 on process 0 and 2, 3 on process 1, in every data row;
    # Explicit axes as jax.make_mesh makes them. (expert=8): jax.make_mesh's own layout over both
    # processes' devices.
    grid = np.array([[local[e // 2][r * 2 + e % 2] for e in range(4)] for r in range(2)])
    strategies = {
        "data2_expert4": jd.ShardedStrategy(mesh=Mesh(grid, ("data", "expert"),
                                                      axis_types=(AxisType.Explicit,) * 2),
                                            batch_axes=("data", "expert"), expert_axes="expert"),
        "expert8": jd.ShardedStrategy(mesh=jax.make_mesh((8,), ("expert",)), expert_axes="expert",
                                      min_shard_size=1),
    }
    initial = load_initial(initial_path)
    results = {}
    for name in WORKER_MESHES:
        strategy = strategies[name]
        mesh = strategy.mesh
        expert = mesh.axis_names.index("expert")
        for row in np.moveaxis(mesh.devices, expert, -1).reshape(-1, mesh.shape["expert"]):
            # the expert axis crosses the processes
            assert {d.process_index for d in row} == {0, 1}, (name, row)
        assert strategy.num_hosts == 2, name
        state, losses, metrics = train(strategy, start(strategy, initial), STEPS)
        share = expert_share(state[0])
        assert share == each_expert_weight(EXPERTS // mesh.shape["expert"]), (name, share)
        results[f"{name}/losses"] = np.array(losses)
        # Counted in the program the step lowers to (the all-to-alls are the layer's own, in its
        # shard_map): a plan would compile it once more, ~4 s per mesh and process; the plan's count
        # of them is tests/test_moe.py::test_the_plan_counts_the_layers_all_to_alls.
        lowered = strategy.jit(step, batch_argnums=2).lower(*start(strategy, initial), _tokens())
        results[f"all_to_alls/{name}"] = np.array(lowered.as_text().count("stablehlo.all_to_all"))
        for tree in ("params", "metrics"):
            value = nn.unbox(state[0] if tree == "params" else metrics)
            gathered = gather(value)
            for path, leaf in jax.tree_util.tree_leaves_with_path(gathered):
                results[f"{name}/{tree}{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    state, losses, _ = train(strategies["data2_expert4"], start(strategies["data2_expert4"], initial),
                             STEPS, dropless_step)
    results["dropless/losses"] = np.array(losses)
    gathered = gather(nn.unbox(state[0]))
    for path, leaf in jax.tree_util.tree_leaves_with_path(gathered):
        results[f"dropless/params{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    if pid == 0:
        np.savez(out_path, **results)
    print(f"process {pid} done", flush=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_processes_with_the_expert_axis_across_them_train_a_moe_lm_like_one_device(tmp_path):
    """Slow because each of the 2 processes compiles the MoE LM's step on 2 meshes and the dropless
    ragged step, and this process the one-device references."""
    initial, out = tmp_path / "initial.npz", tmp_path / "result.npz"
    save_initial(initial)
    proc = subprocess.run(
        [*LAUNCH, "-n", "2", "--cpu-devices", "4", "--timeout", "250",
         str(Path(__file__).resolve()), str(initial), str(out)],
        env=launch_env(), capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "[0] process 0 done" in proc.stdout and "[1] process 1 done" in proc.stdout
    state, losses, metrics = train(None, start(None), STEPS)
    with np.load(out) as data:
        result = dict(data)
    # this step's, nothing stale
    assert len(jax.tree.leaves(metrics["MoE_0"]["dropped_fraction"])) == 1
    expected = {"losses": np.array(losses)}
    for tree, want in (("params", state[0]), ("metrics", metrics)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(nn.unbox(want)):
            expected[f"{tree}{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    for name in WORKER_MESHES:
        assert {k for k in result if k.startswith(f"{name}/")} == {
            f"{name}/{k}" for k in expected
        }, name
        for key, want in expected.items():
            np.testing.assert_allclose(result[f"{name}/{key}"], want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name}/{key}")
        dropped = result[f"{name}/metrics['MoE_0']['dropped_fraction'][0]"]
        assert dropped > 0, (name, dropped)  # dropping really drops
        # tokens to the experts and back, forward and backward
        assert result[f"all_to_alls/{name}"] >= 4, name
    state, losses, _ = train(None, start(None), STEPS, dropless_step)
    np.testing.assert_allclose(result["dropless/losses"], losses, rtol=1e-5)
    for path, leaf in jax.tree_util.tree_leaves_with_path(nn.unbox(state[0])):
        np.testing.assert_allclose(result[f"dropless/params{jax.tree_util.keystr(path)}"],
                                   np.asarray(leaf),
                                   rtol=1e-5, atol=1e-6,
                                   err_msg=f"dropless{jax.tree_util.keystr(path)}")


# -------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    """A checkpoint at step 2 written under expert parallelism 4, and the uninterrupted 4-step
    one-device run."""
    directory = tmp_path_factory.mktemp("moe_checkpoint")
    ep4 = jd.ShardedStrategy(mesh=jax.make_mesh((2, 4), ("data", "expert")),
                             batch_axes=("data", "expert"), expert_axes="expert")
    state, losses, metrics = train(ep4, start(ep4), 2)
    assert float(metrics["MoE_0"]["dropped_fraction"][0]) > 0  # dropping really drops
    assert expert_share(state[0]) == each_expert_weight(EXPERTS // 4)
    ckpt = jd.training.Checkpointer(directory)
    ckpt.save(2, state, {"losses": losses})
    ckpt.close()
    reference_state, reference_losses, _ = train(None, start(None), 4)
    np.testing.assert_allclose(losses, reference_losses[:2], rtol=1e-5)
    return directory, jax.device_get(state), reference_state, reference_losses


TARGETS = {
    "one_device": (lambda: jd.OneDeviceStrategy(), None),
    "expert2": (lambda: jd.ShardedStrategy(mesh=jax.make_mesh((4, 2), ("data", "expert")),
                                           batch_axes=("data", "expert"), expert_axes="expert"),
                EXPERTS // 2),
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_checkpoint_written_under_expert_parallelism_4_restores_elsewhere_and_continues_like_one_device(
    moe_checkpoint, target
):
    directory, saved, reference_state, reference_losses = moe_checkpoint
    make, share = TARGETS[target]
    strategy = make()
    like = start(strategy)
    ckpt = jd.training.Checkpointer(directory)
    restored, meta = ckpt.restore(like)
    ckpt.close()
    assert meta["step"] == 2 and meta["losses"] == pytest.approx(reference_losses[:2], rel=1e-5)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True):
        assert got.sharding == want.sharding  # the target's layout, not the writer's
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), saved)  # bit for bit
    if share is None:
        assert {len(leaf.sharding.device_set) for leaf in jax.tree.leaves(restored)} == {1}
    else:
        assert expert_share(restored[0]) == each_expert_weight(share)
    state, losses, _ = train(strategy, restored, 2)
    np.testing.assert_allclose(losses, reference_losses[2:], rtol=1e-5)
    assert_close(jax.device_get(state), reference_state, f"{target}: ")


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
