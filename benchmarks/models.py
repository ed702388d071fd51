"""The benchmark models: a Flax linen MLP at two sizes, optax adam, softmax cross-entropy, fixed
synthetic data.

Every stepper of a comparison trains the same `Problem`: the same network, the same optimizer, the
same initial parameters and the same host batches, so the only difference between two sides is how
the step is compiled, placed and fed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["LARGE", "MODELS", "SMALL", "TINY", "MLP", "ModelSpec", "Problem", "make_problem"]

NUM_CLASSES = 10
NUM_FEATURES = 784


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One benchmark model.

    Attributes:
        name: short label used in tables and file names.
        hidden: widths of the hidden layers (input 784, output 10).
        batch: global batch size (split over the replicas).
        batches: distinct fixed batches cycled through (enough that no step sees the previous step's
            batch).
    """

    name: str
    hidden: tuple[int, ...]
    batch: int
    batches: int = 8

    @property
    def layers(self) -> str:
        """The layer widths, e.g. ``784-64-64-10``."""
        return "-".join(str(w) for w in (NUM_FEATURES, *self.hidden, NUM_CLASSES))


SMALL = ModelSpec("mlp-small", (64, 64), 64)
LARGE = ModelSpec("mlp-large", (512, 512), 256)
# --smoke only: exercises every code path quickly
TINY = ModelSpec("mlp-tiny", (16,), 16, batches=2)
MODELS = {spec.name: spec for spec in (SMALL, LARGE, TINY)}


class MLP(nn.Module):
    """ReLU MLP with a linear 10-way output (logits)."""

    hidden: tuple[int, ...]

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(NUM_CLASSES)(x)


@dataclasses.dataclass(frozen=True)
class Problem:
    """Everything a stepper needs to train one `ModelSpec`.

    Attributes:
        spec: the model spec.
        model: the Flax module.
        optimizer: the optax transformation (adam).
        init: ``init(rng, sample_x) -> (params, opt_state)``.
        step: the unmodified single-device training step, ``step(state, (x, y)) -> (state, loss)``.
        loss: ``loss(params, x, y) -> scalar`` (mean over the rows it is given).
        loss_of_logits: ``loss_of_logits(logits, y) -> scalar``, the same loss from the model's
            outputs.
        host_batches: the fixed ``(x, y)`` numpy batches, global batch size each.
    """

    spec: ModelSpec
    model: MLP
    optimizer: optax.GradientTransformation
    init: Callable[[jax.Array, jax.Array], Any]
    step: Callable[[Any, Any], Any]
    loss: Callable[[Any, jax.Array, jax.Array], jax.Array]
    loss_of_logits: Callable[[jax.Array, jax.Array], jax.Array]
    host_batches: tuple[tuple[np.ndarray, np.ndarray], ...]

    def sample_x(self) -> jax.Array:
        """One input row, for shape inference in ``init``."""
        return jnp.zeros((1, NUM_FEATURES), jnp.float32)

    def apply_gradients(self, state: Any, grads: Any) -> Any:
        """``state`` after one optimizer update with ``grads`` (for steps that compute gradients
        themselves)."""
        params, opt_state = state
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state


def _loss_of_logits(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _loss(model: MLP, params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return _loss_of_logits(model.apply(params, x), y)


def _init(model: MLP, optimizer: optax.GradientTransformation, rng: jax.Array, x: jax.Array) -> Any:
    params = model.init(rng, x)
    return params, optimizer.init(params)


def _step(model: MLP, optimizer: optax.GradientTransformation, state: Any, batch: Any) -> Any:
    params, opt_state = state
    x, y = batch
    loss, grads = jax.value_and_grad(functools.partial(_loss, model))(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


@functools.cache
def make_problem(spec: ModelSpec, seed: int = 0) -> Problem:
    """Build (once per spec) the model, optimizer, step and fixed synthetic batches of ``spec``.

    Example:
        >>> problem = make_problem(TINY)
        >>> problem.host_batches[0][0].shape
        (16, 784)
    """
    model = MLP(spec.hidden)
    optimizer = optax.adam(1e-3)
    rng = np.random.default_rng(seed)
    batches = tuple(
        (
            rng.standard_normal((spec.batch, NUM_FEATURES), dtype=np.float32),
            rng.integers(0, NUM_CLASSES, size=(spec.batch,), dtype=np.int32),
        )
        for _ in range(spec.batches)
    )
    return Problem(
        spec=spec,
        model=model,
        optimizer=optimizer,
        init=functools.partial(_init, model, optimizer),
        step=functools.partial(_step, model, optimizer),
        loss=functools.partial(_loss, model),
        loss_of_logits=_loss_of_logits,
        host_batches=batches,
    )
