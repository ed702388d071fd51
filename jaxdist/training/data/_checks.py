"""The batches' checks: one structure, shapes and dtypes for a whole run (`BatchChecker`)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxdist.strategies.input import refuse_text
from jaxdist.training.data._format import Key, keys_of, split_batch
from jaxdist.training.data._position import DataPosition

__all__ = ["BatchChecker", "describe", "global_rows", "say_batch_change", "signature"]

def signature(batch: Any) -> tuple:
    """The structure, shapes and dtypes of a batch (batches with equal signatures share one compiled
    step); cheap enough for every batch (`describe` spells the dtypes out).

    Examples:
        >>> import numpy as np
        >>> describe(signature((np.zeros((2, 3)), np.zeros(2, np.int32))))
        '((2, 3) float64, (2,) int32)'
    """
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, tuple((x.shape, x.dtype) if isinstance(x, (np.ndarray, jax.Array))
                          else (np.shape(x), np.asarray(x).dtype) for x in leaves)


def describe(sig: tuple) -> str:
    """A `signature`'s shapes and dtypes, as text for messages.

    Examples:
        >>> import numpy as np
        >>> describe(signature({"x": np.zeros((4, 2), np.float32)}))
        '((4, 2) float32)'
    """
    return "(" + ", ".join(f"{tuple(shape)} {np.dtype(dtype).name}"
                           for shape, dtype in sig[1]) + ")"


class BatchChecker:
    """Brings each training batch to ``(x, y)`` on the host and checks it: structure, rows, shapes.

    The first batch fixes the signature (one compiled step); a later batch with other shapes is an
    error that names the fix, never a silent recompile. The first batch's rows (every leaf's axis 0)
    are checked too: later batches have the same shapes. This is the one check a training batch
    gets (`jaxdist.training.data.BatchFeed` runs it once per batch).

    Args:
        replicas: the strategy's ``num_replicas_in_sync``.
        grad_accum_steps: micro-batches per step (the global batch divides by ``replicas`` x this).
        input_key / target_key: the dict keys of the inputs and targets (see `split_batch`).

    Raises:
        ValueError: (when called) for a batch of the wrong structure, a first batch with a scalar
            leaf, leaves with different rows, or rows that ``replicas`` x ``grad_accum_steps`` do
            not divide (naming the rows, the replicas and a batch size that works), or a batch whose
            shapes differ from the first one's.

    Examples:
        >>> import numpy as np
        >>> check = BatchChecker(2, 1, input_key="image", target_key="label")
        >>> x, y = check({"image": np.ones((4, 3)), "label": np.zeros(4)}, "batch 0")
        >>> x.shape, y.shape
        ((4, 3), (4,))
    """

    def __init__(self, replicas: int, grad_accum_steps: int = 1, *, input_key: Key = "x",
                 target_key: Key = "y"):
        self.replicas, self.grad_accum_steps = replicas, grad_accum_steps
        self.input_key, self.target_key = input_key, target_key
        self._named = set(keys_of(input_key)) | set(keys_of(target_key))
        self._signature: tuple | None = None
        self._warned = False

    @property
    def signature(self) -> tuple | None:
        """The first training batch's `signature` (every one's); None before one is checked."""
        return self._signature

    def split(self, batch: Any, where: str, need_targets: bool = True) -> tuple[Any, Any]:
        """``(x, y)`` of ``batch`` (see `split_batch`); warns once about dict keys neither names."""
        x, y = split_batch(batch, where, need_targets, input_key=self.input_key,
                           target_key=self.target_key)
        if isinstance(batch, Mapping) and not self._warned:
            extra = sorted(str(k) for k in batch if k not in self._named)
            if extra:
                self._warned = True
                warnings.warn(
                    f"{where} has keys {extra} that neither input_key={self.input_key!r} nor "
                    f"target_key={self.target_key!r} names: they are dropped on the host (not sent "
                    "to the devices); leave them out of the batches to silence this.", UserWarning,
                    stacklevel=2)
        return x, y

    def __call__(self, batch: Any, where: str, processes: int = 1) -> tuple[Any, Any]:
        """The training batch ``(x, y)``, checked.

        ``processes > 1``: ``batch`` is this process's share of a global batch that many processes
        read together (per-process input): the checks and the signature are those of the global
        batch (axis 0 times ``processes``).
        """
        pair = self.split(batch, where)
        sig = signature(pair)
        if processes > 1:
            sig = (sig[0], tuple(((shape[0] * processes, *shape[1:]) if shape else shape, dtype)
                                 for shape, dtype in sig[1]))
        if self._signature is None:  # later batches have its signature: they pass these too
            rows = _common_rows(pair, where)
            need = self.replicas * self.grad_accum_steps
            if rows * processes % need:
                got = (f"{rows} rows" if processes == 1 else f"{rows} rows on this process "
                       f"({rows * processes} over {processes} processes)")
                raise ValueError(f"{where} has {got}, which {self.replicas} replicas x "
                                 f"grad_accum_steps={self.grad_accum_steps} do not divide: use a "
                                 f"global batch that is a multiple of {need} (e.g. "
                                 f"{-(-rows * processes // need) * need}), dropping or padding "
                                 "the remainder.")
            self._signature = sig
        elif sig != self._signature:
            raise ValueError(f"{where} has structure/shapes {describe(sig)} ({sig[0]}), but the "
                             f"first training batch had {describe(self._signature)} "
                             f"({self._signature[0]}): every training batch needs the same "
                             "structure and shapes (one compiled step); drop the ragged last "
                             "batch or pad it.")
        return pair


def global_rows(sig: tuple | None) -> int | None:
    """The global batch's rows in a `BatchChecker.signature` (None before the first batch)."""
    if sig is None or not sig[1] or not sig[1][0][0]:
        return None
    return int(sig[1][0][0][0])


