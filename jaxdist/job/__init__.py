"""The job: its processes, joined, checked, failing together, and the programs a restart reuses.

``_join`` joins the job over ``jax.distributed`` and answers "does this job span processes";
``_failure`` is the job's key-value store and makes a job's processes end together; ``_checks``
holds what the processes of one ``fit`` check together; ``_compilation_cache`` keeps compiled
programs across restarts. The bottom of the package but for the records (``costs``, ``replicate``):
nothing here knows strategies or training. Public names: ``jd.initialize_cluster``,
``jd.configure_compilation_cache``, ``jd.training.JobDisagreementError``.
"""

from jaxdist.job._checks import AGREE_SECONDS as AGREE_SECONDS
from jaxdist.job._checks import DATA_END_SECONDS as DATA_END_SECONDS
from jaxdist.job._checks import JobDisagreementError as JobDisagreementError
from jaxdist.job._checks import agree_on_fit as agree_on_fit
from jaxdist.job._checks import data_ended as data_ended
from jaxdist.job._checks import failing as failing
from jaxdist.job._compilation_cache import (
    configure_compilation_cache as configure_compilation_cache,
)
from jaxdist.job._failure import BEAT_SECONDS as BEAT_SECONDS
from jaxdist.job._failure import EXIT_SECONDS as EXIT_SECONDS
from jaxdist.job._failure import POLL_SECONDS as POLL_SECONDS
from jaxdist.job._failure import FailureMonitor as FailureMonitor
from jaxdist.job._failure import exchange as exchange
from jaxdist.job._failure import forget as forget
from jaxdist.job._failure import gather as gather
from jaxdist.job._failure import guard_exit as guard_exit
from jaxdist.job._failure import post as post
from jaxdist.job._failure import read as read
from jaxdist.job._failure import report_failure as report_failure
from jaxdist.job._failure import set_heartbeat_timeout as set_heartbeat_timeout
from jaxdist.job._failure import silence_seconds as silence_seconds
from jaxdist.job._join import CLUSTER_VARIABLES as CLUSTER_VARIABLES
from jaxdist.job._join import check_connected as check_connected
from jaxdist.job._join import check_spans_processes as check_spans_processes
from jaxdist.job._join import detected_cluster as detected_cluster
from jaxdist.job._join import from_chief as from_chief
from jaxdist.job._join import initialize_cluster as initialize_cluster
from jaxdist.job._join import resolve_cluster as resolve_cluster
from jaxdist.job._join import spans_processes as spans_processes

__all__ = [
    "AGREE_SECONDS", "BEAT_SECONDS", "CLUSTER_VARIABLES", "DATA_END_SECONDS", "EXIT_SECONDS",
    "POLL_SECONDS", "FailureMonitor", "JobDisagreementError", "agree_on_fit", "check_connected",
    "check_spans_processes", "configure_compilation_cache", "data_ended", "detected_cluster",
    "exchange", "failing", "forget", "gather", "from_chief", "guard_exit", "initialize_cluster",
    "post", "read", "report_failure", "resolve_cluster", "set_heartbeat_timeout", "silence_seconds",
    "spans_processes",
]
