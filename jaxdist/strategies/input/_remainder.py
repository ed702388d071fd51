"""A dataset's smaller last batch (tf.data's ``batch()`` without ``drop_remainder``): refused,
dropped or padded, as ``remainder=`` of `Strategy.experimental_distribute_dataset` says.

A padded batch's placed arrays are registered here with their *row weights* (1.0 for a real row, 0.0
for a padding row, laid out like the batch). Inside a ``strategy.jit`` step the batch is a tracer,
which carries no weights: the step's call brings them in and records which traced leaf has which
(`jaxdist.strategies.compile._trace._padded`), and `padding_weights` reads them there.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.strategies import ambient

__all__ = [
    "PADDED", "REMAINDERS", "check_batches", "check_remainder", "holds_padded", "padding_weights",
    "with_remainder"
]

REMAINDERS = ("error", "drop", "pad")

# id(placed array) -> (weak ref to it, its row weights)
_weights: dict[int, tuple[weakref.ref, Any]] = {}
PADDED = _weights
"""The padded batches alive (empty, hence false, while there are none): a step's per-call check
reads it before calling `holds_padded`, which costs a call."""
# registering from the read-ahead thread while the loop reads (never in a weakref callback)
_lock = threading.Lock()


def check_remainder(remainder: Any) -> str:
    """``remainder`` validated.

    Raises:
        ValueError: for a value other than "error", "drop" and "pad".

    Examples:
        >>> check_remainder("pad")
        'pad'
    """
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder={remainder!r} is not one of {REMAINDERS}: 'error' refuses a "
                         "smaller last batch, 'drop' skips it (tf.data's drop_remainder=True), "
                         "'pad' pads it with rows that jd.compute_average_loss leaves out.")
    return remainder


def _rows(batch: Any) -> int | None:
    leaves = jax.tree.leaves(batch)
    return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else None


def _message(index: int, rows: int, full: int, divisor: int) -> str:
    return (f"batch {index} has {rows} rows, which the {divisor} replicas do not divide (the "
            f"first batch has {full}): a smaller last batch, as tf.data's batch() without "
            "drop_remainder gives. Pass remainder='drop' to skip it (drop_remainder=True) or "
            "remainder='pad' to pad it (the padding rows are left out of jd.compute_average_loss; "
            "ReplicaContext.batch_weights marks them) to experimental_distribute_dataset / "
            "distribute_datasets_from_function.")


def check_batches(batches: Sequence[Any], divisor: int) -> None:
    """Refuse, before anything runs, a list with a batch that ``divisor`` replicas do not divide
    after a first batch they do (a first batch they do not divide is the placement's error).

    Raises:
        ValueError: naming the batch, its rows, the first batch's rows and ``remainder=``.

    Examples:
        >>> check_batches([np.zeros((4, 2)), np.zeros((2, 2))], divisor=2)
    """
    full = None
    for index, batch in enumerate(batches):
        rows = _rows(batch)
        if full is None:
            full = rows
        elif rows is not None and full is not None and full % divisor == 0 and rows % divisor:
            raise ValueError(_message(index, rows, full, divisor))


def with_remainder(source: Iterator[Any], remainder: str, place: Callable[[Any], Any],
                   divisor: int) -> tuple[Iterator[Any], Callable[[Any], Any]]:
    """The batches of ``source`` under ``remainder``, and the placement that goes with them.

    Args:
        source: the host batches.
        remainder: "error", "drop" or "pad".
        place: how one host batch is placed.
        divisor: the replicas that share a batch's rows (of this process, for per-process input).

    Returns:
        ``(batches, place)``: with "pad", a padded batch is placed with its row weights registered.

    Raises:
        ValueError: (while iterating) under "error", for a batch the replicas do not divide (after a
            first one they do); under "drop" and "pad", for one larger than the first.

    Examples:
        >>> batches, place = with_remainder(iter([np.ones((4, 1)), np.ones((3, 1))]), "drop",
        ...                                 lambda b: b, 2)
        >>> [b.shape for b in batches]
        [(4, 1)]
    """
    batches = _Batches(source, remainder, divisor)
    if remainder != "pad":
        return batches, place

    def place_padded(item: Any) -> Any:
        batch, weights = item
        placed = place(batch)
        if weights is not None:
            placed_weights = place(weights)
            with _lock:
                for leaf in jax.tree.leaves(placed):
                    _weights[id(leaf)] = (weakref.ref(leaf, _forget(id(leaf))), placed_weights)
        return placed

    return batches, place_padded


class _Batches:
    """The batches of ``source`` under ``remainder`` (not a generator: after an error reading the
    source the next call reads on, as the source itself would)."""

    def __init__(self, source: Iterator[Any], remainder: str, divisor: int):
        self._source, self._remainder, self._divisor = source, remainder, divisor
        self._full: int | None = None  # the first batch's rows
        self._index = 0

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> Any:
        while True:
            batch = next(self._source)
            index, self._index = self._index, self._index + 1
            rows, full = _rows(batch), self._full
            if full is None or rows is None:
                self._full = rows if full is None else full
                return (batch, None) if self._remainder == "pad" else batch
            if self._remainder == "error":
                if full % self._divisor == 0 and rows % self._divisor:
                    raise ValueError(_message(index, rows, full, self._divisor))
                return batch
            if rows == full:
                return (batch, None) if self._remainder == "pad" else batch
            if rows > full:
                raise ValueError(f"batch {index} has {rows} rows, more than the first batch's "
                                 f"{full}: remainder={self._remainder!r} handles a smaller last "
                                 "batch; give every batch the first one's rows.")
            if self._remainder == "pad":
                return _pad(batch, full), (np.arange(full) < rows).astype(np.float32)
            # "drop": skipped, read on


def _pad(batch: Any, full: int) -> Any:
    """``batch`` with zero rows appended up to ``full`` rows."""

    def pad(leaf: Any) -> np.ndarray:
        leaf = np.asarray(leaf)
        return np.concatenate([leaf, np.zeros((full - leaf.shape[0], *leaf.shape[1:]), leaf.dtype)])

    return jax.tree.map(pad, batch)


def _forget(key: int, entries: dict = _weights) -> Callable[[Any], None]:
    """The callback that drops ``key``'s entry when its array dies: only that array's entry (``key``
    may be a newer array's by then), and without the lock (the callback may run in the middle of a
    registration, on the same thread, when the garbage collector frees an old batch; at exit the
    module's globals are gone)."""

    def forget(ref: weakref.ref) -> None:
        entry = entries.get(key)
        if entry is not None and entry[0] is ref:
            entries.pop(key, None)

    return forget


def padding_weights(leaf: Any) -> Any:
    """The row weights of a padded batch's placed array (``remainder="pad"``), or of the tracer that
    stands for it in a ``strategy.jit`` step's trace (the traced weights the step got with it; the
    step then counts the batch as handed to ``strategy.run``); None for any other value.

    Examples:
        >>> padding_weights(np.zeros(3)) is None
        True
    """
    if isinstance(leaf, jax.core.Tracer):
        for frame in reversed(ambient.state.computations):
            for padded in frame.padded:
                if padded.leaf is leaf:
                    padded.handed[0] = True
                    return padded.weights
        return None
    if not _weights:
        return None
    entry = _weights.get(id(leaf))
    return entry[1] if entry is not None and entry[0]() is leaf else None


def holds_padded(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is a padded batch's array (free while no padded batch is alive).

    Examples:
        >>> holds_padded((np.zeros(2), {"x": 1.0}))
        False
    """
    return bool(_weights) and any(padding_weights(leaf) is not None
                                  for leaf in jax.tree.leaves(tree))
