"""Distributed input: global batches placed on the replicas, each process placing only its own rows.

``strategy.experimental_distribute_dataset(iterable)`` takes an iterable of GLOBAL batches (pytrees of
arrays whose axis 0 is the global batch). ``strategy.distribute_datasets_from_function(fn)`` calls
``fn(InputContext)`` once per process for an iterable of that process's batches. Either way every batch comes
out as global `jax.Array`s split on axis 0 over the replicas, built with
`jax.make_array_from_process_local_data` (no process ever transfers rows it does not own), and a background
thread keeps ``prefetch`` batches in flight to the devices so the step rarely waits on the host.

grain (the JAX ecosystem's data loader) plugs in as it is: ``fn(ctx)`` may return a ``grain.MapDataset``,
``grain.IterDataset`` or ``grain.DataLoader`` that reads this process's share, e.g.
``grain.experimental.ElasticIterator(examples, global_batch_size, grain.sharding.ShardByJaxProcess())`` or
``examples[ctx.input_pipeline_id::ctx.num_input_pipelines].batch(per_process_batch)``. Iterators over a source
with ``get_state`` / ``set_state`` (every grain iterator) have them too, exact despite the prefetch thread
(`DistributedIterator.get_state`), so a checkpoint can hold the input's position
(``jd.training.Checkpointer.save(..., data_iterator=it)``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from jaxdist.replicate.layouts import on_mesh
from jaxdist.strategies.layout import LayoutPolicy, mark_placed_batch

__all__ = [
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "argument_layouts",
    "batch_leaf_layout",
    "check_divisible",
    "check_sequence",
    "kept",
    "place_batch",
    "replicas_on_this_process",
    "sharding_off",
]



@dataclasses.dataclass(frozen=True)
class InputContext:
    """What an input function needs to know to read its share of the data (tf.distribute.InputContext).

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
            raise ValueError(
                f"input_pipeline_id={self.input_pipeline_id} must be in [0, {self.num_input_pipelines})."
            )
        if self.num_replicas_in_sync < 1:
            raise ValueError(f"num_replicas_in_sync={self.num_replicas_in_sync} must be >= 1.")

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch each replica gets from a global batch of ``global_batch_size``.

        Raises:
            ValueError: when the replicas do not divide the global batch.
        """
        return global_batch_size // check_divisible(global_batch_size, self.num_replicas_in_sync)


def check_divisible(batch: int, replicas: int, where: str = "global batch", axes: tuple[str, ...] = ()) -> int:
    """``replicas``, after checking that it divides ``batch`` rows (``axes``: the batch axes, for the message).

    Raises:
        ValueError: naming the counts, the batch axes and the two nearest batch sizes that work.

    Examples:
        >>> check_divisible(64, 8)
        8
        >>> check_divisible(5, 8)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: num_replicas_in_sync=8 does not divide global batch 5: each replica needs at least one row: ...
    """
    if batch % replicas:
        up = -(-batch // replicas) * replicas
        down = batch // replicas * replicas
        over = f" (the product of batch_axes={axes})" if len(axes) > 1 else ""
        fix = (f"drop the remainder (batch {down}) or pad to {up}" if down else
               f"each replica needs at least one row: give at least {replicas} rows (a multiple of {replicas}), "
               "or a strategy with fewer replicas (jd.OneDeviceStrategy(), or devices= / batch_axes= naming fewer)")
        raise ValueError(f"num_replicas_in_sync={replicas}{over} does not divide {where} {batch}: {fix}.")
    return replicas


def check_sequence(policy: LayoutPolicy, shape: tuple[int, ...], where: str | None = None) -> None:
    """Check that ``policy``'s context axes divide the sequence dimension of a batch leaf of ``shape``.

    Raises:
        ValueError: naming the sequence length, the context axes and their sizes, and the fix.

    Examples:
        >>> import jax, jaxdist as jd
        >>> cp = jd.strategies.LayoutPolicy(mesh=jax.make_mesh((2, 4), ("data", "context")),
        ...                                 batch_axes="data", context_axes="context")
        >>> check_sequence(cp, (2, 10))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: sequence length 10 (axis 1 of the global batch) is not divisible by the context axes ...
    """
    n, axis = policy.context_size, policy.sequence_axis
    if n == 1 or len(shape) <= axis or shape[axis] % n == 0 or shape[axis] == 1:
        return
    sizes = {a: policy.mesh.shape[a] for a in policy.context_axes}
    raise ValueError(
        f"sequence length {shape[axis]} (axis {axis} of {where or 'the global batch'}) is not divisible by the "
        f"context axes {policy.context_axes} of sizes {sizes} ({n} parts): pad the sequence to "
        f"{-(-shape[axis] // n) * n} (a multiple of {n}), or pick a context_axes / context_parallelism that "
        f"divides {shape[axis]}."
    )


def replicas_on_this_process(policy: LayoutPolicy) -> int:
    """How many of ``policy``'s replicas this process's devices hold."""
    return len(policy.local_replicas)


def place_batch(policy: LayoutPolicy, batch: Any, *, process_local: bool = False, where: str | None = None) -> Any:
    """Place one batch (a pytree of arrays) split on axis 0 over ``policy``'s replicas (with context axes, its
    sequence dimension over them too: `LayoutPolicy.batch_layout`).

    Args:
        policy: the layout policy whose replicas get the rows.
        batch: the global batch, or with ``process_local=True`` this process's rows only.
        process_local: whether ``batch`` holds only this process's rows.
        where: how errors name the batch (e.g. ``"argument 1 (in batch_argnums)"``).

    Returns:
        The batch as global `jax.Array`s laid out with ``policy``'s batch sharding.

    Raises:
        ValueError: for a scalar leaf, a batch the replicas do not divide evenly, or a sequence the context
            axes do not divide.
    """
    n_proc = jax.process_count()
    if process_local and n_proc > 1 and policy.replicas_span_processes:
        raise ValueError(
            f"per-process input (distribute_datasets_from_function) on a mesh whose replicas span processes "
            f"(mesh {dict(policy.mesh.shape)}, batch axes {policy.batch_axes}: a model axis crosses processes), "
            "so no process owns a replica's rows alone: pass GLOBAL batches (experimental_distribute_dataset, "
            "the same batch on every process), or put the processes on a batch axis of the mesh."
        )
    leaves, treedef = jax.tree.flatten(batch)
    layouts = _batch_layouts(policy, batch, leaves, treedef, where, process_local)
    todo = [i for i, layout in enumerate(layouts) if layout is not None]
    if todo:
        if n_proc == 1:
            moved = _place_rows([layouts[i] for i in todo], [leaves[i] for i in todo])
        else:
            moved = [_place_process_rows(layouts[i], leaves[i], process_local, n_proc) for i in todo]
        for i, m in zip(todo, moved, strict=True):
            leaves[i] = m
    for leaf in leaves:  # the role these arrays carry (where the layout alone cannot say: FSDP)
        mark_placed_batch(leaf)
    return jax.tree.unflatten(treedef, leaves)


_HOST_BATCH_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # policy -> {signature: layouts}


def _batch_layouts(policy: LayoutPolicy, batch: Any, leaves: list[Any], treedef: Any, where: str | None,
                   process_local: bool) -> list[Any]:
    """`argument_layouts` of a batch, as a list over its leaves. A batch of host arrays (a training loop's,
    every step) is laid out by its structure and shapes alone: decided once per signature (its checks made
    then), not leaf by leaf at every step."""
    if not all(type(x) is np.ndarray for x in leaves):
        return treedef.flatten_up_to(argument_layouts(policy, batch, True, where, process_local=process_local))
    key = (treedef, tuple(x.shape for x in leaves), process_local)
    known = _HOST_BATCH_LAYOUTS.setdefault(policy, {})
    layouts = known.get(key)
    if layouts is None:
        layouts = treedef.flatten_up_to(argument_layouts(policy, batch, True, where, process_local=process_local))
        if len(known) >= 64:  # bounded: a few signatures per run (a last partial batch, evaluation)
            known.pop(next(iter(known)))
        known[key] = layouts
    return layouts


def sharding_off(sharding: Any, mesh: Any) -> bool:
    """Whether an array with ``sharding`` must be moved to be on ``mesh``: not on it (`on_mesh`), except one
    not laid out over any mesh (a single device's) on exactly the mesh's devices, which jax.jit takes as is.
    An array on another mesh over the same devices (say the user's, with Explicit axes) is moved: one program
    does not mix meshes."""
    if on_mesh(sharding, mesh):
        return False
    own = getattr(sharding, "mesh", None)
    return (own is not None and not own.empty) or sharding.device_set != set(mesh.devices.flat)


def kept(policy: LayoutPolicy, x: Any, batch: bool) -> bool:
    """Whether a step takes argument leaf ``x`` as it is (the one rule of calls, plans, on-device loops and
    distributed input): an array (or a `jax.ShapeDtypeStruct` with a sharding) on the strategy's mesh, except a
    batch leaf every replica holds whole (its rows are what the replicas share out); a Python value that is no
    batch leaf; a tracer (the step called inside another's trace). Anything else is placed: a batch leaf split
    over the replicas (a scalar one is an error), a variable in the variable layout.

    Examples:
        >>> import jax, numpy as np, jaxdist as jd
        >>> policy = jd.strategies.LayoutPolicy(jax.devices()[:1])
        >>> kept(policy, 0.1, batch=False), kept(policy, np.ones(2), batch=False)
        (True, False)
    """
    if isinstance(x, jax.core.Tracer):  # a step called inside another's trace: its values pass through
        return True
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = x.sharding
        if sharding is None or sharding_off(sharding, policy.mesh):
            return False
        return not (batch and policy.num_replicas > 1 and np.ndim(x) >= 1 and sharding.is_fully_replicated)
    return not batch and not isinstance(x, (np.ndarray, np.generic))


def argument_layouts(policy: LayoutPolicy, value: Any, batch: bool, where: str | None = None, *,
                     process_local: bool = False) -> Any:
    """The layout a step's call gives each leaf of argument ``value`` (a pytree; ``batch``: a declared batch),
    None for a leaf it takes as it is (`kept`): what a call places and what a plan describes, by one rule.

    Raises:
        ValueError: for a batch leaf that is a scalar, or whose rows the replicas (or sequence the context axes)
            do not divide.

    Examples:
        >>> import jax, numpy as np, jaxdist as jd
        >>> policy = jd.strategies.LayoutPolicy(jax.devices()[:1])
        >>> argument_layouts(policy, {"x": np.ones((4, 2)), "lr": 0.1}, batch=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: batch leaf ['lr'] is a scalar: every leaf of a batch needs a batch axis 0 ...
    """
    if batch:
        def one(path, x):
            if kept(policy, x, True):
                return None
            leaf = f"{where or 'batch'} leaf {jax.tree_util.keystr(path) or '<root>'}"
            return batch_leaf_layout(policy, np.shape(x), leaf, where, process_local=process_local)

        return jax.tree_util.tree_map_with_path(one, value)
    leaves = jax.tree.leaves(value)
    if all(kept(policy, x, False) for x in leaves):
        return jax.tree.map(lambda _: None, value)
    shapes = jax.tree.map(lambda x: x if kept(policy, x, False) else jax.ShapeDtypeStruct(
        np.shape(x), jax.dtypes.result_type(x)), value)
    layouts = policy.variable_shardings(shapes)
    return jax.tree.map(lambda x, layout: None if kept(policy, x, False) else layout, value, layouts)


def batch_leaf_layout(policy: LayoutPolicy, shape: tuple[int, ...], leaf: str, where: str | None = None, *,
                      process_local: bool = False) -> jax.sharding.Sharding:
    """The layout a batch leaf of ``shape`` is placed in (`LayoutPolicy.batch_layout`), after the checks every
    placement makes (calls and plans alike).

    Args:
        policy: the layout policy.
        shape: the leaf's (global, or with ``process_local`` this process's) shape.
        leaf: how errors name the leaf (``"argument 1 (in batch_argnums) leaf ['x']"``).
        where: how errors name the batch.
        process_local: whether ``shape`` holds only this process's rows.

    Raises:
        ValueError: for a scalar leaf, rows the replicas do not divide, or a sequence the context axes do not.
    """
    if not shape:
        raise ValueError(
            f"{leaf} is a scalar: every leaf of a batch needs a batch axis 0 to split over the replicas (pass "
            "scalars as separate, non-batch arguments)."
        )
    if process_local:
        check_divisible(shape[0], replicas_on_this_process(policy),
                        "per-process batch" if where is None else f"the per-process rows of {where}",
                        policy.batch_axes)
    else:
        check_divisible(shape[0], policy.num_replicas,
                        "global batch" if where is None else f"the rows of {where}", policy.batch_axes)
    check_sequence(policy, shape, where)
    return policy.batch_layout(len(shape), shape)


def _place_rows(shardings: list[Any], values: list[Any]) -> list[jax.Array]:
    """One process holds the whole global batch: each device gets its own rows. On accelerators, one
    `jax.device_put` of every leaf (one batched transfer, dispatched in C++). On CPU devices, each device's rows
    are views of the host array (no host copy: measured cheaper there than a copy per leaf)."""
    if not shardings or any(d.platform != "cpu" for d in shardings[0].device_set):
        return jax.device_put(values, shardings)
    moved = []
    for sharding, x in zip(shardings, values, strict=True):
        if isinstance(x, jax.Array):
            moved.append(jax.device_put(x, sharding))
        else:
            host = np.asarray(x)
            moved.append(jax.make_array_from_callback(host.shape, sharding, lambda index, host=host: host[index]))
    return moved


def _place_process_rows(sharding, x: Any, process_local: bool, n_proc: int) -> jax.Array:
    """Several processes: each transfers only the rows its own devices hold."""
    shape = np.shape(x)
    if process_local:
        return jax.make_array_from_process_local_data(sharding, np.asarray(x), (shape[0] * n_proc, *shape[1:]))
    # The global batch: each process transfers the rows of its own devices, wherever the mesh puts them.
    host = x if isinstance(x, jax.Array) else np.asarray(x)
    return jax.make_array_from_callback(shape, sharding, lambda index: np.asarray(host[index]))


_END = object()
_STOP_SECONDS = 5.0  # how long set_state / close wait for the prefetch thread's read in progress


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def _has_state(source: Any) -> bool:
    return callable(getattr(source, "get_state", None)) and callable(getattr(source, "set_state", None))


class DistributedIterator:
    """Iterates placed global batches; a background thread keeps ``prefetch`` of them in flight.

    Call ``close()`` (or exhaust it, or use it as a context manager) to stop the thread early.

    When the source iterator has ``get_state()`` / ``set_state(state)`` (grain's ``DatasetIterator`` and
    ``DataLoaderIterator``), so does this iterator, and its state is the source's state after the last batch
    THIS iterator handed out, not after the batches the thread has read ahead: restoring it (in this or a new
    iterator over the same pipeline) continues with exactly the batch that would have come next.

    Examples:
        >>> import numpy as np, jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> with iter(strategy.experimental_distribute_dataset([np.ones((2, 1))] * 5)) as batches:
        ...     first = next(batches)   # the thread stops on leaving the block, batches in flight are dropped
        >>> first.shape
        (2, 1)
    """

    def __init__(self, source: Iterator[Any], place: Callable[[Any], Any], prefetch: int):
        self._source = source
        self._place = place
        self._prefetch = prefetch
        self._done = False
        self._stateful = _has_state(source)
        self._state = source.get_state() if self._stateful else None  # the state after the last batch handed out
        self._thread: threading.Thread | None = None
        if prefetch > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
            self._stop = threading.Event()
            self._start_thread()

    @property
    def source(self) -> Iterator[Any]:
        """The iterator the batches are read from (e.g. a grain ``DatasetIterator``), before placement."""
        return self._source

    def _start_thread(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._fill, name="jaxdist-prefetch", daemon=True)
        self._thread.start()

    def _read(self) -> tuple[Any, Any]:
        """The next placed batch and the source's state right after it (raises StopIteration at the end)."""
        batch = next(self._source)
        state = self._source.get_state() if self._stateful else None
        return self._place(batch), state

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item = self._read()
                except StopIteration:
                    break
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
            if not self._stop.is_set():
                self._put_final(_END)
        except BaseException as error:  # re-raised in the consumer's thread
            self._put_final(_Failure(error))

    def _put_final(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._prefetch == 0:
            try:
                batch, state = self._read()
            except StopIteration:
                self._done = True
                raise
            self._state = state
            return batch
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        batch, self._state = item
        return batch

    def _check_stateful(self, method: str) -> None:
        if not self._stateful:
            raise TypeError(
                f"{method}: this dataset's iterator ({type(self._source).__name__}) has no get_state() / "
                "set_state(state), so its position cannot be saved or restored: read the data with grain "
                "(grain.MapDataset, grain.IterDataset, grain.DataLoader), or give the iterator both methods."
            )

    def get_state(self) -> Any:
        """The source iterator's state after the last batch this iterator returned (batches read ahead by the
        prefetch thread do not count): save it with the model's checkpoint.

        Returns:
            What the source's ``get_state()`` returns (a dict for a grain ``DatasetIterator``, JSON bytes for a
            grain ``DataLoaderIterator``).

        Raises:
            TypeError: when the source iterator has no ``get_state`` / ``set_state``.

        Examples:
            >>> import grain, numpy as np, jaxdist as jd
            >>> strategy = jd.OneDeviceStrategy()
            >>> ds = grain.MapDataset.source(np.arange(12.0).reshape(6, 2)).batch(2)
            >>> it = iter(strategy.experimental_distribute_dataset(ds))
            >>> _ = next(it)
            >>> state = it.get_state()            # after batch 0, whatever the thread has read ahead
            >>> later = iter(strategy.experimental_distribute_dataset(ds))
            >>> later.set_state(state)
            >>> next(later).tolist(), next(it).tolist()
            ([[4.0, 5.0], [6.0, 7.0]], [[4.0, 5.0], [6.0, 7.0]])
        """
        self._check_stateful("get_state()")
        return copy.deepcopy(self._state)

    def set_state(self, state: Any) -> None:
        """Continue from ``state`` (a `get_state` result of an iterator over the same pipeline): the batches in
        flight are dropped and the next batch is the one that followed ``state``.

        Raises:
            TypeError: when the source iterator has no ``get_state`` / ``set_state``.
            RuntimeError: when the prefetch thread does not stop within 5 s (a read that does not return).
        """
        self._check_stateful("set_state(state)")
        if self._prefetch > 0:
            self._stop_thread()
        self._source.set_state(state)
        self._state = copy.deepcopy(state)
        self._done = False
        if self._prefetch > 0:
            self._start_thread()

    def _stop_thread(self) -> None:
        self._stop.set()
        deadline = time.monotonic() + _STOP_SECONDS
        thread = self._thread
        while thread is not None and thread.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):  # make room: a producer blocked on put sees the stop
                while True:
                    self._queue.get_nowait()
            thread.join(timeout=0.01)
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        if thread is not None and thread.is_alive():
            raise RuntimeError(
                f"the prefetch thread is still reading from the dataset after {_STOP_SECONDS:g} s: its read does not "
                "return, so the iterator cannot be repositioned; check the dataset for a blocking read."
            )

    def close(self) -> None:
        """Stop the prefetch thread and drop batches in flight."""
        self._done = True
        if self._prefetch > 0:
            with contextlib.suppress(RuntimeError):  # a daemon thread stuck in a read dies with the process
                self._stop_thread()

    def __enter__(self) -> DistributedIterator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if self._prefetch > 0 and not self._done:
            self._stop.set()


class DistributedDataset:
    """An iterable of placed global batches; each ``iter()`` starts a new pass (and a prefetch thread).

    Made by ``strategy.experimental_distribute_dataset`` or ``strategy.distribute_datasets_from_function``.
    Its iterators are `DistributedIterator` objects (with ``get_state`` / ``set_state`` over a grain source).

    Examples:
        >>> import numpy as np, jaxdist as jd
        >>> dataset = jd.OneDeviceStrategy().experimental_distribute_dataset([np.zeros((4, 2))] * 3)
        >>> len(list(dataset)), len(list(dataset))  # each pass iterates the source again
        (3, 3)
    """

    def __init__(self, make_source: Callable[[], Iterable[Any]], place: Callable[[Any], Any], prefetch: int):
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch={prefetch!r} must be an int >= 0 (0 places batches on demand).")
        self._make_source = make_source
        self._place = place
        self._prefetch = prefetch

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(iter(self._make_source()), self._place, self._prefetch)
