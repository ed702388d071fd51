"""Train a small Flax MLP on scikit-learn's digits with `jd.training.Trainer` on simulated CPU
devices.

The drop-in training loop of jaxdist, end to end:

1. ``Trainer(strategy, model, optimizer, loss_fn)`` builds the train state (params + optax state)
   directly in the strategy's layout (mirrored: a copy on every replica) and compiles an ordinary
   single-device train step with ``strategy.jit``: XLA inserts the gradient all-reduce, so each step
   computes what the step computes on one device for the same global batch;
2. ``trainer.fit(data_fn, steps=..., eval_data=..., checkpoint_dir=...)`` feeds GLOBAL batches
   (split over the replicas), shows progress, evaluates, and saves orbax checkpoints that restore
   onto any strategy; run it again with the same ``--checkpoint-dir`` and it resumes where it
   stopped (also after a SIGTERM);
3. ``trainer.evaluate`` averages accuracy over every test example (the ragged last batch is padded
   and masked).

``--compare-loop`` also trains the same model with a hand-written ``strategy.jit`` loop and prints
the steps/s of both side by side. The digits data ship with scikit-learn (no download). Run it with
``./scripts/demo`` or::

    .venv/bin/python examples/digits_mirrored.py --devices 8 --epochs 15 --batch-size 64
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import flax.linen as nn
import jax
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jaxdist as jd


class MLP(nn.Module):
    """64 pixels -> 128 -> 128 -> 10 logits."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(128)(x))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(10)(x)


def loss_fn(logits, labels):
    """The mean loss over the (global) batch: the Trainer differentiates it with respect to the
    params."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train_batches(x, y, batch_size, epoch, seed):
    """One epoch of GLOBAL batches, shuffled with a per-epoch seed (deterministic, so resuming is
    exact); the ragged remainder is dropped."""
    order = np.random.default_rng((seed, epoch)).permutation(len(x))
    return [
        (x[order[i : i + batch_size]], y[order[i : i + batch_size]])
        for i in range(0, len(x) - batch_size + 1, batch_size)
    ]


def test_batches(x, y, batch_size):
    """Every example once; the Trainer pads the ragged last batch and masks the padding out."""
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]


class FirstStep(jd.training.Callback):
    """Remembers the step ``fit`` starts from (after it resumed from a checkpoint, if it did)."""

    step = 0

    def on_train_begin(self, trainer):
        self.step = trainer.step


def make_strategy(name: str) -> jd.Strategy:
    if name == "mirrored":
        return jd.MirroredStrategy()
    if name == "one_device":
        return jd.OneDeviceStrategy()
    if name == "tpu":
        return jd.TPUStrategy(steps_per_run=10)
    return jd.ShardedStrategy()


def hand_written_steps_per_sec(strategy, data_fn, steps, seed, sample):
    """The same model, optimizer and batches in a hand-written ``strategy.jit`` loop (the Core API
    path)."""
    model, optimizer = MLP(), optax.adam(3e-3)

    def init(rng, x):
        params = model.init(rng, x)
        return params, optimizer.init(params)

    def train_step(state, batch):
        params, opt_state = state
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model.apply(p, x), y))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    state = strategy.create_variables(init, jax.random.key(seed), sample)
    step = strategy.jit(train_step, donate_argnums=(0,))
    # compile, untimed
    state, loss = step(state, strategy.experimental_distribute_values(data_fn(0)[0]))
    float(loss)
    done, epoch, start = 0, 0, time.perf_counter()
    while done < steps:
        for batch in strategy.experimental_distribute_dataset(data_fn(epoch)[: steps - done]):
            state, loss = step(state, batch)
            done += 1
            if done % 10 == 0:
                float(loss)  # what a progress bar reads
        epoch += 1
    float(loss)
    return steps / (time.perf_counter() - start)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default: 8)")
    parser.add_argument("--strategy", choices=("mirrored", "one_device", "sharded", "tpu"),
                        default="mirrored")
    parser.add_argument("--epochs", type=int, default=15,
                        help="passes over the training split (default: 15)")
    parser.add_argument("--steps", type=int, default=None,
                        help="train this many steps instead of --epochs")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="GLOBAL batch, split over the replicas")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where checkpoints go (default: a new temporary directory); reuse one "
                             "to resume")
    parser.add_argument("--compare-loop", action="store_true",
                        help="also time a hand-written strategy.jit loop on the same model "
                             "(steps/s side by side)")
    parser.add_argument("--verbose", action="store_true",
                        help="show the step's whole cost line (FLOP sources, peak, live memory) at "
                             "the start")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # Simulated devices must be set before JAX starts a backend (importing jax or jaxdist starts
    # none).
    jax.config.update("jax_num_cpu_devices", args.devices)

    strategy = make_strategy(args.strategy)
    n = strategy.num_replicas_in_sync
    if args.batch_size % n:
        raise SystemExit(
            f"--batch-size={args.batch_size} is not divisible by {n} replicas: "
            f"use a multiple of {n}, e.g. {-(-args.batch_size // n) * n}."
        )

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # pixel values are 0..16
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=args.seed,
                                                        stratify=y)
    steps_per_epoch = len(x_train) // args.batch_size
    total_steps = args.steps if args.steps is not None else args.epochs * steps_per_epoch
    checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="jaxdist-digits-")
    print(f"{type(strategy).__name__} over {n} replicas: global batch {args.batch_size} "
          f"({args.batch_size // n} per replica)\ndigits: {len(x_train)} train / {len(x_test)} "
          f"test examples, {total_steps} steps",
          flush=True)  # before the progress bar starts writing to stderr

    def data_fn(epoch):
        return train_batches(x_train, y_train, args.batch_size, epoch, args.seed)

    trainer = jd.training.Trainer(
        strategy, MLP(), optax.adam(3e-3), loss_fn, metrics={"accuracy": jd.training.accuracy},
        seed=args.seed
    )
    test_data = test_batches(x_test, y_test, args.batch_size)
    start, first = time.perf_counter(), FirstStep()
    history = trainer.fit(data_fn, steps=total_steps, eval_data=test_data,
                          checkpoint_dir=checkpoint_dir,
                          log_every=steps_per_epoch, verbose=2 if args.verbose else "auto",
                          callbacks=[first])
    seconds = time.perf_counter() - start
    trained = trainer.step - first.step

    metrics = trainer.evaluate(test_data)
    print(f"trained {trained} steps in {seconds:.1f}s (compilation, evaluation and checkpoints "
          "included)")
    print(f"checkpoint: {os.path.join(checkpoint_dir, str(trainer.step))} (history: "
          f"{len(history.train)} log points)")
    if args.compare_loop:
        steps = min(total_steps, 500)
        timed = jd.training.Trainer(strategy, MLP(), optax.adam(3e-3), loss_fn, seed=args.seed)
        timed.fit(data_fn, steps=1, verbose=0)  # compile outside the timing
        t0 = time.perf_counter()
        timed.fit(data_fn, steps=1 + steps, verbose=0, log_every=10)
        fit_rate = steps / (time.perf_counter() - t0)
        hand_rate = hand_written_steps_per_sec(strategy, data_fn, steps, args.seed, x_train[:1])
        print(f"steps/s over {steps} compiled steps, same model and batches:\n"
              f"  Trainer.fit {fit_rate:.0f} | hand-written strategy.jit loop {hand_rate:.0f} | "
              f"ratio {fit_rate / hand_rate:.2f}")
    print(f"final eval accuracy: {metrics['accuracy']:.4f}")


if __name__ == "__main__":
    main()
