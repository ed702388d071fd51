"""`MultiWorkerMirroredStrategy`: synchronous data parallelism over every device of every process.

Built on JAX's own multi-controller runtime: `jax.distributed.initialize` connects the processes,
and XLA's collectives (gloo on CPU, NCCL on GPU, ICI on TPU) do the all-reduces — there is no
jaxdist protocol. The cluster comes from the keyword arguments, else the
``JAXDIST_COORDINATOR_ADDRESS`` / ``JAXDIST_NUM_PROCESSES`` / ``JAXDIST_PROCESS_ID`` environment
variables (what ``python -m jaxdist.launch`` sets), else JAX's own cluster detection (SLURM, Open
MPI, TPU pods, ...); with none of them it is a single process.

A dead peer is an error, not a wait: the coordination service's heartbeats
(``heartbeat_timeout_seconds``) make the survivors exit with "the JAX distributed service detected
fatal errors ... another task died", and a peer that never shows up fails ``initialization_timeout``
seconds after start.
"""

from __future__ import annotations

import jax

from jaxdist.job import initialize_cluster
from jaxdist.replicate.trees import is_chief
from jaxdist.strategies.base import Strategy
from jaxdist.strategies.layout import LayoutPolicy
from jaxdist.strategies.tf_api import StrategyExtended, StrategyV1Names

__all__ = ["MultiWorkerMirroredStrategy"]


class MultiWorkerMirroredStrategy(Strategy, StrategyExtended, StrategyV1Names):
    """Mirrored data parallelism over every device of every process (tf.distribute's).

    Args:
        coordinator_address: ``"host:port"`` of process 0's coordination service.
        num_processes: how many processes take part.
        process_id: this process's index in ``[0, num_processes)``.
        initialization_timeout: seconds to wait for every process to join before failing.
        heartbeat_timeout_seconds: seconds without heartbeats after which a peer counts as dead and
            every survivor exits with an error.
        axis_name: the name ``run`` binds the replica axis to (pmap-era code: ``"batch"``); None:
            ``"replica"``.

    Raises:
        ValueError: for a partial or malformed cluster description.
        RuntimeError: when created after this process already ran a JAX computation.

    Examples:
        >>> import jaxdist as jd
        >>> strategy = jd.MultiWorkerMirroredStrategy()   # no cluster configured: one process
        >>> strategy.num_hosts, strategy.num_replicas_in_sync
        (1, 8)
    """

    def __init__(self, coordinator_address: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None, *, initialization_timeout: int = 120,
                 heartbeat_timeout_seconds: int = 30, axis_name: str | None = None):
        initialize_cluster(coordinator_address, num_processes, process_id,
                           initialization_timeout=initialization_timeout,
                           heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                           caller="MultiWorkerMirroredStrategy")
        super().__init__(LayoutPolicy(tuple(jax.devices())), axis_name=axis_name)

    @property
    def is_chief(self) -> bool:
        """True on process 0, whose initial values every process uses."""
        return is_chief()

    def __repr__(self) -> str:
        return (f"MultiWorkerMirroredStrategy(num_hosts={self.num_hosts}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")
