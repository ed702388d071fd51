"""Input: how host batches become global arrays split over the batch axes.

``_placement`` is the one placement rule (which values need placing, the batch layouts,
``place_batch``); ``_dataset`` wraps datasets and iterators (`DistributedDataset`,
`DistributedIterator`, `InputContext`); ``_remainder`` a dataset's smaller last batch (refused,
dropped or padded with row weights); ``_read_ahead`` is the one home of reading batches ahead of the
step that takes them (in line for the Trainer's loop, a thread for `DistributedIterator`).
"""

from jaxdist.strategies.input._dataset import DistributedDataset as DistributedDataset
from jaxdist.strategies.input._dataset import DistributedIterator as DistributedIterator
from jaxdist.strategies.input._dataset import InputContext as InputContext
from jaxdist.strategies.input._placement import all_on_mesh as all_on_mesh
from jaxdist.strategies.input._placement import argument_layouts as argument_layouts
from jaxdist.strategies.input._placement import check_batch_leaves as check_batch_leaves
from jaxdist.strategies.input._placement import check_divisible as check_divisible
from jaxdist.strategies.input._placement import kept as kept
from jaxdist.strategies.input._placement import needs_placing as needs_placing
from jaxdist.strategies.input._placement import place_batch as place_batch
from jaxdist.strategies.input._placement import place_nnx_defaults as place_nnx_defaults
from jaxdist.strategies.input._placement import refuse_text as refuse_text
from jaxdist.strategies.input._placement import replicas_on_this_process as replicas_on_this_process
from jaxdist.strategies.input._placement import sharding_off as sharding_off
from jaxdist.strategies.input._placement import shardings_of as shardings_of
from jaxdist.strategies.input._read_ahead import Prefetcher as Prefetcher
from jaxdist.strategies.input._read_ahead import ahead as ahead
from jaxdist.strategies.input._remainder import PADDED as PADDED
from jaxdist.strategies.input._remainder import check_batches as check_batches
from jaxdist.strategies.input._remainder import check_remainder as check_remainder
from jaxdist.strategies.input._remainder import holds_padded as holds_padded
from jaxdist.strategies.input._remainder import padding_weights as padding_weights

__all__ = [
    "PADDED", "DistributedDataset", "DistributedIterator", "InputContext", "Prefetcher", "ahead",
    "all_on_mesh", "argument_layouts", "check_batch_leaves", "check_batches", "check_divisible",
    "check_remainder", "holds_padded", "kept", "needs_placing", "padding_weights", "place_batch",
    "place_nnx_defaults", "replicas_on_this_process", "sharding_off", "refuse_text", "shardings_of"
]
