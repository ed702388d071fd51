"""A checkpoint's metadata: its format, the fingerprint of the state it holds (each leaf's path,
shape and dtype, and the NamedTuple types of optax's states), and whether a state fits it.

`check_fits` is what a restore asks before any array is read: another model's or another optimizer's
checkpoint is an error naming the first differing leaves and the fix. `check_same` is what a save of
an existing step asks: the same contents are a no-op, others a `CheckpointConflictError`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax

from jaxdist.replicate.trees import describe
from jaxdist.training.checkpoints._claim import CheckpointConflictError
from jaxdist.training.checkpoints._damage import checksums

__all__ = ["FORMAT", "check_fits", "check_same", "fingerprint", "node_types"]

FORMAT = "jaxdist.training/1"
"""The ``format`` entry of every checkpoint jaxdist.training writes (others: `_foreign.advice`)."""


def fingerprint(tree: Any) -> list[list]:
    """``[[path, shape, dtype], ...]`` for every leaf of ``tree``: what must match for a restore.

    Examples:
        >>> import numpy as np
        >>> fingerprint({"w": np.zeros((2, 3), np.float32)})
        [["['w']", [2, 3], 'float32']]
    """
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out.append([jax.tree_util.keystr(path), list(leaf.shape), str(leaf.dtype)])
    return out


def _by_path(saved: list, here: list) -> tuple[dict, dict, list[str]]:
    """Two fingerprints by path, and the paths whose entries differ (sorted)."""
    saved_by, here_by = {e[0]: e for e in saved}, {e[0]: e for e in here}
    paths = sorted(set(saved_by) | set(here_by))
    return saved_by, here_by, [p for p in paths if saved_by.get(p) != here_by.get(p)]


def node_types(tree: Any) -> list[list[str]]:
    """``[[path, type name], ...]`` for every NamedTuple node of ``tree`` (optax's states): what
    tells apart two optimizers whose states have the same leaves (Adam's and AdaBelief's).

    Examples:
        >>> import optax, numpy as np
        >>> node_types(optax.adam(0.1).init({"w": np.zeros(2)}))
        [['[0]', 'ScaleByAdamState'], ['[1]', 'EmptyState']]
    """
    out: list[list[str]] = []

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            out.append([jax.tree_util.keystr(path), type(node).__name__])
        children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        if len(children) == 1 and children[0][1] is node:  # a leaf
            return
        for key, child in children:
            walk(child, path + key)

    walk(tree, ())
    return out


def _describe(entry: list | None) -> str:
    return "absent" if entry is None else f"{tuple(entry[1])} {entry[2]}"


def _mismatch(saved: list, here: list) -> list[str]:
    saved_by, here_by, paths = _by_path(saved, here)
    order = (".params", ".model_state", ".opt_state")  # the most telling differences first

    def rank(path: str) -> tuple[int, str]:
        return next((i for i, p in enumerate(order) if path.startswith(p)), len(order)), path

    return [f"{p}: {_describe(saved_by.get(p))} in the checkpoint, {_describe(here_by.get(p))} here"
            for p in sorted(paths, key=rank)]


def check_fits(directory: str, like: Any, meta: Mapping[str, Any]) -> None:
    """Raise ValueError, naming the leaves, when checkpoint ``meta`` does not fit ``like``."""
    diff = _mismatch(meta["fingerprint"], fingerprint(like))
    saved_types = meta.get("node_types")  # none in checkpoints written before them
    if not diff and saved_types is not None:
        saved_by, here_by = dict(map(tuple, saved_types)), dict(map(tuple, node_types(like)))
        types = [f"{p}: {saved_by.get(p, 'absent')} in the checkpoint, {here_by.get(p, 'absent')} "
                 "here" for p in sorted(set(saved_by) | set(here_by))
                 if saved_by.get(p) != here_by.get(p)]
        if types:
            more = f"; and {len(types) - 3} more" if len(types) > 3 else ""
            shown = "; ".join(types[:3]) + more
            raise ValueError(
                f"checkpoint_dir={directory!r} (step {meta['step']}) holds the state of another "
                f"optimizer (its state types differ): {shown}. Fix: use the optimizer that wrote "
                "it (same transforms, in the same chain), or a fresh checkpoint_dir (to keep only "
                "the parameters: Trainer.load_state(params=...)).")
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
    raise ValueError(f"checkpoint_dir={directory!r} (step {meta['step']}) holds {what}: {shown}. "
                     f"Fix: {fix}.")


def check_same(directory: str, step: int, saved: Mapping[str, Any], state: Any) -> None:
    """Checkpoint ``step`` (metadata ``saved``) exists: saving ``state`` as it again is a no-op for
    the same contents, an error for others."""
    differ = _by_path(saved.get("fingerprint", []), fingerprint(state))[2]
    sums = saved.get("checksums")
    if not differ and sums is not None:
        here = checksums(state)
        differ = [p for p, v in here.items() if p in sums and list(sums[p]) != v]
    if not differ:
        return
    raise CheckpointConflictError(
        f"checkpoint step {step} in {directory!r} already exists with other contents "
        f"({describe(differ)} differ): saving over it would keep the old state under this step. "
        "Another run wrote this directory, or this run went back without restore_step=. Fix: pass "
        "a fresh directory, resume from the newest checkpoint (fit does), or delete "
        f"{os.path.join(directory, str(step))} first.", directory)
