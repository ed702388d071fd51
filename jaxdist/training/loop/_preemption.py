"""Preemption: SIGTERM becomes a request to stop, on which every process of the job agrees.

Schedulers (Kubernetes, SLURM, cloud spot VMs) send SIGTERM some seconds before they kill a job.
The handler only records the request (stopping mid-step or mid-write would waste it): the loop
finishes the current step, saves, and stops; the previous handler is restored afterwards. A
callback's ``trainer.stop_training`` is a request to stop too, through the same agreement.

Several processes: usually ONE host gets the signal; were it to leave the loop alone, it would
enter the collective save while its peers enter the next step's all-reduce: a deadlock. So at
every check (one per step or on-device loop, in the same order on every process) each process adds
its flag to a one-element max over the strategy's devices, dispatched like a step, and reads the
result ``lag`` checks later, when the devices have long computed it; every process reads the same
value at the same check, so all stop after the same step, at most ``lag + 1`` checks after the
signal. One last (blocking) check at the end of the loop settles the signals that came since. When
the devices are the bottleneck the read does wait (the host stays at most ``lag`` steps ahead): that
wait is the devices finishing steps, handed to ``waited`` (``fit``: `FitClock.waited`).

The same agreement carries process 0's request to save on its clock (``should_stop(save=True)``,
`PreemptionWatcher.save_agreed`) in the flag's lowest bit, below the reasons to stop (a stop saves
anyway), so the max keeps what matters.

Not JAX's ``multihost_utils.reached_preemption_sync_point``: orbax's ``CheckpointManager`` shares
its step counter from a background thread (which can place the agreed step behind one process:
the same deadlock), and it hears SIGTERM only through the C handler that any Python handler
replaces.
"""

from __future__ import annotations

import collections
import functools
import signal
import threading
from collections.abc import Callable
from time import perf_counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.job import spans_processes

__all__ = ["PreemptionWatcher"]


