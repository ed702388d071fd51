"""One process of the 2-process ShardedStrategy test (run by tests/test_sharded_multiprocess.py
through jaxdist.launch).

FSDP over all 8 devices of both processes (the short form: ``ShardedStrategy()`` joins the cluster
from the ``JAXDIST_*`` environment), then HSDP on the user's own mesh (``data`` across the processes
x ``fsdp`` within each), each training the MLP and the tiny LM from global batches. Process 0 saves
the losses, the final parameters (gathered) and the fraction of a sharded kernel each device holds;
the HSDP run also writes a checkpoint, which the test restores on other topologies. Arguments:
out_path, checkpoint_dir.
"""

import sys

import jaxdist as jd

fsdp = jd.ShardedStrategy(min_shard_size=1)  # before any computation: connects the processes

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from gathering import gather  # noqa: E402
from multiprocess_model import (  # noqa: E402
    batches,
    init_state,
    lm_batches,
    lm_init_state,
    lm_train_step,
    train_step,
)

out_path, ckpt_dir = sys.argv[1], sys.argv[2]
pid = jax.process_index()
assert fsdp.num_hosts == 2 and fsdp.num_replicas_in_sync == 8 and fsdp.num_replicas_per_host == 4, (
    fsdp
)

# The user's mesh: its own names, 'data' across the processes and 'fsdp' within each.
devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))).reshape(2, 4)
mesh = Mesh(devices, ("data", "fsdp"))
hsdp = jd.ShardedStrategy(mesh=mesh, batch_axes=("data", "fsdp"), fsdp_axes=("fsdp",),
                          min_shard_size=1,
                          logical_axis_rules=[("batch", ("data", "fsdp"))],
                          activation_axes=("batch",))
assert hsdp.num_replicas_in_sync == 8 and hsdp.num_hosts == 2

# A strategy over this process's devices alone is an error, never a silent copy per process.
try:
    jd.MirroredStrategy(devices=jax.local_devices())
    raise AssertionError("a MirroredStrategy over one process of two was accepted")
except ValueError as error:
    assert "process(es) [" in str(error) and "MultiWorkerMirroredStrategy" in str(error), error
assert jd.MirroredStrategy().num_replicas_in_sync == 8  # the default spans every process

# Meshes whose axes cross the processes the other way round: each process's rows are not one block
# ('fsdp' across the processes), and a model axis across the processes (no process owns a replica's
# rows alone).
# (4, 2): 'fsdp' pairs a device of process 0 with one of process 1
across = Mesh(devices.T, ("data", "fsdp"))
woven = jd.TPUStrategy(mesh=across)  # data parallel over both axes: rows 0, 2, 4, 6 on process 0
rows = np.arange(16, dtype=np.float32).reshape(8, 2)
ctx = woven.run_steps_on_dataset(
    lambda ctx, total, x: total + x.sum(), iter([rows] * 2), initial_loop_values=np.float32(0),
    iterations=2
)
assert float(ctx.loop_values) == 2 * rows.sum(), ctx.loop_values
ids = woven.run(lambda: jd.get_replica_context().replica_id_in_sync_group * 1.0)
assert [float(v) for v in woven.experimental_local_results(ids)] == [
    2.0 * i + pid for i in range(4)
], pid
tensor = jd.ShardedStrategy(mesh=Mesh(devices.T, ("data", "tensor")), batch_axes="data",
                            min_shard_size=1)
assert tensor.num_replicas_per_host == 4  # every replica has a device here
ids = tensor.run(lambda: 1.0 * jd.get_replica_context().replica_id_in_sync_group)
assert [float(v) for v in tensor.experimental_local_results(ids)] == [0.0, 1.0, 2.0, 3.0]
try:
    next(iter(tensor.distribute_datasets_from_function(lambda ctx: iter([rows]))))
    raise AssertionError("per-process input on a mesh whose replicas span processes was accepted")
except ValueError as error:
    assert "replicas span processes" in str(error), error

results = {}


def train(strategy, name, init, step_fn, data):
    # Every process passes a different key: process 0's wins, so all start from the same state.
    state = strategy.create_variables(init, jax.random.key(pid))
    step = strategy.jit(step_fn, donate_argnums=(0,))
    losses = []
    with strategy.scope():  # the LM's activation constraints use the strategy's rules
        for batch in strategy.experimental_distribute_dataset(data):
            state, loss = step(state, batch)
            losses.append(float(loss))
    results[f"{name}/losses"] = np.array(losses)
    gathered = gather(state[0])
    for path, leaf in jax.tree_util.tree_leaves_with_path(gathered):
        results[f"{name}/params{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    return state


for label, strategy in (("fsdp", fsdp), ("hsdp", hsdp)):
    state = train(strategy, f"{label}/mlp", init_state, train_step, batches(steps=10))
    kernel = state[0]["params"]["Dense_0"]["kernel"]  # (8, 32): split on its 32 columns
    results[f"{label}/kernel_fraction"] = np.array(
        [shard.data.size / kernel.size for shard in kernel.addressable_shards]
    )
    lm_state = train(strategy, f"{label}/lm", lm_init_state, lm_train_step, lm_batches())

# Every process writes its own shards of the HSDP LM state; the test restores it elsewhere.
ckpt = jd.training.Checkpointer(ckpt_dir)
ckpt.save(8, lm_state, {"mesh": "data=2,fsdp=4"})
ckpt.close()

if pid == 0:
    np.savez(out_path, **results)
print(f"process {pid} done", flush=True)
