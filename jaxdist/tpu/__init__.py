"""TPU: TPUStrategy, on-device step loops, and outside_compilation host regions."""

from jaxdist.strategies.compile import MultiStepContext as MultiStepContext
from jaxdist.tpu.outside_compilation import host_compute_core as host_compute_core
from jaxdist.tpu.outside_compilation import outside_compilation as outside_compilation
from jaxdist.tpu.strategy import TPUStrategy as TPUStrategy

__all__ = ["MultiStepContext", "TPUStrategy", "host_compute_core", "outside_compilation"]
