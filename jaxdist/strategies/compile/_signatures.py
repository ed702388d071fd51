"""Which arguments a declaration means: ``*_argnums`` and ``*_argnames`` resolved as `jax.jit` does.

A declaration may name an argument by position or by name; each is completed from the other through
the function's signature, so ``static_argnames=("lr",)`` also covers ``lr`` passed positionally, and
``batch_argnums=(1,)`` also covers ``batch=`` passed by keyword.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from jaxdist.replicate.trees import fn_name

__all__ = ["argument_spec", "as_argnames", "as_argnums", "signature_of"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def as_argnums(value: int | Sequence[int] | None, name: str) -> tuple[int, ...]:
    """``value`` (an int, a sequence of ints or None) as a tuple of argument positions.

    Raises:
        TypeError: for anything else, naming ``name``.
        ValueError: for a negative position.

    Examples:
        >>> as_argnums(1, "batch_argnums"), as_argnums(None, "batch_argnums")
        ((1,), ())
    """
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if not (isinstance(value, (tuple, list))
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise TypeError(f"{name}={value!r} must be an int or a tuple of ints (positional argument "
                        "indices).")
    if any(v < 0 for v in value):
        raise ValueError(f"{name}={tuple(value)!r}: use non-negative positions (counted from the "
                         "first argument).")
    return tuple(value)


def as_argnames(value: str | Sequence[str] | None, name: str) -> tuple[str, ...]:
    """``value`` (a name, a sequence of names or None) as a tuple of argument names.

    Raises:
        TypeError: for anything else, naming ``name``.

    Examples:
        >>> as_argnames("lr", "static_argnames"), as_argnames(None, "static_argnames")
        (('lr',), ())
    """
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"{name}={value!r} must be a parameter name or a tuple of them, e.g. "
                    "('batch',).")


def signature_of(fn: Callable) -> inspect.Signature | None:
    """``fn``'s signature, or None when Python cannot tell (some builtins)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def argument_spec(signature: inspect.Signature | None, fn: Any, argnums: Any, argnames: Any,
                  what: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The positions and names a ``{what}_argnums`` / ``{what}_argnames`` declaration covers, each
    completed from the other through ``signature``.

    Raises:
        TypeError: for malformed declarations.
        ValueError: for a name ``fn`` does not take (unless it takes ``**kwargs``).

    Examples:
        >>> import inspect
        >>> def step(state, batch, lr=0.1): ...
        >>> argument_spec(inspect.signature(step), step, None, ("lr",), "static")
        ((2,), ('lr',))
        >>> argument_spec(inspect.signature(step), step, 1, None, "batch")
        ((1,), ('batch',))
    """
    positions = as_argnums(argnums, f"{what}_argnums")
    names = as_argnames(argnames, f"{what}_argnames")
    if signature is None:
        return positions, names
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        for name in names:
            if (name not in signature.parameters
                    or signature.parameters[name].kind is inspect.Parameter.POSITIONAL_ONLY):
                raise ValueError(f"{what}_argnames={names!r} names {name!r}, which {fn_name(fn)} "
                                 "does not take by name: its parameters are "
                                 f"{tuple(signature.parameters)}.")
    # with *args any position may come
    if not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        beyond = [i for i in positions if i >= len(positional)]
        if beyond:
            raise ValueError(f"{what}_argnums={argnums!r} names position(s) {beyond}, but "
                             f"{fn_name(fn)} takes {len(positional)} positional argument(s) "
                             f"{tuple(p.name for p in positional)}: pass positions below "
                             f"{len(positional)} (counting from 0), or {what}_argnames=.")
    by_name = {p.name: i for i, p in enumerate(positional)
               if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}
    positions = tuple(sorted({*positions, *(by_name[n] for n in names if n in by_name)}))
    names = tuple(sorted({*names, *(positional[i].name for i in positions
                                    if i < len(positional) and positional[i].name in by_name)}))
    return positions, names
