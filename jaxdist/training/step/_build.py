"""Building the trainer's state: the initial `TrainState` from a sample batch, its abstract twin,
loss checks.

``Trainer.init`` runs `state_builder`'s function under ``strategy.create_variables`` (born in the
strategy's layout, no host copy); a restore into a trainer that has no state yet reads into
`restore_target`'s abstract arrays instead (nothing computed or allocated twice). Both check
``loss_fn`` and the metrics on the sample's shapes first (`check_losses`), before anything compiles.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdist.replicate.trees import abstract
from jaxdist.strategies import Strategy
from jaxdist.strategies.layout import untyped
from jaxdist.training.step._functions import TrainState
from jaxdist.training.step._weighted import check_value

__all__ = ["check_losses", "params_target", "restore_target", "state_builder", "state_keys"]


def state_keys(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(init key, base key data)`` of a trainer seeded with ``key``: the key ``model.init`` gets,
    and ``TrainState.rng`` as raw key data (cheaper to pass into every compiled step than a typed
    key). One rule for a built state and a loaded one.

    Examples:
        >>> import jax
        >>> init_key, rng = state_keys(jax.random.key(0))
        >>> rng.dtype, rng.shape
        (dtype('uint32'), (2,))
    """
    init_rng, step_rng = jax.random.split(key)
    return init_rng, jax.random.key_data(step_rng)


def state_builder(model: Any, optimizer: optax.GradientTransformation, seed: int,
                  x: Any) -> tuple[Callable, tuple]:
    """``(build, args)``: ``build(*args)`` returns the initial `TrainState` for inputs like ``x``.

    Args:
        model: the `LinenModel` / `NnxModel` adapter.
        optimizer: the optax transformation.
        seed: seeds ``model.init`` (linen) and the state's base key.
        x: a sample of the inputs (only the first row's shape and dtype are used).

    Returns:
        The pure function and its arguments (the key, a one-row sample, the model's variables).

    Examples:
        >>> import jax, numpy as np, optax, flax.linen as nn
        >>> from jaxdist.training.step._models import LinenModel
        >>> build, args = state_builder(LinenModel(nn.Dense(2)), optax.sgd(0.1), 0,
        ...                             np.ones((8, 3), np.float32))
        >>> jax.eval_shape(build, *args).params["kernel"].shape
        (3, 2)
    """
    sample = jax.tree.map(lambda a: np.asarray(a)[:1], x)

    def build(rng, x_sample, given):
        init_rng, step_rng = state_keys(rng)
        params, model_state = model.init(init_rng, x_sample, given)
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), model_state,
                          step_rng)

    return build, (jax.random.key(seed), sample, getattr(model, "initial_variables", None))


def restore_target(strategy: Strategy, build: Callable, args: tuple) -> Any:
    """The state ``build(*args)`` would make, as abstract arrays in ``strategy``'s variable layout.

    Examples:
        >>> import numpy as np, optax, flax.linen as nn, jaxdist as jd
        >>> from jaxdist.training.step._models import LinenModel
        >>> build, args = state_builder(LinenModel(nn.Dense(2)), optax.sgd(0.1), 0,
        ...                             np.ones((8, 3), np.float32))
        >>> restore_target(jd.OneDeviceStrategy(), build, args).params["kernel"].shape
        (3, 2)
    """
    return _laid_out(strategy, build, *untyped(args))


def _laid_out(strategy: Strategy, build: Callable, *args: Any) -> Any:
    with strategy.policy.shape_scope():
        shapes = jax.eval_shape(build, *args)
    layouts = strategy.variable_shardings(shapes)  # the layout create_variables would use
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                        layouts)


def params_target(strategy: Strategy, optimizer: optax.GradientTransformation, params: Any,
                  model_state: Any) -> Any:
    """The state a run with ``params`` (and ``model_state``, or none) has, as abstract arrays in
    ``strategy``'s variable layout, no model needed: what `Trainer.load_state` checks the pieces
    against before a linen model's first batch (the model's check follows at that batch).

    Examples:
        >>> import numpy as np, optax, jaxdist as jd
        >>> like = params_target(jd.OneDeviceStrategy(), optax.adam(1e-3), {"w": np.ones((3, 2))},
        ...                      None)
        >>> like.opt_state[0].mu["w"].shape, like.step.dtype
        ((3, 2), dtype('int32'))
    """
    def build(rng):
        _, step_rng = state_keys(rng)
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                          model_state or {}, step_rng)

    params, model_state = abstract(params), abstract(model_state)
    key = jax.random.key(0)  # outside the scope: its seeding compiled once, as everywhere else
    return _laid_out(strategy, build, key)


