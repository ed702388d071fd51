"""Reading one checkpoint's items with orbax (its metadata, its state into a layout, its input
iterator's state), and the search for an intact checkpoint when one is damaged (`read_intact`).

A damaged item is an `UnsearchedDamage` here; `read_intact` (behind every ``Checkpointer.read``)
turns it into the one `CheckpointCorruptedError` that names the newest older checkpoint that
restores.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxdist.replicate.trees import describe
from jaxdist.strategies.layout import is_own, mark
from jaxdist.training.checkpoints._damage import (
    CheckpointCorruptedError,
    UnsearchedDamage,
    damage_summary,
    is_damage,
    missing_parts,
    verify_checksums,
)
from jaxdist.training.checkpoints._foreign import advice
from jaxdist.training.checkpoints._metadata import FORMAT
from jaxdist.training.checkpoints._tree import from_disk, to_disk
from jaxdist.training.data import IteratorSnapshot, restore_args, state_for_process

__all__ = ["check_target", "read_intact", "read_iterator_state", "read_meta", "read_state"]

# Set inside `read_intact`: a read nested in another (``meta`` inside ``restore``) leaves the search
# for an intact checkpoint to the outermost one, which knows everything the caller needs to read.
_READING: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxdist_checkpoint_read",
                                                                default=False)


def read_intact[T](fn: Callable[[int], T], step: int, all_steps: Callable[[], list[int]],
                   directory: str, step_argument: str) -> T:
    """``fn(step)``, with ONE clear `CheckpointCorruptedError` when it finds checkpoint ``step``
    damaged: ``fn`` is tried on the older checkpoints (``all_steps()``), newest first, and the error
    names the first one it reads (else a newer one that does); see `Checkpointer.read`."""
    if _READING.get():
        return fn(step)
    token = _READING.set(True)
    try:
        try:
            return fn(step)
        except CheckpointCorruptedError as error:
            damaged = error
        failed, intact = [], None
        for older in reversed([s for s in all_steps() if s < step]):
            try:
                fn(older)
            except Exception:
                failed.append(older)
            else:
                intact = older
                break
        steps = all_steps()
        newer = None
        if intact is None:  # none older: a newer one may still resume the run
            for later in reversed([s for s in steps if s > step]):
                try:
                    fn(later)
                except Exception:
                    continue
                newer = later
                break
        clear = CheckpointCorruptedError(damaged.step, directory, damaged.reason, intact, failed,
                                         latest=not steps or steps[-1] == damaged.step,
                                         step_argument=step_argument, newer_intact_step=newer)
        clear.__context__ = damaged.__cause__ or damaged  # kept for debugging, not printed
        raise clear from None
    finally:
        _READING.reset(token)


def _damaged(directory: str, step: int, error: BaseException,
             item: str = "") -> CheckpointCorruptedError:
    """The error for checkpoint ``step`` found damaged by ``error`` (`read_intact` adds more)."""
    reason = damage_summary(error, os.path.join(directory, str(step)))
    return UnsearchedDamage(step, directory, f"{item}: {reason}" if item else reason)


def read_meta(manager: ocp.CheckpointManager, directory: str, step: int) -> dict:
    """The JSON metadata of checkpoint ``step``: `UnsearchedDamage` when parts are missing or it is
    unreadable, ValueError (`advice`) when jaxdist.training did not write it."""
    missing = missing_parts(os.path.join(directory, str(step)))
    if missing:  # cut short (a save or a delete killed): orbax's errors would not say so
        raise UnsearchedDamage(step, directory,
                               f"{describe(missing)} missing: partly written or partly deleted")
    try:
        info = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except (FileNotFoundError, KeyError, ValueError) as error:
        if os.path.isdir(os.path.join(directory, str(step), "meta")):  # it has one, unreadable
            raise _damaged(directory, step, error, "meta") from error
        info = None
        cause: Exception | None = error
    else:
        cause = None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ValueError(advice(directory, step)) from cause
    return info


def check_target(like: Any, argument: str = "like") -> None:
    """Raise TypeError unless every leaf of ``like`` says where its restored array goes: a
    `jax.Array` (its sharding) or a `jax.ShapeDtypeStruct` with a sharding. A numpy array has no
    layout to restore into.

    Examples:
        >>> import numpy as np
        >>> check_target({"w": np.zeros(4)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: like['w'] is a numpy.ndarray (shape (4,), float64), which says no layout to ...
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(like)[0]:
        if getattr(leaf, "sharding", None) is not None:
            continue
        kind = type(leaf)
        shown = f"{kind.__module__.split('.')[0]}.{kind.__name__}"
        detail = (f" (shape {np.shape(leaf)}, "
                  f"{getattr(leaf, 'dtype', None) or np.result_type(leaf)})")
        raise TypeError(
            f"{argument}{jax.tree_util.keystr(path)} is a {shown}{detail}, which says no layout to "
            "restore into: pass the state in the layout to restore onto (e.g. "
            f"{argument}=strategy.mirror(host_state), or the state strategy.create_variables "
            "built), or jax.ShapeDtypeStruct(shape, dtype, sharding=...) leaves.")


def read_state(manager: ocp.CheckpointManager, directory: str, step: int, like: Any,
               info: dict) -> Any:
    """The state of checkpoint ``step`` (metadata ``info``, checked to fit) read into ``like``'s
    layout, its checksums verified."""
    target = to_disk(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                 sharding=a.sharding), like))
    args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
    try:
        restored = from_disk(like, manager.restore(step, args=args)["state"])
        verify_checksums(info.get("checksums"), restored)  # none in checkpoints written before them
    except Exception as error:
        if is_damage(error):
            raise _damaged(directory, step, error) from error
        raise
    # A value restored into a layout jaxdist decided is jaxdist's, as the value it replaces was.
    mark(jax.tree.leaves(restored), [is_own(getattr(a, "sharding", None))
                                     for a in jax.tree.leaves(like)])
    return restored


def read_iterator_state(manager: ocp.CheckpointManager, directory: str, step: int,
                        info: dict) -> Any:
    """This process's input iterator state saved with checkpoint ``step`` (``info``), or None."""

    def read() -> Any:
        holder = IteratorSnapshot()
        try:
            manager.restore(step, args=ocp.args.Composite(data_iterator=restore_args(holder)))
        except (OSError, KeyError, ValueError) as error:
            raise _damaged(directory, step, error, "data_iterator") from error
        return holder.state

    return state_for_process(info.get("data_iterator"), read,
                             f"checkpoint_dir={directory!r} step {step}")