class PreemptionWatcher:
    """A context manager: while open, SIGTERM (and any extra ``signals``) set ``requested`` instead
    of killing.

    ``requested`` says whether THIS process got a signal; `should_stop` says whether every process
    of the job stops now (the agreement described in `jaxdist.training.loop._preemption`), for a
    signal or for a ``stop_training`` request of any process; ``preempted`` whether a signal was
    among the reasons. Signal handlers can only be installed from the main thread; elsewhere the
    watcher installs nothing and ``installed`` is False.

    Args:
        signals: the signals to catch (default: SIGTERM).
        mesh: the devices of the job that stop together (a strategy's ``mesh``). When they belong to
            several processes, `should_stop` agrees across them; otherwise (None, or one process) it
            is local.
        lag: checks between dispatching an agreement and reading it (several processes only): larger
            hides more of the devices' queue, smaller stops sooner after the signal.
        waited: hears the seconds each agreement's read waited for the devices (several processes
            only; ``fit`` passes `FitClock.waited`: that wait is the devices finishing steps).

    Raises:
        ValueError: for no signals or ``lag < 1``.

    Examples:
        >>> import os, signal
        >>> with PreemptionWatcher() as watcher:
        ...     before = watcher.should_stop()
        ...     os.kill(os.getpid(), signal.SIGTERM)
        ...     before, watcher.requested, watcher.should_stop(), watcher.preempted
        (False, True, True, True)
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,), *, mesh: Mesh | None = None,
                 lag: int = 2, waited: Callable[[float], None] | None = None):
        if not signals:
            raise ValueError("signals=() catches nothing: pass e.g. (signal.SIGTERM,).")
        if not isinstance(lag, int) or isinstance(lag, bool) or lag < 1:
            raise ValueError(f"lag={lag!r} must be an int >= 1.")
        self.signals, self.requested, self.installed = tuple(signals), False, False
        self.received: int | None = None  # the signal this process got (the first one)
        self.save_agreed = False  # the last check agreed on a save (`should_stop(save=True)`)
        self._previous: dict[int, Any] = {}
        self._mesh, self._lag, self._waited = mesh, lag, waited
        self._agreement: _Agreement | None = None
        self._agreed = 0  # the agreed reasons to stop: _STOP_TRAINING | _SIGNAL

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        if self.received is None:
            self.received = signum
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

    @functools.cached_property
    def spans_processes(self) -> bool:
        """Whether `should_stop` agrees across processes (the mesh's devices belong to several);
        read once, not at every step's check."""
        return self._mesh is not None and spans_processes(self._mesh.devices.flat)

    @property
    def stopping(self) -> bool:
        """Whether `should_stop` has returned True (it stays True)."""
        return bool(self._agreed)

    @property
    def preempted(self) -> bool:
        """Whether a signal (to any process) is among the agreed reasons to stop."""
        return bool(self._agreed & _SIGNAL)

    @property
    def cause(self) -> str | None:
        """Which signal preempted the run, in words (``"SIGTERM"``; ``"SIGTERM (to another
        process)"`` where another process of the job got it); None when no signal is among the
        reasons to stop.

        Examples:
            >>> import os, signal
            >>> with PreemptionWatcher() as watcher:
            ...     os.kill(os.getpid(), signal.SIGTERM)
            ...     _ = watcher.should_stop()
            >>> watcher.cause
            'SIGTERM'
        """
        if not self.preempted:
            return None
        if self.received is not None:
            return signal.Signals(self.received).name
        return f"{' or '.join(signal.Signals(s).name for s in self.signals)} (to another process)"

    def should_stop(self, final: bool = False, *, stop_training: bool = False,
                    save: bool = False) -> bool:
        """Whether every process stops now; once True, always True.

        Call it once per step (or step loop) on every process, in the same order. One process:
        whether this process got a signal or ``stop_training`` is set. Several: whether any process
        had got one (or set it) ``lag`` checks ago; with ``final=True`` (once, at the end of the
        loop, on every process unless `stopping`): whether any had by now (this waits for the
        devices).

        Args:
            final: read every process's flag up to this check now (blocking): the last check of the
                loop, or one every process makes at the same step on purpose (``fit`` at an epoch's
                end, so that a callback's stop there takes effect at once).
            stop_training: this process asks to stop for another reason than a signal (a callback's
                ``trainer.stop_training``).
            save: this process asks every process to save after the same step (several processes:
                the answer is `save_agreed`, ``lag`` checks later; one process: nothing to agree,
                ignored).

        Returns:
            True when the job is to stop (save, then return or exit) after the current step.
        """
        self.save_agreed = False
        if self._agreed:
            return True
        flag = (_SIGNAL if self.requested else 0) | (_STOP_TRAINING if stop_training else 0)
        if not self.spans_processes:
            self._agreed = flag
        else:
            if self._agreement is None:
                self._agreement = _Agreement(self._mesh, self._lag, self._waited)
            agreed = self._agreement.check(flag << 1 | bool(save), final)  # save: the lowest bit
            self._agreed = agreed >> 1
            self.save_agreed = agreed == 1  # a save, and no reason to stop (which saves anyway)
        return bool(self._agreed)


# flag bits; the agreement's max keeps _SIGNAL when any process had it
_STOP_TRAINING, _SIGNAL = 1, 2


class _Agreement:
    """The cross-process max of every process's flag (an int), one per check, read ``lag`` checks
    after dispatch; `check` returns the largest flag read (0: go on) and hands the seconds its reads
    waited to ``waited``."""

    def __init__(self, mesh: Mesh, lag: int, waited: Callable[[float], None] | None = None):
        self._size = mesh.devices.size
        self._sharding = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))  # one a device
        self._max = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))
        self._flags: dict[int, jax.Array] = {}
        self._pending: collections.deque = collections.deque()
        self._lag, self._waited = lag, waited

    def _flag(self, value: int) -> jax.Array:
        if value not in self._flags:  # built once per value: no transfer per check
            self._flags[value] = jax.make_array_from_callback(
                (self._size,), self._sharding, lambda index: np.full((1,), value, np.int32))
        return self._flags[value]

    def check(self, flag: int, final: bool) -> int:
        agreed = self._max(self._flag(int(flag))).addressable_data(0)
        agreed.copy_to_host_async()
        self._pending.append(agreed)
        stop, start = 0, perf_counter()
        while self._pending and (final or len(self._pending) > self._lag):
            stop = max(stop, int(np.asarray(self._pending.popleft())))  # waits if devices lag
        if self._waited is not None:
            self._waited(perf_counter() - start)
        return stop
