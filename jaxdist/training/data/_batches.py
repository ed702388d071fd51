"""Training data on the host: batch formats, epochs, a resumable position, batch checks, padding for evaluation.

A batch is a pair ``(x, y)`` or a dict. Dict batches hold the inputs under ``input_key`` and the targets under
``target_key`` (``"x"`` and ``"y"`` unless the `Trainer` is told otherwise, e.g. ``input_key="image",
target_key="label"`` for the NNX tutorial's ``{"image": ..., "label": ...}``). Every batch is brought to the
pair ``(x, y)`` on the host, before it is placed: keys that neither option names are dropped there (with a
one-time warning), never sent to the devices.

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
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any

import jax
import numpy as np

from jaxdist.strategies.input import DistributedIterator

__all__ = [
    "BatchChecker",
    "BatchStream",
    "DataPosition",
    "UnrestorableState",
    "check_key",
    "describe",
    "eval_batches",
    "is_grain",
    "signature",
    "split_batch",
]

Key = str | tuple[str, ...]
"""A dict batch's key for the inputs or the targets: one key, or several (their values then form a dict)."""

_TARGET_NAMES = ("label", "labels", "target", "targets", "y")


def check_key(key: Any, name: str) -> Key:
    """``key`` as a `Key` (a string, or a tuple of distinct strings).

    Raises:
        TypeError: for anything else, naming the option (``name``) and the value received.

    Examples:
        >>> check_key(["input_ids", "mask"], "input_key")
        ('input_ids', 'mask')
    """
    if isinstance(key, str):
        return key
    if isinstance(key, Sequence) and key and all(isinstance(k, str) for k in key) and len(set(key)) == len(key):
        return tuple(key)
    raise TypeError(
        f"{name}={key!r} must be a dict key (a string such as 'image') or a sequence of distinct strings "
        "(their values are passed to the model as a dict)."
    )


def _keys(key: Key) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else key


def _pick(batch: Mapping, key: Key) -> Any:
    return batch[key] if isinstance(key, str) else {k: batch[k] for k in key}


def _suggest(present: list[str]) -> str:
    """An example ``input_key=..., target_key=...`` built from the keys a batch has."""
    targets = [k for k in present if k.lower() in _TARGET_NAMES]
    inputs = [k for k in present if k not in targets]
    if not targets and len(inputs) >= 2:
        inputs, targets = inputs[:1], inputs[1:2]
    parts = [f"input_key={inputs[0]!r}"] if inputs else []
    parts += [f"target_key={targets[0]!r}"] if targets else []
    return ", ".join(parts) or "input_key='...', target_key='...'"


def split_batch(
    batch: Any,
    where: str = "batch",
    need_targets: bool = True,
    *,
    input_key: Key = "x",
    target_key: Key = "y",
) -> tuple[Any, Any]:
    """``(x, y)`` of a batch given as a tuple / list ``(x, y)`` or a dict with ``input_key`` and ``target_key``.

    Args:
        batch: the batch.
        where: how to name the batch in errors (e.g. ``"train_data batch 3"``).
        need_targets: False for prediction: a bare array / pytree, ``(x,)`` or a dict without the target key
            is fine.
        input_key: the dict key holding the inputs, or several keys (``x`` is then the dict of their values).
        target_key: the dict key (or keys) holding the targets.

    Returns:
        ``(x, y)``; ``y`` is None when there are no targets and ``need_targets`` is False. Other dict keys are
        left out.

    Raises:
        ValueError: for any other structure, naming what was received; for a dict without the keys, naming
            the keys it has and the options to set.

    Examples:
        >>> split_batch({"x": 1, "y": 2})
        (1, 2)
        >>> split_batch({"image": 1, "label": 2, "id": 7}, input_key="image", target_key="label")
        (1, 2)
    """
    if isinstance(batch, Mapping):
        missing = [(k, "input_key", input_key) for k in _keys(input_key) if k not in batch]
        if need_targets:
            missing += [(k, "target_key", target_key) for k in _keys(target_key) if k not in batch]
        if not missing:
            has_targets = all(k in batch for k in _keys(target_key))
            return _present(_pick(batch, input_key), (_pick(batch, target_key) if has_targets else None), where,
                            need_targets)
        present = sorted(map(str, batch))
        lacks = " and ".join(f"no {k!r} ({option}={value!r})" for k, option, value in missing)
        raise ValueError(
            f"{where} is a dict with keys {present} and {lacks}: name the keys that hold the inputs and the "
            f"targets, e.g. Trainer(..., {_suggest(present)})."
        )
    if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
        if len(batch) == 2 or (not need_targets and len(batch) == 1):
            return _present(batch[0], (batch[1] if len(batch) == 2 else None), where, need_targets)
        got = f"a {type(batch).__name__} of {len(batch)} items"
    elif not need_targets:
        return batch, None
    else:
        got = f"a {type(batch).__name__}"
    want = f"(x, y) or a dict with keys {input_key!r} and {target_key!r}" if need_targets else \
        f"x, (x,), (x, y) or a dict with key {input_key!r}"
    raise ValueError(
        f"{where} is {got}; expected {want}: yield inputs and targets as a pair (x may be any pytree, e.g. a dict "
        "of model inputs), or a dict and name its keys with Trainer(..., input_key=..., target_key=...)."
    )


