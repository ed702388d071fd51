"""Checkpoints jaxdist.training did not write: the plain orbax that reads one, and how it enters a
`Trainer`.

A migrating run's checkpoint directory (orbax's ``CheckpointManager`` with ``StandardSave``, or one
``StandardCheckpointer`` directory) has no ``meta`` item. ``Trainer.restore`` and ``fit`` do not
guess what its arrays are; they answer with `advice`, written for the directory found.
"""

from __future__ import annotations

import ast
import json
import os

__all__ = ["advice", "is_orbax_checkpoint"]

_TREE_FILES = ("_METADATA", "manifest.ocdbt")  # what one orbax pytree (item) directory holds


def is_orbax_checkpoint(path: str) -> bool:
    """Whether ``path`` is one orbax pytree checkpoint (a ``StandardCheckpointer``'s, or an item).

    Examples:
        >>> import tempfile
        >>> is_orbax_checkpoint(tempfile.mkdtemp())
        False
    """
    return any(os.path.isfile(os.path.join(path, name)) for name in _TREE_FILES)


def _items(where: str) -> list[str]:
    """The orbax pytree checkpoints at ``where``: itself, or its items (a manager's step)."""
    if is_orbax_checkpoint(where):
        return [where]
    try:
        names = sorted(os.listdir(where))
    except OSError:
        return []
    return [os.path.join(where, n) for n in names if is_orbax_checkpoint(os.path.join(where, n))]


def _top_names(item: str) -> list[str]:
    """The names at the top of the tree in ``item`` (orbax's ``_METADATA``; [] if unreadable)."""
    try:
        with open(os.path.join(item, "_METADATA")) as f:
            tree = json.load(f)["tree_metadata"]
        names = []
        for key, entry in tree.items():
            first = (entry["key_metadata"][0]["key"] if "key_metadata" in entry
                     else ast.literal_eval(key)[0])
            if first not in names:
                names.append(str(first))
        return names
    except (OSError, ValueError, KeyError, IndexError, TypeError, SyntaxError):
        return []


def _pick(names: list[str], exact: str, part: str) -> str | None:
    if exact in names:
        return exact
    return next((n for n in names if part in n.lower()), None)


def advice(directory: str, step: int | None) -> str:
    """What to tell about a checkpoint jaxdist did not write: ``directory``'s step ``step`` (None:
    the directory is one orbax checkpoint itself): the two lines of plain orbax and ``load_state``
    that continue it.

    Args:
        directory: the checkpoint directory given to ``restore`` / ``fit``.
        step: the step directory found there, or None.

    Returns:
        The message (starting with what the directory holds).

    Examples:
        >>> import tempfile, numpy as np, orbax.checkpoint as ocp
        >>> directory = tempfile.mkdtemp()
        >>> with ocp.CheckpointManager(directory) as manager:
        ...     _ = manager.save(20, args=ocp.args.StandardSave({"params": {"w": np.zeros(2)}}))
        >>> print(advice(directory, 20).split("\\n")[1].strip().replace(directory, "DIR"))
        state = ocp.StandardCheckpointer().restore('DIR/20/default')
    """
    where = directory if step is None else os.path.join(directory, str(step))
    items = _items(where)
    item = items[0] if items else os.path.join(where, "<item>")
    names = _top_names(item) if items else []
    params, opt_state = _pick(names, "params", "param"), _pick(names, "opt_state", "opt")
    if params is None:  # the tree holds the parameters themselves, or names we cannot tell
        args = "params=state" if names else 'params=state["params"]'
    else:
        args = f"params=state[{params!r}]"
    if opt_state is not None:
        args += f", opt_state=state[{opt_state!r}]"
    if step is not None:
        args += f", step={step}"
    what = f"a checkpoint at step {step}" if step is not None else "an orbax checkpoint"
    seen = f" (its tree's top: {names})" if names else ""
    others = (f"; the other items here: {[os.path.basename(i) for i in items[1:]]}"
              if len(items) > 1 else "")
    return (
        f"checkpoint_dir={directory!r} holds {what} that jaxdist.training did not write (no 'meta' "
        f"item){seen}{others}. To continue that run in this Trainer, read it with plain orbax "
        "(import orbax.checkpoint as ocp) and load it:\n"
        f"    state = ocp.StandardCheckpointer().restore({item!r})\n"
        f"    trainer.load_state({args})\n"
        "(a linen model's trainer with no state yet also takes batch=a sample batch), then fit "
        "with a checkpoint_dir of this run's own: jaxdist writes its checkpoints where no other "
        "writer's are."
    )
