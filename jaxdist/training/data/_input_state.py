"""The input pipeline's position in checkpoints: grain iterator states, one file per process.

Each process's grain iterator reads its own shard, so each process has its own state.
`Checkpointer.save(..., data_iterator=it)` stores it as the checkpoint's ``data_iterator`` item
through grain's orbax handler (one ``process_<i>-of-<n>.json`` per process), and a restore on the
same number of processes gives every process back exactly its own state.

On another number of processes a per-process state has no exact meaning, so restoring one is an
error that names the fix, except for ``grain.experimental.ElasticIterator``, whose state (the
examples consumed globally) is the same on every process. The metadata keeps that state, so any
process count resumes from it: every global batch holds the same examples as in the run that wrote
it (their row order inside a batch follows the process count).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jaxdist.training.data._position import DataPosition, UnrestorableState

__all__ = ["IteratorSnapshot", "describe", "restore_args", "restored_position", "save_args",
           "snapshot", "state_for_process"]

FORMAT = "jaxdist.data_iterator/1"
# grain.experimental.ElasticIterator: the same on every shard
_PORTABLE_KEYS = {"global_next_index"}


def _grain_checkpoint() -> Any:
    try:
        import grain.checkpoint as grain_checkpoint
    except ImportError as error:
        raise ImportError("data_iterator= saves the input iterator's state with grain's orbax "
                          "handler, and grain is not installed: pip install 'jaxdist[grain]' (or "
                          "grain>=0.2.18).") from error
    return grain_checkpoint


class IteratorSnapshot:
    """A fixed iterator state in the shape grain's orbax handler saves and restores (JSON bytes).
    Taken at save time, so an asynchronous save writes the state of the step it saves.

    Args:
        state: the iterator's state: a dict (grain ``DatasetIterator``), JSON bytes (grain
            ``DataLoaderIterator``), or anything JSON-serializable.

    Raises:
        TypeError: for a state that is not JSON-serializable.

    Examples:
        >>> snap = IteratorSnapshot({"next_index": 3})
        >>> back = IteratorSnapshot()
        >>> back.set_state(snap.get_state())
        >>> back.state
        {'next_index': 3}
    """

    def __init__(self, state: Any = None):
        self.state = state
        if state is not None:
            self.get_state()  # fail at save time, naming the state, not inside orbax

    def get_state(self) -> bytes:
        """The state as JSON bytes (what grain's handler writes)."""
        encoding, value = (("bytes", self.state.decode()) if isinstance(self.state, bytes)
                           else ("json", self.state))
        try:
            return json.dumps({"format": FORMAT, "encoding": encoding, "state": value}).encode()
        except (TypeError, ValueError) as error:
            raise TypeError(f"the data iterator's state {self.state!r} is not JSON-serializable: "
                            "a data_iterator's get_state() must return a dict of JSON values or "
                            "JSON bytes, as grain's iterators do.") from error

    def set_state(self, data: bytes) -> None:
        """Read back what `get_state` wrote."""
        envelope = json.loads(data.decode())
        if not isinstance(envelope, dict) or envelope.get("format") != FORMAT:
            raise ValueError(f"a data_iterator item that jaxdist did not write: {data[:200]!r}")
        value = envelope["state"]
        self.state = value.encode() if envelope["encoding"] == "bytes" else value

    def start_prefetch(self) -> None:
        """Nothing to prefetch (grain's handler calls it after a restore)."""


def _portable(state: Any) -> bool:
    return isinstance(state, Mapping) and set(state) == _PORTABLE_KEYS


def describe(state: Any) -> dict:
    """The checkpoint metadata entry for a saved iterator state: the process count that wrote it,
    and the state itself when it is valid on any process count (ElasticIterator), else None.

    Examples:
        >>> describe({"global_next_index": 64})
        {'processes': 1, 'portable': {'global_next_index': 64}}
        >>> describe({"next_index": 2})
        {'processes': 1, 'portable': None}
    """
    return {"processes": jax.process_count(), "portable": dict(state) if _portable(state) else None}


def snapshot(data_iterator: Any) -> IteratorSnapshot:
    """`IteratorSnapshot` of ``data_iterator``'s current state (an `IteratorSnapshot` as it is).

    Raises:
        TypeError: when ``data_iterator`` has no ``get_state()``, or its state is not JSON.
    """
    if isinstance(data_iterator, IteratorSnapshot):
        return data_iterator
    get_state = getattr(data_iterator, "get_state", None)
    if not callable(get_state):
        raise TypeError(f"data_iterator={data_iterator!r} (type {type(data_iterator).__name__}) "
                        "has no get_state(): pass the iterator the training loop reads, e.g. "
                        "iter(strategy.distribute_datasets_from_function(fn)) over a grain "
                        "dataset, or a grain iterator itself.")
    return IteratorSnapshot(get_state())


def save_args(data_iterator: Any) -> tuple[dict, Any]:
    """``(metadata entry, orbax args)`` that save ``data_iterator``'s state (see `describe`).

    Raises:
        TypeError: see `snapshot`.
        ImportError: when grain is not installed.
    """
    snap = snapshot(data_iterator)
    return describe(snap.state), _grain_checkpoint().CheckpointSave(item=snap)


def restore_args(holder: IteratorSnapshot) -> Any:
    """The orbax args that read this process's saved state into ``holder``."""
    return _grain_checkpoint().CheckpointRestore(item=holder)


def state_for_process(entry: Mapping[str, Any] | None, read: Callable[[], Any], where: str) -> Any:
    """This process's iterator state from a checkpoint's metadata ``entry`` (`describe`).

    Args:
        entry: the checkpoint's ``data_iterator`` metadata, or None when it has none.
        read: reads this process's saved state (through grain's handler); called only when the
            process count matches.
        where: the checkpoint, for messages (e.g. ``"checkpoint_dir='/ckpt' step 40"``).

    Returns:
        The state, or None when the checkpoint holds none.

    Raises:
        ValueError: when the checkpoint was written by another number of processes and its state is
            per-process (not an ElasticIterator's), naming both counts and the fixes.

    Examples:
        >>> state_for_process({"processes": 4, "portable": {"global_next_index": 96}}, None, "ckpt")
        {'global_next_index': 96}
    """
    if entry is None:
        return None
    saved, here = int(entry["processes"]), jax.process_count()
    if saved == here:
        return read()
    if entry.get("portable") is not None:
        return dict(entry["portable"])
    raise ValueError(f"{where} holds the input iterator state of {saved} processes (one per "
                     f"process, each for its own shard), but this run has {here}: a per-process "
                     "position cannot be mapped onto another process count. Fix: resume with "
                     f"{saved} processes, or read the data with "
                     "grain.experimental.ElasticIterator(dataset, global_batch_size, "
                     "grain.sharding.ShardByJaxProcess()), whose position is valid on any process "
                     "count (for a checkpoint written from then on).")


def restored_position(position: Mapping[str, Any], read_state: Callable[[], Any]) -> DataPosition:
    """The `DataPosition` a trainer resumes from: the checkpoint's ``{"epoch", "index"}`` with this
    process's iterator state (``read_state()``). A state that does not fit this run (``read_state``
    raises ValueError) becomes an `UnrestorableState`.

    Examples:
        >>> restored_position({"epoch": 1, "index": 3}, lambda: None)
        DataPosition(epoch=1, index=3)
    """
    try:
        state = read_state()
    except ValueError as error:
        state = UnrestorableState(error)
    return dataclasses.replace(DataPosition(int(position["epoch"]), int(position["index"])),
                               state=state)
