"""Evaluation batches: every example once, the last partial batch padded and masked."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxdist.training.data._stream import data_kind

__all__ = ["eval_batches"]

def _rows(batch: Any) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves or not np.shape(leaves[0]):
        raise ValueError("a batch needs arrays with a batch axis 0.")
    return int(np.shape(leaves[0])[0])


def eval_batches(data: Any, multiple: int, name: str = "eval_data",
                 prepare: Callable[[Any, str], Any] | None = None,
                 ) -> Iterator[tuple[Any, np.ndarray, int]]:
    """``(batch, weights, rows)`` for each batch of ``data``, padded to a multiple of ``multiple``.

    Padding repeats the last real row (so no loss sees made-up zeros) and gets weight 0; ``rows`` is
    the number of real rows. ``data`` is a re-iterable, an iterator, or a function of no arguments
    returning one; ``prepare(batch, where)``, if given, maps each batch first (e.g. to ``(x, y)``:
    only what is used is padded).

    Raises:
        TypeError: when ``data`` is neither iterable nor callable.

    Examples:
        >>> import numpy as np
        >>> [(b.shape, w.tolist(), n) for b, w, n in eval_batches([np.ones((3, 2))], 4)]
        [((4, 2), [1.0, 1.0, 1.0, 0.0], 3)]
    """
    source = data() if data_kind(data, name) == "function" else data
    for i, batch in enumerate(source):
        if prepare is not None:
            batch = prepare(batch, f"{name} batch {i}")
        rows = _rows(batch)
        pad = -rows % multiple
        weights = np.concatenate([np.ones(rows, np.float32), np.zeros(pad, np.float32)])
        if pad:
            batch = jax.tree.map(lambda a, pad=pad: np.concatenate([a, np.repeat(a[-1:], pad, 0)]),
                                 jax.tree.map(np.asarray, batch))
        yield batch, weights, rows
