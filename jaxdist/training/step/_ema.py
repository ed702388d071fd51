"""Averaged weights: an exponential moving average (EMA) of the parameters, kept on the devices.

``Trainer(..., ema_decay=d)`` keeps ``TrainState.ema``, a copy of the parameters in the strategy's
layout (the parameters' own shardings, leaf for leaf), which the compiled train step updates after
each optimizer step::

    ema = d * ema + (1 - d) * params

starting from the first parameters (a new run's initial ones, or the ones `Trainer.load_state` or a
checkpoint without averaged weights gives). It is part of the step's donated state, so it costs no
transfer, no extra program and no host work per step (also inside ``steps_per_run > 1`` on-device
loops), and it is saved and restored with the checkpoint like the rest of the state. A step that the
non-finite policy skips (``on_non_finite="skip"``) leaves it as it was, as it leaves the parameters.

Precision: the average is computed and kept in the parameters' own dtype (``d`` is a weakly typed
Python float), so float32 parameters (the Trainer's, also under ``compute_dtype=jnp.bfloat16``) give
a float32 average. Each update moves the average by ``(1 - d) * (params - ema)``; in bfloat16
parameters with ``d`` close to 1 that difference rounds away (bfloat16 keeps 8 bits), so keep
float32 parameters for averaged weights. Integer leaves are not averaged: their average is the
current value.

Checkpoints: a state is restored whether or not the checkpoint holds what the trainer keeps
(`restore_state`). A checkpoint holds ``TrainState.ema`` exactly when the run that wrote it kept
averaged weights (``Trainer(ema_decay=...)``). Restoring reads what both sides have:

* the checkpoint has averaged weights, the trainer keeps them: restored as they are (a resumed run's
  average is the uninterrupted run's, bit for bit);
* the checkpoint has none (a run without ``ema_decay``, or an older one), the trainer keeps them:
  the state is restored without them and the average starts again from the restored parameters (what
  a new run does with its first parameters), with a warning saying so;
* the checkpoint has them, the trainer keeps none: the parameters are restored and the average is
  left out.
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
    in its own dtype; other leaves (integers) take the current value.

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
    """A copy of ``params`` in their own shardings (new buffers: the step donates both trees);
    abstract arrays stay abstract (a plan or a restore target)."""
    leaves = jax.tree.leaves(params)
    if all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
        return params
    shardings = jax.tree.map(lambda a: a.sharding, params)
    with jax.set_mesh(None):  # the arrays' own shardings decide (a strategy's scope may be open)
        return jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=shardings)(params)


def with_ema(state: Any, decay: float | None) -> Any:
    """``state`` (a `TrainState`, or its abstract twin) with averaged weights when ``decay`` is set:
    its own average, or a new one started from its parameters (same shardings); without ``decay``,
    none.

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


def averaged(
    state_for: Callable[[Any], Any], decay: float | None, where: str
) -> Callable[[Any], Any]:
    """``state_for`` whose states carry the averaged weights as their parameters (for evaluation,
    prediction).

    The state keeps its structure and shardings (``params`` and ``ema`` swap roles only), so
    evaluating with the average runs the program that evaluates the parameters.

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
    """Whether the checkpoint whose metadata is ``meta`` holds averaged weights (leaves under
    ``.ema``).

    Examples:
        >>> has_ema({"fingerprint": [[".params['w']", [2], "float32"],
        ...                          [".ema['w']", [2], "float32"]]})
        True
    """
    return any(entry[0].startswith(".ema") for entry in meta.get("fingerprint", ()))


def restore_state(ckpt: Any, like: Any, step: int) -> tuple[Any, dict]:
    """Checkpoint ``step`` read into ``like`` (a `TrainState`, live or abstract), averaged weights
    or not.

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
        warnings.warn(
            f"checkpoint step {step} of {ckpt.directory!r} has no averaged weights (the run that "
            "wrote it had no "
            "ema_decay): the average starts again from its parameters.", UserWarning, stacklevel=4)
        return state, meta
    # the average's leaves are the params'
    state, meta = ckpt.restore(like._replace(ema=like.params), step)
    return state._replace(ema=None), meta
