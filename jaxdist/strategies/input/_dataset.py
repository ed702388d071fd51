"""Distributed input: global batches placed on the replicas, each process placing only its own rows.

The datasets of ``strategy.experimental_distribute_dataset`` and
``strategy.distribute_datasets_from_function`` (see those), whose iterators keep ``prefetch``
batches in flight to the devices on a background thread. grain (the JAX ecosystem's data loader)
plugs in as it is: ``fn(ctx)`` may return a ``grain.MapDataset``, ``grain.IterDataset`` or
``grain.DataLoader`` that reads this process's share, e.g.
``examples[ctx.input_pipeline_id::ctx.num_input_pipelines].batch(per_process_batch)``; its position
is then exact despite the prefetch thread (`DistributedIterator.get_state`), so a checkpoint can
hold it (``jd.training.Checkpointer.save(..., data_iterator=it)``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jaxdist.strategies.input._placement import check_divisible
from jaxdist.strategies.input._read_ahead import Prefetcher
from jaxdist.strategies.input._remainder import check_remainder, with_remainder

__all__ = ["DistributedDataset", "DistributedIterator", "InputContext"]


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What an input function needs to know to read its share of the data (tf.distribute's).

    Attributes:
        num_input_pipelines: how many input pipelines (processes) read data.
        input_pipeline_id: this pipeline's index in ``[0, num_input_pipelines)``.
        num_replicas_in_sync: replicas across all pipelines.

    Examples:
        >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
        >>> ctx.get_per_replica_batch_size(64)
        8
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        if self.num_input_pipelines < 1:
            raise ValueError(f"num_input_pipelines={self.num_input_pipelines} must be >= 1.")
        if not 0 <= self.input_pipeline_id < self.num_input_pipelines:
            raise ValueError(f"input_pipeline_id={self.input_pipeline_id} must be in [0, "
                             f"{self.num_input_pipelines}).")
        if self.num_replicas_in_sync < 1:
            raise ValueError(f"num_replicas_in_sync={self.num_replicas_in_sync} must be >= 1.")

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch each replica gets from a global batch of ``global_batch_size``.

        Raises:
            ValueError: when the replicas do not divide the global batch.
        """
        return global_batch_size // check_divisible(global_batch_size, self.num_replicas_in_sync)


def _has_state(source: Any) -> bool:
    return callable(getattr(source, "get_state", None)) and callable(getattr(source, "set_state",
                                                                             None))


