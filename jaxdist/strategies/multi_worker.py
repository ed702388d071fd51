"""`MultiWorkerMirroredStrategy`: synchronous data parallelism over every device of every process.

Built on JAX's own multi-controller runtime: `jax.distributed.initialize` connects the processes, and XLA's
collectives (gloo on CPU, NCCL on GPU, ICI on TPU) do the all-reduces — there is no jaxdist protocol. The
cluster comes from the keyword arguments, else the ``JAXDIST_COORDINATOR_ADDRESS`` / ``JAXDIST_NUM_PROCESSES``
/ ``JAXDIST_PROCESS_ID`` environment variables (what ``python -m jaxdist.launch`` sets), else JAX's own
cluster detection (SLURM, Open MPI, TPU pods, ...); with none of them it is a single process.

A dead peer is an error, not a wait: the coordination service's heartbeats (``heartbeat_timeout_seconds``)
make the survivors exit with "the JAX distributed service detected fatal errors ... another task died", and a
peer that never shows up fails ``initialization_timeout`` seconds after start.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxdist.replicate.trees import is_array, is_chief
from jaxdist.strategies.base import Strategy
from jaxdist.strategies.extended import StrategyExtended
from jaxdist.strategies.legacy import StrategyV1Names
from jaxdist.strategies.policy import LayoutPolicy

__all__ = ["MultiWorkerMirroredStrategy", "resolve_cluster"]

_ENV = ("JAXDIST_COORDINATOR_ADDRESS", "JAXDIST_NUM_PROCESSES", "JAXDIST_PROCESS_ID")
_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:\d{1,5}$")


def resolve_cluster(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> tuple[str, int, int] | None:
    """The cluster from keyword arguments, else the ``JAXDIST_*`` environment; None when neither says.

    Raises:
        ValueError: for a partial or malformed cluster description, naming what is missing or wrong.

    Example:
        >>> resolve_cluster("127.0.0.1:1234", 2, 1)
        ('127.0.0.1:1234', 2, 1)
    """
    given = (coordinator_address, num_processes, process_id)
    source = "keyword arguments"
    if all(v is None for v in given):
        env = [os.environ.get(k) for k in _ENV]
        if all(v is None for v in env):
            return None
        if any(v is None for v in env):
            missing = [k for k, v in zip(_ENV, env, strict=True) if v is None]
            raise ValueError(f"the cluster environment is incomplete: {', '.join(missing)} not set; set all three.")
        source = "environment"
        try:
            given = (env[0], int(env[1]), int(env[2]))
        except ValueError:
            raise ValueError(
                f"JAXDIST_NUM_PROCESSES={env[1]!r} and JAXDIST_PROCESS_ID={env[2]!r} must be integers."
            ) from None
    elif any(v is None for v in given):
        names = ("coordinator_address", "num_processes", "process_id")
        missing = [n for n, v in zip(names, given, strict=True) if v is None]
        raise ValueError(f"{', '.join(missing)} missing: pass coordinator_address, num_processes and process_id "
                         "together (or none, to use the environment or JAX's cluster detection).")
    address, n, pid = given
    if not isinstance(address, str) or not _ADDRESS.match(address):
        raise ValueError(f"coordinator_address={address!r} ({source}) must be 'host:port', e.g. '10.0.0.1:1234'.")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_processes={n!r} ({source}) must be an int >= 1.")
    if not isinstance(pid, int) or not 0 <= pid < n:
        raise ValueError(f"process_id={pid!r} ({source}) must be in [0, {n}).")
    return address, n, pid


def _initialize(cluster, initialization_timeout: int, heartbeat_timeout_seconds: int) -> None:
    if jax.distributed.is_initialized():
        if cluster is not None and jax.process_count() != cluster[1]:
            raise ValueError(
                f"jax.distributed is already initialized with {jax.process_count()} processes, but "
                f"num_processes={cluster[1]} was asked for."
            )
        return
    timeouts = {"initialization_timeout": initialization_timeout,
                "heartbeat_timeout_seconds": heartbeat_timeout_seconds}
    try:
        if cluster is not None:
            address, n, pid = cluster
            if n == 1:
                return  # a cluster of one: nothing to connect
            jax.distributed.initialize(address, n, pid, **timeouts)
        else:
            try:
                jax.distributed.initialize(**timeouts)  # SLURM, Open MPI, TPU pods, ...
            except (ValueError, RuntimeError) as err:
                text = str(err)
                if "coordinator_address" in text or "cluster" in text.lower() or "must be called before" in text:
                    return  # nothing detected, or JAX already running without a cluster: this process alone
                raise
    except RuntimeError as err:
        if "before" in str(err) and ("computation" in str(err) or "backend" in str(err)):
            raise RuntimeError(
                "MultiWorkerMirroredStrategy must be created before any JAX computation or device query in "
                f"this process (jax.distributed.initialize has to run first): {err}. Create the strategy at "
                "the top of your program."
            ) from None
        raise


class MultiWorkerMirroredStrategy(Strategy, StrategyExtended, StrategyV1Names):
    """Mirrored data parallelism over every device of every process (tf.distribute's MultiWorker...).

    Args:
        coordinator_address: ``"host:port"`` of process 0's coordination service.
        num_processes: how many processes take part.
        process_id: this process's index in ``[0, num_processes)``.
        initialization_timeout: seconds to wait for every process to join before failing.
        heartbeat_timeout_seconds: seconds without heartbeats after which a peer counts as dead and every
            survivor exits with an error.
        axis_name: the name ``run`` binds the replica axis to (pmap-era code: ``"batch"``); None: ``"replica"``.

    Raises:
        ValueError: for a partial or malformed cluster description.
        RuntimeError: when created after this process already ran a JAX computation.

    Example:
        >>> import jaxdist as jd
        >>> strategy = jd.MultiWorkerMirroredStrategy()   # no cluster configured: one process
        >>> strategy.num_hosts, strategy.num_replicas_in_sync
        (1, 8)
    """

    def __init__(
        self,
        coordinator_address: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        *,
        initialization_timeout: int = 120,
        heartbeat_timeout_seconds: int = 30,
        axis_name: str | None = None,
    ):
        cluster = resolve_cluster(coordinator_address, num_processes, process_id)
        _initialize(cluster, initialization_timeout, heartbeat_timeout_seconds)
        super().__init__(LayoutPolicy(tuple(jax.devices())), axis_name=axis_name)

    @property
    def is_chief(self) -> bool:
        """True on process 0, whose initial values every process uses."""
        return is_chief()

    def create_variables(self, init_fn, *args, **kwargs):
        """As `Strategy.create_variables`; the chief's arguments (rng keys, samples) are used everywhere, so
        every process starts from the chief's values."""
        return super().create_variables(init_fn, *_from_chief(args), **kwargs)

    def mirror(self, tree: Any) -> Any:
        """As `Strategy.mirror`; the chief's values win (they are broadcast from process 0)."""
        return super().mirror(_from_chief(tree))

    def __repr__(self) -> str:
        return (f"MultiWorkerMirroredStrategy(num_hosts={self.num_hosts}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


def _from_chief(tree: Any) -> Any:
    """``tree`` as process 0 has it (a no-op in a single process)."""
    if jax.process_count() == 1:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if is_array(x)]
    keys = [jax.dtypes.issubdtype(leaves[i].dtype, jax.dtypes.prng_key) for i in arrays]
    impls = [jax.random.key_impl(leaves[i]) if k else None for i, k in zip(arrays, keys, strict=True)]
    plain = [np.asarray(jax.random.key_data(leaves[i]) if k else leaves[i]) for i, k in zip(arrays, keys, strict=True)]
    plain = multihost_utils.broadcast_one_to_all(plain)
    for i, p, k, impl in zip(arrays, plain, keys, impls, strict=True):
        leaves[i] = jax.random.wrap_key_data(np.asarray(p), impl=impl) if k else np.asarray(p)
    return jax.tree.unflatten(treedef, leaves)  # Python scalars and other values are left as they are