def _present(x: Any, y: Any, where: str, need_targets: bool) -> tuple[Any, Any]:
    """``(x, y)``, unless the inputs (or the targets a loss needs) hold no array: ``(x, None)`` is named."""
    if not jax.tree.leaves(x):
        raise ValueError(f"{where} has inputs {x!r} (no array): yield (x, y) with x an array (or a pytree of "
                         "arrays) whose axis 0 is the batch.")
    if need_targets and not jax.tree.leaves(y):
        raise ValueError(
            f"{where} has targets {y!r} (no array): loss_fn(outputs, targets) gets the targets, and their rows count "
            "the examples. Fix: yield (x, y) with y an array of the batch's rows (a loss without targets, e.g. an "
            "autoencoder's: yield (x, x)); for predictions without targets use trainer.predict.")
    return x, y


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """How far training has read its data: ``index`` batches of epoch ``epoch``.

    Attributes:
        epoch: the epoch being read.
        index: batches of it consumed by training steps.
        state: for a source whose iterator has a state (grain): that iterator's ``get_state()`` right after
            those batches, on THIS process (each process reads its own shard). A resumed run restores it
            instead of re-reading and dropping ``index`` batches. None for plain iterables. Not shown, not
            compared.

    Examples:
        >>> DataPosition(epoch=2, index=5)
        DataPosition(epoch=2, index=5)
    """

    epoch: int = 0
    index: int = 0
    state: Any = dataclasses.field(default=None, repr=False, compare=False)


class UnrestorableState:
    """The `DataPosition.state` of a checkpoint whose input state does not fit this run (another process
    count): resuming a stateful source from it raises ``error``; evaluating or resuming plain data does not."""

    def __init__(self, error: Exception):
        self.error = error


def is_grain(obj: Any) -> bool:
    """Whether ``obj`` is a grain dataset, loader or iterator (without importing grain when nobody has).

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
    return is_grain(it) and callable(getattr(it, "get_state", None)) and callable(getattr(it, "set_state", None))


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

    Cheap enough to run on every batch: the dtypes stay dtype objects (`describe` spells them out).

    Examples:
        >>> import numpy as np
        >>> describe(signature((np.zeros((2, 3)), np.zeros(2, np.int32))))
        '((2, 3) float64, (2,) int32)'
    """
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, tuple(
        (x.shape, x.dtype) if isinstance(x, (np.ndarray, jax.Array)) else (np.shape(x), np.asarray(x).dtype)
        for x in leaves
    )


def describe(sig: tuple) -> str:
    """A `signature`'s shapes and dtypes, as text for messages.

    Examples:
        >>> import numpy as np
        >>> describe(signature({"x": np.zeros((4, 2), np.float32)}))
        '((4, 2) float32)'
    """
    return "(" + ", ".join(f"{tuple(shape)} {np.dtype(dtype).name}" for shape, dtype in sig[1]) + ")"


