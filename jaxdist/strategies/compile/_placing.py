"""Where a ``strategy.jit`` call's arguments go before its program runs (`StrategyFunction`'s full
path).

The rule is `jaxdist.strategies.input`'s (`kept`: an array on the strategy's mesh is taken as it is;
anything else is placed): a declared batch is split over the replicas (`place_batch`), also when
every replica holds it whole; every other argument takes the variable layout, and an nnx state Flax
put on the mesh whole settles into it. Without any ``batch_argnums`` an unplaced array of rank >= 1
might be a batch: the first one met raises a one-time `UndeclaredBatchWarning`, unless an argument
carries the batch role by its layout (a batch from a distributed dataset).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxdist.replicate.layouts import put
from jaxdist.replicate.trees import fn_name
from jaxdist.strategies.input import (
    all_on_mesh,
    argument_layouts,
    needs_placing,
    place_batch,
    place_nnx_defaults,
    shardings_of,
)
from jaxdist.strategies.layout import LayoutPolicy, UndeclaredBatchWarning

__all__ = ["ArgumentPlacement"]


class ArgumentPlacement:
    """The placement of one step's arguments: called as ``placement(args, kwargs, state)``.

    Args:
        policy: the strategy's `LayoutPolicy`.
        fn: the user's step (named in the warning).
        static / static_names: its static arguments' positions and names (never placed).
        batch / batch_names: its declared batch arguments' positions (None: nothing declared) and
            names.
    """

    def __init__(self, policy: LayoutPolicy, fn: Callable, static: tuple[int, ...],
                 static_names: tuple[str, ...], batch: tuple[int, ...] | None,
                 batch_names: tuple[str, ...]):
        self._policy = policy
        self._fn = fn
        self._static, self._static_names = static, static_names
        self._batch, self._batch_names = batch, batch_names
        self._warned = False
        self._call: list[Any] = []  # the dynamic arguments of the call being placed
        self._settled: set[Any] = set()  # nnx state structures whose default layouts were placed

    def __call__(self, args: tuple, kwargs: dict, state: Any) -> tuple[tuple, dict, Any]:
        """``(args, kwargs, nnx state)`` of a call (keywords bound to positions where they can be,
        nnx objects split off) with every value placed where the step takes it.

        Raises:
            ValueError: for a declared batch the replicas do not divide, or a scalar batch leaf.
        """
        policy = self._policy
        mesh = policy.mesh
        declared = self._batch or ()
        if state is not None and not all_on_mesh(jax.tree.leaves(state), mesh):
            state = self._variables(state, "the nnx state", warn=False)
        if state is not None and policy.splits_variables:
            # Which nnx variables settle into the variable layout depends on their metadata only
            # (part of the state's structure): resolved once per structure, not on every call.
            structure = jax.tree.structure(state)
            if structure not in self._settled:
                state = place_nnx_defaults(policy, state)
                self._settled.add(structure)
        # Every array on the mesh already and no declared batch held whole: nothing to place (told
        # from the arguments' distinct shardings, a handful whatever the number of leaves).
        dynamic = [a for i, a in enumerate(args) if i not in self._static]
        dynamic += [a for k, a in kwargs.items() if k not in self._static_names]
        if all_on_mesh(jax.tree.leaves(dynamic), mesh) and not self._whole_batch(args, kwargs):
            return args, kwargs, state
        # Arrays on the mesh keep their layout, except a declared batch that every replica holds
        # whole: it is split. Only the arguments holding an array to move are walked again.
        todo = [i for i, a in enumerate(args)
                if i not in self._static and needs_placing(a, policy, i in declared)]
        named = [k for k, a in kwargs.items() if k not in self._static_names
                 and needs_placing(a, policy, k in self._batch_names)]
        if not todo and not named:
            return args, kwargs, state
        self._call = dynamic  # read only where the warning would be raised (`_variables`)
        placed = list(args)
        for i in todo:
            if i in declared:
                placed[i] = place_batch(policy, args[i], where=f"argument {i} (in batch_argnums)")
            else:
                placed[i] = self._variables(args[i], f"argument {i}")
        kwargs = dict(kwargs)
        for k in named:
            if k in self._batch_names:
                kwargs[k] = place_batch(policy, kwargs[k],
                                        where=f"argument {k!r} (in batch_argnames)")
            else:
                kwargs[k] = self._variables(kwargs[k], f"argument {k!r}")
        return tuple(placed), kwargs, state

    def _whole_batch(self, args: tuple, kwargs: dict, shardings: set[Any] | None = None) -> bool:
        """Whether a declared batch argument holds a leaf every replica holds whole (to be split) or
        one that is no array on a mesh (to be placed, or refused: `jaxdist.strategies.input.kept`).
        ``shardings``: the distinct shardings of all the arguments, when read already (one replica
        and no leaf without one: no)."""
        if not self._batch and not self._batch_names:
            return False
        if shardings is not None and None not in shardings and self._policy.num_replicas == 1:
            return False
        batches = [args[i] for i in self._batch or () if i < len(args)]
        batches += [kwargs[k] for k in self._batch_names if k in kwargs]
        shardings = shardings_of(jax.tree.leaves(batches))
        if None in shardings:
            return True
        return self._policy.num_replicas > 1 and any(s.is_fully_replicated for s in shardings)

    def _variables(self, tree: Any, where: str, warn: bool = True) -> Any:
        layouts = argument_layouts(self._policy, tree, False, where)
        moved = [(p, x) for (p, x), s in zip(jax.tree_util.tree_leaves_with_path(tree),
                                             jax.tree.structure(tree).flatten_up_to(layouts),
                                             strict=True)
                 if s is not None]
        if not moved:
            return tree
        if warn and self._batch is None and not self._warned:
            ranked = [(p, x) for p, x in moved if np.ndim(x) >= 1]
            if ranked and not any(self._policy.layout_role(x) == "batch"
                                  for x in jax.tree.leaves(self._call)):
                # (a batch carried by its layout, as a distributed dataset's, declares the roles)
                self._warned = True
                path, leaf = ranked[0]
                warnings.warn(
                    f"{fn_name(self._fn)}: {where} holds unplaced arrays (e.g. "
                    f"{where}{jax.tree_util.keystr(path)} of shape {np.shape(leaf)}) and no "
                    "argument is declared a batch, so they are placed as variables (mirrored: "
                    "every replica computes on all of their rows). If an argument is a batch, "
                    "declare it: strategy.jit(fn, batch_argnums=(i,)) splits its rows over the "
                    "replicas; pass batch_argnums=() to declare that there is none.",
                    UndeclaredBatchWarning, stacklevel=5)
        return jax.tree.map(lambda x, s: x if s is None else put(x, s), tree, layouts,
                            is_leaf=lambda x: x is None)
