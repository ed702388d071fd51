"""The stream boundary: where a `Trainer`'s data becomes device batches, checked and placed once.

Every training batch crosses this boundary exactly once. A `BatchFeed` brings it to the pair ``(x,
y)``, checks it (`jaxdist.training.data.BatchChecker`) and places it split over the replicas. What
comes out is a `TrainBatch`, whose type says that it has been checked and placed, so the stages
after it (the fit loop, ``Trainer.train_on_batch``, the compiled step) never check, split or move
it again.

The next batch's transfer overlaps the current step: the loop's read-ahead
(`jaxdist.strategies.input.ahead`) places batch n+1 right before step n is dispatched, while step
n-1 still runs, which hides the transfer with no thread (a prefetch thread cost more on the
``trainer-P2`` benchmark row: about 9% against 5%, contending with the loop for the interpreter).

In a job of several processes each process passes the same global batch whole and places only its
own devices' rows of it, so processes that pass different batches would train on a mix of them
without a word. There the feed returns `WholeBatch` es, which keep the host batch (a reference),
and ``fit`` compares their `WholeBatch.fingerprint` across the processes
(`jaxdist.training.loop._hosts.SameBatches`).

Example:
    >>> import numpy as np, jaxdist as jd
    >>> from jaxdist.training.data._checks import BatchChecker
    >>> strategy = jd.MirroredStrategy()
    >>> feed = BatchFeed(strategy, BatchChecker(strategy.num_replicas_in_sync, target_key="label"))
    >>> batch = feed({"x": np.ones((8, 3), np.float32), "label": np.zeros(8, np.int32)}, "batch 0")
    >>> x, y = batch.pair
    >>> x.sharding == strategy.batch_sharding, y.shape
    (True, (8,))
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import jax
import numpy as np

from jaxdist.strategies import Strategy
from jaxdist.strategies.input import place_batch
from jaxdist.training.data._checks import BatchChecker

__all__ = ["FINGERPRINT_BYTES", "ROW_SAMPLES", "BatchFeed", "TrainBatch", "WholeBatch"]

FINGERPRINT_BYTES = 1 << 16
"""A leaf of at most this many bytes enters a `WholeBatch.fingerprint` whole."""

ROW_SAMPLES = 64
"""A larger leaf enters it by this many evenly spaced values of each of its rows (axis 0)."""


@dataclasses.dataclass(frozen=True, eq=False)
class TrainBatch:
    """A training batch that a `BatchFeed` has checked (and placed, unless left for a device loop).

    Attributes:
        pair: ``(x, y)``: global `jax.Array` s split on axis 0 over the replicas when ``placed``;
            host arrays otherwise (an on-device loop stacks several for one transfer).
        placed: whether ``pair`` is on the devices in the strategy's batch layout.
        checker: the `BatchChecker` that checked it (a trainer takes as they are only the batches
            its own checker has seen).

    Example:
        >>> import numpy as np
        >>> from jaxdist.training.data._checks import BatchChecker
        >>> checker = BatchChecker(1)
        >>> TrainBatch((np.ones((2, 1)), np.ones(2)), placed=False, checker=checker).pair[1].shape
        (2,)
    """

    pair: tuple[Any, Any]
    placed: bool
    checker: BatchChecker = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True, eq=False)
class WholeBatch(TrainBatch):
    """A `TrainBatch` of a job whose processes each pass the global batch whole, with the host batch
    this process passed (``host``, the checked pair; kept, not copied) for `fingerprint`.

    Example:
        >>> import numpy as np
        >>> from jaxdist.training.data._checks import BatchChecker
        >>> pair = (np.arange(6.0).reshape(3, 2), np.arange(3))
        >>> batch = WholeBatch(pair, placed=False, checker=BatchChecker(1), host=pair)
        >>> batch.fingerprint() == WholeBatch(pair, False, BatchChecker(1),
        ...                                   (pair[0].copy(), pair[1])).fingerprint()
        True
        >>> batch.fingerprint() == WholeBatch(pair, False, BatchChecker(1),
        ...                                   (pair[0][::-1], pair[1])).fingerprint()
        False
    """

    host: Any = dataclasses.field(repr=False)

    def fingerprint(self) -> str | None:
        """A cheap fingerprint of the host batch: its structure, each leaf's shape and dtype, and a
        CRC-32 of each leaf's bytes (a leaf of at most `FINGERPRINT_BYTES`) or of `ROW_SAMPLES`
        evenly spaced values of each of its rows. Other examples, or the same in another order,
        change it; a few values inside one large example may not. None for a batch of global arrays
        (nothing of it is this process's alone). Computed when asked, never per step."""
        leaves, treedef = jax.tree.flatten(self.host)
        parts = [str(treedef)]
        for leaf in leaves:
            if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
                return None
            a = np.asarray(leaf)
            if a.nbytes > FINGERPRINT_BYTES and a.ndim and a.shape[0]:
                rows = a.reshape(a.shape[0], -1)
                a = rows[:, np.unique(np.linspace(0, rows.shape[1] - 1,
                                                  ROW_SAMPLES).astype(np.intp))]
            a = np.ascontiguousarray(a).reshape(-1)
            parts.append(f"{a.dtype}{np.shape(leaf)}:{zlib.crc32(a.view(np.uint8)):08x}")
        return ";".join(parts)


class BatchFeed:
    """Turns a trainer's batches into `TrainBatch` es: as ``(x, y)``, checked, placed once.

    Args:
        strategy: the strategy whose replicas get the rows.
        checker: the trainer's `BatchChecker`.
        place: True (a compiled step per batch): place every batch. False (an on-device loop per
            several batches): leave global batches on the host, since the loop stacks them and
            places the stack in one transfer; per-process batches of several processes are placed
            either way (only the global array they form together can hold them).

    Raises:
        ValueError: (when called) for a batch of the wrong structure, one the replicas do not
            divide, or one whose shapes differ from the first batch's (`BatchChecker`).

    Example:
        >>> import numpy as np, jaxdist as jd
        >>> from jaxdist.training.data._checks import BatchChecker
        >>> strategy = jd.MirroredStrategy()
        >>> feed = BatchFeed(strategy, BatchChecker(strategy.num_replicas_in_sync))
        >>> feed((np.ones((12, 2)), np.ones(12)), "batch 0")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: batch 0 has 12 rows, which 8 replicas x grad_accum_steps=1 do not divide: ...
    """

    def __init__(self, strategy: Strategy, checker: BatchChecker, *, place: bool = True):
        self.strategy = strategy
        self.checker = checker
        self.place = place
        self.whole = strategy.policy.spans_processes  # each process passes global batches whole

    def __call__(self, batch: Any, where: str, processes: int = 1) -> TrainBatch:
        """``batch`` checked and (see ``place``) placed: the one check and the one transfer it gets.

        Args:
            batch: a batch as the user gives it: ``(x, y)``, a dict with the trainer's keys, or a
                placed batch of this strategy's distributed dataset (kept where it is).
            where: how errors name the batch (``"train_data batch 3 of epoch 0"``).
            processes: > 1 when ``batch`` is this process's share of a global batch that many
                processes read together (per-process input, e.g. grain): it is checked as the global
                batch and placed from each process's rows.
        """
        if isinstance(batch, TrainBatch):  # another trainer's: checked again, for this one
            batch = batch.pair
        pair = checked = self.checker(batch, where, processes)
        if processes > 1:
            pair = place_batch(self.strategy.policy, pair, process_local=True, where=where)
        elif self.place:
            pair = place_batch(self.strategy.policy, pair, where=where)
        if self.whole and processes == 1:
            return WholeBatch(pair, self.place, self.checker, checked)
        return TrainBatch(pair, self.place or processes > 1, self.checker)

    def trusts(self, batch: Any) -> bool:
        """Whether ``batch`` is a `TrainBatch` this feed's checker has checked (taken as it is)."""
        return isinstance(batch, TrainBatch) and batch.checker is self.checker
