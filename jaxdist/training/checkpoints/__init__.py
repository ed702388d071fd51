"""State on disk: the `Checkpointer`, its damage checks, the one-writer claim, storage errors,
foreign (Orbax) checkpoints, the record of how far a fit got, states loaded into a strategy's
layout, the local tier (`LocalCheckpointer`: each process's own disk, every shard on two processes),
a Trainer's state saved, restored and loaded (averaged weights with it or not), and the compilation
cache.

This `__init__` is the folder's interface: the rest of `jaxdist.training` imports from here.
"""

from jaxdist.training.checkpoints._checkpointer import Checkpointer as Checkpointer
from jaxdist.training.checkpoints._claim import CheckpointConflictError as CheckpointConflictError
from jaxdist.training.checkpoints._damage import (
    CheckpointCorruptedError as CheckpointCorruptedError,
)
from jaxdist.training.checkpoints._directory import clear_progress as clear_progress
from jaxdist.training.checkpoints._directory import read_progress as read_progress
from jaxdist.training.checkpoints._directory import write_progress as write_progress
from jaxdist.training.checkpoints._live import load_live as load_live
from jaxdist.training.checkpoints._live import restore_live as restore_live
from jaxdist.training.checkpoints._live import roll_back as roll_back
from jaxdist.training.checkpoints._live import save_live as save_live
from jaxdist.training.checkpoints._local import LocalCheckpointer as LocalCheckpointer
from jaxdist.training.checkpoints._local import LocalRestore as LocalRestore
from jaxdist.training.checkpoints._local_live import restore_live_local as restore_live_local
from jaxdist.training.checkpoints._local_live import save_live_local as save_live_local
from jaxdist.training.checkpoints._storage import CheckpointSaveError as CheckpointSaveError
from jaxdist.training.checkpoints._storage import check_directory as check_directory

__all__ = [
    "CheckpointConflictError", "CheckpointCorruptedError", "CheckpointSaveError", "Checkpointer",
    "LocalCheckpointer", "LocalRestore", "check_directory", "clear_progress", "load_live",
    "read_progress", "restore_live", "roll_back", "restore_live_local", "save_live",
    "save_live_local", "write_progress",
]
