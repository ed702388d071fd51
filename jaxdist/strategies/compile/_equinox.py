"""Equinox modules as step arguments: array leaves are traced, every other leaf is static (as
`eqx.filter_jit`).

An Equinox model is a pytree whose leaves are arrays and also activation functions, ``custom_jvp``
objects and Python values; `jax.jit` refuses those as arguments. ``strategy.jit`` of a step called
with an Equinox module among its arguments splits every argument the way ``eqx.filter_jit`` does
(``eqx.is_array`` leaves traced and laid out like any pytree's, the rest part of the compiled
program), and outputs the same way: the static leaves of the step's outputs are recorded when it is
traced and put back after each call. Equinox is optional and never imported here: while a process
has not imported it, no argument is an Equinox module.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxdist.replicate.trees import equinox

__all__ = ["Static", "combine", "holds_module", "partition"]


def holds_module(args: tuple, kwargs: dict) -> bool:
    """Whether an argument is an Equinox module (one ``isinstance`` per argument, not per leaf).

    Examples:
        >>> holds_module((1.0,), {})
        False
    """
    eqx = equinox()
    return eqx is not None and any(isinstance(a, eqx.Module) for a in (*args, *kwargs.values()))


class Static:
    """The non-array leaves of a pytree and its structure: hashable, a program's static argument.

    Leaves compare by equality where they define it (numbers, strings) and by identity otherwise
    (functions, ``custom_jvp`` objects), as `jax.jit` compares static arguments.
    """

    __slots__ = ("_hash", "leaves", "treedef")

    def __init__(self, treedef: Any, leaves: tuple):
        self.treedef, self.leaves = treedef, leaves
        self._hash = hash((treedef, leaves))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Static) and self.treedef == other.treedef
                and self.leaves == other.leaves)


def _is_traced(x: Any) -> bool:
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return True
    eqx = equinox()
    return eqx is not None and eqx.is_array(x)


def partition(tree: Any) -> tuple[Any, Static]:
    """``tree`` split into its array leaves (None elsewhere) and a `Static` of others.

    Raises:
        TypeError: when a non-array leaf is not hashable (it would be part of the compiled program).

    Examples:
        >>> import jax.numpy as jnp
        >>> arrays, static = partition({"w": jnp.ones(2), "act": abs})
        >>> arrays["act"] is None, static.leaves
        (True, (<built-in function abs>, None))
    """
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [x if _is_traced(x) else None for x in leaves]
    rest = tuple(None if _is_traced(x) else x for x in leaves)
    try:
        static = Static(treedef, rest)
    except TypeError as error:
        bad = next(x for x in rest if getattr(type(x), "__hash__", None) is None)
        raise TypeError(f"a non-array leaf of an Equinox argument, {bad!r} (type "
                        f"{type(bad).__name__}), is not hashable: strategy.jit makes every "
                        "non-array leaf part of the compiled program, as eqx.filter_jit does; make "
                        "it hashable (a tuple, a frozen dataclass) or an array.") from error
    return jax.tree.unflatten(treedef, arrays), static


def combine(arrays: Any, static: Static) -> Any:
    """The pytree `partition` split: array leaves from ``arrays``, the others from ``static``.

    Examples:
        >>> import jax.numpy as jnp
        >>> tree = combine(*partition({"w": jnp.ones(2), "act": abs}))
        >>> tree["act"] is abs, tree["w"].shape
        (True, (2,))
    """
    # None at a leaf's place is that leaf (not an empty subtree)
    flat = static.treedef.flatten_up_to(arrays)
    return jax.tree.unflatten(
        static.treedef, [a if s is None else s for a, s in zip(flat, static.leaves, strict=True)])
