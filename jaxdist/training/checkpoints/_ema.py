"""Checkpoints and averaged weights: a state restored whether or not the checkpoint holds what the trainer keeps.

A checkpoint holds ``TrainState.ema`` exactly when the run that wrote it kept averaged weights
(``Trainer(ema_decay=...)``). Restoring reads what both sides have:

* the checkpoint has averaged weights, the trainer keeps them: restored as they are (a resumed run's average
  is the uninterrupted run's, bit for bit);
* the checkpoint has none (a run without ``ema_decay``, or an older one), the trainer keeps them: the state is
  restored without them and the average starts again from the restored parameters (what a new run does with
  its first parameters), with a warning saying so;
* the checkpoint has them, the trainer keeps none: the parameters are restored and the average is left out.
"""

from __future__ import annotations

import warnings
from typing import Any

from jaxdist.training.checkpoints._checkpointer import Checkpointer

__all__ = ["has_ema", "restore_state"]


def has_ema(meta: dict) -> bool:
    """Whether the checkpoint whose metadata is ``meta`` holds averaged weights (leaves under ``.ema``).

    Examples:
        >>> has_ema({"fingerprint": [[".params['w']", [2], "float32"], [".ema['w']", [2], "float32"]]})
        True
    """
    return any(entry[0].startswith(".ema") for entry in meta.get("fingerprint", ()))


def restore_state(ckpt: Checkpointer, like: Any, step: int) -> tuple[Any, dict]:
    """Checkpoint ``step`` read into ``like`` (a `TrainState`, live or abstract), averaged weights or not.

    Args:
        ckpt: the open checkpointer.
        like: the state to restore into (``like.ema`` None: the trainer keeps no averaged weights).
        step: which checkpoint.

    Returns:
        ``(state, meta)`` as `Checkpointer.restore`; ``state.ema`` is None when the checkpoint has no averaged
        weights or ``like`` has none (`jaxdist.training.step.with_ema` starts them from the parameters).

    Raises:
        What `Checkpointer.restore` raises.

    Warns:
        UserWarning: when ``like`` keeps averaged weights and the checkpoint has none.

    Examples:
        >>> import tempfile, jax.numpy as jnp
        >>> from jaxdist.training.step import TrainState
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
            f"checkpoint step {step} of {ckpt.directory!r} has no averaged weights (the run that wrote it had no "
            "ema_decay): the average starts again from its parameters.", UserWarning, stacklevel=4)
        return state, meta
    state, meta = ckpt.restore(like._replace(ema=like.params), step)  # the average's leaves are the params'
    return state._replace(ema=None), meta
