"""One process of the 2-process context-parallel test (run by tests/test_context_parallel.py through
jaxdist.launch).

A ``(data=2, context=4)`` mesh over 2 processes x 4 CPU devices whose context axis spans the
processes (context devices 0, 1 on process 0, 2, 3 on process 1): the char LM trains from global
batches with ring attention (load-balanced), packed sequences. Process 0 saves the losses and the
final parameters (gathered). Importing this module only defines the model, data and step (the test
computes its one-device reference with them); running it trains. Arguments: out_path.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from char_lm import CharLM, LMConfig

MODES = {"ring_balanced": ("ring", True)}  # all-gather is covered on one process (a fast suite)


def config(mode: str) -> LMConfig:
    context, balance = MODES[mode]
    return LMConfig(vocab_size=32, d_model=16, num_heads=2, num_layers=1, mlp_dim=32, max_len=32,
                    context=context, load_balance=balance)


def init(cfg: LMConfig):
    return CharLM(cfg).init(jax.random.key(0), jnp.ones((1, 32), jnp.int32))["params"]


def step(params, batch, cfg):
    def loss(p):
        logits = CharLM(cfg).apply({"params": p}, batch["x"], batch["seg"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), value


def data(steps: int = 2) -> list[dict]:
    rng = np.random.default_rng(11)
    out = []
    for _ in range(steps):
        x = rng.integers(0, 32, (4, 32)).astype(np.int32)
        # two packed documents per row
        seg = np.sort(rng.integers(1, 3, (4, 32)), axis=1).astype(np.int32)
        out.append({"x": x, "y": np.roll(x, -1, axis=1), "seg": seg})
    return out


def main(out_path: str) -> None:
    import jaxdist as jd

    jd.initialize_cluster()  # before any computation: connects the processes
    from gathering import gather
    from jax.sharding import AxisType, Mesh

    pid = jax.process_index()
    local = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
             for p in (0, 1)]
    grid = np.array([[local[c // 2][d * 2 + c % 2] for c in range(4)] for d in range(2)])
    mesh = Mesh(grid, ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes="data", context_axes="context",
                                  min_shard_size=1)
    assert strategy.num_hosts == 2 and strategy.policy.replicas_span_processes
    results = {}
    for mode in MODES:
        cfg = config(mode)
        params = strategy.create_variables(init, cfg)
        jitted = strategy.jit(step, static_argnums=2, batch_argnums=1)
        losses = []
        with strategy.scope():
            for batch in strategy.experimental_distribute_dataset(data()):
                params, loss = jitted(params, batch, cfg)
                losses.append(float(loss))
        results[f"{mode}/losses"] = np.array(losses)
        gathered = gather(params)
        for path, leaf in jax.tree_util.tree_leaves_with_path(gathered):
            results[f"{mode}/params{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    if pid == 0:
        np.savez(out_path, **results)
    print(f"process {pid} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
