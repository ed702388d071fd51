"""`jax.Ref` arguments in a step: they enter as the arrays they hold, their updates written back.

JAX's training cookbook keeps its state in refs (``jax.tree.map(jax.ref.new_ref, train_state)``) and
its step updates them in place (``param[...] -= ...``). A ref is no array (its type is the caller's
buffer's), so each ref leaf of the step's arguments is read at entry and its value enters in its
role and layout like any array (`RefArguments.read`), the step's code gets a ref of its own holding
the entered value (`RefArguments.wrap`), and what that ref holds when the step returns is written
back into the caller's ref, typed as that ref is (`RefArguments.write_back`, outside any Auto
region). Inside one program refs are values (JAX discharges them), so this costs no copy.

A ref's layout is its buffer's, a sharding object `jax.ref.new_ref` makes: to a step it is the
user's (its type kept on Explicit axes; `jaxdist.strategies.layout._provenance`).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxdist.strategies.layout import explicit_axes

__all__ = ["RefArguments", "is_ref"]


def is_ref(x: Any) -> bool:
    """Whether ``x`` is a `jax.Ref` (a concrete one, or one traced as an argument)."""
    return isinstance(x, jax.ref.Ref) or isinstance(getattr(x, "aval", None), jax.ref.AbstractRef)


class RefArguments:
    """The ref leaves of one trace of a step's arguments, by argument (position, keyword), leaf."""

    def __init__(self) -> None:
        self._outer: dict[tuple[int | str, int], Any] = {}

    def __bool__(self) -> bool:
        return bool(self._outer)

    def read(self, args: tuple, kwargs: dict, skip: set[int],
             skip_names: set[str]) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with each ref leaf (outside positions ``skip`` and keywords
        ``skip_names``: static and nnx arguments) replaced by the value it holds; the refs are kept
        for `wrap` and `write_back`."""
        def one(where: int | str, tree: Any) -> Any:
            leaves, treedef = jax.tree.flatten(tree)
            if not any(map(is_ref, leaves)):
                return tree
            for i, leaf in enumerate(leaves):
                if is_ref(leaf):
                    self._outer[where, i] = leaf
                    leaves[i] = leaf[...]
            return jax.tree.unflatten(treedef, leaves)

        args = tuple(a if i in skip else one(i, a) for i, a in enumerate(args))
        return args, {k: v if k in skip_names else one(k, v) for k, v in kwargs.items()}

    def wrap(self, args: Any, kwargs: dict) -> tuple[Any, dict, list[Any]]:
        """``(args, kwargs, inner)``: the values `read` took out of refs put back in refs of the
        step's own (``inner``, in `read`'s order), as the step's code expects them."""
        if not self._outer:
            return args, kwargs, []
        args, kwargs = list(args), dict(kwargs)
        inner = {}
        for where in dict.fromkeys(w for w, _ in self._outer):
            holder = args if isinstance(where, int) else kwargs
            leaves, treedef = jax.tree.flatten(holder[where])
            for (w, i) in self._outer:
                if w == where:
                    leaves[i] = inner[w, i] = jax.ref.new_ref(leaves[i])
            holder[where] = jax.tree.unflatten(treedef, leaves)
        return args, kwargs, [inner[k] for k in self._outer]

    def write_back(self, mesh: Any, values: list[Any]) -> None:
        """Write ``values`` (what the step's refs held when it returned) into the caller's refs,
        each typed as its ref is (resharded on Explicit axes: a no-op where the types agree)."""
        explicit = bool(explicit_axes(mesh))
        for outer, value in zip(self._outer.values(), values, strict=True):
            if explicit:
                spec = jax.typeof(outer).inner_aval.sharding.spec
                value = jax.sharding.reshard(value, NamedSharding(mesh, spec))
            outer[...] = value