class BatchChecker:
    """Brings each training batch to ``(x, y)`` on the host and checks it: structure, divisibility, shapes.

    The first batch fixes the signature (one compiled step); a later batch with other shapes is an error that
    names the fix, never a silent recompile. This is the one check a training batch gets: the trainer's
    `jaxdist.training.data.BatchFeed` runs it once per batch, at the stream boundary, and what passes it is
    not checked again. On the first batch it also checks that every leaf has axis 0 (the rows), that they
    agree on it, and that ``replicas`` x ``grad_accum_steps`` divide it (later batches have the same shapes).

    Args:
        replicas: the strategy's ``num_replicas_in_sync``.
        grad_accum_steps: micro-batches per step (the global batch must divide by ``replicas`` times this).
        input_key / target_key: the dict keys of the inputs and targets (see `split_batch`).

    Raises:
        ValueError: (when called) for a batch of the wrong structure, a first batch with a scalar leaf, leaves
            with different rows, or rows that ``replicas`` x ``grad_accum_steps`` do not divide (naming the
            rows, the replicas and a batch size that works), or a batch whose shapes differ from the first one's.

    Examples:
        >>> import numpy as np
        >>> check = BatchChecker(2, 1, input_key="image", target_key="label")
        >>> x, y = check({"image": np.ones((4, 3)), "label": np.zeros(4)}, "batch 0")
        >>> x.shape, y.shape
        ((4, 3), (4,))
    """

    def __init__(self, replicas: int, grad_accum_steps: int = 1, *, input_key: Key = "x", target_key: Key = "y"):
        self.replicas, self.grad_accum_steps = replicas, grad_accum_steps
        self.input_key, self.target_key = input_key, target_key
        self._named = set(_keys(input_key)) | set(_keys(target_key))
        self._signature: tuple | None = None
        self._warned = False

    @property
    def signature(self) -> tuple | None:
        """The first training batch's `signature` (every training batch has it); None before one is checked."""
        return self._signature

    def split(self, batch: Any, where: str, need_targets: bool = True) -> tuple[Any, Any]:
        """``(x, y)`` of ``batch`` (see `split_batch`); warns once about dict keys that neither option names."""
        x, y = split_batch(batch, where, need_targets, input_key=self.input_key, target_key=self.target_key)
        if isinstance(batch, Mapping) and not self._warned:
            extra = sorted(str(k) for k in batch if k not in self._named)
            if extra:
                self._warned = True
                warnings.warn(
                    f"{where} has keys {extra} that neither input_key={self.input_key!r} nor "
                    f"target_key={self.target_key!r} names: they are dropped on the host (not sent to the devices); "
                    "leave them out of the batches to silence this.",
                    UserWarning,
                    stacklevel=2,
                )
        return x, y

    def __call__(self, batch: Any, where: str, processes: int = 1) -> tuple[Any, Any]:
        """The training batch ``(x, y)``, checked.

        ``processes > 1``: ``batch`` is this process's share of a global batch that many processes read
        together (per-process input): the checks and the signature are those of the global batch (axis 0
        times ``processes``).
        """
        pair = self.split(batch, where)
        sig = signature(pair)
        if processes > 1:
            sig = (
                sig[0],
                tuple(((shape[0] * processes, *shape[1:]) if shape else shape, dtype) for shape, dtype in sig[1]),
            )
        if self._signature is None:  # later batches have its signature, so they pass these checks too
            rows = _common_rows(pair, where)
            need = self.replicas * self.grad_accum_steps
            if rows * processes % need:
                got = (
                    f"{rows} rows"
                    if processes == 1
                    else f"{rows} rows on this process ({rows * processes} over {processes} processes)"
                )
                raise ValueError(
                    f"{where} has {got}, which {self.replicas} replicas x "
                    f"grad_accum_steps={self.grad_accum_steps} do not divide: use a global batch that is a "
                    f"multiple of {need} (e.g. {-(-rows * processes // need) * need}), dropping or padding the "
                    "remainder."
                )
            self._signature = sig
        elif sig != self._signature:
            raise ValueError(
                f"{where} has structure/shapes {describe(sig)} ({sig[0]}), but the first training batch had "
                f"{describe(self._signature)} ({self._signature[0]}): every training batch needs the same "
                "structure and shapes (one compiled step); drop the ragged last batch or pad it."
            )
        return pair


def global_rows(sig: tuple | None) -> int | None:
    """The global batch's rows in a `BatchChecker.signature` (None before the first batch)."""
    if sig is None or not sig[1] or not sig[1][0][0]:
        return None
    return int(sig[1][0][0][0])


def say_batch_change(meta: Mapping[str, Any], rows: int | None, position: DataPosition) -> None:
    """Warn when a run resumes from a checkpoint written with global batches of other ``rows``: the data position
    is counted in batches, so it moves in examples (what it does is said, and how to keep it).

    Examples:
        >>> say_batch_change({"global_batch": 32, "step": 4}, 32, DataPosition(0, 4))   # the same: silent
    """
    old = meta.get("global_batch")
    if old is None or rows is None or int(old) == rows:
        return
    warnings.warn(
        f"fit resumes from checkpoint {meta.get('step')}, written with global batches of {old} rows; train_data now "
        f"yields {rows}. The data position counts batches: it resumes at batch {position.index} of epoch "
        f"{position.epoch}, skipping {position.index * rows} examples of that epoch where the run that wrote it had "
        f"read {position.index * int(old)}. To resume on the same examples use batches of {old} rows, or set "
        "trainer.data_position before fit.", UserWarning, stacklevel=4)


