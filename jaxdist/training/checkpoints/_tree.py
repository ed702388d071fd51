"""The state as orbax stores it: a NamedTuple state (`TrainState`) is stored as the dict of its
fields, leaving out the fields that are None.

So a field added to the state with a None default (``TrainState.ema``) changes nothing on disk while
it is None: checkpoints written before it restore, and plain orbax reads a checkpoint with a dict
target of the fields it holds. Fingerprints and checksums are taken of the state itself, so their
paths (``.params['w']``) are unchanged.
"""

from __future__ import annotations

from typing import Any

__all__ = ["from_disk", "to_disk"]


def _is_record(tree: Any) -> bool:
    return isinstance(tree, tuple) and hasattr(tree, "_fields")


def to_disk(tree: Any) -> Any:
    """``tree`` as it is written: a NamedTuple as the dict of its fields that are not None.

    Examples:
        >>> from typing import NamedTuple
        >>> class State(NamedTuple):
        ...     step: int
        ...     ema: Any = None
        >>> to_disk(State(3)), to_disk({"w": 1})
        ({'step': 3}, {'w': 1})
    """
    if _is_record(tree):
        return {name: value for name, value in tree._asdict().items() if value is not None}
    return tree


def from_disk(like: Any, stored: Any) -> Any:
    """What `to_disk` wrote, read back as ``like``'s type (fields left out on disk are None).

    Examples:
        >>> from typing import NamedTuple
        >>> class State(NamedTuple):
        ...     step: int
        ...     ema: Any = None
        >>> from_disk(State(0), {"step": 3})
        State(step=3, ema=None)
    """
    if _is_record(like):
        return type(like)(**{name: stored.get(name) for name in like._fields})
    return stored
