"""TPU: TPUStrategy and outside_compilation host regions (on-device step loops:
``jd.MultiStepContext``)."""

from jaxdist.tpu.outside_compilation import host_compute_core as host_compute_core
from jaxdist.tpu.outside_compilation import outside_compilation as outside_compilation
from jaxdist.tpu.strategy import TPUStrategy as TPUStrategy

__all__ = ["TPUStrategy", "host_compute_core", "outside_compilation"]
