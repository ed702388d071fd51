"""A Trainer's state on disk: its `LiveState` (state, step, data position) saved, restored, loaded.

* `save_live` (``Trainer.save``) writes the state, the step, the data position (and a grain source's
  iterator state, one file per process) as one checkpoint, and refuses a state that is not finite
  (`NonFiniteError`).
* `restore_live` (``Trainer.restore``, ``fit``'s resume) reads one back whole or not at all, into
  the trainer's layout; `roll_back` is ``fit(restore_step=)``: that checkpoint restored, the later
  ones abandoned.
* `load_live` (``Trainer.load_state``) places a run trained elsewhere, checked leaf by leaf
  (`checked_pieces`, `assemble`); without a batch, a linen model's parameters are checked at its
  first batch (``LiveState.unchecked``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import jax

from jaxdist.replicate.trees import describe, is_distributed
from jaxdist.training.checkpoints._checkpointer import Checkpointer
from jaxdist.training.checkpoints._load import assemble, checked_pieces
from jaxdist.training.data import (
    DataPosition,
    IteratorSnapshot,
    UnrestorableState,
    global_rows,
    restored_position,
)
from jaxdist.training.step import (
    LiveState,
    NonFiniteError,
    TrainState,
    abstract_state,
    check_int,
    non_finite_leaves,
    params_target,
    restore_state,
    with_ema,
)

__all__ = ["load_live", "restore_live", "roll_back", "save_live"]

Directory = str | os.PathLike | Checkpointer


@contextlib.contextmanager
def _opened(checkpoint_dir: Directory, max_to_keep: int | None) -> Iterator[Checkpointer]:
    """An open `Checkpointer` given (left open), or one opened on a directory for the block."""
    if isinstance(checkpoint_dir, Checkpointer):
        yield checkpoint_dir
        return
    ckpt = Checkpointer(checkpoint_dir, max_to_keep)
    try:
        yield ckpt
    finally:
        ckpt.close()


def save_live(live: LiveState, checkpoint_dir: Directory, max_to_keep: int | None,
              extra: dict | None = None) -> str:
    """``Trainer.save``: checkpoint ``live``'s state at its step unless it is not finite, with
    ``extra`` JSON in its metadata; the checkpoint's path."""
    if live.state is None:
        raise RuntimeError("save() before the state exists: call fit(...) or init(batch) first.")
    bad = non_finite_leaves(live.state)
    if bad:
        _refuse(live, checkpoint_dir, bad)
    meta = {**live_meta(live), **(extra or {})}
    state = live.position.state  # a grain source's iterator state goes beside it, one per process
    data_iterator = (None if state is None or isinstance(state, UnrestorableState)
                     else IteratorSnapshot(state))
    with _opened(checkpoint_dir, max_to_keep) as ckpt:
        return ckpt.save(live.step, live.state, meta, data_iterator)


def live_meta(live: LiveState) -> dict:
    """What a checkpoint of ``live`` (either tier) keeps beside its state: the model kind, the data
    position and the global batch's rows."""
    position = live.position
    return {"model_kind": live.model.kind,
            "data_position": {"epoch": position.epoch, "index": position.index},
            "global_batch": global_rows(live.batches.signature)}


def _refuse(live: LiveState, checkpoint_dir: Directory, bad: list[str]) -> None:
    """Raise the `NonFiniteError` of a save refused because the leaves ``bad`` are not finite."""
    if isinstance(checkpoint_dir, Checkpointer):
        directory, latest = checkpoint_dir.directory, checkpoint_dir.latest_step()
    else:
        directory = os.path.abspath(os.fspath(checkpoint_dir))
        latest = None
        if os.path.isdir(directory) and os.listdir(directory):
            with _opened(directory, None) as ckpt:
                latest = ckpt.latest_step()
    where = ("there is no checkpoint there" if latest is None
             else f"the newest checkpoint there is step {latest}")
    raise NonFiniteError(
        f"not saving step {live.step} to {directory!r}: its state is not finite ({describe(bad)}); "
        f"{where}. Resume from a finite checkpoint (fit(..., restore_step=...)) with a lower "
        "learning rate or clip_grad_norm=..., or train with on_non_finite='skip' / 'rollback'.",
        step=live.step, count=0, checkpoint=latest, directory=directory,
    )


