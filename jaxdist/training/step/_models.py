"""Model adapters: one functional interface over Flax linen and Flax nnx modules.

The trainer never calls a model directly. It asks an adapter for the initial ``(params,
model_state)`` and for ``apply(params, model_state, x, rng, train) -> (outputs, new_model_state)``,
a pure function it can differentiate, compile, scan over micro-batches and cast to bf16.
``params`` are what the optimizer updates; ``model_state`` is everything else a model carries
between steps. Both are plain nested dicts of arrays, so checkpoints are readable without the
model's classes. Partitioning annotations ride along (linen's boxes, nnx's annotated Variables), so
the strategy lays out the parameters, and the optimizer state built from them, as annotated.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import flax.linen as nn
import flax.traverse_util
import jax

import jaxdist.nn
from jaxdist.nn.moe import SOWN
from jaxdist.replicate.trees import flax_nnx
from jaxdist.strategies.layout import annotation, is_variable, unboxed

__all__ = ["LinenModel", "NnxModel", "as_model", "model_kind"]


def model_kind(model: Any) -> str:
    """``"linen"`` or ``"nnx"``: which Flax API ``model`` belongs to.

    Args:
        model: a Flax module instance.

    Returns:
        ``"linen"`` for a `flax.linen.Module`, ``"nnx"`` for a `flax.nnx.Module`.

    Raises:
        TypeError: for a module class instead of an instance, or anything that is not a Flax module.

    Examples:
        >>> import flax.linen as nn
        >>> model_kind(nn.Dense(3))
        'linen'
    """
    if isinstance(model, nn.Module):
        return "linen"
    nnx = flax_nnx()  # an nnx module exists only once nnx is imported
    if nnx is not None and isinstance(model, nnx.Module):
        return "nnx"
    if inspect.isclass(model) and issubclass(model, nn.Module):
        raise TypeError(f"model={model.__name__} is a linen module class, not an instance: pass "
                        f"{model.__name__}(...).")
    if nnx is not None and inspect.isclass(model) and issubclass(model, nnx.Module):
        raise TypeError(f"model={model.__name__} is an nnx module class, not an instance: pass "
                        f"{model.__name__}(..., rngs=nnx.Rngs(0)).")
    raise TypeError(f"model={model!r} (type {type(model).__name__}) is not a Flax module: pass a "
                    "flax.linen.Module instance (e.g. nn.Dense(10)) or a flax.nnx.Module instance "
                    "(e.g. nnx.Linear(4, 10, rngs=nnx.Rngs(0))).")


@dataclasses.dataclass(frozen=True)
class LinenModel:
    """A linen module seen as ``init`` / ``apply`` over ``(params, model_state)``.

    Args:
        module: the `flax.linen.Module` instance.
        variables: existing variables (``{"params": ..., "batch_stats": ...}``) to start from
            instead of ``module.init`` (e.g. pretrained weights), or None.
        train_kwargs: keyword arguments for ``module.apply`` in training (e.g. ``{"train": True}``).
        eval_kwargs: keyword arguments for ``init``, evaluation and prediction.
        rng_streams: rng names passed to ``apply`` in training, each a fresh key per step (dropout).

    Raises:
        TypeError: when ``module`` is not a linen module instance (an nnx module names the fix).
        ValueError: for ``variables`` without a ``"params"`` collection.

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> m = LinenModel(nn.Dense(2))
        >>> params, state = m.init(jax.random.key(0), jnp.ones((1, 3)))
        >>> m.apply(params, state, jnp.ones((4, 3)), None, train=False)[0].shape
        (4, 2)
    """

    module: Any
    variables: Any = None
    train_kwargs: dict = dataclasses.field(default_factory=dict)
    eval_kwargs: dict = dataclasses.field(default_factory=dict)
    rng_streams: tuple[str, ...] = ("dropout",)

    kind = "linen"

    def __post_init__(self) -> None:
        if model_kind(self.module) != "linen":
            raise TypeError(f"model={type(self.module).__name__} is an nnx module where a linen "
                            "module is expected: pass it to Trainer directly (nnx modules are "
                            "detected), or use NnxModel(module).")
        if self.variables is not None and "params" not in self.variables:
            raise ValueError(f"variables has collections {sorted(self.variables)} but no "
                             "'params': pass what module.init(...) returned.")

    @property
    def initial_variables(self) -> Any:
        """The variables to start from (passed back to `init` as ``given``), or None."""
        return self.variables

    def init(self, rng: jax.Array, x: Any, given: Any = None) -> tuple[dict, dict]:
        """``(params, model_state)``: ``given`` variables if any, else ``module.init`` on ``x``."""
        if given is not None:
            variables = dict(given)
        else:
            keys = jax.random.split(rng, 1 + len(self.rng_streams))
            rngs = {"params": keys[0], **dict(zip(self.rng_streams, keys[1:], strict=True))}
            variables = dict(self.module.init(rngs, x, **self.eval_kwargs))
        params = variables.pop("params")
        for name in SOWN:  # what layers sow per call (jd.nn.MoE's losses and metrics) is no state
            variables.pop(name, None)
        return params, variables

    def apply(self, params: Any, model_state: dict, x: Any, rng: jax.Array | None,
              train: bool) -> tuple[Any, dict]:
        """``(outputs, new_model_state)``; in training, non-param collections are mutable."""
        if train:
            return self.apply_train(params, model_state, x, rng)[:2]
        out = self.module.apply({"params": params, **model_state}, x, **self.eval_kwargs)
        return out, model_state

    def apply_train(self, params: Any, model_state: dict, x: Any,
                    rng: jax.Array | None) -> tuple[Any, dict, dict]:
        """``(outputs, new_model_state, sown)`` in training; ``sown`` holds what the model's layers
        sowed in `jaxdist.nn.moe.SOWN` (the MoE layers' losses and metrics)."""
        rngs = None
        if rng is not None and self.rng_streams:
            keys = jax.random.split(rng, len(self.rng_streams))
            rngs = dict(zip(self.rng_streams, keys, strict=True))
        out, updates = self.module.apply({"params": params, **model_state}, x, rngs=rngs,
                                         mutable=[*model_state, *SOWN], **self.train_kwargs)
        updates = dict(updates)
        sown = {name: updates.pop(name) for name in SOWN if name in updates}
        return out, {**model_state, **updates}, sown

    def sync(self, params: Any, model_state: dict) -> None:
        """Linen modules hold no state: nothing to write back."""
        del params, model_state


def _rngs_parameter(module: Any) -> inspect.Parameter | None:
    """The ``rngs`` parameter of ``module.__call__`` if it can be passed by name, or None."""
    try:
        parameters = inspect.signature(module.__call__).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented __call__: nothing to inspect
        return None
    param = parameters.get("rngs")
    if param is None or param.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                           inspect.Parameter.KEYWORD_ONLY):
        return None
    return param


