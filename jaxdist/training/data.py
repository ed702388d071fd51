"""Training data on the host: epochs, a resumable position, batch checks, and padding for evaluation.

``train_data`` is one of

* a function ``data_fn(epoch) -> iterable of global batches`` (the way to shuffle per epoch: seed the
  shuffle with the epoch, e.g. ``np.random.default_rng((seed, epoch))``);
* a re-iterable (a list, a ``DistributedDataset``): iterated again for each epoch, in the same order;
* an iterator (a generator's result): read once, as one long epoch.

The trainer counts the batches it has consumed. A checkpoint stores that position as ``(epoch, index)`` and a
resumed run asks for the same epoch again and skips ``index`` batches on the host (never placing them on a
device). With deterministic data (the same batches for the same epoch) the resumed run sees exactly the
batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

__all__ = ["BatchStream", "DataPosition", "eval_batches", "signature"]


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """How far training has read its data: ``index`` batches of epoch ``epoch``.

    Example:
        >>> DataPosition(epoch=2, index=5)
        DataPosition(epoch=2, index=5)
    """

    epoch: int = 0
    index: int = 0


def _kind(data: Any, name: str) -> str:
    if isinstance(data, Iterable):
        return "iterator" if isinstance(data, Iterator) else "iterable"
    if callable(data):
        return "function"
    raise TypeError(
        f"{name}={data!r} (type {type(data).__name__}) is neither iterable nor callable: pass a list of "
        "batches, a generator, or a function epoch -> iterable of batches."
    )


def signature(batch: Any) -> tuple:
    """The structure, shapes and dtypes of a batch (batches with equal signatures share one compiled step).

    Example:
        >>> import numpy as np
        >>> signature((np.zeros((2, 3)), np.zeros(2, np.int32)))[1]
        (((2, 3), 'float64'), ((2,), 'int32'))
    """
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, tuple((tuple(np.shape(x)), str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype))
                          for x in leaves)


class BatchStream:
    """The training batches from a position on, across epochs; maps a consumed count back to a position.

    Args:
        data: ``train_data`` (see the module docstring).
        start: where to start (a restored checkpoint's position); None for the beginning.
        epochs: stop after this many epochs in total (None: repeat until the trainer stops reading).
        check: ``check(batch, where)`` validates each batch (raises ValueError).

    Raises:
        TypeError: when ``data`` is neither iterable nor callable.
        ValueError: (while iterating) when an epoch yields no batches, or ends before the restored position.

    Example:
        >>> stream = BatchStream([10, 11, 12], DataPosition(0, 1), epochs=2)
        >>> list(stream), stream.position(3)
        ([11, 12, 10, 11, 12], DataPosition(epoch=1, index=1))
    """

    def __init__(
        self,
        data: Any,
        start: DataPosition | None = None,
        epochs: int | None = None,
        check: Callable[[Any, str], None] | None = None,
    ):
        self._data = data
        self._kind = _kind(data, "train_data")
        self._start = start or DataPosition()
        self._epochs = epochs
        self._check = check
        self._lengths: dict[int, int] = {}  # written by whichever thread reads the data (prefetch)

    @property
    def data(self) -> Any:
        """The data (after `peek`, an iterator is replaced by one that still yields the peeked batch)."""
        return self._data

    def peek(self, epoch: int = 0) -> Any:
        """The first batch of ``epoch`` (for building the state), without consuming an iterator's batch.

        Raises:
            ValueError: when there is no batch.
        """
        if self._kind == "iterator":
            first = next(self._data, _END)
            if first is not _END:
                self._data = itertools.chain([first], self._data)
                return first
        else:
            for batch in self._source(epoch):
                return batch
        raise ValueError(f"train_data yielded no batches (epoch {epoch}): pass at least one batch.")

    def _source(self, epoch: int) -> Iterator[Any]:
        if self._kind == "function":
            source = self._data(epoch)
            if not isinstance(source, Iterable):
                raise TypeError(
                    f"train_data({epoch}) returned {type(source).__name__}, not an iterable of batches."
                )
            return iter(source)
        return iter(self._data)

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self._start.epoch, self._start.index
        while self._epochs is None or epoch < self._epochs:
            if self._kind == "iterator" and epoch > self._start.epoch:
                return  # an iterator is read once
            it = self._source(epoch)
            for count in range(skip):
                if next(it, _END) is _END:
                    raise ValueError(
                        f"train_data has {count} batches in epoch {epoch}, but the restored position is batch "
                        f"{skip} of that epoch: the data differs from the run that wrote the checkpoint (pass the "
                        "same deterministic data, or start from a fresh checkpoint_dir)."
                    )
            count = skip
            for batch in it:
                if self._check is not None:
                    self._check(batch, f"train_data batch {count} of epoch {epoch}")
                yield batch
                count += 1
            if count == 0:
                raise ValueError(f"train_data yielded no batches in epoch {epoch}: pass at least one batch.")
            self._lengths[epoch] = count
            epoch, skip = epoch + 1, 0

    def position(self, consumed: int) -> DataPosition:
        """The position after ``consumed`` batches of this stream have been used."""
        epoch, index = self._start.epoch, self._start.index + consumed
        if self._kind == "iterator":
            return DataPosition(epoch, index)
        while epoch in self._lengths and index >= self._lengths[epoch]:
            index -= self._lengths[epoch]
            epoch += 1
        return DataPosition(epoch, index)


_END = object()


def _rows(batch: Any) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves or not np.shape(leaves[0]):
        raise ValueError("a batch needs arrays with a batch axis 0.")
    return int(np.shape(leaves[0])[0])


def eval_batches(data: Any, multiple: int, name: str = "eval_data") -> Iterator[tuple[Any, np.ndarray, int]]:
    """``(batch, weights, rows)`` for each batch of ``data``, padded to a multiple of ``multiple`` rows.

    Padding repeats the last real row (so no loss sees made-up zeros) and gets weight 0; ``rows`` is the
    number of real rows. ``data`` is a re-iterable, an iterator, or a function of no arguments returning one.

    Raises:
        TypeError: when ``data`` is neither iterable nor callable.

    Example:
        >>> import numpy as np
        >>> [(b.shape, w.tolist(), n) for b, w, n in eval_batches([np.ones((3, 2))], 4)]
        [((4, 2), [1.0, 1.0, 1.0, 0.0], 3)]
    """
    source = data() if _kind(data, name) == "function" else data
    for batch in source:
        rows = _rows(batch)
        pad = -rows % multiple
        weights = np.concatenate([np.ones(rows, np.float32), np.zeros(pad, np.float32)])
        if pad:
            batch = jax.tree.map(lambda a, pad=pad: np.concatenate([a, np.repeat(a[-1:], pad, 0)]),
                                 jax.tree.map(np.asarray, batch))
        yield batch, weights, rows
