"""State on disk: the `Checkpointer`, its damage checks, the one-writer claim, storage errors, foreign (Orbax)
checkpoints, states loaded into a strategy's layout, averaged weights restored or not, and the compilation cache.

This `__init__` is the folder's interface: the rest of `jaxdist.training` imports these names from here.
"""

from jaxdist.training.checkpoints._checkpointer import Checkpointer as Checkpointer
from jaxdist.training.checkpoints._claim import CheckpointConflictError as CheckpointConflictError
from jaxdist.training.checkpoints._compilation_cache import configure_compilation_cache as configure_compilation_cache
from jaxdist.training.checkpoints._damage import CheckpointCorruptedError as CheckpointCorruptedError
from jaxdist.training.checkpoints._ema import restore_state as restore_state
from jaxdist.training.checkpoints._load import assemble as assemble
from jaxdist.training.checkpoints._load import checked_pieces as checked_pieces
from jaxdist.training.checkpoints._storage import CheckpointSaveError as CheckpointSaveError
from jaxdist.training.checkpoints._storage import check_directory as check_directory

__all__ = [
    "CheckpointConflictError",
    "CheckpointCorruptedError",
    "CheckpointSaveError",
    "Checkpointer",
    "assemble",
    "check_directory",
    "checked_pieces",
    "configure_compilation_cache",
    "restore_state",
]
