"""In-place updates in a ``strategy.jit`` step: a sync-on-read value updated there must be returned.

``SyncOnRead.assign_add`` updates the object in place, as tf.distribute's variables are updated,
and eagerly (and in ``strategy.run``) the object passed in keeps the update. A compiled step sees
copies made for the trace: an update it does not return would vanish silently. `InPlaceUpdates`
notices, and says how to thread the value.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxdist.replicate.trees import is_distributed
from jaxdist.replicate.values import SyncOnRead

__all__ = ["InPlaceUpdates"]


class InPlaceUpdates:
    """The sync-on-read values among a step's arguments, as they were when the step's code started.

    Args:
        fn: the step's name, for the message.
        arguments: the step's positional arguments as its code sees them (`SyncOnRead` leaves are
            watched).
        keywords: its keyword arguments, likewise.

    Examples:
        >>> import jax.numpy as jnp
        >>> v = SyncOnRead(jnp.zeros((1,)), "sum")
        >>> watch = InPlaceUpdates("step", (v,))
        >>> watch.check(out=v.assign_add(1.0))  # updated and returned: fine
    """

    def __init__(self, fn: str, arguments: tuple, keywords: dict | None = None):
        self._fn = fn
        found = [("args" + jax.tree_util.keystr(p), v) for p, v in
                 jax.tree_util.tree_flatten_with_path(tuple(arguments), is_leaf=is_distributed)[0]]
        found += [("kwargs" + jax.tree_util.keystr(p), v) for p, v in
                  jax.tree_util.tree_flatten_with_path(dict(keywords or {}),
                                                       is_leaf=is_distributed)[0]]
        self._watched = [(where, v, v.stacked) for where, v in found if isinstance(v, SyncOnRead)]

    def check(self, out: Any) -> None:
        """Raise when a watched value was updated in place but does not leave through ``out``.

        Raises:
            ValueError: naming the argument and how to return it.
        """
        if not self._watched:
            return
        returned = {id(v) for v in jax.tree.leaves(out, is_leaf=is_distributed)}
        for where, value, before in self._watched:
            if (value.stacked is not before and id(value) not in returned
                    and id(value.stacked) not in returned):
                raise ValueError(f"{self._fn} updated the sync-on-read value {where} in place "
                                 "(assign / assign_add / assign_sub) but does not return it: "
                                 "inside strategy.jit the update would be lost when the step "
                                 "returns. Return it and rebind it, e.g. `return loss, seen` and "
                                 "`loss, seen = step(params, seen, batch)` (strategy.run outside a "
                                 "compiled step keeps such updates by itself).")
