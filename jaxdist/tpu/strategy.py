"""`TPUStrategy`: every device of the default backend, with on-device loops
(tf.distribute.TPUStrategy).

On a TPU host the default backend is the TPU and its cores are the replicas; elsewhere it is
whatever JAX runs on (the simulated CPU devices in tests), so TPU code runs unchanged on a laptop.
``steps_per_run`` is how many steps ``run_steps_on_dataset`` runs per call by default (the on-device
loop amortises the host round trip, which on TPUs is the dominant cost of small steps).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxdist.job import initialize_cluster
from jaxdist.strategies.base import Strategy
from jaxdist.strategies.layout import LayoutPolicy, resolve_devices
from jaxdist.strategies.tf_api import StrategyExtended, StrategyV1Names

__all__ = ["TPUStrategy"]


class TPUStrategy(Strategy, StrategyExtended, StrategyV1Names):
    """Synchronous data parallelism over the cores of the default backend, with on-device loops.

    Args:
        steps_per_run: steps (>= 1) per ``run_steps_on_dataset`` call without ``iterations``.
        num_cores: use only the first ``num_cores`` devices; None for all of them.
        devices: explicit devices instead (overrides the default backend's); mostly for tests.
        host_offload: keep ``"opt_state"``, ``"params"`` or ``"all"`` variables in host memory
            between on-device loops, streamed to the cores for each loop (see the host-offload
            guide); None: device memory.
        axis_name: the name ``run`` binds the replica axis to (pmap-era code: ``"batch"``); None:
            ``"replica"``.
        mesh: the user's `jax.sharding.Mesh` (a pod's ``jax.make_mesh``) instead of ``devices``:
            data parallel over all its axes.
        coordinator_address: the cluster, as for `MultiWorkerMirroredStrategy`: process 0's
            ``"host:port"`` (default: the ``JAXDIST_*`` variables, else JAX's cluster detection: a
            TPU pod's hosts connect themselves).
        num_processes: as for `MultiWorkerMirroredStrategy`: how many processes take part.
        process_id: as for `MultiWorkerMirroredStrategy`: this process's index.
        initialization_timeout: seconds to wait for every process to join.
        heartbeat_timeout_seconds: seconds without heartbeats after which a peer counts as dead.

    Raises:
        ValueError: for ``steps_per_run`` < 1, ``num_cores`` outside ``[1, number of devices]``, or
            an unknown ``host_offload``.

    Examples:
        >>> import jaxdist as jd
        >>> strategy = jd.TPUStrategy(steps_per_run=20, num_cores=4)
        >>> strategy.num_replicas_in_sync, strategy.steps_per_run
        (4, 20)
    """

    def __init__(self, steps_per_run: int = 1, num_cores: int | None = None, devices: Any = None,
                 host_offload: str | None = None, axis_name: str | None = None, *,
                 mesh: jax.sharding.Mesh | None = None, coordinator_address: str | None = None,
                 num_processes: int | None = None, process_id: int | None = None,
                 initialization_timeout: int = 120, heartbeat_timeout_seconds: int = 30):
        if not isinstance(steps_per_run, int) or isinstance(steps_per_run, bool) or (
                steps_per_run < 1):
            raise ValueError(f"steps_per_run={steps_per_run!r} must be an int >= 1 (steps per "
                             "on-device loop).")
        initialize_cluster(coordinator_address, num_processes, process_id,
                           initialization_timeout=initialization_timeout,
                           heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                           caller="TPUStrategy")
        if mesh is not None:
            if devices is not None or num_cores is not None:
                raise ValueError("TPUStrategy got mesh= with devices= / num_cores=: a mesh already "
                                 "says which cores; pass one of them.")
            policy = LayoutPolicy(mesh=mesh, host_offload=host_offload)
        else:
            available = (tuple(jax.devices()) if devices is None
                         else resolve_devices(devices, "devices"))
            if num_cores is not None:
                if not isinstance(num_cores, int) or not 1 <= num_cores <= len(available):
                    raise ValueError(
                        f"num_cores={num_cores!r} must be an int in [1, {len(available)}] (the "
                        f"{available[0].platform} devices here); pass None to use all of them.")
                available = available[:num_cores]
            policy = LayoutPolicy(available, host_offload=host_offload)
        super().__init__(policy, axis_name=axis_name)
        self.steps_per_run = steps_per_run
        self._initialized = False

    @property
    def num_cores(self) -> int:
        """The cores (replicas) in use."""
        return self.num_replicas_in_sync

    def get_host_cpu_device(self, host_id: int = 0) -> jax.Device:
        """The CPU device of host ``host_id`` (this process's host; other hosts' CPUs are not
        addressable).

        Raises:
            ValueError: for a host id outside ``[0, num_hosts)`` or another process's host.

        Examples:
            >>> import jaxdist as jd
            >>> jd.TPUStrategy().get_host_cpu_device(0).platform
            'cpu'
        """
        if not isinstance(host_id, int) or not 0 <= host_id < self.num_hosts:
            raise ValueError(f"host_id={host_id!r} must be in [0, {self.num_hosts}) "
                             f"(num_hosts={self.num_hosts}).")
        hosts = sorted({d.process_index for d in self.devices})
        if hosts[host_id] != jax.process_index():
            raise ValueError(
                f"host_id={host_id} is process {hosts[host_id]}, not this process "
                f"({jax.process_index()}): only this host's CPU is addressable here; ask that "
                "process.")
        return jax.local_devices(backend="cpu")[0]

    def initialize(self) -> None:
        """Bring the devices up (a no-op after the first call; JAX starts backends on demand). Safe
        to call any number of times."""
        if not self._initialized:
            for d in self.devices:
                if d.process_index == jax.process_index():
                    _ = d.platform  # fails here, clearly, if the backend cannot start
            self._initialized = True

    def finalize(self) -> None:
        """Drop this strategy's compiled programs. Safe to call any number of times, before or after
        initialize."""
        self.programs.clear()
        self._initialized = False

    def __repr__(self) -> str:
        return f"TPUStrategy(num_cores={self.num_cores}, steps_per_run={self.steps_per_run})"