def restore_live(live: LiveState, checkpoint_dir: Directory, step: int | None, batch: Any,
                 step_argument: str = "step") -> int:
    """Restore checkpoint ``step`` (None: the latest) into ``live`` whole or not at all; the model
    synced. The restored step."""
    with _opened(checkpoint_dir, None) as ckpt:
        targets: list[Any] = []  # built once, on the first checkpoint that fits this model

        def read(at: int) -> tuple[Any, int, DataPosition]:
            meta = ckpt.meta(at)
            if meta.get("model_kind") != live.model.kind:
                raise ValueError(f"checkpoint_dir={ckpt.directory!r} holds a checkpoint of a "
                                 f"{meta.get('model_kind')} model, but this Trainer's model is a "
                                 f"{live.model.kind} module: pass the {meta.get('model_kind')} "
                                 "model that wrote it, or use a fresh checkpoint_dir.")
            if not targets:
                targets.append(_restore_target(live, batch))
            state, meta = restore_state(ckpt, targets[0], at)  # with or without averaged weights
            position = restored_position(meta["data_position"],
                                         lambda: ckpt.data_iterator_state(at))
            return state, int(meta["step"]), position

        state, live.step, live.position = ckpt.read(read, step, step_argument=step_argument)
        live.state = with_ema(state, live.ema_decay)  # none saved: started from its parameters
    live.sync()
    return live.step


def _restore_target(live: LiveState, batch: Any) -> Any:
    """What a restore reads into: the live state, or abstract arrays in the strategy's layout."""
    if live.state is not None:
        return live.state
    if batch is None:
        raise ValueError("restore() needs batch=... (a sample batch) to build the state it "
                         "restores into.")
    return with_ema(live.target(batch), live.ema_decay)


def roll_back(live: LiveState, ckpt: Checkpointer, step: int, batch: Any) -> None:
    """``fit(restore_step=step)``: restore that checkpoint, then delete the later ones (kept, they
    would be resumed from next time, and a save at one of their steps skipped as done)."""
    steps = ckpt.all_steps()
    if step not in steps:
        raise FileNotFoundError(f"restore_step={step}: {ckpt.directory!r} has no checkpoint for "
                                f"step {step}; it has steps {steps}: pass one of them, or leave "
                                "restore_step out to resume from the latest.")
    restore_live(live, ckpt, step, batch, "restore_step")
    ckpt.abandon_after(step)  # recorded first: an interruption cannot bring them back as the newest


def load_live(live: LiveState, params: Any, opt_state: Any, step: int | None, model_state: Any,
              batch: Any) -> TrainState:
    """``Trainer.load_state``: every piece checked before anything is built or placed (an error
    leaves ``live`` as it was), then the state assembled in the strategy's layout."""
    check_int(step, "step", 0)
    for name, piece in (("params", params), ("opt_state", opt_state), ("model_state", model_state)):
        held = [jax.tree_util.keystr(p) for p, v in
                jax.tree_util.tree_flatten_with_path(piece, is_leaf=is_distributed)[0]
                if is_distributed(v)]
        if held:
            raise ValueError(f"{name} holds per-replica values ({type(piece).__name__}{held[0]}"
                             f"{f' and {len(held) - 1} more' if len(held) > 1 else ''}): one copy "
                             "per replica, where the trainer keeps one state. Pass one copy "
                             "(strategy.experimental_local_results(value)[0]) or their mean "
                             "(strategy.reduce('mean', value)); replicas that drifted apart were "
                             "trained apart.")
    unchecked = False  # the model's own check waits for its first batch
    if live.state is not None:
        like = abstract_state(live.state)
    elif batch is None and live.model.kind == "linen" and live.model.initial_variables is None:
        # A linen model's shapes come from its inputs: the pieces are checked against each other
        # now and against the model at the first batch.
        like, unchecked = params_target(live.strategy, live.optimizer, params, model_state), True
    else:
        like = live.target(batch)
    pieces = checked_pieces(like, params, opt_state, model_state)
    base = live.state
    if base is None and model_state is None and jax.tree.leaves(like.model_state):
        # the model's other variables (batch statistics, nnx Rngs), as a new run's
        base = live.init(batch)
    step = live.step if step is None else step
    state = with_ema(assemble(like, pieces, base, live.optimizer, live.seed, step), live.ema_decay)
    live.state, live.step = state, step
    live.unchecked = functools.partial(_check_at_first_batch, live) if unchecked else None
    live.position = DataPosition()
    live.position_unknown = True  # fit says where it starts reading a list
    live.loaded = True  # until a fit trains on it (one that restores over it says so)
    live.sync()
    return state


def _check_at_first_batch(live: LiveState, batch: Any) -> None:
    """At the first batch after `load_live` without one: the loaded parameters checked against the
    model's, and the model's other variables as a new run's."""
    like = live.target(batch)
    state = live.state
    try:
        checked_pieces(like, state.params, None, None)
    except ValueError as e:
        raise ValueError("the parameters given to load_state() do not fit this model on its first "
                         f"batch: {e}") from None
    if jax.tree.leaves(like.model_state) and not jax.tree.leaves(state.model_state):
        build, args = live.builder(batch)
        with live.strategy.scope():
            fresh = live.strategy.create_variables(build, *args)
        state = state._replace(model_state=fresh.model_state)
    live.state, live.unchecked = state, None
