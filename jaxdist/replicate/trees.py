"""Pytree utilities every layer uses: which leaves are traced (arrays) and which are constants
(static, as in tf.function), which are distributed values, abstract shapes, cache keys and names."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.replicate.values import PerReplica, SyncOnRead

__all__ = ["abstract", "describe", "equinox", "flax_nnx", "fn_name", "hashable", "is_array",
           "is_chief", "is_distributed", "is_graph_node", "merge_static", "signature",
           "split_static"]


def is_distributed(x: Any) -> bool:
    """True for a value with one component per replica (`PerReplica`, `SyncOnRead`).

    Examples:
        >>> import numpy as np
        >>> is_distributed(np.ones(2))
        False
    """
    return isinstance(x, (PerReplica, SyncOnRead))


def is_array(x: Any) -> bool:
    """True for a leaf that is traced (a `jax.Array`, a tracer, a numpy array or scalar); other
    leaves (Python numbers, strings, callables, configs) are compile-time constants.

    Examples:
        >>> import numpy as np
        >>> is_array(np.float32(1)), is_array(1.0), is_array("relu")
        (True, False, False)
    """
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_value(x: Any) -> bool:
    """True for a leaf that is a value a program takes or returns: an array (`is_array`) or a Python
    number; other leaves (functions, strings, an Equinox module's activations) are not.

    Examples:
        >>> import numpy as np
        >>> is_value(np.float32(1)), is_value(1.0), is_value(abs)
        (True, True, False)
    """
    return is_array(x) or isinstance(x, (int, float, complex))


def equinox() -> Any:
    """The ``equinox`` module if this process has imported it, else None (a value can be an Equinox
    module only once Equinox is imported, so jaxdist never imports it itself).

    Examples:
        >>> import equinox as eqx
        >>> equinox() is eqx
        True
    """
    return sys.modules.get("equinox")


def flax_nnx() -> Any:
    """The ``flax.nnx`` module if this process has imported it, else None: a value can be an nnx
    object only once nnx is imported, so jaxdist never imports it itself (a linen or plain-JAX
    program starts without it: about 0.3 s of CPU less per process).

    Examples:
        >>> from flax import nnx
        >>> flax_nnx() is nnx
        True
    """
    return sys.modules.get("flax.nnx")


def is_graph_node(x: Any) -> bool:
    """True for an nnx graph object (a module, an optimizer, a Variable: what ``nnx.split`` takes);
    False for everything while nnx is not imported.

    Examples:
        >>> from flax import nnx
        >>> is_graph_node(nnx.Linear(2, 3, rngs=nnx.Rngs(0))), is_graph_node({"w": 1.0})
        (True, False)
    """
    nnx = flax_nnx()
    return nnx is not None and nnx.graph.is_graph_node(x)


def is_module(x: Any) -> bool:
    """True for an Equinox module (False for everything while Equinox is not imported).

    Examples:
        >>> is_module({"w": 1.0})
        False
    """
    eqx = equinox()
    return eqx is not None and isinstance(x, eqx.Module)


def placed_leaves(tree: Any) -> list[bool]:
    """Per leaf of ``tree``, whether it is a value to place on devices: an array or a Python number,
    as ``jax.device_put`` places them (a Flax ``TrainState``'s ``step=0`` is a counter), except
    inside an Equinox module, whose Python numbers and bools are its settings (``eqx.filter_jit``'s
    rule: BatchNorm's ``inference`` flag is branched on in Python). Functions, strings and None are
    never placed.

    Examples:
        >>> placed_leaves({"step": 0, "act": abs, "w": np.zeros(2)})
        [False, True, True]
    """
    flags: list[bool] = []
    for node in jax.tree.leaves(tree, is_leaf=is_module):
        if is_module(node):
            flags += [is_array(x) for x in jax.tree.leaves(node)]
        else:
            flags.append(is_value(node))
    return flags


def split_static(tree: Any) -> tuple[list[Any], Any, tuple]:
    """``tree``'s array leaves (to trace) and a record of the rest (constants), for `merge_static`.

    Returns:
        ``(dynamic, treedef, statics)``: the array leaves in order; the tree structure; one entry
        per leaf, None where the leaf is an array, the constant itself otherwise.

    Examples:
        >>> import numpy as np
        >>> dynamic, treedef, statics = split_static((np.ones(2), "mean"))
        >>> len(dynamic), statics
        (1, (None, 'mean'))
        >>> merge_static([np.zeros(2)], treedef, statics)[1]
        'mean'
    """
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [is_array(x) for x in leaves]
    dynamic = [x for x, a in zip(leaves, arrays, strict=True) if a]
    statics = tuple(None if a else x for x, a in zip(leaves, arrays, strict=True))
    return dynamic, treedef, statics


def merge_static(dynamic: Sequence[Any], treedef: Any, statics: tuple) -> Any:
    """The tree `split_static` took apart, ``dynamic`` (traced values) at the array positions."""
    it = iter(dynamic)
    return jax.tree.unflatten(treedef, [next(it) if s is None else s for s in statics])


def abstract(tree: Any, keep_sharding: bool = False) -> Any:
    """``tree`` with every leaf as a `jax.ShapeDtypeStruct` (readable even from donated arrays).

    Args:
        tree: a pytree of arrays (or anything with a shape).
        keep_sharding: also keep each leaf's sharding (where it has one).

    Examples:
        >>> import numpy as np
        >>> abstract({"w": np.zeros((2, 3), np.float32)})["w"]
        ShapeDtypeStruct(shape=(2, 3), dtype=float32)
    """

    def one(x):
        sharding = getattr(x, "sharding", None) if keep_sharding else None
        return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x), sharding=sharding)

    return jax.tree.map(one, tree)


def signature(tree: Any) -> tuple:
    """``tree``'s structure with the shape and dtype of each leaf: equal signatures are
    interchangeable values.

    Examples:
        >>> import numpy as np
        >>> signature((np.zeros(2), np.ones(2))) == signature((np.ones(2), np.zeros(2)))
        True
    """
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(x), str(jax.dtypes.result_type(x))) for x in leaves)


def hashable(values: tuple) -> Hashable:
    """``values`` as a cache-key part: itself when hashable, else the identities of its entries.

    Examples:
        >>> hashable((1, "a")), len(hashable(([1],)))
        ((1, 'a'), 1)
    """
    try:
        hash(values)
        return values
    except TypeError:
        return tuple(id(v) for v in values)


def describe(names: Sequence[str], limit: int = 3) -> str:
    """``names`` (leaf paths, files, outputs) for a message: the first ``limit`` and how many more.

    Examples:
        >>> describe(["a", "b", "c", "d"], limit=2)
        'a, b and 2 more'
        >>> describe(["a", "b"])
        'a, b'
    """
    shown = ", ".join(names[:limit])
    return f"{shown} and {len(names) - limit} more" if len(names) > limit else shown


def fn_name(fn: Callable | Any) -> str:
    """How error messages name a user's function.

    Examples:
        >>> def train_step(): ...
        >>> fn_name(train_step)
        'train_step'
        >>> import functools
        >>> fn_name(functools.partial(train_step))
        'train_step'
    """
    while isinstance(fn, functools.partial):  # a step wrapped as Flax's examples wrap theirs
        fn = fn.func
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def is_chief() -> bool:
    """True on process 0, the one process that writes single-writer files (logs, summaries).

    Examples:
        >>> is_chief()
        True
    """
    return jax.process_index() == 0
