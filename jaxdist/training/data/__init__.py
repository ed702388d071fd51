"""The batches a fit reads: their format and checks, the stream and its position (`DataPosition`),
the feed that places them on the devices, and the input iterator's state saved with a checkpoint.

This `__init__` is the folder's interface: the rest of `jaxdist.training` imports from here.
"""

from jaxdist.training.data._checks import BatchChecker as BatchChecker
from jaxdist.training.data._checks import global_rows as global_rows
from jaxdist.training.data._checks import say_batch_change as say_batch_change
from jaxdist.training.data._eval import eval_batches as eval_batches
from jaxdist.training.data._feed import BatchFeed as BatchFeed
from jaxdist.training.data._feed import TrainBatch as TrainBatch
from jaxdist.training.data._feed import WholeBatch as WholeBatch
from jaxdist.training.data._format import check_key as check_key
from jaxdist.training.data._format import split_batch as split_batch
from jaxdist.training.data._input_state import IteratorSnapshot as IteratorSnapshot
from jaxdist.training.data._input_state import restore_args as restore_args
from jaxdist.training.data._input_state import restored_position as restored_position
from jaxdist.training.data._input_state import save_args as save_args
from jaxdist.training.data._input_state import state_for_process as state_for_process
from jaxdist.training.data._position import DataPosition as DataPosition
from jaxdist.training.data._position import UnrestorableState as UnrestorableState
from jaxdist.training.data._stream import BatchStream as BatchStream

__all__ = [
    "BatchChecker", "BatchFeed", "BatchStream", "DataPosition", "IteratorSnapshot", "TrainBatch",
    "UnrestorableState", "WholeBatch", "check_key", "eval_batches", "global_rows", "restore_args",
    "restored_position", "save_args", "say_batch_change", "split_batch", "state_for_process",
]
