"""Cluster: the processes of a job and the devices a strategy is given.

``_join`` joins the job over ``jax.distributed`` (keyword arguments, then the ``JAXDIST_*`` environment, then JAX's
own detection) and answers "does this job span processes"; ``_failure`` makes a job's processes end together (a
failing process tells the others why, none waits forever); ``_devices`` turns ``devices=`` arguments into devices.
"""

from jaxdist.strategies.cluster._devices import resolve_device as resolve_device
from jaxdist.strategies.cluster._devices import resolve_devices as resolve_devices
from jaxdist.strategies.cluster._failure import BEAT_SECONDS as BEAT_SECONDS
from jaxdist.strategies.cluster._failure import EXIT_SECONDS as EXIT_SECONDS
from jaxdist.strategies.cluster._failure import POLL_SECONDS as POLL_SECONDS
from jaxdist.strategies.cluster._failure import FailureMonitor as FailureMonitor
from jaxdist.strategies.cluster._failure import exchange as exchange
from jaxdist.strategies.cluster._failure import forget as forget
from jaxdist.strategies.cluster._failure import guard_exit as guard_exit
from jaxdist.strategies.cluster._failure import post as post
from jaxdist.strategies.cluster._failure import read as read
from jaxdist.strategies.cluster._failure import report_failure as report_failure
from jaxdist.strategies.cluster._failure import set_heartbeat_timeout as set_heartbeat_timeout
from jaxdist.strategies.cluster._failure import silence_seconds as silence_seconds
from jaxdist.strategies.cluster._join import CLUSTER_VARIABLES as CLUSTER_VARIABLES
from jaxdist.strategies.cluster._join import check_connected as check_connected
from jaxdist.strategies.cluster._join import check_spans_processes as check_spans_processes
from jaxdist.strategies.cluster._join import detected_cluster as detected_cluster
from jaxdist.strategies.cluster._join import from_chief as from_chief
from jaxdist.strategies.cluster._join import initialize_cluster as initialize_cluster
from jaxdist.strategies.cluster._join import resolve_cluster as resolve_cluster
from jaxdist.strategies.cluster._join import spans_processes as spans_processes

__all__ = [
    "BEAT_SECONDS",
    "CLUSTER_VARIABLES",
    "EXIT_SECONDS",
    "POLL_SECONDS",
    "FailureMonitor",
    "exchange",
    "forget",
    "guard_exit",
    "post",
    "read",
    "report_failure",
    "set_heartbeat_timeout",
    "silence_seconds",
    "check_connected",
    "check_spans_processes",
    "detected_cluster",
    "from_chief",
    "initialize_cluster",
    "resolve_cluster",
    "resolve_device",
    "resolve_devices",
    "spans_processes",
]
