"""The global view: `Strategy.jit` compiles an unmodified single-device step for the strategy's layout.

The step sees global arrays: whole mirrored parameters and the whole global batch. Layouts come from the
arguments (mirrored state replicated, batches split on axis 0, as placed by the strategy) and XLA's SPMD
partitioner inserts the collectives, so the step computes what it computes on one device.

Two rules keep steady-state calls as cheap as a hand-written ``jax.jit`` with ``NamedSharding``s:

* arguments not yet on the strategy's mesh (numpy arrays, arrays on another device) are placed mirrored;
  arguments already on the mesh are passed through untouched;
* an output with the same structure, shapes and dtypes as a positional argument (``state -> new_state``) is
  constrained to that argument's layout, so state keeps its layout from step to step. This costs nothing per
  call: the layouts are read only when the step is traced.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxdist.replicate.layouts import put, replicated
from jaxdist.strategies.tracing import computation

if TYPE_CHECKING:
    from jaxdist.strategies.base import Strategy

__all__ = ["StrategyFunction"]


def _as_tuple(x: int | Sequence[int] | None) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, int):
        return (x,)
    return tuple(x)


class StrategyFunction:
    """A step compiled by ``strategy.jit``: call it like the original function.

    Example:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> step = strategy.jit(lambda w, x: w - 0.1 * x.mean(0))
        >>> step(jnp.ones(2), jnp.ones((4, 2))).tolist()
        [0.8999999761581421, 0.8999999761581421]
    """

    def __init__(
        self,
        strategy: Strategy,
        fn: Callable,
        donate_argnums: int | Sequence[int] | None = None,
        static_argnums: int | Sequence[int] | None = None,
    ):
        if not callable(fn):
            raise TypeError(f"fn={fn!r} is not callable: strategy.jit compiles a step function.")
        self._strategy = strategy
        self._fn = fn
        self._static = _as_tuple(static_argnums)
        self._local = threading.local()
        functools.update_wrapper(self, fn)
        self._jitted = jax.jit(
            self._traced, donate_argnums=_as_tuple(donate_argnums), static_argnums=self._static
        )

    def _needs_placing(self, x: Any) -> bool:
        if isinstance(x, jax.Array):
            sharding = x.sharding
            mesh = self._strategy.mesh
            return not (getattr(sharding, "mesh", None) is mesh or sharding.device_set == set(mesh.devices.flat))
        return isinstance(x, np.ndarray)

    def _place_args(self, args: tuple) -> tuple:
        # Fast path: in steady state every argument is already on the mesh, so nothing is rebuilt.
        mesh = self._strategy.mesh
        dynamic = [a for i, a in enumerate(args) if i not in self._static] if self._static else args
        for x in jax.tree.leaves(dynamic):
            if getattr(getattr(x, "sharding", None), "mesh", None) is mesh:
                continue  # the common case, checked without a method call
            if self._needs_placing(x):
                break
        else:
            return args

        def place(x):
            return put(x, replicated(mesh)) if self._needs_placing(x) else x

        return tuple(a if i in self._static else jax.tree.map(place, a) for i, a in enumerate(args))

    def __call__(self, *args: Any) -> Any:
        placed = self._place_args(args)
        self._local.args = placed  # read only if this call traces
        try:
            return self._jitted(*placed)
        finally:
            self._local.args = None

    def lower(self, *args: Any):
        """Lower for these arguments (for inspecting HLO or memory), as ``jax.jit(...).lower``."""
        placed = self._place_args(args)
        self._local.args = placed
        try:
            return self._jitted.lower(*placed)
        finally:
            self._local.args = None

    def _traced(self, *args: Any) -> Any:
        strategy = self._strategy
        concrete = getattr(self._local, "args", None)
        batches, signatures = [], []
        if concrete is not None:
            for i, (a, c) in enumerate(zip(args, concrete, strict=True)):
                if i in self._static:
                    continue
                for t, leaf in zip(jax.tree.leaves(a), jax.tree.leaves(c), strict=True):
                    if isinstance(leaf, jax.Array) and strategy._is_batch(leaf):
                        batches.append(t)
                signatures.append((_signature(c), c))
        with computation(strategy, "global", batches):
            out = self._fn(*args)
        return _keep_layouts(out, signatures)


def _signature(tree: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(x), str(jax.dtypes.result_type(x))) for x in leaves)


def _keep_layouts(out: Any, signatures: list) -> Any:
    """Constrain outputs shaped like an input argument to that argument's layout."""
    if not signatures:
        return out

    def constrain(tree):
        sig = _signature(tree)
        for s, concrete in signatures:
            if s == sig:
                shardings = [getattr(c, "sharding", None) for c in jax.tree.leaves(concrete)]
                if all(sh is not None for sh in shardings):
                    leaves, treedef = jax.tree.flatten(tree)
                    leaves = [
                        jax.lax.with_sharding_constraint(x, sh) for x, sh in zip(leaves, shardings, strict=True)
                    ]
                    return jax.tree.unflatten(treedef, leaves), True
        return tree, False

    # The whole output first (``state -> state``), then the elements of a tuple (``-> (state, metrics)``).
    whole, matched = constrain(out)
    if matched or not (isinstance(out, tuple) and not hasattr(out, "_fields")):
        return whole
    return tuple(constrain(o)[0] for o in out)
