"""A Trainer's `LiveState` in the local tier (`jaxdist.training.checkpoints._local`): ``fit``'s
local saves, and its resume from the newest step the surviving processes' copies assemble.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from jaxdist.training.checkpoints._live import live_meta
from jaxdist.training.checkpoints._local import LocalCheckpointer, LocalRestore
from jaxdist.training.data import restored_position
from jaxdist.training.step import LiveState, with_ema

__all__ = ["restore_live_local", "save_live_local"]

LOG = logging.getLogger("jaxdist.training.checkpoint")


def save_live_local(live: LiveState, local: LocalCheckpointer) -> None:
    """Save ``live`` as a local step (asynchronously; every process at once)."""
    local.save(live.step, live.state, live_meta(live))


def restore_live_local(live: LiveState, local: LocalCheckpointer, persistent_step: int | None,
                       target: Any) -> LocalRestore:
    """Restore into ``live`` the newest local step every process agrees on, when it is at least as
    new as the persistent tier's ``persistent_step`` (and ahead of ``live``); the decision, which
    process 0 logs.

    Args:
        live: the trainer's state, replaced when the local tier restores.
        local: this process's local tier.
        persistent_step: the persistent tier's newest step (None: none).
        target: the state to restore into (``live.state`` or its abstract layout).
    """
    decision = local.restore(target, persistent_step)
    if decision.step is not None and decision.step > live.step:
        if decision.meta.get("model_kind") != live.model.kind:  # the identity covers it too
            raise ValueError(f"local step {decision.step} in {local.directory!r} holds a "
                             f"{decision.meta.get('model_kind')} model, this Trainer's is "
                             f"{live.model.kind}.")
        live.state = with_ema(decision.state, live.ema_decay)
        live.step = int(decision.meta["step"])
        live.position = restored_position(decision.meta["data_position"], lambda: None)
        live.sync()
    decision = LocalRestore(decision.step, None, decision.meta, decision.sources, decision.reason,
                            persistent_step)
    if jax.process_index() == 0 and (decision.step is not None or local.all_steps()
                                     or persistent_step):
        LOG.warning("%s", decision.message())
    return decision
