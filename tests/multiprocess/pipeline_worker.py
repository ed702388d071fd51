"""One process of the 2-process pipeline test (run by tests/test_pipeline_multiprocess.py through
jaxdist.launch).

The stage axis spans the processes (stage 0 on process 0's devices, stage 1 on process 1's: the
pipeline over the slow link), data parallel over each process's 4 devices. The tiny pipelined LM
trains a few steps with dropout; process 0 saves the losses, the first step's gradients and the
final parameters (gathered), and the share of the layer weights each of its devices holds. Argument:
out_path.
"""

import sys

import jaxdist as jd

# before any computation: connects the processes (JAXDIST_* from jaxdist.launch)
jd.initialize_cluster()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from gathering import gather  # noqa: E402
from pipeline_model import PipelineLM, batches, init_state, make_step  # noqa: E402

out_path = sys.argv[1]
pid = jax.process_index()
devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))).reshape(2, 4)
mesh = Mesh(devices, ("stage", "data"), axis_types=(AxisType.Auto,) * 2)
strategy = jd.ShardedStrategy(mesh=mesh, batch_axes="data", stage_axes="stage", min_shard_size=1)
assert strategy.num_hosts == 2 and strategy.num_replicas_in_sync == 4

model = PipelineLM(num_layers=4, num_microbatches=2, dropout=0.1)
state = strategy.create_variables(lambda: init_state(model))
step = strategy.jit(make_step(model, True), batch_argnums=(1,))
losses, first_grads = [], None
for batch in batches(3):
    state, (loss, grads) = step(state, batch)
    losses.append(float(loss))
    first_grads = grads if first_grads is None else first_grads

kernel = state[0]["params"]["layers"]["block"]["Dense_0"]["kernel"].value
results = {
    "losses": np.array(losses),
    "layer_share": np.array([s.data.size / kernel.size for s in kernel.addressable_shards]),
}
for name, tree in (("params", state[0]), ("grads", first_grads)):
    gathered = gather(jax.tree.map(lambda b: getattr(b, "value", b), tree,
                                   is_leaf=lambda b: hasattr(b, "value")))
    for path, leaf in jax.tree_util.tree_leaves_with_path(gathered):
        results[f"{name}{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
if pid == 0:
    np.savez(out_path, **results)
print(f"process {pid} done", flush=True)
