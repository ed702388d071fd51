"""Checkpoints with orbax-checkpoint: restorable onto any strategy and device count.

A checkpoint is one orbax step directory with two items: ``state`` (the arrays, written by orbax's
`PyTreeCheckpointHandler` from global `jax.Array`s, so the files do not depend on how many devices held
them) and ``meta`` (JSON: the step, the data position, the model kind, a fingerprint of the state's tree
paths, shapes and dtypes, and each leaf's checksums).

* Any strategy: `Checkpointer.restore` takes the state it should look like, in the NEW strategy's layout
  (what ``strategy.create_variables`` built), and asks orbax for arrays with exactly those shardings, so a
  checkpoint written under ``MirroredStrategy`` on 8 devices restores under ``OneDeviceStrategy`` and back.
* Atomic: orbax writes into a temporary directory and renames it when complete; a process killed during a
  save leaves the previous checkpoints untouched, and the half-written directory is never listed (and is
  removed the next time the directory is opened).
* Another model's checkpoint: the fingerprint is compared before any array is read, and a mismatch is an
  error that names the first differing leaves.
* Keeps the last ``max_to_keep`` checkpoints; `restore` reads the latest by default.
* Damaged: a checkpoint whose files cannot be read (flipped or missing bytes, caught by tensorstore's
  checksums) is one `CheckpointCorruptedError` naming its step, the directory and the newest older checkpoint
  that actually restores (each tried, newest first, with the same target: `Checkpointer.read`), and the fix.
  The array data has no checksum in orbax's files, so ``save`` computes two sums per leaf on the devices
  (`checkpoint_damage.checksums`, layout-independent) into ``meta``, and ``restore`` recomputes them on the
  restored arrays: a leaf whose bytes changed is the same error, naming the leaf. Checkpoints written
  without checksums restore unchecked.
* Asynchronous (``async_save=True``, the default): ``save`` returns once the arrays are copied to host memory
  (the devices are free to go on; a step that donates the state cannot touch the copy) and the files are
  written and renamed into place by a background thread. At most one save is in flight: the next ``save``
  waits for it. A background save that fails is never silent: `Checkpointer.poll` (``fit`` calls it after
  every step), the next ``save``, `Checkpointer.wait_until_finished` and ``close`` raise it, naming the step.
  A process killed meanwhile leaves the previous checkpoints as they were (the rename is the commit);
  `all_steps`, `latest_step`, `meta` and `restore` wait for the save in flight and see complete checkpoints.
* Closed at exit: a checkpointer left open (no ``close``, no ``with`` block) finishes its save in flight when the
  program ends, normally or with an uncaught exception: every ``save`` that returned is complete on disk, without
  orbax's shutdown tracebacks ("cannot schedule new futures after shutdown").
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import logging
import os
import shutil
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp

from jaxdist.strategies.layout import is_own, mark
from jaxdist.training.checkpoints._claim import CheckpointConflictError, Claim, live_claim
from jaxdist.training.checkpoints._damage import (
    CheckpointCorruptedError,
    SettlingArrayHandler,
    UnsearchedDamage,
    checksums,
    damage_summary,
    is_damage,
    missing_parts,
    verify_checksums,
)
from jaxdist.training.checkpoints._foreign import advice, is_orbax_checkpoint
from jaxdist.training.checkpoints._storage import CheckpointSaveError, check_directory, quiet_orbax
from jaxdist.training.data import IteratorSnapshot, restore_args, save_args, state_for_process

__all__ = ["Checkpointer", "fingerprint"]

FORMAT = "jaxdist.training/1"
_T = TypeVar("_T")
LOG = logging.getLogger("jaxdist.training.checkpoint")
# Set inside `Checkpointer.read`: a read nested in another (``meta`` inside ``restore``) leaves the search for an
# intact checkpoint to the outermost one, which knows everything the caller needs to read.
_READING: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxdist_checkpoint_read", default=False)


# The checkpointers with a save that may still be in flight, finished before the interpreter shuts its thread
# pools down (see `_finish_at_exit`).
_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
_AT_EXIT_REGISTERED = False


def _finish_at_exit() -> None:
    """Complete every open checkpointer's save in flight, then close it: runs when the main thread ends.

    It must run before ``concurrent.futures`` refuses new work (its own exit hook), since orbax's commit of an
    asynchronous save schedules work on thread pools: a save finished after that stays a ``*.orbax-checkpoint-tmp``
    directory, under orbax's "cannot schedule new futures after interpreter shutdown" tracebacks. So it is
    registered with the hook that runs before those pools stop (threading's, which runs the most recently
    registered first). A save that fails here is one line on stderr: there is no caller left to raise to.
    """
    for ckpt in list(_OPEN):
        try:
            ckpt.close()
        except Exception as error:  # reported; the other checkpointers still finish
            print(f"jaxdist.training.Checkpointer: {error}", file=sys.stderr, flush=True)


def _register_at_exit() -> None:
    global _AT_EXIT_REGISTERED
    if _AT_EXIT_REGISTERED:
        return
    # CPython's hook that runs before thread pools stop; plain atexit (too late for orbax's pools, but it still
    # closes the manager) where an interpreter lacks it.
    register = getattr(threading, "_register_atexit", atexit.register)
    register(_finish_at_exit)
    _AT_EXIT_REGISTERED = True


_ROLLBACK = ".jaxdist-rollback.json"


def _finish_rollback(directory: str) -> None:
    """Finish a rollback (`Checkpointer.abandon_after`) that was interrupted: delete the steps its record
    abandons, then the record (process 0 only)."""
    record = os.path.join(directory, _ROLLBACK)
    if jax.process_index() != 0 or not os.path.isfile(record):
        return
    try:
        with open(record) as f:
            after = int(json.load(f)["after"])
    except (OSError, ValueError, KeyError, TypeError):
        after = None  # unreadable: written partly, so nothing was deleted yet (it is written before)
    if after is not None:
        for name in os.listdir(directory):
            if name.isdigit() and int(name) > after:
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    os.remove(record)


def _remove_unfinished(directory: str) -> None:
    """Remove the step directories a killed save left unfinished (orbax's temporary ``*.orbax-checkpoint-tmp*``
    names, never listed as steps); by process 0 only, as orbax does."""
    if jax.process_index() != 0 or not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        if ".orbax-checkpoint-tmp" in name:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def fingerprint(tree: Any) -> list[list]:
    """``[[path, shape, dtype], ...]`` for every leaf of ``tree``: what must match for a restore to fit.

    Examples:
        >>> import numpy as np
        >>> fingerprint({"w": np.zeros((2, 3), np.float32)})
        [["['w']", [2, 3], 'float32']]
    """
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out.append([jax.tree_util.keystr(path), list(leaf.shape), str(leaf.dtype)])
    return out


def _mismatch_entries(saved: list, here: list) -> list[list]:
    """The entries of ``saved`` and ``here`` (fingerprints) that differ, by path."""
    saved_by, here_by = {e[0]: e for e in saved}, {e[0]: e for e in here}
    paths = sorted(set(saved_by) | set(here_by))
    return [saved_by.get(p) or here_by[p] for p in paths if saved_by.get(p) != here_by.get(p)]


def node_types(tree: Any) -> list[list[str]]:
    """``[[path, type name], ...]`` for every NamedTuple node of ``tree`` (optax's states are NamedTuples): what
    tells two optimizers apart whose states have the same leaves (Adam's and AdaBelief's ``mu``/``nu``).

    Examples:
        >>> import optax, numpy as np
        >>> node_types(optax.adam(0.1).init({"w": np.zeros(2)}))
        [['[0]', 'ScaleByAdamState'], ['[1]', 'EmptyState']]
    """
    out: list[list[str]] = []

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            out.append([jax.tree_util.keystr(path), type(node).__name__])
        children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        if len(children) == 1 and children[0][1] is node:  # a leaf
            return
        for key, child in children:
            walk(child, path + key)

    walk(tree, ())
    return out


def _describe(entry: list | None) -> str:
    return "absent" if entry is None else f"{tuple(entry[1])} {entry[2]}"


def _mismatch(saved: list, here: list) -> list[str]:
    saved_by, here_by = {e[0]: e for e in saved}, {e[0]: e for e in here}
    out = []
    order = (".params", ".model_state", ".opt_state")  # the most telling differences first

    def rank(path: str) -> tuple[int, str]:
        return next((i for i, p in enumerate(order) if path.startswith(p)), len(order)), path

    for path in sorted(set(saved_by) | set(here_by), key=rank):
        a, b = saved_by.get(path), here_by.get(path)
        if a != b:
            out.append(f"{path}: {_describe(a)} in the checkpoint, {_describe(b)} here")
    return out


def _array_handlers() -> dict[str, Any]:
    """Keyword arguments for orbax's ``PyTreeCheckpointHandler`` of the state.

    In ONE process a replicated array is written from one replica. orbax's default on CPU and TPU,
    "replica-parallel", splits it into one slice per replica so that several hosts share the writing; in one
    process the same host writes every byte anyway, and the slicing (a device op per replica and array) lands
    in the part of an asynchronous save that blocks the loop: measured, 0.08-0.12 s instead of 0.03-0.04 s for a
    70 MB state mirrored on 8 CPU devices. Several processes keep orbax's default. Arrays are read by
    `SettlingArrayHandler` (a damaged checkpoint's error without event-loop noise).
    """
    try:  # the store that keeps random-key metadata, as in orbax's own registry
        from orbax.checkpoint._src.metadata.array_metadata_store import Store
    except ImportError:  # moved in another orbax: its default handlers (correct, only slower to start a save)
        return {}
    types = ocp.type_handlers
    parallel = {} if jax.process_count() > 1 else {"use_replica_parallel": False}
    arrays = SettlingArrayHandler(**parallel, array_metadata_store=Store())
    handlers = [(t, types.get_type_handler(t)) for t in types.supported_types() if t is not jax.Array]
    return {"type_handler_registry": types.create_type_handler_registry(*handlers, (jax.Array, arrays))}


class Checkpointer:
    """Save and restore a training state (any pytree of arrays) plus JSON metadata in ``directory``.

    Also the own-loop path's checkpointing: ``ckpt.save(step, state)`` / ``ckpt.restore(state)``.

    Args:
        directory: where the step directories go (created when missing).
        max_to_keep: how many of the latest checkpoints to keep (None: all).
        async_save: write in a background thread (``save`` returns once the arrays are on the host); False:
            ``save`` returns when the checkpoint is complete.

    Raises:
        ValueError: for ``max_to_keep < 1``, or a ``directory`` that is ``""`` or a regular file.

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

        As a context manager (closed at the block's end; one left open is closed when the program ends):

        >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
        ...     _ = ckpt.save(8, state)
        >>> ckpt.all_steps()
        [8]
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3, *, async_save: bool = True):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep={max_to_keep!r} must be an int >= 1 (or None to keep all).")
        if not isinstance(async_save, bool):
            raise ValueError(f"async_save={async_save!r} must be True or False.")
        self.directory = check_directory(directory, "directory", create=False, probe=False)
        self.async_save = async_save
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            # What a killed save left behind is removed here, synchronously (`_remove_unfinished`): orbax does it in
            # a background thread that its ``close`` does not wait for (a checkpointer closed early then prints
            # "cannot schedule new futures after shutdown").
            cleanup_tmp_directories=False,
            enable_async_checkpointing=async_save,
        )
        if live_claim(self.directory) is None:  # else a live writer's save in flight, or its rollback
            _remove_unfinished(self.directory)
            _finish_rollback(self.directory)  # before orbax lists the steps
        handler = ocp.PyTreeCheckpointHandler(**_array_handlers())
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add("state", ocp.args.PyTreeSave, handler)
        registry.add("state", ocp.args.PyTreeRestore, handler)
        self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        # The thread that waits for the save in flight and records how it ended.
        self._lock = threading.Lock()
        self._waiter: threading.Thread | None = None
        self._finished: list[tuple[int, str]] = []  # complete, not yet reported by poll
        self._failed: tuple[int, Exception] | None = None  # a background save's error, not yet raised
        self._closed = False
        self._claim: Claim | None = None
        self._quiet = contextlib.ExitStack()  # orbax's log records of the save in flight, kept out of the terminal
        _register_at_exit()
        _OPEN.add(self)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any) -> None:
        """`close`; with an exception on its way out, a failed save is a note on it rather than a new error."""
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

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None when there is none (waits like `all_steps`)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: Mapping[str, Any] | None = None, data_iterator: Any = None) -> str:
        """Write ``state`` as checkpoint ``step`` (atomically; the oldest beyond ``max_to_keep`` is removed).

        Args:
            step: the step number (an int; saving an existing step again is a no-op when the contents are the
                same, an error when they differ).
            state: a pytree of arrays (global `jax.Array`s of any layout, or numpy).
            meta: extra JSON-serializable metadata stored beside it.
            data_iterator: the input iterator (a grain iterator, or a distributed iterator over one): its
                ``get_state()``, one file per process (`jaxdist.training.data._input_state`); read it back with
                `data_iterator_state`.

        With ``async_save`` it returns once the arrays are copied to host memory; the files are written in the
        background (the state may be changed or donated meanwhile). It first waits for the save in flight.
        Each leaf's checksums (`checkpoint_damage.checksums`, computed on the devices before that copy) go into
        the metadata: `restore` compares them with the restored arrays.

        Returns:
            The checkpoint's directory (complete once `poll` reports it, or after `wait_until_finished`).

        Raises:
            TypeError: for metadata that is not JSON-serializable, or a ``data_iterator`` without
                ``get_state()``.
            CheckpointConflictError: when another live run holds the directory (`claim`), or ``step`` exists
                with other contents (its saved checksums differ).
            CheckpointSaveError: (a RuntimeError) when this save, or an earlier background one (see `poll`),
                failed: naming the step, the directory, the last complete checkpoint and the fix.
        """
        step = int(step)
        path = os.path.join(self.directory, str(step))
        self._raise_failure()
        self.claim()
        if step in self._manager.all_steps():  # complete, or being written
            self._check_same(step, state)
            return path
        info = {**dict(meta or {}), "format": FORMAT, "step": step, "fingerprint": fingerprint(state),
                "node_types": node_types(state)}
        items = {"state": ocp.args.PyTreeSave(state), "meta": ocp.args.JsonSave(info)}
        if data_iterator is not None:
            info["data_iterator"], items["data_iterator"] = save_args(data_iterator)
        try:  # here, not in the background thread that writes it
            json.dumps(info)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"meta={dict(meta or {})!r} is not JSON-serializable ({error}): pass JSON values."
            ) from None
        # Before the copy to host (and any donation after this call); while the save in flight, if any, is written.
        info["checksums"] = checksums(state)
        self._join()  # one save at a time (orbax would wait for it too)
        self._raise_failure()
        self._quiet.enter_context(quiet_orbax())  # until the save has ended (`_join`)
        try:
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as error:
            self._quiet.close()
            with contextlib.suppress(Exception):  # orbax raises it again to every waiter: take this turn now
                with quiet_orbax():
                    self._manager.wait_until_finished()
            LOG.debug("saving checkpoint step %d failed", step, exc_info=error)
            failed = CheckpointSaveError(step, self.directory, self.latest_step(), error)
            failed.__context__ = error  # kept for debugging, not printed (``from None``)
            raise failed from None
        if not self.async_save:
            self._quiet.close()
            self._finished.append((step, path))
            return path
        self._waiter = threading.Thread(target=self._wait, args=(step, path), name="jaxdist-checkpoint", daemon=True)
        self._waiter.start()
        return path

    def claim(self) -> None:
        """Claim the directory for this run's saves (`save` does at its first call; ``fit`` at its start).

        Of two runs on one directory, the second (while the first is alive) is refused: two writers lose one
        run's checkpoints (`jaxdist.training.checkpoints._claim`). The claim is released by `close`. In a job of
        several processes process 0 claims for all (the others share its directory).

        Raises:
            CheckpointConflictError: when another live run holds the directory (naming it, with the fix), or
                this run's claim was taken over.
            ValueError: when the directory cannot be written (read-only, full, ...).
        """
        if jax.process_index() != 0:
            return
        if self._claim is not None:
            self._claim.check()
            return
        check_directory(self.directory, "directory")  # exists (orbax made it) and is writable
        self._claim = Claim.acquire(self.directory, "checkpoint_dir")

    def _check_same(self, step: int, state: Any) -> None:
        """Checkpoint ``step`` exists: saving it again is a no-op for the same contents, an error for others."""
        self._join()
        saved = self.meta(step)
        differ = [e[0] for e in _mismatch_entries(saved.get("fingerprint", []), fingerprint(state))]
        sums = saved.get("checksums")
        if not differ and sums is not None:
            here = checksums(state)
            differ = [p for p, v in here.items() if p in sums and list(sums[p]) != v]
        if not differ:
            return
        shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
        raise CheckpointConflictError(
            f"checkpoint step {step} in {self.directory!r} already exists with other contents ({shown} differ): "
            "saving over it would keep the old state under this step. Another run wrote this directory, or this "
            "run went back without restore_step=. Fix: pass a fresh directory, resume from the newest checkpoint "
            f"(fit does), or delete {os.path.join(self.directory, str(step))} first.", self.directory)

    def _wait(self, step: int, path: str) -> None:
        """The waiter thread: wait for the background save of ``step`` and record how it ended."""
        try:
            self._manager.wait_until_finished()
        except Exception as error:  # recorded for the thread that uses the checkpointer, which raises it
            with self._lock:
                self._failed = (step, error)
        else:
            with self._lock:
                self._finished.append((step, path))

    def _join(self) -> None:
        """Wait for the save in flight (if any)."""
        waiter, self._waiter = self._waiter, None
        if waiter is None:
            return
        waiter.join()
        if self._failed is not None:
            # orbax raises a failed save once in every thread that waits for it: take this thread's turn now
            # (the error is recorded), or a later save or close would raise it again.
            with contextlib.suppress(Exception):
                self._manager.wait_until_finished()
        self._quiet.close()

    def _raise_failure(self) -> None:
        with self._lock:
            failed, self._failed = self._failed, None
        if failed is None:
            return
        step, error = failed
        LOG.debug("saving checkpoint step %d failed in the background", step, exc_info=error)
        clear = CheckpointSaveError(step, self.directory, self.latest_step(), error, background=True)
        clear.__context__ = error  # kept for debugging, not printed (``from None``)
        raise clear from None

    def poll(self, wait: bool = False) -> list[tuple[int, str]]:
        """The saves that became complete since the last call, as ``(step, path)``, oldest first.

        Never waits (``fit`` calls it after every step), unless ``wait``: then it first waits for the save in
        flight. A synchronous save is reported by the next call.

        Args:
            wait: wait for the save in flight first.

        Returns:
            ``[(step, path), ...]``, possibly empty.

        Raises:
            CheckpointSaveError: (a RuntimeError) when a background save failed (raised once), naming its step,
                the last complete checkpoint and the fix.

        Examples:
            >>> import tempfile, numpy as np
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> _ = ckpt.save(1, {"w": np.zeros(2)})
            >>> [step for step, path in ckpt.poll(wait=True)], ckpt.poll()
            ([1], [])
            >>> ckpt.close()
        """
        waiter = self._waiter
        if wait or (waiter is not None and not waiter.is_alive()):
            self._join()
        self._raise_failure()
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def wait_until_finished(self) -> None:
        """Wait until the save in flight (if any) is complete.

        Raises:
            RuntimeError: when it (or an earlier background save not yet reported) failed.
        """
        self._join()
        self._raise_failure()

    def read(self, fn: Callable[[int], _T], step: int | None = None, *, step_argument: str = "step") -> _T:
        """``fn(step)`` for checkpoint ``step`` (default: the latest), with ONE clear error when it is damaged.

        Every read of a checkpoint goes through here (`restore`, `meta`, `data_iterator_state`, ``Trainer.restore``
        and ``fit``'s resume). When ``fn`` raises `CheckpointCorruptedError`, ``fn`` is tried on the older
        checkpoints, newest first, and the error raised names the first one it reads without error (so "intact"
        means it restores into the same target, not that its files exist), or says that none does. A read nested
        in another (``meta`` inside ``restore``) leaves the search to the outer one.

        Args:
            fn: reads checkpoint ``step`` (e.g. with `restore` and `data_iterator_state`) and returns anything.
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
            >>> (restored, meta), it = ckpt.read(lambda s: (ckpt.restore(state, s), ckpt.data_iterator_state(s)))
            >>> meta["step"], it
            (5, None)
            >>> ckpt.close()
        """
        step = self._step(step)
        if _READING.get():
            return fn(step)
        token = _READING.set(True)
        try:
            try:
                return fn(step)
            except CheckpointCorruptedError as error:
                damaged = error
            failed, intact = [], None
            for older in reversed([s for s in self.all_steps() if s < step]):
                try:
                    fn(older)
                except Exception:
                    failed.append(older)
                else:
                    intact = older
                    break
            steps = self.all_steps()
            newer = None
            if intact is None:  # none older: a newer one may still resume the run (never "start again" then)
                for later in reversed([s for s in steps if s > step]):
                    try:
                        fn(later)
                    except Exception:
                        continue
                    newer = later
                    break
            clear = CheckpointCorruptedError(damaged.step, self.directory, damaged.reason, intact, failed,
                                             latest=not steps or steps[-1] == damaged.step, step_argument=step_argument,
                                             newer_intact_step=newer)
            clear.__context__ = damaged.__cause__ or damaged  # kept for debugging; not printed (``from None``)
            raise clear from None
        finally:
            _READING.reset(token)

    def _damaged(self, step: int, error: BaseException, item: str = "") -> CheckpointCorruptedError:
        """The error for checkpoint ``step`` found damaged by ``error`` (`read` adds the intact step)."""
        reason = damage_summary(error, os.path.join(self.directory, str(step)))
        return UnsearchedDamage(step, self.directory, f"{item}: {reason}" if item else reason)

    def meta(self, step: int | None = None) -> dict:
        """The JSON metadata of checkpoint ``step`` (default: the latest; a save in flight is waited for).

        Raises:
            FileNotFoundError: when there is no such checkpoint.
            ValueError: when the directory holds a checkpoint not written by jaxdist.training (the message shows
                the plain orbax that reads it and ``Trainer.load_state``).
            CheckpointCorruptedError: when its metadata file is damaged or missing.
        """
        return self.read(self._meta, step)

    def _meta(self, step: int) -> dict:
        missing = missing_parts(os.path.join(self.directory, str(step)))
        if missing:  # cut short (a save or a delete killed, a copy that stopped): orbax's errors would not say so
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise UnsearchedDamage(step, self.directory, f"{shown} missing: partly written or partly deleted")
        try:
            info = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except (FileNotFoundError, KeyError, ValueError) as error:
            if os.path.isdir(os.path.join(self.directory, str(step), "meta")):  # it has one, unreadable
                raise self._damaged(step, error, "meta") from error
            info = None
            cause: Exception | None = error
        else:
            cause = None
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise ValueError(advice(self.directory, step)) from cause  # the orbax that reads it, and load_state
        return info

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
        """Delete every checkpoint after ``step`` (a rollback: they belong to the run being replaced), atomically
        as far as any later run can tell: the decision is written to a record file first (``os.replace``), and a
        checkpointer opened on this directory after an interruption finishes the deletions before it lists the
        steps. So no interruption brings an abandoned step back as the newest.

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
        record = os.path.join(self.directory, _ROLLBACK)
        if jax.process_index() == 0:
            with open(record + ".tmp", "w") as f:
                json.dump({"after": int(step), "abandoned": later}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(record + ".tmp", record)
        for s in reversed(later):  # newest first
            self._manager.delete(s)
        if jax.process_index() == 0:
            os.remove(record)

    def check_writer(self) -> None:
        """Raise unless every checkpoint here is one jaxdist.training wrote (what ``fit`` asks before it writes
        here): the newest one has a ``meta`` item, and the directory is not itself one orbax checkpoint.

        Raises:
            ValueError: naming the checkpoint, with the two lines of plain orbax and ``Trainer.load_state`` that
                continue it (`jaxdist.training.checkpoints._foreign.advice`).

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
        if latest is not None and not os.path.isdir(os.path.join(self.directory, str(latest), "meta")):
            raise ValueError(advice(self.directory, latest))

    def _step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                if is_orbax_checkpoint(self.directory):  # a StandardCheckpointer's directory: no steps, one tree
                    raise ValueError(advice(self.directory, None))
                raise FileNotFoundError(f"no checkpoint in {self.directory!r} (it has no complete step directory).")
            return steps[-1]
        if int(step) not in steps:
            raise FileNotFoundError(f"no checkpoint for step={step} in {self.directory!r}; it has steps {steps}.")
        return int(step)

    def check(self, like: Any, meta: Mapping[str, Any]) -> None:
        """Raise ValueError when a checkpoint with metadata ``meta`` does not fit ``like``, naming the leaves."""
        diff = _mismatch(meta["fingerprint"], fingerprint(like))
        saved_types = meta.get("node_types")  # none in checkpoints written before them
        if not diff and saved_types is not None:
            saved_by, here_by = dict(map(tuple, saved_types)), dict(map(tuple, node_types(like)))
            types = [f"{p}: {saved_by.get(p, 'absent')} in the checkpoint, {here_by.get(p, 'absent')} here"
                     for p in sorted(set(saved_by) | set(here_by)) if saved_by.get(p) != here_by.get(p)]
            if types:
                shown = "; ".join(types[:3]) + (f"; and {len(types) - 3} more" if len(types) > 3 else "")
                raise ValueError(
                    f"checkpoint_dir={self.directory!r} (step {meta['step']}) holds the state of another optimizer "
                    f"(its state types differ): {shown}. Fix: use the optimizer that wrote it (same transforms, in "
                    "the same chain), or a fresh checkpoint_dir (to keep only the parameters: "
                    "Trainer.load_state(params=...)).")
        if not diff:
            return
        shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
        if any(d.startswith(".params") for d in diff) or not any(d.startswith(".") for d in diff):
            what = "another model's checkpoint (its parameters differ from this model's)"
            fix = "use a fresh checkpoint_dir for this model, or build the model that wrote it"
        elif any(d.startswith(".opt_state") for d in diff):
            what = "an optimizer state that does not fit this model's parameters and optimizer"
            fix = "use the optimizer (and clip_grad_norm) that wrote it, or a fresh checkpoint_dir"
        else:
            what = "a state that does not fit this trainer"
            fix = "use the model and settings that wrote it, or a fresh checkpoint_dir"
        raise ValueError(f"checkpoint_dir={self.directory!r} (step {meta['step']}) holds {what}: {shown}. Fix: {fix}.")

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict]:
        """Read checkpoint ``step`` (default: the latest) into the layout of ``like``.

        Args:
            like: a state with the target structure and layout: live arrays (e.g. from
                ``strategy.create_variables`` under the strategy to restore onto) or `jax.ShapeDtypeStruct`s
                with shardings. Checkpoints restore onto any strategy and device count.
            step: which checkpoint.

        Returns:
            ``(state, meta)``: the arrays with ``like``'s shardings, and the checkpoint's metadata.

        Raises:
            FileNotFoundError: when there is no such checkpoint.
            ValueError: when it was not written by jaxdist.training or does not fit ``like`` (the message
                names the differing leaves).
            CheckpointCorruptedError: when its files are damaged, or a restored leaf does not match the checksums
                saved with it (naming the leaf), naming the newest older checkpoint that restores into ``like``
                (see `read`).
        """
        return self.read(lambda s: self._restore(like, s), step)

    def _restore(self, like: Any, step: int) -> tuple[Any, dict]:
        info = self.meta(step)
        self.check(like, info)
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), like)
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(target, restore_args=restore_args))
        try:
            restored = self._manager.restore(step, args=args)["state"]
            verify_checksums(info.get("checksums"), restored)  # none in checkpoints written before them
        except Exception as error:
            if is_damage(error):
                raise self._damaged(step, error) from error
            raise
        # A value restored into a layout jaxdist decided is jaxdist's, as the value it replaces was.
        mark(jax.tree.leaves(restored), [is_own(getattr(a, "sharding", None)) for a in jax.tree.leaves(like)])
        return restored, info

    def data_iterator_state(self, step: int | None = None) -> Any:
        """This process's input iterator state saved with checkpoint ``step`` (default: the latest), for
        ``iterator.set_state(...)``; None when it was saved without ``data_iterator``.

        Raises:
            FileNotFoundError: when there is no such checkpoint.
            ValueError: when another number of processes saved a per-process state (see
                `jaxdist.training.data._input_state`; an ElasticIterator's state restores on any count).
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
        return self.read(self._data_iterator_state, step)

    def _data_iterator_state(self, step: int) -> Any:
        info = self.meta(step)

        def read() -> Any:
            holder = IteratorSnapshot()
            args = ocp.args.Composite(data_iterator=restore_args(holder))
            try:
                self._manager.restore(step, args=args)
            except (OSError, KeyError, ValueError) as error:
                raise self._damaged(step, error, "data_iterator") from error
            return holder.state

        where = f"checkpoint_dir={self.directory!r} step {step}"
        return state_for_process(info.get("data_iterator"), read, where)

    def close(self) -> None:
        """Wait for the save in flight and release the directory (again: nothing to do).

        A checkpointer left open is closed when the program ends normally, or ends with an uncaught exception
        (after its traceback is printed): every ``save`` that returned is complete on disk by then. A
        ``with Checkpointer(...) as ckpt:`` block closes it at the block's end.

        Raises:
            RuntimeError: when a background save failed and nothing raised it yet (see `poll`).
        """
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        try:
            self._join()
        finally:
            self._manager.close()
            if self._claim is not None:
                self._claim.release()
                self._claim = None
        self._raise_failure()
