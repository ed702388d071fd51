"""Roles in the trace: which of a global-view step's traced values are batches, which variables.

The rule is `jaxdist.strategies.layout`'s (a role is declared, or carried by the value:
``batch_argnums``, else the layout a value arrives in, `LayoutPolicy.layout_role`); here it is
applied to the leaves of the step's trace, once per program. The step records them in its
computation frame (`jaxdist.strategies.ambient`), where a per-replica verb inside it
(``strategy.run``, ``outside_compilation``) reads the role an argument entered with; `carried` keeps
them across a nested trace of the same step (the Shardy guard's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax

from jaxdist.strategies.ambient import Padded, computation

__all__ = ["carried", "step_argument_roles"]


def step_argument_roles(policy: Any, args: tuple, concrete: tuple, declared: tuple[int, ...] | None,
                        skip: set[int]) -> tuple[list[Any], list[Any]]:
    """The roles the arguments of a global-view step enter with, sorted into its traced leaves.

    Args:
        policy: the strategy's `LayoutPolicy`.
        args: the step's traced arguments.
        concrete: the values it was called with (placed arrays, or abstract shapes), same structure.
        declared: the step's ``batch_argnums`` (None: nothing declared).
        skip: positions that are not traced arrays (static arguments, nnx graph objects).

    Returns:
        ``(batches, variables)``: traced leaves declared or carried as batches, and every other
        array leaf (an undeclared array split like a batch on a policy whose variables can be split
        so too is a variable, as the rule says: "everything else is a variable").
    """
    batches: list[Any] = []
    variables: list[Any] = []
    for i, (a, c) in enumerate(zip(args, concrete, strict=True)):
        if i in skip:
            continue
        for t, leaf in zip(jax.tree.leaves(a), jax.tree.leaves(c), strict=True):
            if declared is not None:
                (batches if i in declared else variables).append(t)
            elif policy.layout_role(leaf) == "batch":
                batches.append(t)
            else:
                variables.append(t)
    return batches, variables


def carried(policy: Any, outer: Sequence[Any], inner: Sequence[Any], batches: Sequence[Any],
            variables: Sequence[Any], padded: Sequence[Padded] = ()
            ) -> contextlib.AbstractContextManager[Any]:
    """The computation frame of a nested trace of the step whose leaves ``inner`` stand for
    ``outer`` (the step's traced leaves, one for one): each keeps the role its counterpart entered
    with (``batches`` / ``variables``: the step's, from `step_argument_roles`), and a padded batch's
    leaves their row weights (``padded``: read in the nested trace from the step's, whose flag they
    share)."""
    batch_ids, variable_ids = {id(b) for b in batches}, {id(v) for v in variables}
    weights = {id(p.leaf): p for p in padded}
    return computation(policy, "global", [t for t, o in zip(inner, outer, strict=True)
                                          if id(o) in batch_ids],
                       [t for t, o in zip(inner, outer, strict=True) if id(o) in variable_ids],
                       padded=[Padded(t, weights[id(o)].weights, weights[id(o)].handed)
                               for t, o in zip(inner, outer, strict=True) if id(o) in weights])
