"""Cluster: the processes of a job and the devices a strategy is given.

``_join`` joins the job over ``jax.distributed`` (keyword arguments, then the ``JAXDIST_*`` environment, then JAX's
own detection) and answers "does this job span processes"; ``_devices`` turns ``devices=`` arguments into devices.
"""

from jaxdist.strategies.cluster._devices import resolve_device as resolve_device
from jaxdist.strategies.cluster._devices import resolve_devices as resolve_devices
from jaxdist.strategies.cluster._join import CLUSTER_VARIABLES as CLUSTER_VARIABLES
from jaxdist.strategies.cluster._join import check_connected as check_connected
from jaxdist.strategies.cluster._join import check_spans_processes as check_spans_processes
from jaxdist.strategies.cluster._join import detected_cluster as detected_cluster
from jaxdist.strategies.cluster._join import from_chief as from_chief
from jaxdist.strategies.cluster._join import initialize_cluster as initialize_cluster
from jaxdist.strategies.cluster._join import resolve_cluster as resolve_cluster
from jaxdist.strategies.cluster._join import spans_processes as spans_processes

__all__ = [
    "CLUSTER_VARIABLES",
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
