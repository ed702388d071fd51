"""Provenance in a step: which outputs leave in jaxdist's layouts, which layouts a program traced.

Whose layout a sharding is is `jaxdist.strategies.layout._provenance`'s rule (`own`, `is_own`,
`mark`). It changes a program only on a policy that splits variables over Explicit axes; there, for
a ``strategy.jit`` step, this module records while the step traces which outputs it constrained to
an own layout (`own_outputs`, `constrained`; marked after a call: `Provenance.marked`), and puts the
provenance of the arguments' split layouts in the program's cache key (`Provenance.key`). Elsewhere
(``Provenance.tells`` False) nothing here runs on a call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxdist.replicate.layouts import spec_axes
from jaxdist.strategies import ambient
from jaxdist.strategies.input import shardings_of
from jaxdist.strategies.layout import is_own, is_variable, mark

__all__ = ["Provenance", "constrained", "own_outputs"]


def constrained(value: Any, sharding: Any) -> Any:
    """``value`` (a traced output just constrained to ``sharding``), noted as jaxdist's where
    ``sharding`` is and a step's outputs are being recorded (`own_outputs`)."""
    owned = ambient.state.owned_outputs
    if owned is not None and is_own(sharding):
        owned[id(value)] = value
    return value


@contextlib.contextmanager
def own_outputs() -> Iterator[Any]:
    """Record, while a step is traced, which of its outputs leave in an own layout: yields
    ``flags``, which called on the step's traced output leaves says for each whether it does (for
    `mark` after the call)."""
    previous, ambient.state.owned_outputs = ambient.state.owned_outputs, {}
    owned = ambient.state.owned_outputs
    try:
        yield lambda leaves: [id(x) in owned and owned[id(x)] is x for x in leaves]
    finally:
        ambient.state.owned_outputs = previous


class Provenance:
    """The provenance of one ``strategy.jit`` step's layouts: part of its programs' cache key, and
    the record of which outputs of each program leave in jaxdist's layouts.

    Args:
        policy: the strategy's `LayoutPolicy`.

    Attributes:
        tells: whether anything is told apart (a policy that splits variables over Explicit axes);
            where False `key` is None and `marked` returns its outputs as they are.
    """

    def __init__(self, policy: Any):
        self._explicit = policy.roles.explicit_axes
        self.tells = bool(self._explicit) and policy.splits_variables
        # (nnx positions, provenance) of a program -> (output treedef, which outputs leave in
        # jaxdist's layouts, the first one's key path); no graphdef in the key (hashing one: ~1 ms)
        self._owned: dict[tuple, tuple] = {}

    def key(self, leaves: list[Any], shardings: set[Any] | None = None) -> Any:
        """Part of the program's cache key: the layouts among the arguments ``leaves`` that split a
        value over Explicit axes and that the user placed (jaxdist's own are typed whole inside the
        step, the user's keep their type), so that a program traced for one is never run for the
        other. None where there is nothing to tell apart; read from the arguments' distinct
        shardings (``shardings``, when read already), except where one layout arrives both ways
        (then leaf by leaf)."""
        if not self.tells:
            return None
        shardings = shardings_of(leaves) if shardings is None else shardings
        users = frozenset(s for s in shardings if isinstance(s, NamedSharding) and not is_own(s)
                          and not spec_axes(s.spec).isdisjoint(self._explicit))
        if not users:
            return None
        if any(is_own(s) and s in users for s in shardings):
            return users, tuple(is_own(getattr(x, "sharding", None)) for x in leaves)
        return users

    def record(self, program: tuple, out: Any, owned: Any) -> None:
        """While program ``program`` (its static key past the graphdef) traces: which leaves of its
        traced output ``out`` leave in an own layout (``owned``: `own_outputs`' flags)."""
        if not self.tells:
            return
        leaves, treedef = jax.tree.flatten(out)
        flags = owned(leaves)
        if True in flags:
            first = jax.tree_util.tree_flatten_with_path(out)[0][flags.index(True)][0]
            self._owned[program] = treedef, flags, first

    def marked(self, program: tuple, out: Any) -> Any:
        """``out`` (a call's results), whose shardings are recorded as jaxdist's where the program
        says their layout is (`jaxdist.strategies.layout.mark`). JAX reuses a trace for arguments of
        the same types whatever their layouts, each with an executable (and output sharding objects)
        of its own: the flags are the trace's, and a call marks the outputs of an executable not
        seen yet, told by one leaf."""
        if not self.tells:
            return out
        entry = self._owned.get(program)
        if entry is None:
            return out
        treedef, flags, first = entry
        if is_own(getattr(_leaf_at(out, first), "sharding", None)):
            return out  # an executable seen before (or one whose first such output is)
        leaves, structure = jax.tree.flatten(out)
        if structure == treedef:
            mark(leaves, flags)
        return out


def _leaf_at(tree: Any, path: tuple) -> Any:
    """The leaf of ``tree`` at key ``path``: read by indexing along it (no flattening, for a hot
    path) where its keys are dict keys, sequence indices and attributes (an nnx Variable's child is
    its value); else found by flattening. None when there is no such leaf."""
    node = tree
    for key in path:
        try:
            if isinstance(key, jax.tree_util.DictKey):
                node = node[key.key]
            elif isinstance(key, jax.tree_util.SequenceKey):
                node = node[key.idx]
            elif is_variable(node):
                node = node.get_value()
            elif isinstance(key, jax.tree_util.GetAttrKey):
                node = getattr(node, key.name)
            else:
                return next((x for p, x in jax.tree_util.tree_leaves_with_path(tree) if p == path),
                            None)
        except (KeyError, IndexError, TypeError, AttributeError):
            return None
    return node
