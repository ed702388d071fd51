"""Where a training step's time goes: forward, backward, gradient all-reduce, optimizer, and the
host's part.

``python -m benchmarks.step_parts [--devices 8] [--blocks 9] [--steps 40] [--out
benchmarks/results]`` times six programs on the same model, batch and devices (`MirroredStrategy`),
each in blocks of ``--steps`` calls, blocks of the six interleaved so that a change in the machine's
load touches them all:

1. the forward pass (the loss) in ``strategy.run`` per replica;
2. forward and backward (local gradients, no communication);
3. the same with the gradients all-reduced (``ctx.all_reduce(MEAN, grads)``);
4. the same with the optax update: one whole training step on batches already on the devices;
5. the same step in the global view (``strategy.jit`` of a single-device step, what the Trainer
   compiles);
6. ``Trainer.fit`` per step, from host (numpy) batches: placing each batch, logging, the data
   position.

A part's time is the median over blocks of the difference of two programs timed back to back:
backward = 2 - 1, all-reduce = 3 - 2, optimizer = 4 - 3, the host's part = 6 - 5. The JSON goes to
``<out>/<date>-cpu<devices>-step-parts.json``; ``docs/figures/step_parts.py`` draws the newest one.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence

PARTS = ("forward", "backward", "gradient all-reduce", "optimizer update",
         "host: batches and bookkeeping")


def measure(devices: int, blocks: int, steps: int) -> dict:
    """Median seconds per call of the five programs, and the parts as their differences."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    import flax.linen as nn
    import numpy as np
    import optax

    import jaxdist as jd
    from benchmarks.report import machine_info

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(256)(x))
            x = nn.relu(nn.Dense(256)(x))
            return nn.Dense(10)(x)

    strategy = jd.MirroredStrategy()
    model, optimizer, batch = MLP(), optax.adam(1e-3), 256
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int32)

    def loss(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    params = strategy.create_variables(model.init, jax.random.key(0), x[:1])
    opt_state = strategy.create_variables(optimizer.init, params)
    placed = strategy.experimental_distribute_values((x, y))

    # Each program returns what its part produced (the gradients, reduced or not), so none is
    # optimised away.
    def forward(p, o, b):
        return p, o, loss(p, *b)

    def backward(p, o, b):
        return p, o, jax.value_and_grad(loss)(p, *b)

    def reduced(p, o, b):
        value, grads = jax.value_and_grad(loss)(p, *b)
        return p, o, (value, jd.get_replica_context().all_reduce(jd.ReduceOp.MEAN, grads))

    def step(p, o, b):
        value, grads = jax.value_and_grad(loss)(p, *b)
        grads = jd.get_replica_context().all_reduce(jd.ReduceOp.MEAN, grads)
        updates, o = optimizer.update(grads, o, p)
        return optax.apply_updates(p, updates), o, (value, grads)

    def runner(fn):
        # State donated in every program: passing it through unchanged costs no copy, as updating it
        # costs none.
        compiled = strategy.jit(
            lambda p, o, b: strategy.run(fn, args=(p, o, b), batch_argnums=(2,)),
            donate_argnums=(0, 1),
        )
        state = [jax.tree.map(jax.numpy.copy, params), jax.tree.map(jax.numpy.copy, opt_state)]

        def call(n):
            out = None
            for _ in range(n):
                state[0], state[1], out = compiled(state[0], state[1], placed)
            jax.block_until_ready(out)

        return call

    def loss_fn(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def global_step(p, o, b):  # a single-device step: XLA inserts the all-reduce
        grads = jax.grad(loss)(p, *b)
        updates, o = optimizer.update(grads, o, p)
        return optax.apply_updates(p, updates), o

    whole = strategy.jit(global_step, donate_argnums=(0, 1), batch_argnums=(2,))
    state = [jax.tree.map(jax.numpy.copy, params), jax.tree.map(jax.numpy.copy, opt_state)]

    def global_view(n):
        for _ in range(n):
            state[0], state[1] = whole(state[0], state[1], placed)
        jax.block_until_ready(state)

    trainer = jd.training.Trainer(strategy, model, optimizer, loss_fn)
    host_batches = [(x, y)]

    def fit(n):
        trainer.fit(host_batches, steps=trainer.step + n, log_every=10, verbose=0)

    calls = [runner(forward), runner(backward), runner(reduced), runner(step), global_view, fit]
    for call in calls:
        call(3)  # compile and warm up
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(blocks):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call(steps)
            times[i].append((time.perf_counter() - start) / steps)
    medians = [statistics.median(t) for t in times]
    # A part: the median over blocks of the difference of neighbours timed back to back (drift
    # cancels).
    def difference(i: int, j: int) -> float:
        return statistics.median(a - b for a, b in zip(times[i], times[j], strict=True))

    parts = dict(zip(PARTS, (medians[0], difference(1, 0), difference(2, 1), difference(3, 2),
                             difference(5, 4)),
                     strict=True))
    return {"machine": machine_info(strategy.devices), "model": "784-256-256-10 MLP, adam",
            "global_batch": batch, "devices": devices, "blocks": blocks, "steps_per_block": steps,
            "seconds_per_call": dict(zip(("forward", "forward+backward", "+all-reduce",
                                          "whole step",
                                          "global-view step", "fit step"), medians, strict=True)),
            "parts_seconds": parts}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_parts",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=9)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    result = measure(args.devices, args.blocks, args.steps)
    path = args.out / f"{result['machine']['date'][:10]}-cpu{args.devices}-step-parts.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    for name, seconds in result["parts_seconds"].items():
        print(f"{name:32s} {seconds * 1e3:8.3f} ms")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
