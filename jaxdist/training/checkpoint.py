"""Checkpoints with orbax-checkpoint: restorable onto any strategy and device count.

A checkpoint is one orbax step directory with two items: ``state`` (the arrays, written by orbax's
`StandardCheckpointHandler` from global `jax.Array`s, so the files do not depend on how many devices held
them) and ``meta`` (JSON: the step, the data position, the model kind, and a fingerprint of the state's tree
paths, shapes and dtypes).

* Any strategy: `Checkpointer.restore` takes the state it should look like, in the NEW strategy's layout
  (what ``strategy.create_variables`` built), and asks orbax for arrays with exactly those shardings, so a
  checkpoint written under ``MirroredStrategy`` on 8 devices restores under ``OneDeviceStrategy`` and back.
* Atomic: orbax writes into a temporary directory and renames it when complete; a process killed during a
  save leaves the previous checkpoints untouched, and the half-written directory is never listed (and is
  removed the next time the directory is opened).
* Another model's checkpoint: the fingerprint is compared before any array is read, and a mismatch is an
  error that names the first differing leaves.
* Keeps the last ``max_to_keep`` checkpoints; `restore` reads the latest by default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpointer", "fingerprint"]

FORMAT = "jaxdist.training/1"


def fingerprint(tree: Any) -> list[list]:
    """``[[path, shape, dtype], ...]`` for every leaf of ``tree``: what must match for a restore to fit.

    Example:
        >>> import numpy as np
        >>> fingerprint({"w": np.zeros((2, 3), np.float32)})
        [["['w']", [2, 3], 'float32']]
    """
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out.append([jax.tree_util.keystr(path), list(leaf.shape), str(leaf.dtype)])
    return out


def _describe(entry: list | None) -> str:
    return "absent" if entry is None else f"{tuple(entry[1])} {entry[2]}"


def _mismatch(saved: list, here: list) -> list[str]:
    saved_by, here_by = {e[0]: e for e in saved}, {e[0]: e for e in here}
    out = []
    order = (".params", ".model_state", ".opt_state")  # the most telling differences first

    def rank(path: str) -> tuple[int, str]:
        return next((i for i, p in enumerate(order) if path.startswith(p)), len(order)), path

    for path in sorted(set(saved_by) | set(here_by), key=rank):
        a, b = saved_by.get(path), here_by.get(path)
        if a != b:
            out.append(f"{path}: {_describe(a)} in the checkpoint, {_describe(b)} here")
    return out


class Checkpointer:
    """Save and restore a training state (any pytree of arrays) plus JSON metadata in ``directory``.

    Also the own-loop path's checkpointing: ``ckpt.save(step, state)`` / ``ckpt.restore(state)``.

    Args:
        directory: where the step directories go (created when missing).
        max_to_keep: how many of the latest checkpoints to keep (None: all).

    Raises:
        ValueError: for ``max_to_keep < 1``.

    Example:
        >>> import tempfile, jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> state = strategy.mirror({"w": jnp.arange(3.0)})
        >>> ckpt = Checkpointer(tempfile.mkdtemp())
        >>> _ = ckpt.save(7, state, {"note": "hi"})
        >>> restored, meta = ckpt.restore(state)
        >>> restored["w"].tolist(), meta["step"], meta["note"]
        ([0.0, 1.0, 2.0], 7, 'hi')
        >>> ckpt.close()
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep={max_to_keep!r} must be an int >= 1 (or None to keep all).")
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            cleanup_tmp_directories=True,  # what a killed save left behind
            enable_async_checkpointing=False,  # a save is complete (renamed into place) when save returns
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: Mapping[str, Any] | None = None) -> str:
        """Write ``state`` as checkpoint ``step`` (atomically; the oldest beyond ``max_to_keep`` is removed).

        Args:
            step: the step number (an int; saving an existing step again is a no-op).
            state: a pytree of arrays (global `jax.Array`s of any layout, or numpy).
            meta: extra JSON-serializable metadata stored beside it.

        Returns:
            The checkpoint's directory.

        Raises:
            TypeError: for metadata that is not JSON-serializable.
        """
        step = int(step)
        path = os.path.join(self.directory, str(step))
        if step in self.all_steps():
            return path
        info = {**dict(meta or {}), "format": FORMAT, "step": step, "fingerprint": fingerprint(state)}
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(info)),
            force=True,
        )
        self._manager.wait_until_finished()
        return path

    def meta(self, step: int | None = None) -> dict:
        """The JSON metadata of checkpoint ``step`` (default: the latest).

        Raises:
            FileNotFoundError: when there is no such checkpoint.
            ValueError: when the directory holds a checkpoint not written by jaxdist.training.
        """
        step = self._step(step)
        try:
            info = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except (FileNotFoundError, KeyError, ValueError) as error:
            info = None
            cause: Exception | None = error
        else:
            cause = None
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise ValueError(
                f"checkpoint_dir={self.directory!r} holds a checkpoint at step {step} that jaxdist.training did not "
                "write (no 'meta' item): use an empty directory for this run."
            ) from cause
        return info

    def _step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {self.directory!r} (it has no complete step directory).")
            return steps[-1]
        if int(step) not in steps:
            raise FileNotFoundError(f"no checkpoint for step={step} in {self.directory!r}; it has steps {steps}.")
        return int(step)

    def check(self, like: Any, meta: Mapping[str, Any]) -> None:
        """Raise ValueError when a checkpoint with metadata ``meta`` does not fit ``like``, naming the leaves."""
        diff = _mismatch(meta["fingerprint"], fingerprint(like))
        if not diff:
            return
        shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
        if any(d.startswith(".params") for d in diff) or not any(d.startswith(".") for d in diff):
            what = "another model's checkpoint (its parameters differ from this model's)"
            fix = "use a fresh checkpoint_dir for this model, or build the model that wrote it"
        elif any(d.startswith(".opt_state") for d in diff):
            what = "an optimizer state that does not fit this model's parameters and optimizer"
            fix = "use the optimizer (and clip_grad_norm) that wrote it, or a fresh checkpoint_dir"
        else:
            what = "a state that does not fit this trainer"
            fix = "use the model and settings that wrote it, or a fresh checkpoint_dir"
        raise ValueError(f"checkpoint_dir={self.directory!r} (step {meta['step']}) holds {what}: {shown}. Fix: {fix}.")

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict]:
        """Read checkpoint ``step`` (default: the latest) into the layout of ``like``.

        Args:
            like: a state with the target structure and layout: live arrays (e.g. from
                ``strategy.create_variables`` under the strategy to restore onto) or `jax.ShapeDtypeStruct`s
                with shardings. Checkpoints restore onto any strategy and device count.
            step: which checkpoint.

        Returns:
            ``(state, meta)``: the arrays with ``like``'s shardings, and the checkpoint's metadata.

        Raises:
            FileNotFoundError: when there is no such checkpoint.
            ValueError: when it was not written by jaxdist.training or does not fit ``like`` (the message
                names the differing leaves).
        """
        info = self.meta(step)
        self.check(like, info)
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), like)
        restored = self._manager.restore(
            info["step"], args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
        )["state"]
        return restored, info

    def close(self) -> None:
        """Wait for pending writes and release the directory."""
        self._manager.close()