class DistributedIterator:
    """Iterates placed global batches; a background thread keeps ``prefetch`` of them in flight.

    Call ``close()`` (or exhaust it, or use it as a context manager) to stop the thread early.

    When the source iterator has ``get_state()`` / ``set_state(state)`` (grain's iterators), so
    does this iterator (see `get_state`).

    Examples:
        >>> import numpy as np, jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> with iter(strategy.experimental_distribute_dataset([np.ones((2, 1))] * 5)) as batches:
        ...     # the thread stops on leaving the block, batches in flight are dropped
        ...     first = next(batches)
        >>> first.shape
        (2, 1)
    """

    def __init__(self, source: Iterator[Any], place: Callable[[Any], Any], prefetch: int,
                 batches: Iterator[Any] | None = None):
        self._source = source
        # what is read: the source, under a remainder rule
        self._batches = source if batches is None else batches
        self._place = place
        self._done = False
        self._stateful = _has_state(source)
        # the state after the last batch handed out
        self._state = source.get_state() if self._stateful else None
        self._ahead = Prefetcher(self._read, prefetch) if prefetch > 0 else None

    @property
    def source(self) -> Iterator[Any]:
        """The iterator the batches are read from (e.g. a grain ``DatasetIterator``)."""
        return self._source

    def _read(self) -> tuple[Any, Any]:
        """The next placed batch and the source's state right after it (StopIteration: the end)."""
        batch = next(self._batches)
        state = self._source.get_state() if self._stateful else None
        return self._place(batch), state

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            batch, state = self._read() if self._ahead is None else self._ahead.next()
        except StopIteration:
            self._done = True
            raise
        except BaseException:
            # The thread's reading ended with this error: exhausted, as at the end. Read on demand,
            # the next call reads the source again (an interrupt while waiting leaves it reading).
            if self._ahead is not None and self._ahead.ended:
                self._done = True
            raise
        self._state = state
        return batch

    def _check_stateful(self, method: str) -> None:
        if not self._stateful:
            raise TypeError(f"{method}: this dataset's iterator ({type(self._source).__name__}) "
                            "has no get_state() / set_state(state), so its position cannot be "
                            "saved or restored: read the data with grain (grain.MapDataset, "
                            "grain.IterDataset, grain.DataLoader), or give the iterator both "
                            "methods.")

    def get_state(self) -> Any:
        """The source iterator's state after the last batch this iterator returned (batches read
        ahead by the prefetch thread do not count): restoring it, in this or a new iterator over the
        same pipeline, continues with exactly the batch that would have come next.

        Returns:
            What the source's ``get_state()`` returns (a dict for a grain ``DatasetIterator``, JSON
            bytes for a grain ``DataLoaderIterator``).

        Raises:
            TypeError: when the source iterator has no ``get_state`` / ``set_state``.

        Examples:
            >>> import grain, numpy as np, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> ds = grain.MapDataset.source(np.arange(12.0).reshape(6, 2)).batch(2)
            >>> it = iter(strategy.experimental_distribute_dataset(ds))
            >>> _ = next(it)
            >>> # after batch 0, whatever the thread has read ahead
            >>> state = it.get_state()
            >>> later = iter(strategy.experimental_distribute_dataset(ds))
            >>> later.set_state(state)
            >>> next(later).tolist(), next(it).tolist()
            ([[4.0, 5.0], [6.0, 7.0]], [[4.0, 5.0], [6.0, 7.0]])
        """
        self._check_stateful("get_state()")
        return copy.deepcopy(self._state)

    def set_state(self, state: Any) -> None:
        """Continue from ``state`` (a `get_state` result of an iterator over the same pipeline): the
        batches in flight are dropped and the next batch is the one that followed ``state``.

        Raises:
            TypeError: when the source iterator has no ``get_state`` / ``set_state``.
            RuntimeError: when the prefetch thread does not stop within 5 s (a read that does not
                return).
        """
        self._check_stateful("set_state(state)")
        if self._ahead is not None:
            self._ahead.stop()
        self._source.set_state(state)
        self._state = copy.deepcopy(state)
        self._done = False
        if self._ahead is not None:
            self._ahead.start()

    def close(self) -> None:
        """Stop the prefetch thread and drop batches in flight."""
        self._done = True
        if self._ahead is not None:
            # a daemon thread stuck in a read dies with the process
            with contextlib.suppress(RuntimeError):
                self._ahead.stop()

    def __enter__(self) -> DistributedIterator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        ahead = getattr(self, "_ahead", None)
        if ahead is not None and not self._done:
            ahead.signal_stop()


class DistributedDataset:
    """An iterable of placed global batches; each ``iter()`` starts a new pass (and thread).

    Made by ``strategy.experimental_distribute_dataset`` or
    ``strategy.distribute_datasets_from_function``; its iterators are `DistributedIterator`s.

    Examples:
        >>> import numpy as np, jaxdist as jd
        >>> dataset = jd.OneDeviceStrategy().experimental_distribute_dataset([np.zeros((4, 2))] * 3)
        >>> len(list(dataset)), len(list(dataset))  # each pass iterates the source again
        (3, 3)
    """

    def __init__(self, make_source: Callable[[], Iterable[Any]], place: Callable[[Any], Any],
                 prefetch: int, remainder: str = "error", divisor: int = 1):
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch={prefetch!r} must be an int >= 0 (0 places batches on "
                             "demand).")
        self._make_source = make_source
        self._place = place
        self._prefetch = prefetch
        self._remainder = check_remainder(remainder)
        self._divisor = divisor  # the replicas that share a batch's rows

    def __iter__(self) -> DistributedIterator:
        source = iter(self._make_source())
        batches, place = with_remainder(source, self._remainder, self._place, self._divisor)
        return DistributedIterator(source, place, self._prefetch, batches)
