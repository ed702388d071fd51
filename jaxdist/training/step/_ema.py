"""Averaged weights: an exponential moving average (EMA) of the parameters, kept on the devices.

``Trainer(..., ema_decay=d)`` keeps ``TrainState.ema``, a copy of the parameters in the strategy's
layout (the parameters' own shardings, leaf for leaf), which the compiled train step updates after
each optimizer step::

    ema = d * ema + (1 - d) * params

starting from the first parameters. It is part of the step's donated state, so it costs no
transfer, no extra program and no host work per step, and it is saved and restored with the
checkpoint like the rest of the state (`restore_state`). A step that the non-finite policy skips
leaves it as it was, as it leaves the parameters.

Precision: the average is kept in the parameters' own dtype (``d`` is a weakly typed Python float).
Each update moves it by ``(1 - d) * (params - ema)``, which rounds away in bfloat16 parameters with
``d`` close to 1, so keep float32 parameters (the Trainer's, also under ``compute_dtype``) for
averaged weights. Integer leaves are not averaged: their average is the current value.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["averaged", "check_ema_decay", "ema_update", "has_ema", "restore_state", "with_ema"]


def check_ema_decay(ema_decay: Any) -> float | None:
    """``ema_decay`` as a float in [0, 1), or None (no averaged weights).

    Args:
        ema_decay: the decay the Trainer was given.

    Returns:
        The decay as a Python float, or None.

    Raises:
        ValueError: for a bool, a non-number, NaN, or a number outside [0, 1).

    Examples:
        >>> check_ema_decay(0.999), check_ema_decay(None)
        (0.999, None)
        >>> try:
        ...     check_ema_decay(1.0)
        ... except ValueError as error:
        ...     print(str(error).split(":")[0])
        ema_decay=1.0 must be a number in [0, 1)
    """
    if ema_decay is None:
        return None
    number = isinstance(ema_decay, (int, float)) and not isinstance(ema_decay, bool)
    if not number or not math.isfinite(ema_decay) or not 0 <= ema_decay < 1:
        raise ValueError(f"ema_decay={ema_decay!r} must be a number in [0, 1): the weight of the "
                         "old average in each update (ema = ema_decay * ema + (1 - ema_decay) * "
                         "params), e.g. ema_decay=0.999 (an average over about 1000 steps); None "
                         "(the default) keeps no averaged weights.")
    return float(ema_decay)


def ema_update(decay: float, ema: Any, params: Any) -> Any:
    """The average after one step: ``decay * ema + (1 - decay) * params`` for every floating leaf,
    in its own dtype; integer leaves take the current value.

    Examples:
        >>> import jax.numpy as jnp
        >>> ema_update(0.5, {"w": jnp.zeros(2)}, {"w": jnp.ones(2)})["w"].tolist()
        [0.5, 0.5]
    """

    def one(e: jax.Array, p: jax.Array) -> jax.Array:
        if not jnp.issubdtype(p.dtype, jnp.inexact):
            return p
        return (decay * e + (1 - decay) * p).astype(p.dtype)

    return jax.tree.map(one, ema, params)


def _copy(params: Any) -> Any:
    """A copy of ``params`` in their own shardings (the step donates both); abstract ones as is."""
    leaves = jax.tree.leaves(params)
    if all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
        return params
    shardings = jax.tree.map(lambda a: a.sharding, params)
    with jax.set_mesh(None):  # the arrays' own shardings decide (a strategy's scope may be open)
        return jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=shardings)(params)


def with_ema(state: Any, decay: float | None) -> Any:
    """``state`` (a `TrainState`, or its abstract twin) with averaged weights when ``decay`` is set
    (its own, or new ones from its parameters); without ``decay``, none.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jaxdist.training.step._functions import TrainState
        >>> state = with_ema(TrainState(jnp.int32(0), {"w": jnp.ones(2)}, (), {}, None), 0.9)
        >>> state.ema["w"].tolist(), with_ema(state, None).ema
        ([1.0, 1.0], None)
    """
    if decay is None:
        return state if state.ema is None else state._replace(ema=None)
    if state.ema is not None:
        return state
    return state._replace(ema=_copy(state.params))


def averaged(state_for: Callable[[Any], Any], decay: float | None,
             where: str) -> Callable[[Any], Any]:
    """``state_for`` whose states carry the averaged weights as their parameters (for evaluation,
    prediction). ``params`` and ``ema`` swap roles only, so the program that evaluates the
    parameters runs unchanged.

    Args:
        state_for: ``batch -> TrainState``.
        decay: the Trainer's ``ema_decay``.
        where: the call, for the error (``"evaluate(ema=True)"``).

    Raises:
        ValueError: when ``decay`` is None (the Trainer keeps no average).

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxdist.training.step._functions import TrainState
        >>> state = with_ema(TrainState(jnp.int32(0), {"w": jnp.ones(2)}, (), {}, None), 0.9)
        >>> averaged(lambda batch: state, 0.9, "evaluate(ema=True)")(None).params["w"].tolist()
        [1.0, 1.0]
    """
    if decay is None:
        raise ValueError(f"{where} needs averaged weights, but this Trainer keeps none "
                         "(ema_decay=None): build it with Trainer(..., ema_decay=0.999) (or "
                         "another decay in [0, 1)), or call it with ema=False.")

    def state_with_average(batch: Any) -> Any:
        state = state_for(batch)
        return state._replace(params=state.ema, ema=state.params)

    return state_with_average


def has_ema(meta: dict) -> bool:
    """Whether the checkpoint with metadata ``meta`` holds averaged weights (leaves under ``.ema``).

    Examples:
        >>> has_ema({"fingerprint": [[".params['w']", [2], "float32"],
        ...                          [".ema['w']", [2], "float32"]]})
        True
    """
    return any(entry[0].startswith(".ema") for entry in meta.get("fingerprint", ()))


def restore_state(ckpt: Any, like: Any, step: int) -> tuple[Any, dict]:
    """Checkpoint ``step`` read into ``like`` (a `TrainState`, live or abstract), averaged weights
    or not: both sides' restored as they are (bit for bit); only the trainer's, the state without
    them and a warning (the average starts again from the parameters); only the checkpoint's, left
    out.

    Args:
        ckpt: the open `jaxdist.training.Checkpointer`.
        like: the state to restore into (``like.ema`` None: the trainer keeps no averaged weights).
        step: which checkpoint.

    Returns:
        ``(state, meta)`` as `Checkpointer.restore`; ``state.ema`` is None when the checkpoint has
        no averaged weights or ``like`` has none (`jaxdist.training.step.with_ema` starts them from
        the parameters).

    Raises:
        What `Checkpointer.restore` raises.

    Warns:
        UserWarning: when ``like`` keeps averaged weights and the checkpoint has none.

    Examples:
        >>> import tempfile, jax.numpy as jnp
        >>> from jaxdist.training import Checkpointer, TrainState
        >>> state = TrainState(jnp.int32(3), {"w": jnp.ones(2)}, (), {}, jnp.zeros(2, jnp.uint32),
        ...                    ema={"w": jnp.zeros(2)})
        >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
        ...     _ = ckpt.save(3, state)
        ...     restored, meta = restore_state(ckpt, state._replace(ema=None), 3)
        >>> restored.params["w"].tolist(), restored.ema
        ([1.0, 1.0], None)
    """
    saved = has_ema(ckpt.meta(step))
    wanted = like.ema is not None
    if saved == wanted:
        return ckpt.restore(like, step)
    if wanted:
        state, meta = ckpt.restore(like._replace(ema=None), step)
        warnings.warn(f"checkpoint step {step} of {ckpt.directory!r} has no averaged weights (the "
                      "run that wrote it had no ema_decay): the average starts again from its "
                      "parameters.", UserWarning, stacklevel=4)
        return state, meta
    # the average's leaves are the params'
    state, meta = ckpt.restore(like._replace(ema=like.params), step)
    return state._replace(ema=None), meta
