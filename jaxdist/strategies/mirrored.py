"""`MirroredStrategy`: synchronous data parallelism over every device (tf.distribute's).

In a job of several processes it spans every device of every process once ``jax.distributed`` is
connected (by `MultiWorkerMirroredStrategy` or ``jax.distributed.initialize()``); in a job whose
processes were never connected it is an error naming the fix, never a strategy over one process
alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxdist.job import check_connected
from jaxdist.strategies.base import Strategy
from jaxdist.strategies.layout import LayoutPolicy, resolve_devices
from jaxdist.strategies.tf_api import StrategyExtended, StrategyV1Names

__all__ = ["MirroredStrategy"]


class MirroredStrategy(Strategy, StrategyExtended, StrategyV1Names):
    """One replica per device; parameters mirrored (replicated), batches split over the replicas.

    Args:
        devices: the devices (``jax.Device``, ids or names such as ``"gpu:0"``), in replica order;
            None for every device of the default backend (of every process).
        host_offload: keep ``"opt_state"``, ``"params"`` or ``"all"`` variables in host memory
            (``"pinned_host"``) between steps and stream them to the devices for each step (see the
            host-offload guide); None: everything in device memory.
        axis_name: the name ``run`` binds the replica axis to (pmap-era code: ``"batch"``); None:
            ``"replica"``.
        mesh: the user's `jax.sharding.Mesh` instead of ``devices``: data parallel over all its axes
            (a batch's rows are split over them, in order; their names are what replica functions'
            collectives use).

    Raises:
        ValueError: for an empty list, a device listed twice, devices of two backends, an unknown
            ``host_offload`` (or one the devices cannot hold: no ``"pinned_host"`` memory), or
            devices that leave out processes of the job.
        RuntimeError: in a job of several processes (``JAXDIST_*`` / SLURM / ... environment) that
            ``jax.distributed`` has not connected.

    Examples:
        >>> import jax, jaxdist as jd
        >>> strategy = jd.MirroredStrategy()
        >>> strategy.num_replicas_in_sync == len(jax.local_devices())
        True
    """

    def __init__(self, devices: Sequence[Any] | None = None, host_offload: str | None = None,
                 axis_name: str | None = None, *, mesh: jax.sharding.Mesh | None = None):
        check_connected(type(self).__name__)
        if mesh is not None and devices is not None:
            raise ValueError("MirroredStrategy got both devices= and mesh=: pass one of them.")
        policy = LayoutPolicy(None if mesh is not None else resolve_devices(devices, "devices"),
                              mesh=mesh, host_offload=host_offload)
        super().__init__(policy, axis_name=axis_name)
