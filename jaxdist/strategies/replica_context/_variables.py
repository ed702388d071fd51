"""Creating values in a policy's layouts: variables compiled into place, existing trees placed,
sync-on-read.

On a mesh over several processes the arrays passed in (rng keys, sample inputs, existing values) are
process 0's, so every process starts from the same state even where its own inputs differ.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxdist.job import from_chief
from jaxdist.replicate.layouts import put
from jaxdist.replicate.ops import VariableAggregation, check_mean_dtype
from jaxdist.replicate.trees import abstract, fn_name, merge_static, placed_leaves, split_static
from jaxdist.replicate.values import SyncOnRead
from jaxdist.strategies.layout import LayoutPolicy, decided, initializer, leave_auto, runs_auto, say

__all__ = ["create_variables", "mirror", "sync_on_read"]


def create_variables(policy: LayoutPolicy, init_fn: Callable[..., Any], args: tuple,
                     kwargs: dict) -> Any:
    """``init_fn(*args, **kwargs)`` compiled into ``policy``'s layout (`Strategy.create_variables`).

    Raises:
        TypeError: when ``init_fn`` is not callable.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> policy = LayoutPolicy(jax.devices()[:2])
        >>> create_variables(policy, lambda: {"w": jnp.zeros(3)}, (), {})["w"].sharding.spec
        P()
    """
    if not callable(init_fn):
        raise TypeError(f"init_fn={init_fn!r} (type {type(init_fn).__name__}) is not callable: "
                        "pass the function that builds the variables, e.g. strategy."
                        "create_variables(model.init, rng, x); use strategy.mirror(tree) to place "
                        "values you already have.")
    # Only array leaves are traced: a config object, a string or a Python number is a constant of
    # the initializer (the program is compiled once, so nothing needs to be hashable).
    dynamic, treedef, statics = split_static((args, kwargs))
    if policy.spans_processes:
        dynamic = from_chief(dynamic)  # new arrays: process 0's values
    else:
        # Arrays enter as copies on the mesh: one on other devices is accepted, and an output that
        # is an argument unchanged (jit forwards those) never shares the caller's buffer.
        dynamic = [put(x, policy.replicated_sharding, copy=True) if isinstance(x, jax.Array) else x
                   for x in dynamic]

    name = fn_name(init_fn)
    mesh = policy.mesh

    def call(dyn: tuple) -> Any:
        call_args, call_kwargs = merge_static(dyn, treedef, statics)
        return init_fn(*call_args, **call_kwargs)

    def traced(dyn: tuple) -> tuple[Any, bool]:
        return initializer(mesh, name, call, dyn)

    def fn(*dyn):
        out, auto = traced(dyn)
        return leave_auto(mesh, out) if auto else out

    fn.__name__ = fn.__qualname__ = name  # errors name the user's function

    def create() -> Any:
        shapes = jax.eval_shape(fn, *dynamic)
        layouts = jax.tree.leaves(policy.variable_shardings(shapes))
        if not runs_auto(mesh):
            # the program eval_shape traced (JAX keeps a function's trace for the same argument
            # types): compiled into the layouts without tracing init_fn again
            say(mesh, name, False)
            return jax.jit(fn, out_shardings=jax.tree.unflatten(jax.tree.structure(shapes),
                                                                layouts))(*dynamic)

        # Run Auto: each leaf leaves the region in its layout (the static parts are eval_shape's)
        def leaves(*dyn):
            out, _ = traced(dyn)
            say(mesh, name, True)
            return [jax.sharding.reshard(x, s)
                    for x, s in zip(jax.tree.leaves(out), layouts, strict=True)]

        leaves.__name__ = leaves.__qualname__ = name
        return jax.tree.unflatten(jax.tree.structure(shapes),
                                  jax.jit(leaves, out_shardings=layouts)(*dynamic))

    return decided(mesh, None, create, name)


def mirror(policy: LayoutPolicy, tree: Any) -> Any:
    """``tree`` with its values (`jaxdist.replicate.trees.placed_leaves`) placed in ``policy``'s
    variable layout and every other leaf as it is (see `Strategy.mirror`).

    Examples:
        >>> import jax, numpy as np
        >>> placed = mirror(LayoutPolicy(jax.devices()[:2]), {"b": np.zeros(2), "act": abs})
        >>> placed["b"].sharding.is_fully_replicated, placed["act"]
        (True, <built-in function abs>)
    """
    leaves, treedef = jax.tree.flatten(tree)
    # Which leaves are placed: see Strategy.mirror (a Flax TrainState's step=0 kept a Python int
    # would make every step compile anew). The values keep their places (layout rules match paths).
    placed_flags = placed_leaves(tree)
    values = jax.tree.unflatten(treedef, [x if f else None
                                          for x, f in zip(leaves, placed_flags, strict=True)])
    if policy.spans_processes:
        values = from_chief(values)
    # A copy, as tf.distribute's: donating the mirror to a step must not delete the caller's arrays.
    placed = iter(jax.tree.leaves(jax.tree.map(functools.partial(put, copy=True), values,
                                               policy.variable_shardings(abstract(values)))))
    return jax.tree.unflatten(treedef, [next(placed) if f else x
                                        for x, f in zip(leaves, placed_flags, strict=True)])


def sync_on_read(policy: LayoutPolicy, owner: Any, initial_value: Any,
                 aggregation: VariableAggregation | str) -> SyncOnRead:
    """A `SyncOnRead` of ``owner``, each component ``initial_value`` (`Strategy.sync_on_read`).

    Raises:
        ValueError: for NONE or an unknown aggregation.
        TypeError: for MEAN on an integer value.
    """
    mode = VariableAggregation.parse(aggregation, "aggregation")
    value = jnp.asarray(initial_value)
    if mode is VariableAggregation.MEAN:
        check_mean_dtype(value, "initial_value")
    n = policy.num_replicas
    stacked = jax.jit(lambda v: jnp.broadcast_to(v, (n, *v.shape)),
                      out_shardings=policy.batch_sharding)(value)
    return SyncOnRead(stacked, mode, owner)
