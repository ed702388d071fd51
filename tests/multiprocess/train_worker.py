"""One process of the 2-process training test (run by tests/test_multi_worker.py through
jaxdist.launch).

Trains the same MLP three ways on the cluster's 8 devices (global view, per-replica view,
per-process input) and process 0 saves the results for the test to compare with single-device
training.
"""

import sys

import jax

import jaxdist as jd

# cluster from the JAXDIST_* environment; before any computation
strategy = jd.MultiWorkerMirroredStrategy()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from multiprocess_model import OPT, batches, init_state, loss_fn, train_step  # noqa: E402

out_path = sys.argv[1]
pid = jax.process_index()
assert (strategy.num_hosts == 2 and strategy.num_replicas_in_sync == 8
        and strategy.num_replicas_per_host == 4)
assert len(jax.local_devices()) == 4

# Chief's values win: every process passes a different key, all start from process 0's (key 0).
state = strategy.create_variables(init_state, jax.random.key(pid))
step = strategy.jit(train_step, donate_argnums=(0,))
losses = []
# global batches; each process places its rows
for batch in strategy.experimental_distribute_dataset(batches()):
    state, loss = step(state, batch)
    losses.append(float(loss))
global_view = jax.tree.map(np.asarray, state[0])


def replica_grads(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jd.get_replica_context().all_reduce("mean", grads), loss


@strategy.jit
def apply(state, grads):
    params, opt_state = state
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def per_process(ctx):  # each process reads only its half of every global batch
    for x, y in batches():
        rows = len(x) // ctx.num_input_pipelines
        sl = slice(ctx.input_pipeline_id * rows, (ctx.input_pipeline_id + 1) * rows)
        yield x[sl], y[sl]


state = strategy.create_variables(init_state, jax.random.key(0))
for x, y in strategy.distribute_datasets_from_function(per_process):
    grads, per_replica_loss = strategy.run(replica_grads, args=(state[0], x, y))
    state = apply(state, grads)
per_replica_view = jax.tree.map(np.asarray, state[0])
assert len(strategy.experimental_local_results(per_replica_loss)) == 4
ones = strategy.run(lambda: jnp.float32(1) + 0 * jd.get_replica_context().replica_id_in_sync_group)
total = strategy.reduce("sum", ones)
assert float(total) == 8.0

# Per-replica values from a function: each process computes only its own replicas, every replica
# gets its own.
seen = []


def replica_value(ctx):
    seen.append(ctx.replica_id_in_sync_group)
    return np.float32(ctx.replica_id_in_sync_group)


ids = strategy.experimental_distribute_values_from_function(replica_value)
assert seen == list(strategy.policy.local_replicas) and len(seen) == 4, seen
wrong = strategy.run(lambda v: jnp.abs(v - jd.get_replica_context().replica_id_in_sync_group),
                     args=(ids,))
assert float(strategy.reduce("sum", wrong)) == 0.0 and float(strategy.reduce("sum", ids)) == 28.0

# Checkpoints from all processes: every process saves its shards, then restores into the strategy's
# layout.
ckpt_dir = sys.argv[2]
ckpt = jd.training.Checkpointer(ckpt_dir)
ckpt.save(20, state, {"note": "two processes"})
abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
restored, meta = ckpt.restore(abstract)
ckpt.close()
assert meta["step"] == 20 and meta["note"] == "two processes"
for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    assert a.sharding == b.sharding
    assert np.array_equal(np.asarray(a), np.asarray(b))

if pid == 0:
    flat = {f"global/{jax.tree_util.keystr(p)}": v
            for p, v in jax.tree_util.tree_leaves_with_path(global_view)}
    flat.update({f"replica/{jax.tree_util.keystr(p)}": v
                 for p, v in jax.tree_util.tree_leaves_with_path(per_replica_view)})
    np.savez(out_path, losses=np.array(losses), **flat)
print(f"process {pid} done", flush=True)
