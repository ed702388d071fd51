"""The trainer's step functions: ordinary single-device code, compiled by ``strategy.jit``.

Nothing here knows about replicas. The trainer compiles `make_train_step`'s function with ``strategy.jit(step,
donate_argnums=(0,), batch_argnums=(1,))`` (`jaxdist.training.compiled`): on a global batch split over the
replicas it computes what it computes on one device, so the loss and every metric are means over the GLOBAL
batch (never a mean of per-replica means).

* Gradient accumulation: with ``grad_accum_steps=k`` each batch is split into k micro-batches inside the step
  (``lax.scan``; activations live for one micro-batch at a time) and their mean gradient makes ONE optimizer
  update: the same update as one step on the whole batch. Micro-batch j takes rows ``j, j+k, j+2k, ...``, so
  every replica splits its own rows and no data moves between devices.
* Mixed precision: with ``compute_dtype=jnp.bfloat16`` the forward and backward pass run in bf16 on bf16
  copies of the parameters and inputs; parameters, gradients and optimizer state stay float32, and outputs
  are cast back to float32 before the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxdist.training.data import split_batch

__all__ = [
    "TrainState",
    "accuracy",
    "add_to_sums",
    "make_eval_step",
    "make_loop_step",
    "make_predict_step",
    "make_train_step",
    "metric_names",
    "step_key",
]


class TrainState(NamedTuple):
    """Everything a training run carries from step to step (and saves in a checkpoint).

    Attributes:
        step: optimizer steps taken (int32 scalar).
        params: what the optimizer updates.
        opt_state: the optax state.
        model_state: the model's other variables (linen ``batch_stats``; nnx batch stats and ``Rngs``).
        rng: the base PRNG key; step ``s`` uses ``jax.random.fold_in(key, s)``, so a resumed run draws the
            same numbers as an uninterrupted one. A typed key (``jax.random.key``) or its raw data
            (``jax.random.key_data``; what the `Trainer` keeps: a plain uint32 array costs less per step to
            pass into a compiled step than a typed key does); `step_key` reads either.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> s = TrainState(jnp.int32(0), {"w": jnp.ones(2)}, (), {}, jax.random.key(0))
        >>> int(s.step)
        0
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array


def step_key(state: TrainState) -> jax.Array:
    """The typed PRNG key of the state's current step: ``fold_in(state.rng, state.step)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> raw = TrainState(jnp.int32(3), {}, (), {}, jax.random.key_data(jax.random.key(0)))
        >>> typed = raw._replace(rng=jax.random.key(0))
        >>> bool((jax.random.key_data(step_key(raw)) == jax.random.key_data(step_key(typed))).all())
        True
    """
    rng = state.rng
    if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)
    return jax.random.fold_in(rng, state.step)


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Fraction of rows whose arg-max logit is the integer label: a metric for ``Trainer(metrics=...)``.

    Args:
        logits: ``(batch, classes)`` scores.
        labels: ``(batch,)`` integer classes.

    Returns:
        A float32 scalar in [0, 1].

    Example:
        >>> import jax.numpy as jnp
        >>> float(accuracy(jnp.array([[0.0, 1.0], [2.0, 0.0]]), jnp.array([1, 1])))
        0.5
    """
    return jnp.mean(jnp.argmax(logits, axis=-1) == labels, dtype=jnp.float32)


def _cast(tree: Any, dtype: Any) -> Any:
    if dtype is None:
        return tree
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _learning_rate(opt_state: Any) -> jax.Array | None:
    """The current learning rate, when the optimizer was built with `optax.inject_hyperparams`."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda n: hasattr(n, "hyperparams")):
        hyper = getattr(node, "hyperparams", None)
        if isinstance(hyper, Mapping) and "learning_rate" in hyper:
            return jnp.asarray(hyper["learning_rate"], jnp.float32)
    return None


