"""The trainer's step functions: ordinary single-device code, compiled by ``strategy.jit``.

Nothing here knows about replicas. The trainer compiles `make_train_step`'s function with
``strategy.jit(step, donate_argnums=(0,), batch_argnums=(1,))`` (`jaxdist.training.step._compiled`):
on a global batch split over the replicas it computes what it computes on one device, so the loss
and every metric are means over the GLOBAL batch (never a mean of per-replica means).

* Gradient accumulation: with ``grad_accum_steps=k`` each batch is split into k micro-batches inside
  the step (``lax.scan``; activations live for one micro-batch at a time) and their mean gradient
  makes ONE optimizer update: the same update as one step on the whole batch. Each replica splits
  its own rows (`_micro_batches`), so no data moves between devices.
* Token-weighted losses (`jaxdist.training.step._weighted`): a ``(sum, weight)`` loss or metric is
  summed over micro-batches and divided once by the summed weight; scalar means are averaged.
* Mixed precision: with ``compute_dtype=jnp.bfloat16`` the forward and backward pass run in bf16 on
  bf16 copies of the parameters and inputs; parameters, gradients and optimizer state stay float32,
  and outputs are cast back to float32 before the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdist.training.step._non_finite as non_finite
import jaxdist.training.step._weighted as weighted
from jaxdist.nn.moe import moe_loss, moe_metrics
from jaxdist.training.data import split_batch
from jaxdist.training.step._ema import ema_update
from jaxdist.training.step._running import PackedSums, RunningSums

__all__ = ["TrainState", "accuracy", "make_eval_step", "make_loop_step", "make_predict_step",
           "make_summed_train_step", "make_train_step", "layer_metric_names", "step_key",
           "zero_sums"]


class TrainState(NamedTuple):
    """Everything a training run carries from step to step (and saves in a checkpoint).

    Attributes:
        step: optimizer steps taken (int32 scalar).
        params: what the optimizer updates.
        opt_state: the optax state.
        model_state: the model's other variables (linen ``batch_stats``; nnx batch stats and
            ``Rngs``).
        rng: the base PRNG key; step ``s`` uses ``jax.random.fold_in(key, s)``, so a resumed run
            draws the same numbers as an uninterrupted one. A typed key or its raw data
            (``jax.random.key_data``: what the `Trainer` keeps, as a plain uint32 array costs less
            per step to pass into a compiled step); `step_key` reads either.
        ema: the averaged weights (`jaxdist.training.step._ema`), a tree like ``params`` updated
            after each optimizer step; None (the default) when the run keeps none.

    Examples:
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
    ema: Any = None


def step_key(state: TrainState) -> jax.Array:
    """The typed PRNG key of the state's current step: ``fold_in(state.rng, state.step)``.

    Examples:
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
    """Fraction of rows whose arg-max logit is the integer label (for ``Trainer(metrics=...)``).

    Args:
        logits: ``(batch, classes)`` scores.
        labels: ``(batch,)`` integer classes.

    Returns:
        A float32 scalar in [0, 1].

    Examples:
        >>> import jax.numpy as jnp
        >>> float(accuracy(jnp.array([[0.0, 1.0], [2.0, 0.0]]), jnp.array([1, 1])))
        0.5
    """
    return jnp.mean(jnp.argmax(logits, axis=-1) == labels, dtype=jnp.float32)


def _cast(tree: Any, dtype: Any) -> Any:
    if dtype is None:
        return tree
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                        tree)


def _hyperparams(opt_state: Any) -> Mapping | None:
    """The hyperparameters holding the learning rate of an `optax.inject_hyperparams` optimizer."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda n: hasattr(n, "hyperparams")):
        hyper = getattr(node, "hyperparams", None)
        if isinstance(hyper, Mapping) and "learning_rate" in hyper:
            return hyper
    return None


