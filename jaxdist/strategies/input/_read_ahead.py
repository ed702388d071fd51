"""Read-ahead: the one home of reading batches before the step that takes them, two ways.

* `ahead`, in line (no thread): the Trainer's loop, where a thread would contend with the loop for
  the interpreter (9% slower than in line, against 5%, on the ``trainer-P2`` benchmark row);
* `Prefetcher`, a thread: `DistributedIterator` (``prefetch=``), where the user's loop reads batches
  one by one and a slow source (a file, a decoder) should overlap with it.

Either way a read that fails raises when the consumer reaches it, after the batches before it, and
nothing is read past the end of the source.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["Prefetcher", "ahead"]

STOP_SECONDS = 5.0  # how long `Prefetcher.stop` waits for a read in progress
_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def ahead(batches: Iterable[Any], depth: int = 2) -> Iterator[Any]:
    """Yield ``batches`` in order, reading (and so placing) ``depth`` of them ahead of the one
    yielded: the loop dispatches the step on batch n after batch n+depth has been read, so its
    transfer goes on while the steps before it run (JAX dispatch does not wait for the devices).

    Args:
        batches: the source (e.g. the Trainer's `BatchStream`, whose check places each batch).
        depth: batches read ahead (1 or 2 are enough: JAX dispatch does not wait for the devices).

    Raises:
        ValueError: for ``depth < 0``.

    Example:
        >>> reads = []
        >>> def source():
        ...     for i in range(4):
        ...         reads.append(i)
        ...         yield i
        >>> it = ahead(source(), depth=2)
        >>> next(it), reads
        (0, [0, 1, 2])
        >>> list(it), reads
        ([1, 2, 3], [0, 1, 2, 3])
    """
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise ValueError(f"depth={depth!r} must be an int >= 0 (batches read ahead of the step; "
                         "0: none).")
    return _read_ahead(iter(batches), depth)


def _read_ahead(source: Iterator[Any], depth: int) -> Iterator[Any]:
    queue: collections.deque = collections.deque()
    ended = False
    try:
        while True:
            while not ended and len(queue) <= depth:
                try:
                    queue.append(next(source))
                except StopIteration:
                    ended = True
                except Exception as error:  # raised in order, when the loop reaches this batch
                    queue.append(_Failure(error))
                    ended = True
            if not queue:
                return
            item = queue.popleft()
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        # the loop stopped early (or ended): stop the source too (a stream's epoch iterator, say)
        close = getattr(source, "close", None)
        if close is not None:
            close()


class Prefetcher:
    """A thread that calls ``read()`` ahead of the consumer, keeping up to ``depth`` results queued.

    ``read`` raises StopIteration at the end; any other error is raised by `next` in the consumer's
    thread, in order. Either ends the reading (`ended`). `stop` ends the thread (and drops what is
    queued), `start` begins reading again.

    Example:
        >>> items = iter(range(3))
        >>> prefetcher = Prefetcher(lambda: next(items), depth=2)
        >>> [prefetcher.next() for _ in range(3)]
        [0, 1, 2]
        >>> prefetcher.next()
        Traceback (most recent call last):
        ...
        StopIteration
    """

    def __init__(self, read: Callable[[], Any], depth: int):
        self._read = read
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ended = False  # the end, or a read's error, has been handed to the consumer
        self.start()

    def queued(self) -> int:
        """How many results are read and waiting."""
        return self._queue.qsize()

    def start(self) -> None:
        self.ended = False
        self._stop.clear()
        self._thread = threading.Thread(target=self._fill, name="jaxdist-prefetch", daemon=True)
        self._thread.start()

    def next(self) -> Any:
        """The next result (raises StopIteration at the end, or the error a read raised)."""
        item = self._queue.get()
        if item is _END or isinstance(item, _Failure):
            self.ended = True
            if item is _END:
                raise StopIteration
            raise item.error
        return item

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item = self._read()
                except StopIteration:
                    break
                self._put(item)
            self._put(_END)
        except BaseException as error:  # re-raised in the consumer's thread
            self._put(_Failure(error))

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def signal_stop(self) -> None:
        """Ask the thread to stop without waiting for it (from a finalizer)."""
        self._stop.set()

    def stop(self) -> None:
        """Stop the thread and drop what is queued.

        Raises:
            RuntimeError: when a read in progress does not return within `STOP_SECONDS`.
        """
        self._stop.set()
        deadline = time.monotonic() + STOP_SECONDS
        thread = self._thread
        while thread is not None and thread.is_alive() and time.monotonic() < deadline:
            self._drain()  # make room: a producer blocked on put sees the stop
            thread.join(timeout=0.01)
        self._drain()
        if thread is not None and thread.is_alive():
            raise RuntimeError("the prefetch thread is still reading from the dataset after "
                               f"{STOP_SECONDS:g} s: its read does not return, so the iterator "
                               "cannot be repositioned; check the dataset for a blocking read.")

    def _drain(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
