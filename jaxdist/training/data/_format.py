"""The batch format (`split_batch`, `check_key`).

A batch is a pair ``(x, y)`` or a dict. Dict batches hold the inputs under ``input_key`` and the
targets under ``target_key`` (``"x"`` and ``"y"`` unless the `Trainer` is told otherwise, e.g.
``input_key="image", target_key="label"`` for the NNX tutorial's ``{"image": ..., "label": ...}``).
Every batch is brought to the pair ``(x, y)`` on the host, before it is placed: keys that neither
option names are dropped there (with a one-time warning), never sent to the devices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

__all__ = ["Key", "check_key", "keys_of", "split_batch"]

Key = str | tuple[str, ...]
"""A dict batch's key for the inputs or the targets: one key, or several (values form a dict)."""


_TARGET_NAMES = ("label", "labels", "target", "targets", "y")


def check_key(key: Any, name: str) -> Key:
    """``key`` as a `Key` (a string, or a tuple of distinct strings).

    Raises:
        TypeError: for anything else, naming the option (``name``) and the value received.

    Examples:
        >>> check_key(["input_ids", "mask"], "input_key")
        ('input_ids', 'mask')
    """
    if isinstance(key, str):
        return key
    if isinstance(key, Sequence) and key and all(isinstance(k, str)
                                                 for k in key) and len(set(key)) == len(key):
        return tuple(key)
    raise TypeError(f"{name}={key!r} must be a dict key (a string such as 'image') or a sequence "
                    "of distinct strings (their values are passed to the model as a dict).")


def keys_of(key: Key) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else key


def _pick(batch: Mapping, key: Key) -> Any:
    return batch[key] if isinstance(key, str) else {k: batch[k] for k in key}


def _suggest(present: list[str]) -> str:
    """An example ``input_key=..., target_key=...`` built from the keys a batch has."""
    targets = [k for k in present if k.lower() in _TARGET_NAMES]
    inputs = [k for k in present if k not in targets]
    if not targets and len(inputs) >= 2:
        inputs, targets = inputs[:1], inputs[1:2]
    parts = [f"input_key={inputs[0]!r}"] if inputs else []
    parts += [f"target_key={targets[0]!r}"] if targets else []
    return ", ".join(parts) or "input_key='...', target_key='...'"


def split_batch(batch: Any, where: str = "batch", need_targets: bool = True, *,
                input_key: Key = "x", target_key: Key = "y") -> tuple[Any, Any]:
    """``(x, y)`` of a batch given as a tuple / list ``(x, y)`` or a dict with ``input_key`` and
    ``target_key``.

    Args:
        batch: the batch.
        where: how to name the batch in errors (e.g. ``"train_data batch 3"``).
        need_targets: False for prediction: a bare array / pytree, ``(x,)`` or a dict without the
            target key is fine.
        input_key: the dict key holding the inputs, or several (``x``: the dict of their values).
        target_key: the dict key (or keys) holding the targets.

    Returns:
        ``(x, y)``; ``y`` is None when there are no targets and ``need_targets`` is False. Other
        dict keys are left out.

    Raises:
        ValueError: for any other structure, naming what was received; for a dict without the keys,
            naming the keys it has and the options to set.

    Examples:
        >>> split_batch({"x": 1, "y": 2})
        (1, 2)
        >>> split_batch({"image": 1, "label": 2, "id": 7}, input_key="image", target_key="label")
        (1, 2)
    """
    if isinstance(batch, Mapping):
        missing = [(k, "input_key", input_key) for k in keys_of(input_key) if k not in batch]
        if need_targets:
            missing += [(k, "target_key", target_key) for k in keys_of(target_key)
                        if k not in batch]
        if not missing:
            has_targets = all(k in batch for k in keys_of(target_key))
            return _present(_pick(batch, input_key),
                            _pick(batch, target_key) if has_targets else None, where, need_targets)
        present = sorted(map(str, batch))
        lacks = " and ".join(f"no {k!r} ({option}={value!r})" for k, option, value in missing)
        raise ValueError(f"{where} is a dict with keys {present} and {lacks}: name the keys that "
                         "hold the inputs and the targets, e.g. Trainer(..., "
                         f"{_suggest(present)}).")
    if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
        if len(batch) == 2 or (not need_targets and len(batch) == 1):
            return _present(batch[0], (batch[1] if len(batch) == 2 else None), where, need_targets)
        got = f"a {type(batch).__name__} of {len(batch)} items"
    elif not need_targets:
        return batch, None
    else:
        got = f"a {type(batch).__name__}"
    want = (f"(x, y) or a dict with keys {input_key!r} and {target_key!r}" if need_targets
            else f"x, (x,), (x, y) or a dict with key {input_key!r}")
    raise ValueError(f"{where} is {got}; expected {want}: yield inputs and targets as a pair (x "
                     "may be any pytree, e.g. a dict of model inputs), or a dict and name its "
                     "keys with Trainer(..., input_key=..., target_key=...).")


def _present(x: Any, y: Any, where: str, need_targets: bool) -> tuple[Any, Any]:
    """``(x, y)``, unless the inputs (or the targets a loss needs) hold no array."""
    if not jax.tree.leaves(x):
        raise ValueError(f"{where} has inputs {x!r} (no array): yield (x, y) with x an array (or a "
                         "pytree of arrays) whose axis 0 is the batch.")
    if need_targets and not jax.tree.leaves(y):
        raise ValueError(
            f"{where} has targets {y!r} (no array): loss_fn(outputs, targets) gets the targets, "
            "and their rows count the examples. Fix: yield (x, y) with y an array of the batch's "
            "rows (a loss without targets, e.g. an autoencoder's: yield (x, x)); for predictions "
            "without targets use trainer.predict.")
    return x, y