def _micro_batches(tree: Any, k: int) -> Any:
    """(B, ...) -> (k, B/k, ...): micro-batch j holds rows j, j+k, ... (each replica's own rows)."""

    def split(a):
        if a.shape[0] % k:
            raise ValueError(f"grad_accum_steps={k} does not divide the batch of {a.shape[0]} "
                             f"rows: use a batch that is a multiple of {k} (and of the replica "
                             f"count times {k}).")
        return jnp.moveaxis(a.reshape((a.shape[0] // k, k, *a.shape[1:])), 1, 0)

    return jax.tree.map(split, tree)


ACCUMULATION_SCOPE = "grad_accumulation"
"""Named scope of the micro-batch loop's ``while`` op (profiles and the compiled text name it)."""


def _forward(model, loss_fn, metrics, compute_dtype) -> Callable:
    """``forward(params, model_state, x, y, rng) -> (loss, (model_state, loss_weight, {name: (value,
    weight)}))``: the loss to differentiate is the mean (scalar losses) or the SUM (``(sum,
    weight)`` losses)."""

    def forward(params, model_state, x, y, rng):
        args = (_cast(params, compute_dtype), model_state, _cast(x, compute_dtype), rng)
        if hasattr(model, "apply_train"):
            out, new_model_state, sown = model.apply_train(*args)
        else:  # an adapter of the user's own: apply(..., train=True), nothing sown
            (out, new_model_state), sown = model.apply(*args, train=True), {}
        out = _cast(out, jnp.float32 if compute_dtype is not None else None)
        values = {}
        for name, fn in metrics.items():
            value, weight = weighted.split_value(f"metrics[{name!r}]", fn(out, y))
            values[name] = (jnp.asarray(value, jnp.float32), weight)
        loss, weight = weighted.split_value("loss_fn", loss_fn(out, y))
        # mixture-of-experts layers: their auxiliary losses join the loss, their metrics the logs
        if sown:
            def as_loss(v):  # a summed loss (with a weight) sums its means weight times
                return v if weight is None else v * weight

            layer_values = _layer_values(sown)
            loss = loss + as_loss(layer_values["moe_aux_loss"])
            values.update({k: (as_loss(v), weight) for k, v in layer_values.items()})
        return loss, (new_model_state, weight, values)

    return forward


def _layer_values(sown: Mapping[str, Any]) -> dict[str, jax.Array]:
    """The metrics of what a model's layers sowed in a training call (MoE aux loss, routing)."""
    return {"moe_aux_loss": moe_loss(sown), **moe_metrics(sown)}


def layer_metric_names(model: Any, params: Any, model_state: Any, x: Any) -> tuple[str, ...]:
    """The names of the metrics ``model``'s own layers add to a train step's; nothing runs.

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxdist as jd
        >>> from jaxdist.training.step._models import LinenModel
        >>> model = LinenModel(jd.nn.MoE(num_experts=2, top_k=1, hidden_dim=4))
        >>> params, state = model.init(jax.random.key(0), jnp.ones((2, 3, 4)))
        >>> sorted(layer_metric_names(model, params, state, jnp.ones((2, 3, 4))))
        ['moe_aux_loss', 'moe_dropped_fraction', 'moe_load_balance', 'moe_max_load']
    """
    if not hasattr(model, "apply_train"):
        return ()
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jax.dtypes.result_type(a)),
                          (params, model_state, x))
    # the key made inside the trace: an eager one would compile its seeding under the caller's mesh
    sown = jax.eval_shape(lambda p, s, xb: model.apply_train(p, s, xb, jax.random.key(0))[2],
                          *shapes)
    if not sown:
        return ()
    return tuple(jax.eval_shape(_layer_values, sown))


def make_summed_train_step(model: Any, optimizer: optax.GradientTransformation,
                           loss_fn: Callable[[Any, Any], Any],
                           metrics: Mapping[str, Callable[[Any, Any], Any]] | None = None,
                           grad_accum_steps: int = 1, compute_dtype: Any = None,
                           skip_non_finite: bool = False, ema_decay: float | None = None,
                           ) -> Callable[[TrainState, Any], tuple[TrainState, dict, dict]]:
    """The train step ``(state, batch) -> (state, metrics, addends)`` behind `make_train_step`.

    ``addends`` is this step's `RunningSums` (`RunningSums.of_step`), which the compiled step adds
    to the running sums: each scalar metric's mean (weight 1), a token-weighted one's sum and weight
    (so sums over steps divide once), the step's non-finite record
    (`jaxdist.training.step._non_finite.step_flag`), and the learning rate when the optimizer
    exposes it. Arguments as for `make_train_step`, and ``skip_non_finite``: a step whose flag is
    set keeps the parameters, optimizer and model state it was given (optax's ``apply_if_finite``;
    the step counter moves on), and ``ema_decay``: ``TrainState.ema`` moves towards the new
    parameters (`jaxdist.training.step._ema.ema_update`), except in a skipped step.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
        >>> from jaxdist.training.step._models import LinenModel
        >>> model, opt = LinenModel(nn.Dense(1)), optax.sgd(0.1)
        >>> params, ms = model.init(jax.random.key(0), jnp.ones((1, 2)))
        >>> state = TrainState(jnp.int32(0), params, opt.init(params), ms, jax.random.key(1))
        >>> mask = jnp.array([1.0, 1.0, 1.0, 0.0])  # the last row is padding
        >>> step = make_summed_train_step(model, opt,
        ...                               lambda out, y: (((out[:, 0] * 0 + 2.0) * mask).sum(),
        ...                                               mask.sum()))
        >>> state, m, addends = step(state, (jnp.ones((4, 2)), jnp.zeros(4)))
        >>> float(m["loss"]), addends.averages["loss"], int(addends.non_finite.count)
        (2.0, Average(total=Array(6., dtype=float32), weight=Array(3., dtype=float32)), 0)
    """
    metrics = dict(metrics or {})
    forward = _forward(model, loss_fn, metrics, compute_dtype)
    grad_fn = jax.value_and_grad(forward, has_aux=True)

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict, dict]:
        x, y = split_batch(batch)
        rng = step_key(state)
        if grad_accum_steps == 1:
            (loss, (model_state, weight, values)), grads = grad_fn(state.params, state.model_state,
                                                                   x, y, rng)
            loss = jnp.asarray(loss, jnp.float32)
        else:
            def micro(carry, inputs):
                grads_sum, loss_sum, weight_sum, values_sum, model_state = carry
                j, xj, yj = inputs
                (loss, (model_state, weight, values)), grads = grad_fn(
                    state.params, model_state, xj, yj, jax.random.fold_in(rng, j))
                add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
                weight_sum = None if weight is None else weight_sum + weight
                return (add(grads_sum, grads), loss_sum + loss.astype(jnp.float32), weight_sum,
                        add(values_sum, values), model_state), None

            # The carry's structure (which values are weighted) is the forward's, read unrun.
            _, (_, weight0, values0) = jax.eval_shape(
                forward, state.params, state.model_state, *_first_micro(x, y, grad_accum_steps),
                rng)
            zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
            with jax.named_scope(ACCUMULATION_SCOPE):
                (grads, loss, weight, values, model_state), _ = jax.lax.scan(
                    micro,
                    (jax.tree.map(jnp.zeros_like, state.params), jnp.zeros((), jnp.float32),
                     zeros(weight0), zeros(values0), state.model_state),
                    (jnp.arange(grad_accum_steps), _micro_batches(x, grad_accum_steps),
                     _micro_batches(y, grad_accum_steps)),
                )
            scale = 1.0 / grad_accum_steps  # scalar means of equal-sized micro-batches: averaged
            values = {k: (v if w is not None else v * scale, w) for k, (v, w) in values.items()}
            if weight is None:
                loss, grads = loss * scale, jax.tree.map(lambda g: g * scale, grads)
        # gradients of the SUM: divide once by the whole step's weight (0 weight: zero gradient)
        if weight is not None:
            inverse = jnp.where(weight > 0, 1.0 / jnp.where(weight > 0, weight, 1.0), 0.0)
            grads = jax.tree.map(lambda g: g * inverse.astype(g.dtype), grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # the whole step's: summed loss, accumulated gradients
        flag = non_finite.step_flag(loss, grads)
        ema = state.ema if ema_decay is None else ema_update(ema_decay, state.ema, params)
        if skip_non_finite:  # a skipped step moves nothing, the average included
            params, opt_state, model_state, ema = non_finite.keep_if_finite(
                flag, (params, opt_state, model_state, ema),
                (state.params, state.opt_state, state.model_state, state.ema))
        out, summed = {}, {}
        for name, (value, w) in {"loss": (loss, weight), **values}.items():
            out[name] = value if w is None else weighted.mean(value, w)
            summed[name] = (value, w)
        hyper, lr = _hyperparams(opt_state), None
        if hyper is not None:
            out["learning_rate"] = lr = jnp.asarray(hyper["learning_rate"], jnp.float32)
        addends = RunningSums.of_step(summed, flag, lr)
        return TrainState(state.step + 1, params, opt_state, model_state, state.rng,
                          ema), out, addends

    return train_step


def _first_micro(x: Any, y: Any, k: int) -> tuple[Any, Any]:
    """Shapes of micro-batch 0 (for `jax.eval_shape`)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // k, *a.shape[1:]), a.dtype),
                        (x, y))


def make_train_step(model: Any, optimizer: optax.GradientTransformation,
                    loss_fn: Callable[[Any, Any], Any],
                    metrics: Mapping[str, Callable[[Any, Any], Any]] | None = None,
                    grad_accum_steps: int = 1, compute_dtype: Any = None,
                    ) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    """The single-device train step ``(state, batch) -> (state, metrics)``.

    Args:
        model: a `LinenModel` / `NnxModel` adapter.
        optimizer: the optax transformation (clipping already chained in).
        loss_fn: ``loss_fn(outputs, targets)`` returning the mean over the batch, or a pair ``(sum,
            weight)`` (e.g. the summed loss over real tokens and their count; see
            `jaxdist.training.step._weighted`).
        metrics: extra ``name -> fn(outputs, targets)``, each a batch mean or a ``(sum, weight)``.
        grad_accum_steps: micro-batches per optimizer step (1: none).
        compute_dtype: e.g. ``jnp.bfloat16`` for mixed precision; None computes in the parameters'
            dtype.

    Returns:
        The step; its metrics dict holds ``"loss"``, each metric (means: a pair's sum over its
        weight) and, for optimizers built with `optax.inject_hyperparams`, ``"learning_rate"``.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
        >>> from jaxdist.training.step._models import LinenModel
        >>> model, opt = LinenModel(nn.Dense(1)), optax.sgd(0.1)
        >>> params, ms = model.init(jax.random.key(0), jnp.ones((1, 2)))
        >>> state = TrainState(jnp.int32(0), params, opt.init(params), ms, jax.random.key(1))
        >>> step = make_train_step(model, opt, lambda out, y: jnp.mean((out[:, 0] - y) ** 2))
        >>> state, m = step(state, (jnp.ones((4, 2)), jnp.zeros(4)))
        >>> int(state.step), sorted(m)
        (1, ['loss'])
    """
    summed = make_summed_train_step(model, optimizer, loss_fn, metrics, grad_accum_steps,
                                    compute_dtype)

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        state, metrics, _ = summed(state, batch)
        return state, metrics

    return train_step


def zero_sums(metrics: Iterable[str], opt_state: Any,
              weighted_names: Collection[str] = ()) -> RunningSums:
    """The running sums of no train steps (`RunningSums.zeros`): ``"loss"`` and each of ``metrics``,
    the ``weighted_names`` token-weighted, and a learning rate when ``opt_state`` has one (nothing
    runs).

    Examples:
        >>> import optax, jax.numpy as jnp
        >>> opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> sums = zero_sums(["accuracy"], opt.init({"w": jnp.ones(2)}), weighted_names={"loss"})
        >>> sums.names, sums.token_weighted, sums.learning_rate is not None
        (('loss', 'accuracy'), ('loss',), True)
    """
    return RunningSums.zeros(("loss", *metrics), weighted_names,
                             learning_rate=_hyperparams(opt_state) is not None)


def make_loop_step(train_step: Callable[[TrainState, Any], tuple], like: PackedSums) -> Callable:
    """The body of an on-device loop of train steps, for ``strategy.run_steps_on_dataset``.

    ``loop_step(ctx, (state, values, i, sums), x, y) -> (state, values, i + 1, sums)`` runs
    ``train_step`` on ``(x, y)``, writes each of its metrics into row ``i`` of ``values`` (``{name:
    float32 array (n,)}``; ``i`` starts at 0) and adds the step to ``sums`` (the vector of a
    `PackedSums` structured as ``like``). ``train_step`` returns
    ``(state, metrics)`` (each metric a scalar mean), or ``(state, metrics, addends)``
    (`make_summed_train_step`) whose addends go to the sums.

    Examples:
        >>> import numpy as np, jax.numpy as jnp, jaxdist as jd
        >>> def train_step(w, batch):
        ...     return w + 1.0, {"loss": batch[0].mean()}
        >>> batches = iter([(np.full((2, 1), i, np.float32), np.zeros(2, np.float32))
        ...                 for i in range(3)])
        >>> like = RunningSums.zeros(["loss"]).pack()
        >>> start = (jnp.float32(0.0), {"loss": np.zeros(3, np.float32)}, np.int32(0), like.vector)
        >>> ctx = jd.OneDeviceStrategy().run_steps_on_dataset(
        ...     make_loop_step(train_step, like), batches, iterations=3, initial_loop_values=start)
        >>> state, values, _, sums = ctx.loop_values
        >>> sums = like.holding(sums).to_host()
        >>> float(state), values["loss"].tolist(), sums.mean("loss"), int(sums.steps)
        (3.0, [0.0, 1.0, 2.0], 1.0, 3)
    """

    def loop_step(ctx, carry, x, y):
        del ctx
        state, values, i, sums = carry
        state, metrics, *addends = train_step(state, (x, y))
        values = {k: v.at[i].set(metrics[k].astype(v.dtype)) for k, v in values.items()}
        step = (addends[0] if addends
                else RunningSums.of_step({k: (v, None) for k, v in metrics.items()}))
        return state, values, i + 1, like.holding(sums).unpack().then(step).pack().vector

    return loop_step


def _per_example(fn: Callable, out: Any, y: Any) -> Any:
    """``fn`` on every row as a batch of one (per-example values, so padding rows can be masked)."""
    one = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731
    return jax.vmap(lambda o, t: fn(one(o), one(t)))(out, y)


def make_eval_step(model: Any, loss_fn: Callable, metrics: Mapping[str, Callable] | None = None,
                   compute_dtype: Any = None,
                   ) -> Callable[[TrainState, Any, jax.Array], tuple[dict, dict, jax.Array]]:
    """The evaluation step ``(state, batch, weights) -> (sums, counts, examples)``.

    Each metric is computed per example (padding rows weigh 0 in ``weights``). For a scalar metric
    ``sums[name]`` is the weighted sum of its per-example values and ``counts[name]`` the sum of
    weights; for a token-weighted one (``(sum, weight)``) ``sums[name]`` adds the per-example sums
    and ``counts[name]`` their weights. ``examples`` counts the real rows. The trainer adds them
    over batches and divides once: exact means over every example (or token).

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> from jaxdist.training.step._models import LinenModel
        >>> model = LinenModel(nn.Dense(1))
        >>> params, ms = model.init(jax.random.key(0), jnp.ones((1, 2)))
        >>> state = TrainState(jnp.int32(0), params, (), ms, jax.random.key(1))
        >>> step = make_eval_step(model, lambda out, y: jnp.mean(out[:, 0] * 0 + 1.0))
        >>> sums, counts, n = step(state, (jnp.ones((4, 2)), jnp.zeros(4)),
        ...                        jnp.array([1.0, 1.0, 1.0, 0.0]))
        >>> float(sums["loss"]), float(counts["loss"]), float(n)
        (3.0, 3.0, 3.0)
    """
    fns = {"loss": loss_fn, **dict(metrics or {})}

    def eval_step(state: TrainState, batch: Any,
                  weights: jax.Array) -> tuple[dict, dict, jax.Array]:
        x, y = split_batch(batch)
        out = _predict(model, state, x, compute_dtype)
        sums, counts = {}, {}
        for name, fn in fns.items():
            value = _per_example(fn, out, y)
            if isinstance(value, tuple) and len(value) == 2:  # (sum, weight) per example
                total, weight = value
                sums[name] = jnp.sum(total.astype(jnp.float32) * weights)
                counts[name] = jnp.sum(weight.astype(jnp.float32) * weights)
            else:
                sums[name] = jnp.sum(jnp.asarray(value).astype(jnp.float32) * weights)
                counts[name] = jnp.sum(weights)
        return sums, counts, jnp.sum(weights)

    return eval_step


def make_predict_step(model: Any, compute_dtype: Any = None) -> Callable[[TrainState, Any], Any]:
    """The prediction step ``(state, x) -> outputs`` (evaluation mode; outputs float32 under bf16).

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> from jaxdist.training.step._models import LinenModel
        >>> model = LinenModel(nn.Dense(3))
        >>> params, ms = model.init(jax.random.key(0), jnp.ones((1, 2)))
        >>> make_predict_step(model)(TrainState(jnp.int32(0), params, (), ms, jax.random.key(1)),
        ...                          jnp.ones((5, 2))).shape
        (5, 3)
    """

    def predict_step(state: TrainState, x: Any) -> Any:
        return _predict(model, state, x, compute_dtype)

    return predict_step


def _predict(model: Any, state: TrainState, x: Any, compute_dtype: Any) -> Any:
    out, _ = model.apply(_cast(state.params, compute_dtype), state.model_state,
                         _cast(x, compute_dtype), None, train=False)
    return _cast(out, jnp.float32 if compute_dtype is not None else None)
