"""Train a small Flax MLP on scikit-learn's digits with `jd.MirroredStrategy` on simulated CPU devices.

The drop-in path of jaxdist, end to end:

1. ``strategy.create_variables`` builds the train state (params + optax state) directly in the mirrored
   layout: a copy on every replica, no host round trip;
2. ``strategy.experimental_distribute_dataset`` turns GLOBAL batches into arrays split over the replicas;
3. ``strategy.jit`` compiles the unmodified single-device ``train_step``; XLA inserts the gradient
   all-reduce, so each step computes what ``train_step`` computes on one device for the same global batch.

The digits data ship with scikit-learn (no download). Run it with ``./scripts/demo`` or::

    .venv/bin/python examples/digits_mirrored.py --devices 8 --epochs 15 --batch-size 64
"""

from __future__ import annotations

import argparse
import time
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jaxdist as jd


class MLP(nn.Module):
    """64 pixels -> 128 -> 128 -> 10 logits."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(128)(x))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(10)(x)


class TrainState(NamedTuple):
    params: dict
    opt_state: optax.OptState


model = MLP()
optimizer = optax.adam(3e-3)


def init_state(rng, sample):
    params = model.init(rng, sample)
    return TrainState(params, optimizer.init(params))


def loss_fn(params, x, y):
    logits = model.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# A plain single-device train step: nothing in it knows about replicas.
def train_step(state, batch):
    x, y = batch
    loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return TrainState(optax.apply_updates(state.params, updates), opt_state), loss


def eval_step(params, batch):
    """How many real rows of the batch are predicted correctly (``mask`` is 0 on padding rows)."""
    x, y, mask = batch
    predictions = jnp.argmax(model.apply(params, x), axis=-1)
    return jnp.sum((predictions == y) * mask)


def train_batches(x, y, batch_size, epoch, seed):
    """One epoch of GLOBAL batches, shuffled with a per-epoch seed; the ragged remainder is dropped."""
    order = np.random.default_rng((seed, epoch)).permutation(len(x))
    return [
        (x[order[i : i + batch_size]], y[order[i : i + batch_size]])
        for i in range(0, len(x) - batch_size + 1, batch_size)
    ]


def eval_batches(x, y, batch_size):
    """Every example exactly once; the last batch is padded to ``batch_size`` and its padding masked out."""
    batches = []
    for i in range(0, len(x), batch_size):
        xb, yb = x[i : i + batch_size], y[i : i + batch_size]
        pad = batch_size - len(xb)
        mask = np.concatenate([np.ones(len(xb), np.float32), np.zeros(pad, np.float32)])
        batches.append((np.pad(xb, ((0, pad), (0, 0))), np.pad(yb, (0, pad)), mask))
    return batches


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default: 8)")
    parser.add_argument("--strategy", choices=("mirrored", "one_device"), default="mirrored")
    parser.add_argument("--epochs", type=int, default=15, help="passes over the training split (default: 15)")
    parser.add_argument("--steps", type=int, default=None, help="train this many steps instead of --epochs")
    parser.add_argument("--batch-size", type=int, default=64, help="GLOBAL batch, split over the replicas")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # Simulated devices must be set before JAX starts a backend (importing jax or jaxdist starts none).
    jax.config.update("jax_num_cpu_devices", args.devices)

    strategy = jd.MirroredStrategy() if args.strategy == "mirrored" else jd.OneDeviceStrategy()
    n = strategy.num_replicas_in_sync
    if args.batch_size % n:
        raise SystemExit(
            f"--batch-size={args.batch_size} is not divisible by {n} replicas: "
            f"use a multiple of {n}, e.g. {-(-args.batch_size // n) * n}."
        )

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # pixel values are 0..16
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=args.seed, stratify=y)
    steps_per_epoch = len(x_train) // args.batch_size
    total_steps = args.steps if args.steps is not None else args.epochs * steps_per_epoch
    print(
        f"{strategy!r}: global batch {args.batch_size} = {args.batch_size // n} per replica x {n}; "
        f"{len(x_train)} train / {len(x_test)} test examples; {total_steps} steps",
        flush=True,  # before tqdm starts writing to stderr
    )

    with strategy.scope():
        state = strategy.create_variables(init_state, jax.random.key(args.seed), x_train[:1])
        step = strategy.jit(train_step, donate_argnums=(0,))
        evaluate = strategy.jit(eval_step)

        start = time.perf_counter()
        done, epoch = 0, 0
        with tqdm(total=total_steps, desc="train", unit="step") as bar:
            while done < total_steps:
                epoch_batches = train_batches(x_train, y_train, args.batch_size, epoch, args.seed)
                for batch in strategy.experimental_distribute_dataset(epoch_batches[: total_steps - done]):
                    state, loss = step(state, batch)
                    done += 1
                    bar.update()
                    if done % 10 == 0 or done == total_steps:
                        bar.set_postfix(loss=f"{float(loss):.4f}", epoch=epoch)
                epoch += 1
        seconds = time.perf_counter() - start

        correct = 0
        for batch in strategy.experimental_distribute_dataset(eval_batches(x_test, y_test, args.batch_size)):
            correct += int(evaluate(state.params, batch))

    print(f"trained {total_steps} steps in {seconds:.1f}s ({total_steps / seconds:.0f} steps/s)")
    print(f"final eval accuracy: {correct / len(x_test):.4f}")


if __name__ == "__main__":
    main()
