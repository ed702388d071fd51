"""One process of the 2-process load_state test (run by tests/test_load_state.py through
jaxdist.launch).

Each process runs the plain-JAX run to step 20 on its own first device (the same numbers on both: as
each process of a migrating job reads the same checkpoint), loads it into a Trainer on FSDP over all
8 devices of both processes (host arrays in: each process transfers only its devices' parts) and
trains steps 21-30; then loads that trainer's FSDP-split global arrays into a Trainer on
MirroredStrategy (global arrays in: resharded on the devices). Process 0 saves the losses and both
trainers' parameters. Arguments: out_path.
"""

import sys

import jaxdist as jd

fsdp = jd.ShardedStrategy(min_shard_size=1)  # before any computation: connects the processes

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from gathering import gather  # noqa: E402
from test_load_state import MLP, SAVED, STEPS, batches, ce, optimizer, plain  # noqa: E402

out_path = sys.argv[1]
assert fsdp.num_hosts == 2 and fsdp.num_replicas_in_sync == 8, fsdp
data = batches()
params, opt_state, _ = plain(SAVED)

trainer = jd.training.Trainer(fsdp, MLP(), optimizer(), ce)
loaded = trainer.load_state(params=params, opt_state=opt_state, step=SAVED, batch=data[0])
kernel = loaded.params["Dense_1"]["kernel"]  # (8, 16), split: each device holds its part only
part = kernel.sharding.shard_shape(kernel.shape)
assert np.prod(part) < kernel.size and {s.data.shape
                                        for s in kernel.addressable_shards} == {part}, part
assert len(kernel.addressable_shards) == 4 and not kernel.is_fully_addressable
history = trainer.fit(iter(data[SAVED:]), steps=STEPS, log_every=1, verbose=0)

mirrored = jd.training.Trainer(jd.MirroredStrategy(), MLP(), optimizer(), ce)
again = mirrored.load_state(params=trainer.params, opt_state=trainer.state.opt_state, step=STEPS,
                            batch=data[0])
assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(again.params))

fsdp_params = gather(trainer.params)
mirrored_params = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), again.params)
if jax.process_index() == 0:
    flat = {}
    for name, tree in (("fsdp", fsdp_params), ("mirrored", mirrored_params)):
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        flat |= {f"{name}/{jax.tree_util.keystr(p)}": np.asarray(v) for p, v in leaves}
    np.savez(out_path, losses=np.array([row["loss"] for row in history.train]), **flat)
print(f"process {jax.process_index()} done", flush=True)
