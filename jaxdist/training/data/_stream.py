"""The training batches on the host (`BatchStream`): epochs and a resumable position, any source.

``train_data`` is one of

* a function ``data_fn(epoch) -> iterable of global batches`` (the way to shuffle per epoch: seed
  the shuffle with the epoch, e.g. ``np.random.default_rng((seed, epoch))``);
* a re-iterable (a list, a ``DistributedDataset``): iterated again each epoch, in the same order;
* an iterator (a generator's result): read once, as one long epoch.

The trainer counts the batches it has consumed. A checkpoint stores that position as ``(epoch,
index)`` and a resumed run asks for the same epoch again and skips ``index`` batches on the host
(never placing them on a device). With deterministic data (the same batches for the same epoch) the
resumed run sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

import jax

from jaxdist.strategies.input import DistributedIterator
from jaxdist.training.data._position import DataPosition, UnrestorableState

__all__ = ["BatchStream", "data_kind", "is_grain"]

def is_grain(obj: Any) -> bool:
    """Whether ``obj`` is a grain dataset, loader or iterator (not importing grain if nobody has).

    Examples:
        >>> import grain
        >>> is_grain(grain.MapDataset.range(4)), is_grain([1, 2])
        (True, False)
    """
    grain = sys.modules.get("grain")
    types = tuple(getattr(grain, n, None) for n in _GRAIN_TYPES) if grain is not None else ()
    return bool(types) and isinstance(obj, tuple(t for t in types if isinstance(t, type)))


_GRAIN_TYPES = ("MapDataset", "IterDataset", "DataLoader", "DatasetIterator", "DataLoaderIterator")


def _stateful(it: Any) -> bool:
    """Whether the position of iterator ``it`` is saved as its state: a grain iterator, or a jaxdist
    distributed iterator reading one (their ``get_state`` accounts for the batches prefetched)."""
    if isinstance(it, DistributedIterator):
        return is_grain(it.source)
    return (is_grain(it) and callable(getattr(it, "get_state", None))
            and callable(getattr(it, "set_state", None)))


def data_kind(data: Any, name: str) -> str:
    if isinstance(data, Iterable):
        return "iterator" if isinstance(data, Iterator) else "iterable"
    if callable(data):
        return "function"
    raise TypeError(f"{name}={data!r} (type {type(data).__name__}) is neither iterable nor "
                    "callable: pass a list of batches, a generator, or a function epoch -> "
                    "iterable of batches.")


class BatchStream:
    """The training batches from a position on, across epochs; maps a consumed count to a position.

    A grain source (given as it is or returned by a ``data_fn(epoch)``) is PER-PROCESS input, as
    grain pipelines are: each process reads its own share of every global batch, and ``check`` gets
    the process count, to check (and place) the global batch those shares form. Its iterator's state
    is recorded after every batch, so `position` carries it (`DataPosition.state`) and a stream
    started from such a position restores it instead of re-reading the batches before it.

    Args:
        data: ``train_data`` (see the module docstring).
        start: where to start (a restored checkpoint's position); None for the beginning.
        epochs: stop after this many epochs in total (None: repeat until the trainer stops reading).
        check: ``check(batch, where) -> batch`` validates each batch (raises ValueError) and returns
            what the stream yields (a `BatchChecker` returns the pair ``(x, y)``, a `BatchFeed` a
            placed `TrainBatch`); per-process batches on several processes are passed as
            ``check(batch, where, processes)``, and need a check that places them (a `BatchFeed`).

    Raises:
        TypeError: when ``data`` is neither iterable nor callable.
        ValueError: (while iterating) when an epoch yields no batches, ends before the restored
            position, the restored position's input state does not fit this run
            (`UnrestorableState`), or per-process batches of several processes come without a
            ``check`` to place them.

    Examples:
        >>> stream = BatchStream([10, 11, 12], DataPosition(0, 1), epochs=2)
        >>> list(stream), stream.position(3)
        ([11, 12, 10, 11, 12], DataPosition(epoch=1, index=1))
    """

    def __init__(self, data: Any, start: DataPosition | None = None, epochs: int | None = None,
                 check: Callable[..., Any] | None = None):
        self._data = data
        self._kind = data_kind(data, "train_data")
        self._start = start or DataPosition()
        self._epochs = epochs
        self._check = check
        self._lengths: dict[int, int] = {}  # written by whichever thread reads the data (prefetch)
        # A sized re-iterable (a list) has one known length every epoch: a position at the end of
        # an epoch reads as the start of the next, whether or not the reader looked past it.
        self._length = len(data) if self._kind == "iterable" and isinstance(data, Sized) else None
        # (epoch, batches read in it) -> a stateful source's iterator state right after them;
        # written by the reading thread, pruned by `position` up to the batch consumed.
        at = (self._start.epoch, self._start.index)
        self._states: dict[tuple[int, int], Any] = {at: self._start.state}
        self._cursor = (0, *at)  # (consumed, epoch, index) of the last position
        self.on_length: Callable[[int], None] | None = None  # hears each epoch's length found

    @property
    def data(self) -> Any:
        """The data (after `peek`, an iterator is one that still yields the peeked batch)."""
        return self._data

    @property
    def length(self) -> int | None:
        """The batches of every epoch, when known before reading (a list: its length), else None."""
        return self._length

    def epoch_end(self, epoch: int) -> int | None:
        """How many batches of this stream are consumed when epoch ``epoch`` ends: its own and those
        of the epochs before it since the start (None while a length is unknown: a generator's epoch
        not read to its end; a ``data_fn(epoch)`` returning a list is known once the epoch begins).

        Examples:
            >>> stream = BatchStream([10, 11, 12], DataPosition(0, 1))
            >>> stream.epoch_end(0), stream.epoch_end(1)
            (2, 5)
        """
        consumed = -self._start.index
        for e in range(self._start.epoch, epoch + 1):
            length = self._lengths.get(e, self._length)
            if not length:
                return None
            consumed += length
        return consumed

    @property
    def epochs(self) -> int | None:
        """The epochs the stream ends after (None: it ends only where an iterator ends)."""
        return self._epochs

    def peek(self, epoch: int = 0) -> Any:
        """The first batch of ``epoch`` (for building the state), checked, without consuming an
        iterator's batch (a grain iterator is put back with ``set_state``). Not placed.

        Raises:
            ValueError: when there is no batch, or it fails the check.
        """
        first, per_process = _END, False
        if self._kind == "iterator":
            per_process = is_grain(self._data)
            if _stateful(self._data):
                state = self._data.get_state()
                first = next(self._data, _END)
                self._data.set_state(state)
            else:
                first = next(self._data, _END)
                if first is not _END:
                    self._data = itertools.chain([first], self._data)
        else:
            source = self._source(epoch)
            per_process = is_grain(source)
            grain = sys.modules.get("grain")
            if grain is not None and isinstance(source, grain.MapDataset) and len(source):
                first = source[0]  # random access: no iterator, no read-ahead threads for one batch
            if first is _END or first is None:  # (a filtered MapDataset's element may be None)
                first = next(iter(source), _END)
        if first is _END:
            raise ValueError(f"train_data yielded no batches (epoch {epoch}): pass at least one "
                             "batch.")
        return self._checked(first, f"train_data batch 0 of epoch {epoch}", per_process)

    def _source(self, epoch: int) -> Any:
        """What epoch ``epoch`` iterates (an iterable or the iterator itself)."""
        if self._kind == "function":
            source = self._data(epoch)
            if not isinstance(source, Iterable):
                raise TypeError(f"train_data({epoch}) returned {type(source).__name__}, not an "
                                "iterable of batches.")
            return source
        return self._data

    def _checked(self, batch: Any, where: str, per_process: bool) -> Any:
        if self._check is None:
            return batch
        processes = jax.process_count() if per_process else 1
        return self._check(batch, where, processes) if processes > 1 else self._check(batch, where)

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self._start.epoch, self._start.index
        while self._epochs is None or epoch < self._epochs:
            if self._kind == "iterator" and epoch > self._start.epoch:
                return  # an iterator is read once
            source = self._source(epoch)
            per_process, it = is_grain(source), iter(source)
            stateful = _stateful(it)
            if per_process and jax.process_count() > 1 and self._check is None:
                raise ValueError("BatchStream(check=None) cannot place per-process (grain) "
                                 f"batches on {jax.process_count()} processes: pass check= a "
                                 "jaxdist.training.data.BatchFeed (it checks the global batch the "
                                 "processes' shares form and places each process's rows on the "
                                 "strategy's replicas).")
            if (self._kind == "function" and isinstance(source, Sized)
                    and epoch not in self._lengths):  # a list from data_fn: known before reading
                self._known(epoch, len(source))
            count = self._resume(it, stateful, epoch, skip)
            for batch in it:
                if stateful:
                    self._states[(epoch, count + 1)] = it.get_state()
                yield self._checked(batch, f"train_data batch {count} of epoch {epoch}",
                                    per_process)
                count += 1
            if count == 0:
                raise ValueError(f"train_data yielded no batches in epoch {epoch}: pass at least "
                                 "one batch.")
            if self._lengths.get(epoch, self._length) != count:
                self._known(epoch, count)
            epoch, skip = epoch + 1, 0

    def _known(self, epoch: int, length: int) -> None:
        self._lengths[epoch] = length
        if self.on_length is not None:
            self.on_length(epoch)

    def _resume(self, it: Iterator[Any], stateful: bool, epoch: int, skip: int) -> int:
        """Bring ``it`` to batch ``skip`` of ``epoch``: restore the recorded state of a stateful
        source, else read and drop ``skip`` batches. Returns ``skip``."""
        state = (self._start.state if (epoch, skip) == (self._start.epoch, self._start.index)
                 else None)
        if skip and stateful and state is not None:
            if isinstance(state, UnrestorableState):
                raise state.error
            it.set_state(state)
            return skip
        for count in range(skip):
            if next(it, _END) is _END:
                raise ValueError(f"train_data has {count} batches in epoch {epoch}, but the "
                                 f"restored position is batch {skip} of that epoch: the data "
                                 "differs from the run that wrote the checkpoint (pass the same "
                                 "deterministic data, or start from a fresh checkpoint_dir).")
        return skip

    def position(self, consumed: int) -> DataPosition:
        """The position after ``consumed`` batches (with a stateful source's iterator state)."""
        epoch, index = self._start.epoch, self._start.index + consumed
        if self._kind != "iterator":
            # Walked on from the last position asked for: a constant cost per step (fit asks after
            # every step) however many epochs lie behind.
            done, at_epoch, at_index = self._cursor
            if consumed >= done:
                epoch, index = at_epoch, at_index + consumed - done
            while (length := self._lengths.get(epoch, self._length)) and index >= length:
                index -= length
                epoch += 1
            self._cursor = consumed, epoch, index
        if index == 0 and epoch != self._start.epoch:
            return DataPosition(epoch, index)  # the start of an epoch: a fresh iterator, no state
        state = self._states.get((epoch, index))
        for key in [k for k in list(self._states) if k < (epoch, index)]:
            self._states.pop(key, None)
        return DataPosition(epoch, index, state)


_END = object()