def say_batch_change(meta: Mapping[str, Any], rows: int | None, position: DataPosition) -> None:
    """Warn when a run resumes from a checkpoint written with global batches of other ``rows``: the
    data position is counted in batches, so it moves in examples (the warning says how to keep it).

    Examples:
        >>> say_batch_change({"global_batch": 32, "step": 4}, 32, DataPosition(0, 4))  # silent
    """
    old = meta.get("global_batch")
    if old is None or rows is None or int(old) == rows:
        return
    warnings.warn(
        f"fit resumes from checkpoint {meta.get('step')}, written with global batches of {old} "
        f"rows; train_data now yields {rows}. The data position counts batches: it resumes at "
        f"batch {position.index} of epoch {position.epoch}, skipping {position.index * rows} "
        f"examples of that epoch where the run that wrote it had read {position.index * int(old)}. "
        f"To resume on the same examples use batches of {old} rows, or set "
        "trainer.data_position before fit.", UserWarning, stacklevel=4)


def _common_rows(pair: Any, where: str) -> int:
    """The rows (axis 0) that every leaf of ``pair`` has: what the replicas split.

    Raises:
        ValueError: for a leaf without axis 0, or leaves that disagree on it, naming the leaves.
        TypeError: for a leaf of text or objects (no JAX array holds them), naming it.
    """
    paths = jax.tree_util.tree_flatten_with_path(pair)[0]
    refuse_text(paths, lambda path: f"{where} leaf {_name(path)}", "Encode it in train_data (e.g. "
                "token ids, or labels looked up as int32), or keep it out of the batch.")
    if not paths:
        raise ValueError(f"{where} holds no arrays: yield (x, y) with arrays whose axis 0 is the "
                         "batch.")
    first_path, first = paths[0]
    if np.shape(first) and np.shape(first)[0] == 0:
        raise ValueError(f"{where} has 0 rows (an empty batch): its loss would be the mean of "
                         "nothing (NaN). Skip empty batches in train_data (e.g. filter them out, "
                         "or drop a last batch with no rows).")
    for path, leaf in paths:
        if not np.shape(leaf):
            raise ValueError(f"{where} leaf {_name(path)} is a scalar: every leaf of a training "
                             "batch needs a batch axis 0 to split over the replicas (pass "
                             "constants to the model or the loss instead).")
        if np.shape(leaf)[0] != np.shape(first)[0]:
            raise ValueError(f"{where} leaf {_name(path)} has {np.shape(leaf)[0]} rows but leaf "
                             f"{_name(first_path)} has {np.shape(first)[0]}: axis 0 of every leaf "
                             "is the batch (the rows the replicas split), so they must agree; "
                             "move an array that is not per example out of the batch.")
    return int(np.shape(first)[0])


def _name(path: tuple) -> str:
    """A leaf of the pair ``(x, y)``, named as the user wrote it: ``x['image']``, ``y``."""
    rest = jax.tree_util.keystr(path[1:])
    return ("x" if path[0].idx == 0 else "y") + rest
