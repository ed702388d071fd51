"""Writing checkpoints with orbax: the state's array handlers and the save in flight (`InFlight`: a waiter thread
records how it ended, the error raised once by the thread that uses the checkpointer). The checkpointers left
open, whose save in flight is finished when the program ends, are `jaxdist.training.checkpoints._at_exit`'s.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxdist.training.checkpoints._damage import SettlingArrayHandler

__all__ = ["InFlight", "array_handlers"]


def array_handlers() -> dict[str, Any]:
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


class InFlight:
    """The save in flight of one orbax ``CheckpointManager`` (at most one): a waiter thread waits for it and
    records how it ended, complete (`take_finished`) or failed (`take_failure`), for the thread that uses the
    checkpointer; orbax's log records are kept out of the terminal until it ends (`quiet`).

    Args:
        manager: the orbax ``CheckpointManager`` that writes.
    """

    def __init__(self, manager: Any):
        self._manager = manager
        self._lock = threading.Lock()
        self._waiter: threading.Thread | None = None
        self._finished: list[tuple[int, str]] = []  # complete, not yet reported by take_finished
        self._failed: tuple[int, Exception] | None = None  # a background save's error, not yet taken
        self.quiet = contextlib.ExitStack()  # orbax's log records of the save in flight, kept out of the terminal

    def started(self, step: int, path: str) -> None:
        """The manager started an asynchronous save of ``step`` into ``path``: wait for it in the background."""
        self._waiter = threading.Thread(target=self._wait, args=(step, path), name="jaxdist-checkpoint", daemon=True)
        self._waiter.start()

    def done(self, step: int, path: str) -> None:
        """A synchronous save of ``step`` is complete."""
        self.quiet.close()
        self._finished.append((step, path))

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
            # orbax raises a failed save once in every thread that waits for it: take this thread's turn now
            # (the error is recorded), or a later save or close would raise it again.
            with contextlib.suppress(Exception):
                self._manager.wait_until_finished()
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
