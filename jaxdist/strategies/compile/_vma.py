"""`Strategy.run`'s varying-type check: strict where the function type-checks, else relaxed.

Inside `jax.shard_map`, JAX types every value as invariant or varying over the replica axis
(``check_vma``). Some code `jax.pmap` runs does not type-check there: a ``lax.scan`` whose carry
starts as a constant and comes out varying (pmap-era RL code: a whole training run as one function,
vmapped over seeds). ``jax.pmap`` runs such functions with the check off, and so does
``strategy.run`` (``check_vma=None``, the default): the first trace is strict; when it fails and the
same trace with the check off succeeds, only the check refused the function, and its program runs
with the check off, with a one-time note (logger ``"jaxdist"``, WARNING). The two traces decide,
never an error's message.

The relaxed check keeps what comes back mirrored (proven from the program's values, `_identical`)
and local gradients (``jax.grad`` of each replica's own copy; the all-reduce stays explicit).
Gradients THROUGH a collective follow pmap's rule with the check off (the gradient of a ``psum`` is
a ``psum``), JAX's typed rule with it on; pmap-era code that names its axis (``run(...,
axis_name=)``) therefore runs with the check off from the start (`Strategy.run`).
``check_vma=True`` asks for the strict check only (JAX's error, as it is); ``check_vma=False`` runs
with the check off from the start, without a note.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["check_vma_arg", "first_trace"]

log = logging.getLogger("jaxdist")
_noted: set[str] = set()  # replica functions whose relaxed check was noted (by name: one note each)


def check_vma_arg(check_vma: bool | None) -> bool | None:
    """``check_vma`` validated: None (strict, relaxed where only the check refuses), True or False.

    Raises:
        TypeError: for anything else.

    Examples:
        >>> check_vma_arg(None) is None, check_vma_arg(False)
        (True, False)
    """
    if check_vma is None or isinstance(check_vma, bool):
        return check_vma
    raise TypeError(f"check_vma={check_vma!r} must be None (the default: JAX's varying-type check, "
                    "turned off as jax.pmap runs the function where only that check refuses it), "
                    "True (the check, always) or False (no check).")


def first_trace(probe: Callable[[bool], None], check_vma: bool | None, name: str) -> bool:
    """Trace a replica function's program once (``probe(check)`` traces it with the check on or off)
    and say whether its program runs with the varying-type check.

    Args:
        probe: traces the program abstractly; raises what the trace raises.
        check_vma: the caller's choice (see the module docstring).
        name: the replica function's name, for the note.

    Returns:
        True: the check stays on; False: the program runs with it off.

    Raises:
        The strict trace's own error where the trace without the check fails too (the function's
            own error, or one that is not the check's), or where ``check_vma=True``.
    """
    if check_vma is False:
        probe(False)
        return False
    try:
        probe(True)
        return True
    except Exception as strict:
        if check_vma is True:
            raise
        try:
            probe(False)
        except Exception:
            raise strict from None
    if name not in _noted:
        _noted.add(name)
        log.warning(
            "strategy.run(%s): JAX's varying-type check (shard_map's check_vma) refuses this "
            "replica function (e.g. a lax.scan whose carry starts as a constant and comes out "
            "different on each replica), which jax.pmap runs with the check off: it runs so here "
            "too. Outputs come back PerReplica unless their values are provably the same on every "
            "replica; gradients stay local (all-reduce them explicitly). strategy.run(..., "
            "check_vma=False) asks for this without this note; check_vma=True keeps the check (and "
            "its error).", name)
    return False