def _to_pure(state: Any) -> dict:
    """``state`` as nested dicts of arrays, except that a Variable annotated with a layout (what
    ``nnx.with_partitioning`` sets) stays a detached Variable: strategies read its layout from its
    metadata, and the optimizer state built from it carries it too, following its parameter."""
    nnx = flax_nnx()
    pure = nnx.to_pure_dict(state)
    flat = flax.traverse_util.flatten_dict(pure)
    annotated = {tuple(p): v for p, v in nnx.to_flat_state(state) if annotation(v, ()) is not None}
    if not annotated:
        return pure
    for path, v in annotated.items():
        flat[path] = v.replace(flat[path])
    return flax.traverse_util.unflatten_dict(flat)


def _from_pure(template: Any, pure: dict) -> Any:
    state = jax.tree.map(lambda v: v, template)  # a fresh copy: replace_by_pure_dict works in place
    flax_nnx().replace_by_pure_dict(state, jax.tree.map(unboxed, pure, is_leaf=is_variable))
    return state


class NnxModel:
    """An nnx module seen as ``init`` / ``apply`` over ``(params, model_state)``.

    ``params`` are the module's `nnx.Param` variables; ``model_state`` every other variable (batch
    statistics, ``Rngs`` keys and counts), as nested dicts of arrays (annotated Variables kept, see
    `_to_pure`). Training runs the module in ``train()`` mode, evaluation in ``eval()`` mode; the
    user's module keeps its mode and is updated in place by ``sync`` (at the end of ``fit``).

    Call-time keys: a module whose ``__call__`` takes a ``rngs`` parameter (the NNX tutorial's
    ``def __call__(self, x, rngs: nnx.Rngs | None = None)``) gets ``rngs=nnx.Rngs(rng)`` in
    training, from the step's key (a resumed run draws the same masks), so every stream it asks for
    is fresh each step. Evaluation and prediction pass no ``rngs`` (``rngs=None`` when the parameter
    has no default).

    Args:
        module: the `flax.nnx.Module` instance (already initialized: it owns its parameters).

    Raises:
        TypeError: when ``module`` is not an nnx module instance (a linen module names the fix).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> m = NnxModel(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
        >>> params, state = m.init(None, None, m.initial_variables)
        >>> m.apply(params, state, jnp.ones((4, 3)), None, train=False)[0].shape
        (4, 2)
        >>> class Net(nnx.Module):  # takes dropout keys at call time
        ...     def __init__(self, rngs):
        ...         self.linear, self.drop = nnx.Linear(3, 2, rngs=rngs), nnx.Dropout(0.5)
        ...     def __call__(self, x, rngs: nnx.Rngs | None = None):
        ...         return self.drop(self.linear(x), rngs=rngs)
        >>> net = NnxModel(Net(nnx.Rngs(0)))
        >>> net.takes_rngs
        True
        >>> params, state = net.init(None, None, net.initial_variables)
        >>> out, _ = net.apply(params, state, jnp.ones((4, 3)), jax.random.key(1), train=True)
        >>> bool((out == 0).any())  # dropped with the step's key
        True
    """

    kind = "nnx"

    def __init__(self, module: Any):
        if model_kind(module) != "nnx":
            raise TypeError(f"model={type(module).__name__} is a linen module where an nnx module "
                            "is expected: pass it to Trainer directly (linen modules are "
                            "detected), or use LinenModel(module).")
        self.module = module
        self._rngs_param = _rngs_parameter(module)
        nnx = flax_nnx()
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        self._params_template, self._rest_template = params, rest
        self._initial = (_to_pure(params), _to_pure(rest))
        # new module objects over the same arrays: modes set on it
        copy = nnx.merge(graphdef, params, rest)
        copy.train()
        self._train_graphdef = nnx.graphdef(copy)
        copy.eval()
        self._eval_graphdef = nnx.graphdef(copy)

    @property
    def initial_variables(self) -> tuple[dict, dict]:
        """The module's ``(params, model_state)`` when wrapped (given back to `init`)."""
        return self._initial

    def init(self, rng: Any, x: Any, given: Any = None) -> tuple[dict, dict]:
        """``(params, model_state)``: ``given`` (the module's variables); ``rng``, ``x`` unused."""
        del rng, x
        return self._initial if given is None else given

    @property
    def takes_rngs(self) -> bool:
        """Whether the module's ``__call__`` takes ``rngs`` (training passes an ``nnx.Rngs``)."""
        return self._rngs_param is not None

    def apply(self, params: dict, model_state: dict, x: Any, rng: Any,
              train: bool) -> tuple[Any, dict]:
        """``(outputs, new_model_state)``; nnx advances its own ``Rngs`` (in ``model_state``).

        ``rng`` (the step's key) becomes ``rngs=nnx.Rngs(rng)`` for a module that takes call-time
        ``rngs``; in training without a key such a module gets ``rngs=None`` (as in evaluation).
        """
        if train:
            return self.apply_train(params, model_state, x, rng)[:2]
        return self._call(self._eval_graphdef, params, model_state, x, None)[0], model_state

    def apply_train(self, params: dict, model_state: dict, x: Any,
                    rng: Any) -> tuple[Any, dict, dict]:
        """``(outputs, new_model_state, sown)`` in training; ``sown`` holds the losses and metrics
        of the model's `jaxdist.nn.nnx.MoE` layers, as linen's `jaxdist.nn.moe.SOWN` collections."""
        out, module = self._call(self._train_graphdef, params, model_state, x, rng)
        nnx = flax_nnx()
        moe = jaxdist.nn.nnx.MoE  # (attached on first use: nnx is imported by now)
        losses, metrics = {}, {}
        for path, node in nnx.iter_graph(module):
            if isinstance(node, moe):
                name = "/".join(map(str, path)) or "moe"
                losses[name] = node.aux_loss[...]
                metrics[name] = {k: v[...] for k, v in node.stats.items()}
        _, rest = nnx.state(module, nnx.Param, ...)
        sown = {"moe_losses": losses, "moe_metrics": metrics} if losses else {}
        return out, _to_pure(rest), sown

    def _call(self, graphdef: Any, params: dict, model_state: dict, x: Any,
              rng: Any) -> tuple[Any, Any]:
        """``(outputs, module)``: the module merged from ``graphdef`` and state, run on ``x``."""
        nnx = flax_nnx()
        module = nnx.merge(graphdef, *self._variables(params, model_state))
        kwargs = {}
        if self._rngs_param is not None:
            if rng is not None:
                kwargs["rngs"] = nnx.Rngs(rng)
            elif self._rngs_param.default is inspect.Parameter.empty:
                # a required parameter: say "no keys" as the tutorial's eval step does
                kwargs["rngs"] = None
        return module(x, **kwargs), module

    def sync(self, params: dict, model_state: dict) -> None:
        """Write trained values back into the user's module (in place, as nnx code expects)."""
        flax_nnx().update(self.module, *self._variables(params, model_state))

    def _variables(self, params: dict, model_state: dict) -> tuple[Any, Any]:
        return (_from_pure(self._params_template, params),
                _from_pure(self._rest_template, model_state))


