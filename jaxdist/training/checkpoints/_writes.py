"""Writing checkpoints with orbax: the state's array handlers, the save in flight (`InFlight`), and
the orbax threads a failed save leaves waiting (`release_stalled`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxdist.training.checkpoints._damage import SettlingArrayHandler
from jaxdist.training.checkpoints._storage import quiet_after_failure

__all__ = ["InFlight", "array_handlers", "operation", "release_stalled"]


def array_handlers() -> dict[str, Any]:
    """Keyword arguments for orbax's ``PyTreeCheckpointHandler`` of the state.

    In ONE process a replicated array is written from one replica: orbax's "replica-parallel"
    default splits it so that several hosts share the writing, but one host writes every byte here,
    and the slicing lands in the blocking part of an asynchronous save (0.08-0.12 s instead of
    0.03-0.04 s for a 70 MB state on 8 CPU devices). Arrays are read by `SettlingArrayHandler`.
    """
    try:  # the store that keeps random-key metadata, as in orbax's own registry
        from orbax.checkpoint._src.metadata.array_metadata_store import Store
    except ImportError:  # moved in another orbax: its defaults (correct, slower to start a save)
        return {}
    types = ocp.type_handlers
    parallel = {} if jax.process_count() > 1 else {"use_replica_parallel": False}
    arrays = SettlingArrayHandler(**parallel, array_metadata_store=Store())
    handlers = [(t, types.get_type_handler(t)) for t in types.supported_types()
                if t is not jax.Array]
    return {"type_handler_registry": types.create_type_handler_registry(*handlers,
                                                                        (jax.Array, arrays))}


def operation() -> str | None:
    """orbax's id of the save started last in this process (the signals between its threads carry
    it), or None in an orbax without one."""
    try:
        from orbax.checkpoint._src.futures import synchronization

        return synchronization.OperationIdGenerator.get_current_operation_id()
    except (ImportError, AttributeError):
        return None


def release_stalled(operation_id: str | None) -> int:
    """End the orbax threads of a FAILED save (``operation_id``) that still wait for a signal from a
    part of it that failed: they are not daemon threads, so each would keep the process from ending
    for orbax's coordination timeout (300 s). Each is woken by setting the signals it waits for: it
    runs its part, which fails or writes into the failed save's temporary directory (never renamed
    into place), and ends. (orbax's ``cancel`` would leave its coroutine never awaited: a
    RuntimeWarning at exit.)

    One process only: a job's signals are shared with its peers, whose threads must not be woken.
    Where orbax's threads are not orbax-checkpoint 0.12's, nothing is done.

    Args:
        operation_id: the failed save's `operation` (None: nothing to do).

    Returns:
        How many threads were released.
    """
    if operation_id is None or jax.process_count() > 1:
        return 0
    try:
        from orbax.checkpoint._src.futures import future, signaling_client

        client = signaling_client.get_signaling_client()
        released = 0
        for thread in threading.enumerate():
            if (not isinstance(thread, future._SignalingThread)
                    or thread._operation_id != operation_id):
                continue
            for signal in thread._receive_signals:
                key = future.AwaitableSignalsContract.get_unique_awaitable_singal_key(signal,
                                                                                     operation_id)
                if client.key_value_try_get(key) is None:
                    client.key_value_set(key, "released by jaxdist after a failed save",
                                         allow_overwrite=True)
            released += 1
        return released
    except (ImportError, AttributeError, TypeError):
        return 0


class InFlight:
    """The save in flight of one orbax ``CheckpointManager`` (at most one): a waiter thread records
    how it ended, complete (`take_finished`) or failed (`take_failure`), for the thread that uses
    the checkpointer; orbax's log records stay out of the terminal until it ends (`quiet`).

    Args:
        manager: the orbax ``CheckpointManager`` that writes.
    """

    def __init__(self, manager: Any):
        self._manager = manager
        self._lock = threading.Lock()
        self._waiter: threading.Thread | None = None
        self._finished: list[tuple[int, str]] = []  # complete, not yet reported by take_finished
        self._failed: tuple[int, Exception] | None = None  # a background save's, not yet taken
        self.last_step: int | None = None  # the newest save started
        self.newest: int | None = None  # the newest save complete (other threads read it)
        self.operation: str | None = None  # orbax's id of it (`operation`)
        self.any_failed = False  # a save of this manager failed (orbax raises it again on close)
        self.quiet = contextlib.ExitStack()  # orbax's log records of the save in flight

    def started(self, step: int, path: str) -> None:
        """The manager started an asynchronous save of ``step`` into ``path``: waited for."""
        self.last_step, self.operation = step, operation()
        self._waiter = threading.Thread(target=self._wait, args=(step, path),
                                        name="jaxdist-checkpoint", daemon=True)
        self._waiter.start()

    def done(self, step: int, path: str) -> None:
        """A synchronous save of ``step`` is complete."""
        self.last_step = self.newest = step
        self.quiet.close()
        self._finished.append((step, path))

    def _wait(self, step: int, path: str) -> None:
        """The waiter thread: wait for the background save of ``step`` and record how it ended."""
        try:
            self._manager.wait_until_finished()
        except Exception as error:  # for the thread that uses the checkpointer to raise
            self.fail(step, error)
        else:
            with self._lock:
                self._finished.append((step, path))
                self.newest = step

    def fail(self, step: int, error: Exception) -> None:
        """Saving ``step`` failed with ``error``: recorded (`take_failure`); orbax's records go
        off the terminal from now on (`quiet_after_failure`)."""
        quiet_after_failure()
        with self._lock:
            self._failed = (step, error)
            self.any_failed = True

    @property
    def ended(self) -> bool:
        """Whether a save was in flight and has ended (its waiter can be joined without waiting)."""
        return self._waiter is not None and not self._waiter.is_alive()

    def join(self) -> None:
        """Wait for the save in flight (if any)."""
        waiter, self._waiter = self._waiter, None
        if waiter is None:
            return
        waiter.join()
        if self._failed is not None:
            # orbax raises a failed save once in every thread that waits for it: take this thread's
            # turn now (the error is recorded), or a later save or close would raise it again.
            with contextlib.suppress(Exception):
                self._manager.wait_until_finished()
            release_stalled(self.operation)
        self.quiet.close()

    def take_failure(self) -> tuple[int, Exception] | None:
        """The background save that failed, as ``(step, error)``, once; None when none did."""
        with self._lock:
            failed, self._failed = self._failed, None
        return failed

    def take_finished(self) -> list[tuple[int, str]]:
        """The saves complete since the last call, as ``(step, path)``, oldest first."""
        with self._lock:
            finished, self._finished = self._finished, []
        return finished
