"""Checkpoints with orbax-checkpoint: restorable onto any strategy and device count.

A checkpoint is one orbax step directory with two items: ``state`` (the arrays, written by orbax's
`PyTreeCheckpointHandler` from global `jax.Array`s, so the files do not depend on how many devices
held them) and ``meta`` (JSON: the step, the data position, the model kind, a fingerprint of the
state's tree paths, shapes and dtypes, and each leaf's checksums).

* Any strategy: `Checkpointer.restore` asks orbax for arrays with the shardings of the state it is
  given (in the NEW strategy's layout), so a checkpoint written under ``MirroredStrategy`` on 8
  devices restores under ``OneDeviceStrategy`` and back.
* Atomic: orbax writes into a temporary directory and renames it when complete; a process killed
  during a save leaves the previous checkpoints untouched, and the half-written directory is never
  listed (and is removed the next time the directory is opened).
* Checked: the fingerprint is compared before any array is read (another model's checkpoint is an
  error naming the first differing leaves), and each leaf's checksums after (orbax's array data has
  none). Damage is one `CheckpointCorruptedError` naming the step, the directory, the newest older
  checkpoint that restores (`Checkpointer.read`) and the fix.
* Asynchronous by default: ``save`` returns once the arrays are in host memory and a background
  thread writes and renames the files. One save is in flight at a time; one that fails is raised by
  the next `Checkpointer.poll`, ``save``, ``wait_until_finished`` or ``close``. A checkpointer left
  open finishes its save when the program ends.
* The parts: the metadata and the fit check (`_metadata`), reading and the search for an intact
  checkpoint (`_reading`), the save in flight (`_writes`), the exit hook (`_at_exit`), unfinished
  saves and rollbacks (`_directory`), damage (`_damage`), the one-writer claim (`_claim`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp

from jaxdist.training.checkpoints._at_exit import forget, keep_open, reserve_threads
from jaxdist.training.checkpoints._claim import Claim, live_claim
from jaxdist.training.checkpoints._damage import checksums, missing_parts
from jaxdist.training.checkpoints._directory import abandon, tidy
from jaxdist.training.checkpoints._foreign import advice, is_orbax_checkpoint
from jaxdist.training.checkpoints._metadata import (
    FORMAT,
    check_fits,
    check_same,
    fingerprint,
    node_types,
)
from jaxdist.training.checkpoints._reading import (
    check_target,
    read_intact,
    read_iterator_state,
    read_meta,
    read_state,
)
from jaxdist.training.checkpoints._storage import (
    CheckpointSaveError,
    check_directory,
    quiet_after_failure,
    quiet_orbax,
)
from jaxdist.training.checkpoints._tree import to_disk
from jaxdist.training.checkpoints._writes import (
    InFlight,
    array_handlers,
    operation,
    release_stalled,
)
from jaxdist.training.data import save_args

__all__ = ["Checkpointer"]

_T = TypeVar("_T")
LOG = logging.getLogger("jaxdist.training.checkpoint")

class Checkpointer:
    """Save and restore a training state (any pytree of arrays) plus JSON metadata in ``directory``.

    Also the own-loop path's checkpointing: ``ckpt.save(step, state)`` / ``ckpt.restore(state)``.

    Args:
        directory: where the step directories go (created when missing).
        max_to_keep: how many of the latest checkpoints to keep (None: all).
        async_save: write in a background thread (``save`` returns once the arrays are on the host);
            False: ``save`` returns when the checkpoint is complete.

    Raises:
        ValueError: for ``max_to_keep < 1``, or a ``directory`` that is ``""``, a regular file, or
            cannot be created (a read-only filesystem, no permission). An existing read-only
            directory opens (to restore from); its first ``save`` raises.

    Examples:
        >>> import tempfile, jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> state = strategy.mirror({"w": jnp.arange(3.0)})
        >>> ckpt = Checkpointer(tempfile.mkdtemp())
        >>> _ = ckpt.save(7, state, {"note": "hi"})   # written in the background
        >>> restored, meta = ckpt.restore(state)       # waits for it
        >>> restored["w"].tolist(), meta["step"], meta["note"]
        ([0.0, 1.0, 2.0], 7, 'hi')
        >>> ckpt.close()

        As a context manager (closed at the block's end; one left open is closed when the program
        ends):

        >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
        ...     _ = ckpt.save(8, state)
        >>> ckpt.all_steps()
        [8]
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3, *,
                 async_save: bool = True):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep={max_to_keep!r} must be an int >= 1 (or None to keep "
                             "all).")
        if not isinstance(async_save, bool):
            raise ValueError(f"async_save={async_save!r} must be True or False.")
        # Created here (process 0) for a named error where orbax would raise a bare OSError.
        self.directory = check_directory(directory, "directory", create=jax.process_index() == 0,
                                         probe=False)
        self.async_save = async_save
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            # What a killed save left behind is removed here, synchronously (`_remove_unfinished`):
            # orbax does it in a background thread that its ``close`` does not wait for (a
            # checkpointer closed early then prints "cannot schedule new futures after shutdown").
            cleanup_tmp_directories=False,
            enable_async_checkpointing=async_save,
            # Orbax names its barriers by the step alone, so two checkpointers saving one step at
            # once (fit's backups and a ModelCheckpoint's best) would meet at each other's
            # barriers; a prefix from the directory's last two names (the same on every host)
            # keeps them apart.
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                barrier_sync_key_prefix=_barrier_prefix(self.directory)),
        )
        # else a live writer's save in flight, or its rollback
        if live_claim(self.directory) is None:
            tidy(self.directory)
        handler = ocp.PyTreeCheckpointHandler(**array_handlers())
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add("state", ocp.args.PyTreeSave, handler)
        registry.add("state", ocp.args.PyTreeRestore, handler)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              handler_registry=registry)
        self._writes = InFlight(self._manager)  # the save in flight, and how it ended
        self._opened_with = self._manager.latest_step()
        self._closed = False
        self._claim: Claim | None = None
        keep_open(self)  # closed when the program ends, if not before

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: Any) -> None:
        """`close`; with an exception on its way out, a failed save is a note on it."""
        if error is None:
            self.close()
            return
        try:
            self.close()
        except RuntimeError as failed:
            error.add_note(str(failed))

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first (a save in flight is waited for)."""
        self._join()
        return sorted(self._manager.all_steps())

    @property
    def newest_written(self) -> int | None:
        """The newest checkpoint known complete, without waiting (any thread may read it): this
        checkpointer's newest finished save, else the newest when it was opened; None: none."""
        return self._writes.newest if self._writes.newest is not None else self._opened_with

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None (waits like `all_steps`)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: Mapping[str, Any] | None = None,
             data_iterator: Any = None) -> str:
        """Write ``state`` as checkpoint ``step``, atomically (dropping the oldest past
        ``max_to_keep``).

        Args:
            step: the step number (an int; saving an existing step again is a no-op when the
                contents are the same, an error when they differ).
            state: a pytree of arrays (global `jax.Array`s of any layout, or numpy).
            meta: extra JSON-serializable metadata stored beside it.
            data_iterator: the input iterator (a grain iterator, or a distributed iterator over
                one): its ``get_state()``, one file per process
                (`jaxdist.training.data._input_state`); read it back with `data_iterator_state`.

        It first waits for the save in flight. With ``async_save`` it returns once the arrays are in
        host memory (the state may then change or be donated). Each leaf's checksums
        (`checkpoint_damage.checksums`, on the devices) go into the metadata for `restore` to check.

        Returns:
            The checkpoint's directory (complete once `poll` reports it, or after
            `wait_until_finished`).

        Raises:
            TypeError: for metadata that is not JSON-serializable, or a ``data_iterator`` without
                ``get_state()``.
            CheckpointConflictError: when another live run holds the directory (`claim`), or
                ``step`` exists with other contents (its saved checksums differ).
            CheckpointSaveError: (a RuntimeError) when this save, or an earlier background one (see
                `poll`), failed: naming the step, the directory, the last complete checkpoint and
                the fix.
        """
        step = int(step)
        path = os.path.join(self.directory, str(step))
        self._raise_failure()
        if jax.process_index() == 0 and not os.path.isdir(self.directory):
            gone = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), self.directory)
            raise CheckpointSaveError(step, self.directory, None, gone) from None
        self.claim()
        if step in self._manager.all_steps():  # complete, or being written
            self._join()
            check_same(self.directory, step, self.meta(step), state)
            return path
        info = {**dict(meta or {}), "format": FORMAT, "step": step,
                "fingerprint": fingerprint(state), "node_types": node_types(state)}
        items = {"state": ocp.args.PyTreeSave(to_disk(state)), "meta": ocp.args.JsonSave(info)}
        if data_iterator is not None:
            info["data_iterator"], items["data_iterator"] = save_args(data_iterator)
        try:  # here, not in the background thread that writes it
            json.dumps(info)
        except (TypeError, ValueError) as error:
            raise TypeError(f"meta={dict(meta or {})!r} is not JSON-serializable ({error}): pass "
                            "JSON values.") from None
        # Before the copy to host (and any donation), while the save in flight is written.
        info["checksums"] = checksums(state)
        self._join()  # one save at a time (orbax would wait for it too)
        self._raise_failure()
        reserve_threads()  # to finish it at exit, where the interpreter refuses new threads
        self._writes.quiet.enter_context(quiet_orbax())  # until the save has ended (`_join`)
        try:
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as error:
            self._writes.quiet.close()
            self._writes.any_failed = True
            quiet_after_failure()  # orbax's other threads of this save may report it again, later
            # orbax raises it again to every waiter: take this turn now
            with contextlib.suppress(Exception):
                with quiet_orbax():
                    self._manager.wait_until_finished()
            release_stalled(operation())  # its threads left waiting for a part that failed
            LOG.debug("saving checkpoint step %d failed", step, exc_info=error)
            failed = CheckpointSaveError(step, self.directory, self.latest_step(), error)
            failed.__context__ = error  # kept for debugging, not printed (``from None``)
            raise failed from None
        if self.async_save:
            self._writes.started(step, path)
        else:
            self._writes.done(step, path)
        return path

    def claim(self) -> None:
        """Claim the directory for this run's saves (`save` does at its first call; ``fit`` at its
        start), until `close`. A second live run on it is refused, as two writers lose one run's
        checkpoints (`jaxdist.training.checkpoints._claim`). Process 0 claims for all processes.

        Raises:
            CheckpointConflictError: when another live run holds the directory (naming it, with the
                fix), or this run's claim was taken over.
            ValueError: when the directory cannot be written (read-only, full, ...).
        """
        if jax.process_index() != 0:
            return
        if self._claim is not None:
            self._claim.check()
            return
        check_directory(self.directory, "directory", consequence="Nothing was saved.")
        self._claim = Claim.acquire(self.directory, "checkpoint_dir")

    def _join(self) -> None:
        self._writes.join()

    def _raise_failure(self) -> None:
        failed = self._writes.take_failure()
        if failed is None:
            return
        step, error = failed
        LOG.debug("saving checkpoint step %d failed in the background", step, exc_info=error)
        clear = CheckpointSaveError(step, self.directory, self.latest_step(), error,
                                    background=True)
        clear.__context__ = error  # kept for debugging, not printed (``from None``)
        raise clear from None

    def poll(self, wait: bool = False) -> list[tuple[int, str]]:
        """The saves that became complete since the last call, as ``(step, path)``, oldest first.

        Never waits (``fit`` calls it after every step) unless ``wait``. A synchronous save is
        reported by the next call.

        Args:
            wait: wait for the save in flight first.

        Returns:
            ``[(step, path), ...]``, possibly empty.

        Raises:
            CheckpointSaveError: (a RuntimeError) when a background save failed (raised once),
                naming its step, the last complete checkpoint and the fix.

        Examples:
            >>> import tempfile, numpy as np
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> _ = ckpt.save(1, {"w": np.zeros(2)})
            >>> [step for step, path in ckpt.poll(wait=True)], ckpt.poll()
            ([1], [])
            >>> ckpt.close()
        """
        if wait or self._writes.ended:
            self._join()
        self._raise_failure()
        return self._writes.take_finished()

    def wait_until_finished(self) -> None:
        """Wait until the save in flight (if any) is complete.

        Raises:
            RuntimeError: when it (or an earlier background save not yet reported) failed.
        """
        self._join()
        self._raise_failure()

    def read(self, fn: Callable[[int], _T], step: int | None = None, *,
             step_argument: str = "step") -> _T:
        """``fn(step)`` for checkpoint ``step`` (default: the latest), with ONE clear error when it
        is damaged.

        Every read of a checkpoint goes through here (`restore`, `meta`, `data_iterator_state`,
        ``Trainer.restore`` and ``fit``'s resume). When ``fn`` raises `CheckpointCorruptedError`,
        ``fn`` is tried on the older checkpoints, newest first, and the error raised names the first
        one it reads without error (so "intact" means it restores into the same target, not that its
        files exist), or says that none does. A read nested in another (``meta`` inside ``restore``)
        leaves the search to the outer one.

        Args:
            fn: reads checkpoint ``step`` (e.g. with `restore` and `data_iterator_state`) and
                returns anything.
            step: which checkpoint.
            step_argument: the caller's argument that picks a step, named in the error's fix.

        Returns:
            What ``fn`` returns.

        Raises:
            FileNotFoundError: when there is no such checkpoint.
            CheckpointCorruptedError: when ``fn`` finds it damaged.

        Examples:
            The state and the input position of one checkpoint, read as one:

            >>> import tempfile, numpy as np, jaxdist as jd
            >>> state = jd.OneDeviceStrategy().mirror({"w": np.zeros(2, np.float32)})
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> _ = ckpt.save(5, state)
            >>> (restored, meta), it = ckpt.read(lambda s: (ckpt.restore(state, s),
            ...                                             ckpt.data_iterator_state(s)))
            >>> meta["step"], it
            (5, None)
            >>> ckpt.close()
        """
        return read_intact(fn, self._step(step), self.all_steps, self.directory, step_argument)

    def meta(self, step: int | None = None) -> dict:
        """Checkpoint ``step``'s JSON metadata (default: the latest; waits for a save in flight).

        Raises:
            FileNotFoundError: when there is no such checkpoint.
            ValueError: when the directory holds a checkpoint not written by jaxdist.training (the
                message shows the plain orbax that reads it and ``Trainer.load_state``).
            CheckpointCorruptedError: when its metadata file is damaged or missing.
        """
        return self.read(lambda s: read_meta(self._manager, self.directory, s), step)

    def delete(self, step: int) -> None:
        """Delete checkpoint ``step`` (e.g. a damaged one; a save in flight is waited for).

        Raises:
            FileNotFoundError: when there is no such checkpoint.

        Examples:
            >>> import tempfile, numpy as np
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> for step in (1, 2):
            ...     _ = ckpt.save(step, {"w": np.zeros(2)})
            >>> ckpt.delete(2)
            >>> ckpt.all_steps()
            [1]
            >>> ckpt.close()
        """
        self._manager.delete(self._step(step))

    def abandon_after(self, step: int) -> None:
        """Delete every checkpoint after ``step`` (a rollback: they belong to the run being
        replaced), atomically as far as any later run can tell: the decision is written to a record
        file first (``os.replace``), and a checkpointer opened on this directory after an
        interruption finishes the deletions before it lists the steps. So no interruption brings an
        abandoned step back as the newest.

        Args:
            step: the step to keep as the newest.

        Examples:
            >>> import tempfile, numpy as np
            >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
            ...     for s in (10, 20, 30):
            ...         _ = ckpt.save(s, {"w": np.zeros(2)})
            ...     ckpt.abandon_after(10)
            ...     ckpt.all_steps()
            [10]
        """
        later = [s for s in self.all_steps() if s > int(step)]
        if not later:
            return
        abandon(self.directory, step, later, self._manager.delete)

    def check_writer(self) -> None:
        """Raise unless the checkpoints here are jaxdist.training's (``fit`` asks before it writes):
        the newest has jaxdist's items (one missing is damage, which reading it reports), and the
        directory is not itself one orbax checkpoint.

        Raises:
            ValueError: naming the checkpoint, with the two lines of plain orbax and
                ``Trainer.load_state`` that continue it
                (`jaxdist.training.checkpoints._foreign.advice`).

        Examples:
            >>> import tempfile, numpy as np
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> _ = ckpt.save(1, {"w": np.zeros(2)})
            >>> ckpt.check_writer()  # jaxdist's: silent
            >>> ckpt.close()
        """
        latest = self.latest_step()
        if latest is None and is_orbax_checkpoint(self.directory):
            raise ValueError(advice(self.directory, None))
        # Another writer's step has neither of jaxdist's items.
        if latest is not None and missing_parts(os.path.join(self.directory, str(latest))) is None:
            raise ValueError(advice(self.directory, latest))

    def _step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                if is_orbax_checkpoint(self.directory):
                    raise ValueError(advice(self.directory, None))
                raise FileNotFoundError(f"no checkpoint in {self.directory!r} (it has no complete "
                                        "step directory).")
            return steps[-1]
        if int(step) not in steps:
            raise FileNotFoundError(f"no checkpoint for step={step} in {self.directory!r}; it has "
                                    f"steps {steps}.")
        return int(step)

    def check(self, like: Any, meta: Mapping[str, Any]) -> None:
        """Raise ValueError, naming the leaves, when checkpoint ``meta`` does not fit ``like``."""
        check_fits(self.directory, like, meta)

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict]:
        """Read checkpoint ``step`` (default: the latest) into the layout of ``like``.

        Args:
            like: a state with the target structure and layout: live arrays (e.g. from
                ``strategy.create_variables`` under the strategy to restore onto) or
                `jax.ShapeDtypeStruct`s with shardings. Checkpoints restore onto any strategy and
                device count.
            step: which checkpoint.

        Returns:
            ``(state, meta)``: the arrays with ``like``'s shardings, and the checkpoint's metadata.

        Raises:
            FileNotFoundError: when there is no such checkpoint.
            ValueError: when it was not written by jaxdist.training or does not fit ``like`` (the
                message names the differing leaves).
            TypeError: when a leaf of ``like`` has no layout (a numpy array), naming it.
            CheckpointCorruptedError: when its files are damaged, or a restored leaf does not match
                the checksums saved with it (naming the leaf), naming the newest older checkpoint
                that restores into ``like`` (see `read`).
        """
        check_target(like)

        def read(at: int) -> tuple[Any, dict]:
            info = self.meta(at)
            self.check(like, info)
            return read_state(self._manager, self.directory, at, like, info), info

        return self.read(read, step)

    def data_iterator_state(self, step: int | None = None) -> Any:
        """This process's input iterator state saved with checkpoint ``step`` (default: the latest),
        for ``iterator.set_state(...)``; None when it was saved without ``data_iterator``.

        Raises:
            FileNotFoundError: when there is no such checkpoint.
            ValueError: when another number of processes saved a per-process state (see
                `jaxdist.training.data._input_state`; an ElasticIterator's state restores on any
                count).
            CheckpointCorruptedError: when its files are damaged (see `read`).

        Examples:
            >>> import grain, tempfile, numpy as np, jaxdist as jd
            >>> it = iter(grain.MapDataset.range(10).batch(2))
            >>> _ = next(it)
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> _ = ckpt.save(1, {"w": np.zeros(2)}, data_iterator=it)
            >>> again = iter(grain.MapDataset.range(10).batch(2))
            >>> again.set_state(ckpt.data_iterator_state())
            >>> next(again).tolist()
            [2, 3]
            >>> ckpt.close()
        """
        return self.read(lambda s: read_iterator_state(self._manager, self.directory, s,
                                                       self.meta(s)), step)

    def close(self) -> None:
        """Wait for the save in flight and release the directory (again: nothing to do).

        A checkpointer left open is closed when the program ends, normally or by an uncaught
        exception (after its traceback): every ``save`` that returned is then complete on disk.

        Raises:
            RuntimeError: when a background save failed and nothing raised it yet (see `poll`).
        """
        if self._closed:
            return
        self._closed = True
        forget(self)
        try:
            self._join()
        finally:
            try:
                with quiet_orbax():
                    self._manager.close()
            except Exception as error:
                # orbax raises a failed save again to each caller that waits for it
                if self._writes.any_failed or self._writes.last_step is None:
                    LOG.debug("closing the checkpoint manager of %r", self.directory,
                              exc_info=error)
                else:  # not seen yet: the newest save's (close waits for it)
                    self._writes.fail(self._writes.last_step, error)
            if self._claim is not None:
                self._claim.release()
                self._claim = None
        self._raise_failure()


def _barrier_prefix(directory: str) -> str:
    """The prefix of orbax's barrier names for ``directory``: its last two names, hashed.

    Examples:
        >>> a, b = _barrier_prefix("/mnt/a/run/backup"), _barrier_prefix("/home/me/run/backup")
        >>> a == b != _barrier_prefix("/r/best")
        True
    """
    tail = os.path.join(*os.path.normpath(directory).split(os.sep)[-2:])
    return "jaxdist-" + hashlib.sha1(tail.encode()).hexdigest()[:12]