def check_losses(model: Any, loss_fn: Callable, metrics: Mapping[str, Callable], state: TrainState,
                 x: Any, y: Any) -> frozenset[str]:
    """Check that ``loss_fn`` and each metric return a scalar mean or a ``(sum, weight)`` pair on
    the model's outputs for ``(x, y)``; return the names that return pairs.

    Args:
        model: the adapter.
        loss_fn: ``loss_fn(outputs, targets)``: a float scalar or a (float sum, numeric weight).
        metrics: ``{name: fn(outputs, targets)}``; each must return a numeric scalar or such a pair.
        state: the state (or its abstract shapes, from ``jax.eval_shape``).
        x / y: a batch's inputs and targets (only shapes and dtypes are used; nothing runs).

    Returns:
        The token-weighted names (see `jaxdist.training.step._weighted`).

    Raises:
        ValueError: for anything else, naming the function, what it returned and the fix.

    Examples:
        >>> import jax, numpy as np, optax, flax.linen as nn
        >>> from jaxdist.training.step._models import LinenModel
        >>> model = LinenModel(nn.Dense(2))
        >>> build, args = state_builder(model, optax.sgd(0.1), 0, np.ones((8, 3), np.float32))
        >>> x, y = np.ones((8, 3), np.float32), np.ones(8, np.float32)
        >>> sorted(check_losses(model, lambda out, y: (out.sum(), y.sum()), {},
        ...                     jax.eval_shape(build, *args), x, y))
        ['loss']
        >>> try:  # a per-example loss, not its mean
        ...     check_losses(model, lambda out, y: (out.sum(-1) - y) ** 2, {},
        ...                  jax.eval_shape(build, *args), x, y)
        ... except ValueError as error:
        ...     print(str(error).split(";")[0])
        loss_fn returned shape (8,) float32 for a batch of 8 rows
    """

    def outputs(s, xb):
        return model.apply(s.params, s.model_state, xb, None, train=False)[0]

    out = jax.eval_shape(outputs, state, abstract(x))
    y_abs = abstract(y)
    rows = jax.tree.leaves(y_abs)[0].shape[0]
    pairs = set()
    for key, name, fn in [("loss", "loss_fn", loss_fn),
                          *((k, f"metrics[{k!r}]", f) for k, f in metrics.items())]:
        _check_call_shape(name, fn)
        try:
            value = jax.eval_shape(fn, out, y_abs)
        except Exception as e:
            # the user's function failed on (outputs, targets): say what it is given
            message = (f"{name}(outputs, targets) failed on the first batch: {_CALL_SHAPE}. It "
                       f"raised {e!r}")
            try:
                again = type(e)(message)  # the same kind of error, with the call shape said
            except Exception:
                again = TypeError(message)
            raise again from e
        if check_value(name, value, rows):
            pairs.add(key)
    return frozenset(pairs)


_CALL_SHAPE = ("the Trainer calls loss_fn(outputs, targets) and each metric(outputs, targets), "
               "where outputs = the model applied to the batch's inputs and targets = its targets "
               "(batch[1], or batch[target_key]). A loss written as loss_fn(model, batch) (the "
               "nnx tutorials' form) becomes, e.g., loss_fn=lambda logits, labels: "
               "optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()")


def _check_call_shape(name: str, fn: Callable) -> None:
    """Refuse, by its signature, a function that cannot be called as ``fn(outputs, targets)`` or
    whose parameters are named as the nnx tutorials' ``loss_fn(model, batch)``."""
    if not callable(fn):
        raise TypeError(f"{name}={fn!r} is not callable: {_CALL_SHAPE}.")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: its call tells
        return
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    required = [p for p in params
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if ((len(names) < 2 and not varargs) or len(required) > 2
            or (names[:1] == ["model"] or names[1:2] == ["batch"])):
        raise TypeError(f"{name} has the parameters ({', '.join(p.name for p in params)}): "
                        f"{_CALL_SHAPE}.")
