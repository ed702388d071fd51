"""A padded batch in a ``strategy.jit`` step: its row weights go with it to ``strategy.run``.

A distributed dataset's padded last batch (``remainder="pad"``) carries row weights
(`jaxdist.strategies.input`); ``strategy.run`` hands them to its replicas, where
``jd.compute_average_loss`` leaves the padding rows out. A compiled step around ``run`` (TF's
``tf.function`` around ``strategy.run``) sees tracers, which carry no weights, so the step's call
passes them in as one more keyword argument (`PADDING`, `padding_argument`) whose structure names
the padded leaves (part of JAX's cache key), and the trace records them in its computation frame
(`padded_leaves`), where ``run`` reads them. A step whose code hands no padded batch to ``run``
would see the padding rows as data: refused by name (`check_handed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxdist.replicate.trees import fn_name
from jaxdist.strategies.ambient import Padded
from jaxdist.strategies.input import padding_weights

__all__ = ["PADDING", "check_handed", "padded_leaves", "padding_argument"]

PADDING = "__jaxdist_padding__"
"""The keyword that brings a padded batch's row weights to a ``strategy.jit`` step's trace."""


def _array_leaves(args: Sequence[Any], kwargs: dict, skip: set[int],
                  static_names: Sequence[str]) -> list[Any]:
    """The leaves of a step's arguments that may be batches, in one order outside the trace and in
    it: the positional arguments outside ``skip`` (static, nnx), then the keyword arguments that are
    not static, by name."""
    names = sorted(k for k in kwargs if k not in static_names and k != PADDING)
    return jax.tree.leaves(([a for i, a in enumerate(args) if i not in skip],
                            [kwargs[k] for k in names]))


def padding_argument(args: Sequence[Any], kwargs: dict, skip: set[int],
                     static_names: Sequence[str]) -> Any:
    """What a call passes as `PADDING`: ``(weights, where)``, the row weights of each padded batch
    among the arguments (the placed arrays, as the call got them) and ``{"leaf:batch": None}``,
    which leaves they belong to (in the keys: a static part of the program's signature); None
    without a padded batch.

    Examples:
        >>> import numpy as np
        >>> padding_argument((np.zeros(2),), {}, set(), ()) is None
        True
    """
    weights: list[Any] = []
    where: dict[str, None] = {}
    for i, leaf in enumerate(_array_leaves(args, kwargs, skip, static_names)):
        w = padding_weights(leaf)
        if w is None:
            continue
        k = next((j for j, seen in enumerate(weights) if seen is w), None)
        if k is None:
            k, weights = len(weights), [*weights, w]
        where[f"{i}:{k}"] = None
    return (tuple(weights), where) if weights else None


def padded_leaves(padding: Any, args: Sequence[Any], kwargs: dict, skip: set[int],
                  static_names: Sequence[str]) -> list[Padded]:
    """In the trace: the traced padded leaves with their traced weights (``padding``: the traced
    `PADDING` argument; ``args`` / ``kwargs``: the traced arguments, in the structure the call
    passed them). The leaves of one batch share one ``handed`` flag."""
    if padding is None:
        return []
    weights, where = padding
    leaves = _array_leaves(args, kwargs, skip, static_names)
    handed = [[False] for _ in weights]
    out = []
    for key in where:
        i, k = map(int, key.split(":"))
        out.append(Padded(leaves[i], weights[k], handed[k]))
    return out


def check_handed(padded: Sequence[Padded], fn: Any) -> None:
    """Refuse a step that got a padded batch and handed it to no ``strategy.run``.

    Raises:
        ValueError: naming the step, ``strategy.run`` and ``remainder=``.
    """
    if any(not p.handed[0] for p in padded):
        raise ValueError(f"{fn_name(fn)} got a batch that a distributed dataset padded "
                         "(remainder='pad') and hands it to no strategy.run: its global-view code "
                         "sees the padding rows as data. Run the per-example work with "
                         "strategy.run inside the step (as TF's tf.function around strategy.run: "
                         "there jd.compute_average_loss leaves the padding rows out, and "
                         "ReplicaContext.batch_weights marks them), or distribute the dataset with "
                         "remainder='drop'.")
