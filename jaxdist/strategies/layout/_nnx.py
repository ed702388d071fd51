"""The layouts of an nnx state: which layout each Variable of a model or optimizer gets.

Asked by a call that places an nnx state (`jaxdist.strategies.input`), by a plan that describes one
(`jaxdist.strategies.plan`) and by a step's trace, which enters and returns the state in these
layouts (`jaxdist.strategies.compile`). The order is the resolver's everywhere: a Variable's
annotation (its ``out_sharding`` / ``sharding`` metadata, through the strategy's logical rules)
first, then the layout it already has on the mesh, then the policy's variable layout.

Examples:
    >>> import jax, jax.numpy as jnp, jaxdist as jd
    >>> from flax import nnx
    >>> policy = jd.strategies.LayoutPolicy(jax.devices()[:1])
    >>> layouts, annotated = nnx_layouts(policy, nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0))))
    >>> len(layouts), annotated
    (2, [False, False])
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxdist.replicate.layouts import on_mesh, path_name
from jaxdist.strategies.layout._provenance import declared
from jaxdist.strategies.layout._rules import annotation, is_variable

__all__ = ["nnx_layouts"]


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x))


def nnx_layouts(policy: Any, state: Any) -> tuple[list[Any], list[bool]]:
    """The layout of each value of an nnx ``state`` (placed arrays), and whether it is annotated.

    An annotated Variable gets its annotation's layout (through the layout rules, which come first);
    an unannotated one keeps the layout it has on the mesh, except that where variables can be
    split, one Flax put on the ambient mesh whole (its default) takes the variable layout; anything
    else takes the variable layout.

    Args:
        policy: the strategy's `LayoutPolicy`.
        state: an nnx ``State`` (or any pytree whose leaves are nnx Variables or arrays).

    Returns:
        ``(layouts, annotated)``: one layout and one flag per Variable, in the order of the state's
        leaves.
    """
    entries = jax.tree_util.tree_leaves_with_path(state, is_leaf=is_variable)
    layouts, annotated = [], []
    for path, v in entries:
        value = v.get_value() if is_variable(v) else v
        box = annotation(v, policy.mesh.axis_names)
        annotated.append(box is not None)
        if (not isinstance(value, (jax.Array, np.ndarray, np.generic))
                or isinstance(value, jax.core.Tracer)):
            layouts.append(getattr(value, "sharding", None) if box is None else declared(
                policy.variable_layout(path_name(path), _aval(value), box)))
            continue
        # the annotation's layout: the user's, as where Flax placed the Variable itself
        if box is not None:
            layouts.append(declared(policy.variable_layout(path_name(path), _aval(value), box)))
            continue
        sharding = getattr(value, "sharding", None)
        if on_mesh(sharding, policy.mesh) and not (
                policy.splits_variables and np.ndim(value) and sharding.is_fully_replicated):
            layouts.append(sharding)
        else:
            layouts.append(policy.variable_layout(path_name(path), _aval(value)))
    return layouts, annotated