def _micro_batches(tree: Any, k: int) -> Any:
    """(B, ...) -> (k, B/k, ...): micro-batch j holds rows j, j+k, ...; each replica splits its own rows."""

    def split(a):
        if a.shape[0] % k:
            raise ValueError(
                f"grad_accum_steps={k} does not divide the batch of {a.shape[0]} rows: use a batch that is a "
                f"multiple of {k} (and of the replica count times {k})."
            )
        return jnp.moveaxis(a.reshape((a.shape[0] // k, k, *a.shape[1:])), 1, 0)

    return jax.tree.map(split, tree)


def make_train_step(
    model: Any,
    optimizer: optax.GradientTransformation,
    loss_fn: Callable[[Any, Any], jax.Array],
    metrics: Mapping[str, Callable[[Any, Any], jax.Array]] | None = None,
    grad_accum_steps: int = 1,
    compute_dtype: Any = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    """The single-device train step ``(state, batch) -> (state, metrics)``.

    Args:
        model: a `LinenModel` / `NnxModel` adapter.
        optimizer: the optax transformation (clipping already chained in).
        loss_fn: ``loss_fn(outputs, targets) -> scalar``, the mean over the batch.
        metrics: extra ``name -> fn(outputs, targets) -> scalar`` (batch means).
        grad_accum_steps: micro-batches per optimizer step (1: none).
        compute_dtype: e.g. ``jnp.bfloat16`` for mixed precision; None computes in the parameters' dtype.

    Returns:
        The step; its metrics dict holds ``"loss"``, each metric and, for optimizers built with
        `optax.inject_hyperparams`, ``"learning_rate"``.

    Example:
        >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
        >>> from jaxdist.training.models import LinenModel
        >>> model, opt = LinenModel(nn.Dense(1)), optax.sgd(0.1)
        >>> params, ms = model.init(jax.random.key(0), jnp.ones((1, 2)))
        >>> state = TrainState(jnp.int32(0), params, opt.init(params), ms, jax.random.key(1))
        >>> step = make_train_step(model, opt, lambda out, y: jnp.mean((out[:, 0] - y) ** 2))
        >>> state, m = step(state, (jnp.ones((4, 2)), jnp.zeros(4)))
        >>> int(state.step), sorted(m)
        (1, ['loss'])
    """
    metrics = dict(metrics or {})

    def forward(params, model_state, x, y, rng):
        out, new_model_state = model.apply(
            _cast(params, compute_dtype), model_state, _cast(x, compute_dtype), rng, train=True
        )
        out = _cast(out, jnp.float32 if compute_dtype is not None else None)
        values = {name: jnp.asarray(fn(out, y), jnp.float32) for name, fn in metrics.items()}
        return loss_fn(out, y), (new_model_state, values)

    grad_fn = jax.value_and_grad(forward, has_aux=True)

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        x, y = split_batch(batch)
        rng = step_key(state)
        if grad_accum_steps == 1:
            (loss, (model_state, values)), grads = grad_fn(state.params, state.model_state, x, y, rng)
        else:
            def micro(carry, inputs):
                grads_sum, loss_sum, values_sum, model_state = carry
                j, xj, yj = inputs
                (loss, (model_state, values)), grads = grad_fn(
                    state.params, model_state, xj, yj, jax.random.fold_in(rng, j)
                )
                add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
                loss_sum = loss_sum + loss.astype(jnp.float32)
                return (add(grads_sum, grads), loss_sum, add(values_sum, values), model_state), None

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            zero_values = {name: jnp.zeros((), jnp.float32) for name in metrics}
            (grads, loss, values, model_state), _ = jax.lax.scan(
                micro,
                (zeros, jnp.zeros((), jnp.float32), zero_values, state.model_state),
                (jnp.arange(grad_accum_steps), _micro_batches(x, grad_accum_steps),
                 _micro_batches(y, grad_accum_steps)),
            )
            scale = 1.0 / grad_accum_steps
            grads = jax.tree.map(lambda g: g * scale, grads)
            loss, values = loss * scale, jax.tree.map(lambda v: v * scale, values)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        out = {"loss": loss, **values}
        lr = _learning_rate(opt_state)
        if lr is not None:
            out["learning_rate"] = lr
        return TrainState(state.step + 1, params, opt_state, model_state, state.rng), out

    return train_step


def metric_names(metrics: Mapping[str, Any], opt_state: Any) -> tuple[str, ...]:
    """The names in a train step's metrics dict: ``"loss"``, each metric, and ``"learning_rate"`` when the
    optimizer was built with `optax.inject_hyperparams` (found in ``opt_state``; nothing runs).

    Example:
        >>> import optax, jax.numpy as jnp
        >>> opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> metric_names({"accuracy": None}, opt.init({"w": jnp.ones(2)}))
        ('loss', 'accuracy', 'learning_rate')
    """
    has_rate = any(
        isinstance(getattr(node, "hyperparams", None), Mapping) and "learning_rate" in node.hyperparams
        for node in jax.tree.leaves(opt_state, is_leaf=lambda n: hasattr(n, "hyperparams"))
    )
    return ("loss", *metrics, *(("learning_rate",) if has_rate else ()))


def add_to_sums(sums: jax.Array, metrics: Mapping[str, jax.Array], names: Sequence[str]) -> jax.Array:
    """Running metric sums, one float32 vector: ``sums[i]`` for ``names[i]`` plus this step's value.

    ``"learning_rate"`` is replaced by this step's (the current rate, not a sum) and ``"steps"`` counts the
    steps. Computed inside the compiled step, it costs nothing per step; the host reads one small vector
    per log point instead of every step's scalars.

    Example:
        >>> import jax.numpy as jnp
        >>> names = ("loss", "learning_rate", "steps")
        >>> sums = add_to_sums(jnp.zeros(3), {"loss": 0.5, "learning_rate": 0.1}, names)
        >>> add_to_sums(sums, {"loss": 0.25, "learning_rate": 0.05}, names).tolist()
        [0.75, 0.05000000074505806, 2.0]
    """
    step = jnp.stack([jnp.asarray(metrics[n] if n != "steps" else 1.0, jnp.float32) for n in names])
    keep = jnp.asarray([0.0 if n == "learning_rate" else 1.0 for n in names], jnp.float32)
    return sums * keep + step


def make_loop_step(train_step: Callable[[TrainState, Any], tuple[TrainState, dict]], names: Sequence[str]) -> Callable:
    """The body of an on-device loop of train steps, for ``strategy.run_steps_on_dataset``.

    ``loop_step(ctx, (state, values, i, sums), x, y) -> (state, values, i + 1, sums)`` runs ``train_step``
    on ``(x, y)``, writes each of its metrics into row ``i`` of ``values`` (``{name: float32 array (n,)}``;
    ``i`` starts at 0) and adds them to ``sums`` (see `add_to_sums`; ``names`` orders it). After a loop of
    ``n`` steps ``values`` holds every step's metrics and ``sums`` their running sums.

    Example:
        >>> import numpy as np, jax.numpy as jnp, jaxdist as jd
        >>> def train_step(w, batch):
        ...     return w + 1.0, {"loss": batch[0].mean()}
        >>> batches = iter([(np.full((2, 1), i, np.float32), np.zeros(2, np.float32)) for i in range(3)])
        >>> start = (jnp.float32(0.0), {"loss": np.zeros(3, np.float32)}, np.int32(0), np.zeros(2, np.float32))
        >>> ctx = jd.OneDeviceStrategy().run_steps_on_dataset(
        ...     make_loop_step(train_step, ("loss", "steps")), batches, iterations=3, initial_loop_values=start)
        >>> state, values, _, sums = ctx.loop_values
        >>> float(state), values["loss"].tolist(), sums.tolist()
        (3.0, [0.0, 1.0, 2.0], [3.0, 3.0])
    """
    names = tuple(names)

    def loop_step(ctx, carry, x, y):
        del ctx
        state, values, i, sums = carry
        state, metrics = train_step(state, (x, y))
        values = {k: v.at[i].set(metrics[k].astype(v.dtype)) for k, v in values.items()}
        return state, values, i + 1, add_to_sums(sums, metrics, names)

    return loop_step


def _per_example(fn: Callable, out: Any, y: Any) -> jax.Array:
    """``fn`` on every row as a batch of one: per-example values that padding rows can be masked out of."""
    one = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731
    return jax.vmap(lambda o, t: fn(one(o), one(t)))(out, y)


def make_eval_step(
    model: Any,
    loss_fn: Callable,
    metrics: Mapping[str, Callable] | None = None,
    compute_dtype: Any = None,
) -> Callable[[TrainState, Any, jax.Array], tuple[dict, jax.Array]]:
    """The evaluation step ``(state, batch, weights) -> (sums, count)``.

    ``sums[name]`` is the weighted sum over rows of each metric computed per example; ``count`` the sum of
    weights (padding rows weigh 0). The trainer adds both over batches and divides once, so evaluation
    metrics are exact means over every example.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> from jaxdist.training.models import LinenModel
        >>> model = LinenModel(nn.Dense(1))
        >>> params, ms = model.init(jax.random.key(0), jnp.ones((1, 2)))
        >>> state = TrainState(jnp.int32(0), params, (), ms, jax.random.key(1))
        >>> step = make_eval_step(model, lambda out, y: jnp.mean(out[:, 0] * 0 + 1.0))
        >>> sums, count = step(state, (jnp.ones((4, 2)), jnp.zeros(4)), jnp.array([1.0, 1.0, 1.0, 0.0]))
        >>> float(sums["loss"]), float(count)
        (3.0, 3.0)
    """
    fns = {"loss": loss_fn, **dict(metrics or {})}

    def eval_step(state: TrainState, batch: Any, weights: jax.Array) -> tuple[dict, jax.Array]:
        x, y = split_batch(batch)
        out, _ = model.apply(
            _cast(state.params, compute_dtype), state.model_state, _cast(x, compute_dtype), None, train=False
        )
        out = _cast(out, jnp.float32 if compute_dtype is not None else None)
        sums = {name: jnp.sum(_per_example(fn, out, y).astype(jnp.float32) * weights) for name, fn in fns.items()}
        return sums, jnp.sum(weights)

    return eval_step


def make_predict_step(model: Any, compute_dtype: Any = None) -> Callable[[TrainState, Any], Any]:
    """The prediction step ``(state, x) -> outputs`` (evaluation mode; outputs float32 under bf16).

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> from jaxdist.training.models import LinenModel
        >>> model = LinenModel(nn.Dense(3))
        >>> params, ms = model.init(jax.random.key(0), jnp.ones((1, 2)))
        >>> make_predict_step(model)(TrainState(jnp.int32(0), params, (), ms, jax.random.key(1)),
        ...                          jnp.ones((5, 2))).shape
        (5, 3)
    """

    def predict_step(state: TrainState, x: Any) -> Any:
        out, _ = model.apply(
            _cast(state.params, compute_dtype), state.model_state, _cast(x, compute_dtype), None, train=False
        )
        return _cast(out, jnp.float32 if compute_dtype is not None else None)

    return predict_step