def as_model(model: Any, variables: Any = None, **linen_options: Any) -> LinenModel | NnxModel:
    """Wrap a linen or nnx module in its adapter (detected from its type).

    Args:
        model: a `flax.linen.Module` or `flax.nnx.Module` instance, or an adapter (returned as is).
        variables: linen only: variables to start from instead of ``model.init``.
        **linen_options: linen only: `LinenModel`'s ``train_kwargs``, ``eval_kwargs``,
            ``rng_streams``.

    Returns:
        A `LinenModel` or `NnxModel`.

    Raises:
        TypeError: for a module class, a non-module, or linen-only options with an nnx module.
        ValueError: for ``variables`` with an nnx module (nnx modules carry their own variables).

    Examples:
        >>> import flax.linen as nn
        >>> as_model(nn.Dense(2)).kind
        'linen'
    """
    if isinstance(model, (LinenModel, NnxModel)):
        return model
    kind = model_kind(model)
    if kind == "linen":
        return LinenModel(model, variables,
                          **{k: v for k, v in linen_options.items() if v is not None})
    if variables is not None:
        raise ValueError("variables=... was given with an nnx module: nnx modules carry their own "
                         "variables; load weights into the module (nnx.update(model, state)) and "
                         "drop variables=.")
    extra = sorted(k for k, v in linen_options.items() if v is not None)
    if extra:
        raise TypeError(f"{', '.join(extra)} apply to linen modules only; "
                        f"model={type(model).__name__} is an nnx module: set train/eval behaviour "
                        "on the module itself (Dropout(deterministic=...), nnx.Rngs).")
    return NnxModel(model)

