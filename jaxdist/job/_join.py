"""Processes: joining the job's cluster, checking that a strategy spans it, and the chief's values.

JAX's own multi-controller runtime does the work: `jax.distributed.initialize` connects the
processes, and XLA's collectives (gloo on CPU, NCCL on GPU, ICI on TPU) move the data; there is no
jaxdist protocol. The cluster comes from keyword arguments, else the ``JAXDIST_COORDINATOR_ADDRESS``
/ ``JAXDIST_NUM_PROCESSES`` / ``JAXDIST_PROCESS_ID`` environment variables (what ``python -m
jaxdist.launch`` sets), else JAX's own cluster detection (SLURM, Open MPI, TPU pods, ...); with none
of them it is a single process.

Once the processes are connected, a strategy spans every device of every process: a strategy over
some of them only would leave each process training its own copy without a word, so it is an error
(`check_spans_processes`). Values that every process passes in (initial variables, rng keys) are
taken from process 0 (`from_chief`), so the processes start from the same state even if their inputs
differ.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxdist.job._failure import guard_exit, set_heartbeat_timeout
from jaxdist.replicate.trees import is_array

try:  # JAX's cluster detectors, to tell a job of several processes that was never connected
    from jax._src.clusters import ClusterEnv as _ClusterEnv
except ImportError:  # pragma: no cover - JAX moved them: no detection beyond JAXDIST_*
    _ClusterEnv = None
try:  # whether this process's JAX already runs (then it is too late to connect it to others)
    from jax._src.xla_bridge import backends_are_initialized as _backends_started
except ImportError:  # pragma: no cover - JAX moved it: jax.distributed.initialize says so itself
    def _backends_started() -> bool:
        return False

__all__ = ["CLUSTER_VARIABLES", "check_connected", "check_spans_processes", "spans_processes",
           "detected_cluster", "from_chief", "initialize_cluster", "resolve_cluster"]

CLUSTER_VARIABLES = ("JAXDIST_COORDINATOR_ADDRESS", "JAXDIST_NUM_PROCESSES", "JAXDIST_PROCESS_ID")
"""The environment variables that describe a job (set by ``jaxdist.launch`` and cluster recipes)."""
_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:\d{1,5}$")


def resolve_cluster(coordinator_address: str | None = None, num_processes: int | None = None,
                    process_id: int | None = None) -> tuple[str, int, int] | None:
    """The cluster from keyword arguments, else the ``JAXDIST_*`` environment; None when neither
    says.

    Raises:
        ValueError: for a partial or malformed cluster description, naming what is missing or wrong.

    Examples:
        >>> resolve_cluster("127.0.0.1:1234", 2, 1)
        ('127.0.0.1:1234', 2, 1)
    """
    given = (coordinator_address, num_processes, process_id)
    source = "keyword arguments"
    if all(v is None for v in given):
        env = [os.environ.get(k) for k in CLUSTER_VARIABLES]
        if all(v is None for v in env):
            return None
        if any(v is None for v in env):
            missing = [k for k, v in zip(CLUSTER_VARIABLES, env, strict=True) if v is None]
            raise ValueError(f"the cluster environment is incomplete: {', '.join(missing)} not "
                             "set; set all three.")
        source = "environment"
        try:
            given = (env[0], int(env[1]), int(env[2]))
        except ValueError:
            raise ValueError(f"JAXDIST_NUM_PROCESSES={env[1]!r} and JAXDIST_PROCESS_ID={env[2]!r} "
                             "must be integers.") from None
    elif any(v is None for v in given):
        names = ("coordinator_address", "num_processes", "process_id")
        missing = [n for n, v in zip(names, given, strict=True) if v is None]
        raise ValueError(f"{', '.join(missing)} missing: pass coordinator_address, num_processes "
                         "and process_id together (or none, to use the environment or JAX's "
                         "cluster detection).")
    address, n, pid = given
    if not isinstance(address, str) or not _ADDRESS.match(address):
        raise ValueError(f"coordinator_address={address!r} ({source}) must be 'host:port', e.g. "
                         "'10.0.0.1:1234'.")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_processes={n!r} ({source}) must be an int >= 1.")
    if not isinstance(pid, int) or not 0 <= pid < n:
        raise ValueError(f"process_id={pid!r} ({source}) must be in [0, {n}).")
    return address, n, pid


def initialize_cluster(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    initialization_timeout: int = 120,
    heartbeat_timeout_seconds: int = 30,
    caller: str = "initialize_cluster",
) -> int:
    """Connect this process to the job's other processes, once; returns the process count.

    What the strategies that take a cluster do first, for programs that build their own mesh (which
    needs every process's devices). The cluster comes from the arguments, else the ``JAXDIST_*``
    variables (``python -m jaxdist.launch``), else JAX's detection (SLURM, Open MPI, Kubernetes, TPU
    pods); with none of them, or when JAX is already connected, nothing happens. A dead peer is then
    an error, not a wait (after ``heartbeat_timeout_seconds``), and so is a peer that never shows up
    (after ``initialization_timeout``).

    Args:
        coordinator_address: ``"host:port"`` of process 0's coordination service (with the next two,
            or none of the three).
        num_processes: how many processes take part.
        process_id: this process's index in ``[0, num_processes)``.
        initialization_timeout: seconds to wait for every process to join before failing.
        heartbeat_timeout_seconds: seconds without heartbeats after which a peer counts as dead.
        caller: who asks, for error messages.

    Raises:
        ValueError: for a partial or malformed cluster, or JAX already connected with another count.
        RuntimeError: when this process already ran a JAX computation
            (``jax.distributed.initialize`` must come first).

    Examples:
        >>> import jaxdist as jd
        >>> jd.initialize_cluster()   # no cluster configured: this process alone
        1
    """
    cluster = resolve_cluster(coordinator_address, num_processes, process_id)
    _join(cluster, initialization_timeout, heartbeat_timeout_seconds, caller)
    return jax.process_count()


def _join(cluster: tuple[str, int, int] | None, initialization_timeout: int,
          heartbeat_timeout_seconds: int, caller: str) -> None:
    if jax.distributed.is_initialized():
        if cluster is not None and jax.process_count() != cluster[1]:
            raise ValueError(
                f"jax.distributed is already initialized with {jax.process_count()} processes, but "
                f"num_processes={cluster[1]} was asked for.")
        return
    detected = None if cluster is not None else detected_cluster()
    timeouts = {"initialization_timeout": initialization_timeout,
                "heartbeat_timeout_seconds": heartbeat_timeout_seconds}
    if cluster is not None and cluster[1] == 1:
        return  # a cluster of one: nothing to connect
    if cluster is None and detected is None:
        # TPU pods, Kubernetes: what JAX finds by itself; else this process alone
        _jax_detection(timeouts)
        set_heartbeat_timeout(heartbeat_timeout_seconds)
        return
    if _backends_started():
        where = (f"the {detected[0]} environment" if cluster is None
                 else "the cluster arguments / JAXDIST_* variables")
        raise RuntimeError(
            f"{caller} must come before any JAX computation or device query in this process: "
            f"{where} describes a job of several processes, and jax.distributed.initialize has to "
            "connect them before JAX starts its backend. Call it (create the strategy) at the top "
            "of your program.")
    jax.distributed.initialize(*(cluster or ()), **timeouts)  # no cluster: JAX's detection
    set_heartbeat_timeout(heartbeat_timeout_seconds)
    guard_exit()  # an uncaught exception ends this process and its peers, never a hang at exit


# JAX's detectors that read only environment variables
_ENV_DETECTORS = ("SlurmCluster", "OmpiCluster")


def _jax_detection(timeouts: dict) -> None:
    """``jax.distributed.initialize()`` where one of JAX's own detectors finds its environment (TPU
    pods, Kubernetes, ...: the ones ``initialize`` itself would pick); none found, or JAX already
    running in this process: this process alone."""
    if _ClusterEnv is None or _backends_started():
        return
    if not any(not env.opt_in_only_method and env.is_env_present()
               for env in _ClusterEnv._cluster_types):
        return
    jax.distributed.initialize(**timeouts)


def detected_cluster() -> tuple[str, int] | None:
    """The job of several processes this process's environment variables describe, as ``(source,
    process count)``: the ``JAXDIST_*`` variables, else SLURM's or Open MPI's (read by JAX's own
    detectors). None for a single process. (TPU pods and Kubernetes are detected by JAX when it
    connects, through their metadata services: not here.)

    Examples:
        >>> detected_cluster() is None   # a plain shell: no cluster
        True
    """
    ours = resolve_cluster()
    if ours is not None:
        return ("JAXDIST_*", ours[1]) if ours[1] > 1 else None
    for env in getattr(_ClusterEnv, "_cluster_types", ()):
        if env.__name__ not in _ENV_DETECTORS:
            continue
        try:
            if not env.is_env_present():
                continue
            count = int(env.get_process_count())
        except Exception:
            continue
        if count > 1:
            return env.__name__.removesuffix("Cluster"), count
    return None


def check_connected(strategy: str) -> None:
    """Raise when the environment describes a job of several processes that JAX has not connected: a
    strategy made now would span this process alone.

    Raises:
        RuntimeError: naming the environment and the fix.

    Examples:
        >>> check_connected("MirroredStrategy")   # a single process: nothing to say
    """
    detected = detected_cluster()
    if detected is None or jax.distributed.is_initialized():
        return
    raise RuntimeError(
        f"{strategy} in a job of {detected[1]} processes ({detected[0]} environment), but "
        "jax.distributed is not initialized: this process alone would train its own copy. Use "
        "MultiWorkerMirroredStrategy (it connects "
        "the processes), or call jd.initialize_cluster() at the top of the program, before the "
        "strategy (it reads the JAXDIST_* variables and the cluster's own; "
        "jax.distributed.initialize() reads only the latter).")


def spans_processes(devices: Iterable[jax.Device] | None) -> bool:
    """Whether ``devices`` (a strategy's, a mesh's ``devices.flat``; None: none) belong to more than
    one process: the one answer to "does this job's work span processes" (collectives over
    processes, agreed decisions, process-local batches).

    Examples:
        >>> import jax
        >>> spans_processes(jax.devices()), spans_processes(None)
        (False, False)
    """
    return devices is not None and len({d.process_index for d in devices}) > 1


def check_spans_processes(devices: Sequence[jax.Device], strategy: str) -> None:
    """Raise unless ``devices`` belong to every process of the job (always true in one process).

    Raises:
        ValueError: naming the processes the devices belong to and the fix.

    Examples:
        >>> import jax
        >>> check_spans_processes(jax.devices(), "MirroredStrategy")
    """
    count = jax.process_count()
    owners = sorted({d.process_index for d in devices})
    if count == 1 or len(owners) == count:
        return
    raise ValueError(
        f"{strategy} over the devices of process(es) {owners} only, in a job of {count} processes: "
        "each process would train its own copy and nothing would keep them in sync. Leave devices= "
        "(and num_cores=) out (every device of every process: jax.devices()), pass a mesh over "
        "jax.devices(), or use MultiWorkerMirroredStrategy.")


def from_chief(tree: Any) -> Any:
    """``tree`` as process 0 has it: its process-local arrays (rng keys included) broadcast from
    process 0; global arrays (already one value across the processes) and other leaves are left as
    they are. A no-op in a single process.

    Examples:
        >>> import numpy as np
        >>> from_chief({"w": np.ones(2)})["w"].tolist()
        [1.0, 1.0]
    """
    if jax.process_count() == 1:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves)
              if is_array(x) and (not isinstance(x, jax.Array) or x.is_fully_addressable)]
    if not arrays:
        return tree
    keys = [jax.dtypes.issubdtype(leaves[i].dtype, jax.dtypes.prng_key) for i in arrays]
    impls = [jax.random.key_impl(leaves[i]) if k else None
             for i, k in zip(arrays, keys, strict=True)]
    plain = multihost_utils.broadcast_one_to_all([
        np.asarray(jax.random.key_data(leaves[i]) if k else leaves[i])
        for i, k in zip(arrays, keys, strict=True)])
    for i, p, k, impl in zip(arrays, plain, keys, impls, strict=True):
        leaves[i] = jax.random.wrap_key_data(np.asarray(p), impl=impl) if k else np.asarray(p)
    return jax.tree.unflatten(treedef, leaves)
