"""Input: how host batches become global arrays split over the batch axes.

``_placement`` is the one placement rule (which values need placing, the batch layouts, ``place_batch``);
``_dataset`` wraps datasets and iterators (`DistributedDataset`, `DistributedIterator`, `InputContext`) and the
read-ahead that places the next batches while a step runs.
"""

from jaxdist.strategies.input._placement import DistributedDataset as DistributedDataset
from jaxdist.strategies.input._placement import DistributedIterator as DistributedIterator
from jaxdist.strategies.input._placement import InputContext as InputContext
from jaxdist.strategies.input._placement import argument_layouts as argument_layouts
from jaxdist.strategies.input._placement import check_divisible as check_divisible
from jaxdist.strategies.input._placement import kept as kept
from jaxdist.strategies.input._placement import place_batch as place_batch
from jaxdist.strategies.input._placement import replicas_on_this_process as replicas_on_this_process
from jaxdist.strategies.input._placement import sharding_off as sharding_off

__all__ = [
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "argument_layouts",
    "check_divisible",
    "kept",
    "place_batch",
    "replicas_on_this_process",
    "sharding_off",
]
