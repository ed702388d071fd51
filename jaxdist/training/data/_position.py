"""How far training has read its data (`DataPosition`), and an input state that does not fit."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["DataPosition", "UnrestorableState"]

@dataclasses.dataclass(frozen=True)
class DataPosition:
    """How far training has read its data: ``index`` batches of epoch ``epoch``.

    Attributes:
        epoch: the epoch being read.
        index: batches of it consumed by training steps.
        state: for a source whose iterator has a state (grain): that iterator's ``get_state()``
            right after those batches, on THIS process (each process reads its own shard). A resumed
            run restores it instead of re-reading and dropping ``index`` batches. None for plain
            iterables. Not shown, not compared.

    Examples:
        >>> DataPosition(epoch=2, index=5)
        DataPosition(epoch=2, index=5)
    """

    epoch: int = 0
    index: int = 0
    state: Any = dataclasses.field(default=None, repr=False, compare=False)


class UnrestorableState:
    """The `DataPosition.state` of a checkpoint whose input state does not fit this run (another
    process count): resuming a stateful source from it raises ``error``; evaluating or resuming
    plain data does not."""

    def __init__(self, error: Exception):
        self.error = error