def _common_rows(pair: Any, where: str) -> int:
    """The rows (axis 0) that every leaf of ``pair`` has: what the replicas split.

    Raises:
        ValueError: for a leaf without axis 0, or leaves that disagree on it, naming the leaves.
    """
    paths = jax.tree_util.tree_flatten_with_path(pair)[0]
    if not paths:
        raise ValueError(f"{where} holds no arrays: yield (x, y) with arrays whose axis 0 is the batch.")
    first_path, first = paths[0]
    if np.shape(first) and np.shape(first)[0] == 0:
        raise ValueError(f"{where} has 0 rows (an empty batch): its loss would be the mean of nothing (NaN). Skip "
                         "empty batches in train_data (e.g. filter them out, or drop a last batch with no rows).")
    for path, leaf in paths:
        if not np.shape(leaf):
            raise ValueError(
                f"{where} leaf {_name(path)} is a scalar: every leaf of a training batch needs a batch axis 0 to "
                "split over the replicas (pass constants to the model or the loss instead)."
            )
        if np.shape(leaf)[0] != np.shape(first)[0]:
            raise ValueError(
                f"{where} leaf {_name(path)} has {np.shape(leaf)[0]} rows but leaf {_name(first_path)} has "
                f"{np.shape(first)[0]}: axis 0 of every leaf is the batch (the rows the replicas split), so they "
                "must agree; move an array that is not per example out of the batch."
            )
    return int(np.shape(first)[0])


def _name(path: tuple) -> str:
    """A leaf of the pair ``(x, y)``, named as the user wrote it: ``x['image']``, ``y``."""
    rest = jax.tree_util.keystr(path[1:])
    return ("x" if path[0].idx == 0 else "y") + rest


