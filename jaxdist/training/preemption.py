"""Preemption: turn SIGTERM into a flag the training loop checks between steps.

Schedulers (Kubernetes, SLURM, cloud spot VMs) send SIGTERM some seconds before they kill a job. Stopping in
the middle of a step, or of a checkpoint write, would waste it; so the handler only records the request and
the loop finishes the current step, saves, and stops. The previous handler is restored afterwards.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["PreemptionWatcher"]


class PreemptionWatcher:
    """A context manager: while open, SIGTERM (and any extra ``signals``) set ``requested`` instead of killing.

    Signal handlers can only be installed from the main thread; elsewhere the watcher does nothing and
    ``installed`` is False.

    Args:
        signals: the signals to catch (default: SIGTERM).

    Example:
        >>> import os, signal
        >>> with PreemptionWatcher() as watcher:
        ...     os.kill(os.getpid(), signal.SIGTERM)
        ...     watcher.requested
        True
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signals = signals
        self.requested = False
        self.installed = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        del signum, frame
        self.requested = True

    def __enter__(self) -> PreemptionWatcher:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
            self.installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        self.installed = False
