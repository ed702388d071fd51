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
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any

import jax
import numpy as np

__all__ = [
    "BatchChecker",
    "BatchStream",
    "DataPosition",
    "check_key",
    "describe",
    "eval_batches",
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

    Example:
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

    Example:
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
            return _pick(batch, input_key), (_pick(batch, target_key) if has_targets else None)
        present = sorted(map(str, batch))
        lacks = " and ".join(f"no {k!r} ({option}={value!r})" for k, option, value in missing)
        raise ValueError(
            f"{where} is a dict with keys {present} and {lacks}: name the keys that hold the inputs and the "
            f"targets, e.g. Trainer(..., {_suggest(present)})."
        )
    if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
        if len(batch) == 2 or (not need_targets and len(batch) == 1):
            return batch[0], (batch[1] if len(batch) == 2 else None)
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

    Cheap enough to run on every batch: the dtypes stay dtype objects (`describe` spells them out).

    Example:
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

    Example:
        >>> import numpy as np
        >>> describe(signature({"x": np.zeros((4, 2), np.float32)}))
        '((4, 2) float32)'
    """
    return "(" + ", ".join(f"{tuple(shape)} {np.dtype(dtype).name}" for shape, dtype in sig[1]) + ")"


class BatchChecker:
    """Brings each training batch to ``(x, y)`` on the host and checks it: structure, divisibility, shapes.

    The first batch fixes the signature (one compiled step); a later batch with other shapes is an error that
    names the fix, never a silent recompile. Called from the prefetch thread and from ``train_on_batch``.

    Args:
        replicas: the strategy's ``num_replicas_in_sync``.
        grad_accum_steps: micro-batches per step (the global batch must divide by ``replicas`` times this).
        input_key / target_key: the dict keys of the inputs and targets (see `split_batch`).

    Raises:
        ValueError: (when called) for a batch of the wrong structure, an indivisible first batch, or a batch
            whose shapes differ from the first one's.

    Example:
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

    def __call__(self, batch: Any, where: str) -> tuple[Any, Any]:
        """The training batch ``(x, y)``, checked."""
        pair = self.split(batch, where)
        sig = signature(pair)
        if self._signature is None:
            leaves = jax.tree.leaves(pair)
            rows = np.shape(leaves[0])[0] if leaves and np.shape(leaves[0]) else 0
            need = self.replicas * self.grad_accum_steps
            if rows % need:
                raise ValueError(
                    f"{where} has {rows} rows, which {self.replicas} replicas x "
                    f"grad_accum_steps={self.grad_accum_steps} do not divide: use a global batch that is a "
                    f"multiple of {need} (e.g. {-(-rows // need) * need}), dropping or padding the remainder."
                )
            self._signature = sig
        elif sig != self._signature:
            raise ValueError(
                f"{where} has structure/shapes {describe(sig)} ({sig[0]}), but the first training batch had "
                f"{describe(self._signature)} ({self._signature[0]}): every training batch needs the same "
                "structure and shapes (one compiled step); drop the ragged last batch or pad it."
            )
        return pair


class BatchStream:
    """The training batches from a position on, across epochs; maps a consumed count back to a position.

    Args:
        data: ``train_data`` (see the module docstring).
        start: where to start (a restored checkpoint's position); None for the beginning.
        epochs: stop after this many epochs in total (None: repeat until the trainer stops reading).
        check: ``check(batch, where) -> batch`` validates each batch (raises ValueError) and returns what
            the stream yields (e.g. a `BatchChecker` returns the pair ``(x, y)``).

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
        check: Callable[[Any, str], Any] | None = None,
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
                    batch = self._check(batch, f"train_data batch {count} of epoch {epoch}")
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
        while (length := self._lengths.get(epoch, self._length)) and index >= length:
            index -= length
            epoch += 1
        return DataPosition(epoch, index)


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

    Example:
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