class BatchStream:
    """The training batches from a position on, across epochs; maps a consumed count back to a position.

    A grain source (a ``grain.MapDataset``, ``grain.IterDataset`` or ``grain.DataLoader``, given as it is or
    returned by a ``data_fn(epoch)``) is PER-PROCESS input, as grain pipelines are: on several processes each
    reads its own share of every global batch (e.g. ``grain.sharding.ShardByJaxProcess``), and ``check``
    gets the process count, to check (and place: `jaxdist.training.data.BatchFeed`) the global batch those
    shares form. Its iterator's state is recorded after every batch, so `position` carries it
    (`DataPosition.state`) and a stream started from such a position restores it instead of re-reading the
    batches before it.

    Args:
        data: ``train_data`` (see the module docstring).
        start: where to start (a restored checkpoint's position); None for the beginning.
        epochs: stop after this many epochs in total (None: repeat until the trainer stops reading).
        check: ``check(batch, where) -> batch`` validates each batch (raises ValueError) and returns what
            the stream yields (a `BatchChecker` returns the pair ``(x, y)``, a `BatchFeed` a placed
            `TrainBatch`); per-process batches on several processes are passed as ``check(batch, where,
            processes)``, and need a check that places them (a `BatchFeed`).

    Raises:
        TypeError: when ``data`` is neither iterable nor callable.
        ValueError: (while iterating) when an epoch yields no batches, ends before the restored position, the
            restored position's input state does not fit this run (`UnrestorableState`), or per-process
            batches of several processes come without a ``check`` to place them.

    Examples:
        >>> stream = BatchStream([10, 11, 12], DataPosition(0, 1), epochs=2)
        >>> list(stream), stream.position(3)
        ([11, 12, 10, 11, 12], DataPosition(epoch=1, index=1))
    """

    def __init__(
        self,
        data: Any,
        start: DataPosition | None = None,
        epochs: int | None = None,
        check: Callable[..., Any] | None = None,
    ):
        self._data = data
        self._kind = _kind(data, "train_data")
        self._start = start or DataPosition()
        self._epochs = epochs
        self._check = check
        self._lengths: dict[int, int] = {}  # written by whichever thread reads the data (prefetch)
        # A sized re-iterable (a list) has the same known length every epoch: a position at the end of an
        # epoch then reads as the start of the next, whether or not the reader has looked past it.
        self._length = len(data) if self._kind == "iterable" and isinstance(data, Sized) else None
        # (epoch, batches read in it) -> the source iterator's state right after them (stateful sources only);
        # written by the reading thread, pruned by `position` up to the batch the steps have consumed.
        self._states: dict[tuple[int, int], Any] = {(self._start.epoch, self._start.index): self._start.state}
        self._cursor = (0, self._start.epoch, self._start.index)  # (consumed, epoch, index) of the last position

    @property
    def data(self) -> Any:
        """The data (after `peek`, an iterator is replaced by one that still yields the peeked batch)."""
        return self._data

    @property
    def epochs(self) -> int | None:
        """The epochs the stream ends after (None: it ends only where an iterator ends)."""
        return self._epochs

    def peek(self, epoch: int = 0) -> Any:
        """The first batch of ``epoch`` (for building the state), checked, without consuming an iterator's
        batch (a grain iterator is put back with ``set_state``). Not placed.

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
            raise ValueError(f"train_data yielded no batches (epoch {epoch}): pass at least one batch.")
        return self._checked(first, f"train_data batch 0 of epoch {epoch}", per_process)

    def _source(self, epoch: int) -> Any:
        """What epoch ``epoch`` iterates (an iterable or the iterator itself)."""
        if self._kind == "function":
            source = self._data(epoch)
            if not isinstance(source, Iterable):
                raise TypeError(
                    f"train_data({epoch}) returned {type(source).__name__}, not an iterable of batches."
                )
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
                raise ValueError(
                    f"BatchStream(check=None) cannot place per-process (grain) batches on {jax.process_count()} "
                    "processes: pass check= a jaxdist.training.data.BatchFeed (it checks the global batch the "
                    "processes' shares form and places each process's rows on the strategy's replicas)."
                )
            count = self._resume(it, stateful, epoch, skip)
            for batch in it:
                if stateful:
                    self._states[(epoch, count + 1)] = it.get_state()
                yield self._checked(batch, f"train_data batch {count} of epoch {epoch}", per_process)
                count += 1
            if count == 0:
                raise ValueError(f"train_data yielded no batches in epoch {epoch}: pass at least one batch.")
            self._lengths[epoch] = count
            epoch, skip = epoch + 1, 0

    def _resume(self, it: Iterator[Any], stateful: bool, epoch: int, skip: int) -> int:
        """Bring ``it`` to batch ``skip`` of ``epoch``: restore the recorded state of a stateful source, else
        read and drop ``skip`` batches. Returns ``skip``."""
        state = self._start.state if (epoch, skip) == (self._start.epoch, self._start.index) else None
        if skip and stateful and state is not None:
            if isinstance(state, UnrestorableState):
                raise state.error
            it.set_state(state)
            return skip
        for count in range(skip):
            if next(it, _END) is _END:
                raise ValueError(
                    f"train_data has {count} batches in epoch {epoch}, but the restored position is batch "
                    f"{skip} of that epoch: the data differs from the run that wrote the checkpoint (pass the "
                    "same deterministic data, or start from a fresh checkpoint_dir)."
                )
        return skip

    def position(self, consumed: int) -> DataPosition:
        """The position after ``consumed`` batches of this stream have been used (with the source iterator's
        state after them, for a stateful source)."""
        epoch, index = self._start.epoch, self._start.index + consumed
        if self._kind != "iterator":
            # Walked on from the last position asked for (fit asks after every step): a constant cost per
            # step however many epochs lie behind, not one that grows with the steps.
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


def _rows(batch: Any) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves or not np.shape(leaves[0]):
        raise ValueError("a batch needs arrays with a batch axis 0.")
    return int(np.shape(leaves[0])[0])


def eval_batches(
    data: Any,
    multiple: int,
    name: str = "eval_data",
    prepare: Callable[[Any, str], Any] | None = None,
) -> Iterator[tuple[Any, np.ndarray, int]]:
    """``(batch, weights, rows)`` for each batch of ``data``, padded to a multiple of ``multiple`` rows.

    Padding repeats the last real row (so no loss sees made-up zeros) and gets weight 0; ``rows`` is the
    number of real rows. ``data`` is a re-iterable, an iterator, or a function of no arguments returning one;
    ``prepare(batch, where)``, if given, maps each batch first (e.g. to ``(x, y)``: only what is used is padded).

    Raises:
        TypeError: when ``data`` is neither iterable nor callable.

    Examples:
        >>> import numpy as np
        >>> [(b.shape, w.tolist(), n) for b, w, n in eval_batches([np.ones((3, 2))], 4)]
        [((4, 2), [1.0, 1.0, 1.0, 0.0], 3)]
    """
    source = data() if _kind(data, name) == "function" else data
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
