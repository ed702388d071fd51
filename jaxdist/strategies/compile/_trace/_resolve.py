"""The resolver: the layout of every argument and output of a compiled step, decided when traced.

Called while JAX traces a step (`jaxdist.strategies.compile._trace._step`), never on a steady-state
call, it applies the layouts the policy gives (`jaxdist.strategies.layout`: ``variable_layout``,
``nnx_layouts``, the annotations); they come, in this order, from:

1. the declarations: ``batch_argnums`` / ``batch_argnames`` (split over the batch axes),
   ``out_layouts=``;
2. each value's own layout: a placed array's sharding, an nnx Variable's partitioning metadata
   (``out_sharding`` / ``sharding``, through the strategy's logical rules), a linen box's names;
3. the policy's variable layout (`LayoutPolicy.variable_layout`), only for what carries none.

Outputs follow the same order. An output that IS one of the step's variables keeps that variable's
layout:

* the nnx state written back in place (``nnx.jit``'s in-place updates) keeps each Variable's layout;
* an nnx ``State`` returned by the step (``return nnx.state((model, optimizer))``) is matched to the
  state of the step's nnx arguments path by path; Variables it holds that match no argument take
  their annotation, else the variable layout;
* an output with the structure, shapes and dtypes of a positional argument (``state -> new_state``)
  takes that argument's layout, leaf by leaf;
* everything else (metrics, gradients) takes the variable layout (per-replica values: split over the
  replicas), except that on ``Explicit`` axes an output whose type splits it over one keeps that
  layout: jaxdist's own variables enter typed whole, so a split type is the user's
  (``out_sharding=`` or `jax.sharding.reshard` in the step's code, a layout the user placed, a
  batch). A whole type is what jaxdist's variables have inside the step too: it takes the variable
  layout unless ``out_layouts=`` declares it.

Where variables can be split (FSDP), an unannotated variable that came in whole on every device
(say, created eagerly inside ``scope()``) leaves in the variable layout: the state settles into FSDP
after one step. A variable whose annotation says "whole" stays whole.

On ``Explicit`` mesh axes a value's layout is part of its type, and model code written for such a
mesh (gemma) expects the types it annotated. A variable that jaxdist itself split over an
``Explicit`` axis (the FSDP rule, not an annotation) therefore enters the step typed whole along it
(`jax.sharding.reshard`; XLA all-gathers it at entry and reduce-scatters its gradient), as the
single-device code it runs expects. Which variables jaxdist split is told by where their layout came
from (`jaxdist.strategies.layout._provenance`), never by their spec: one the user placed keeps its
layout as its type, whatever it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.replicate.layouts import entry_axes, path_name, spec_axes
from jaxdist.replicate.trees import flax_nnx, is_distributed, signature
from jaxdist.strategies.compile._trace._provenance import constrained
from jaxdist.strategies.layout import (
    annotation,
    declared,
    explicit_axes,
    in_host_memory,
    in_trace,
    is_box,
    is_own,
    is_variable,
    own,
    to_host_memory,
)

__all__ = ["check_idle", "constrain", "constrain_outputs", "typed_whole", "typed_whole_at_entry"]


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x))


def typed_whole_at_entry(policy: Any, traced: Sequence[Any], layouts: Sequence[Any],
                         kept: Sequence[bool]) -> list:
    """On a mesh with ``Explicit`` axes: each traced variable that jaxdist split over an
    ``Explicit`` axis (its layout `jaxdist.strategies.layout.is_own`, and ``kept[i]`` False: not
    annotated, not a batch) typed whole along those axes (see the module doc). The user's layouts,
    values on ``Auto`` axes, annotated ones, and anything on a mesh without ``Explicit`` axes are
    returned as they are."""
    explicit = set(explicit_axes(policy.mesh))
    if not explicit:
        return list(traced)
    out = []
    for t, layout, keep in zip(traced, layouts, kept, strict=True):
        spec = getattr(layout, "spec", None)
        if (keep or spec is None or not isinstance(t, jax.Array) or not is_own(layout)
                or not _uses(spec, explicit)):
            out.append(t)
            continue
        out.append(jax.sharding.reshard(t, NamedSharding(policy.mesh, _drop(spec, explicit))))
    return out


def _uses(spec: PartitionSpec, axes: set[str]) -> bool:
    return bool(spec_axes(spec) & axes)


def _drop(spec: PartitionSpec, axes: set[str]) -> PartitionSpec:
    def keep(entry):
        names = tuple(n for n in entry_axes(entry) if n not in axes)
        return None if not names else names[0] if len(names) == 1 else names

    return PartitionSpec(*(keep(e) for e in spec))


# ------------------------------------------------------------------------------------------ outputs
def constrain(policy: Any, x: Any, sharding: Any, host: bool = False) -> Any:
    """Traced ``x`` constrained to ``sharding`` (on Explicit axes resharded: its type agrees)."""
    if not isinstance(x, jax.Array) or not isinstance(sharding, jax.sharding.Sharding):
        return x
    if host:  # an offloaded argument: its new value goes back to host memory
        out = to_host_memory(
            jax.lax.with_sharding_constraint(x, sharding.with_memory_kind("device")))
    elif explicit_axes(policy.mesh) and isinstance(sharding, NamedSharding):
        # on Explicit axes the output's type must agree with its layout (a no-op where it does)
        out = jax.sharding.reshard(x, sharding)
    else:
        out = jax.lax.with_sharding_constraint(x, in_trace(sharding))
    return constrained(out, sharding)


def _like_argument(policy: Any, tree: Any, concrete: Any) -> Any:
    """``tree`` (traced) in the layouts of ``concrete`` (an argument's placed values), leaf by leaf;
    None when no leaf of ``concrete`` has a sharding (abstract arguments: nothing to follow)."""
    leaves = jax.tree.leaves(concrete)
    if not any(isinstance(getattr(c, "sharding", None), jax.sharding.Sharding) for c in leaves):
        return None
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for (path, x), c in zip(paths_leaves, leaves, strict=True):
        s = getattr(c, "sharding", None)
        if not isinstance(s, jax.sharding.Sharding) or not isinstance(x, jax.Array):
            out.append(x)
            continue
        # settle into the variable layout
        if policy.splits_variables and np.ndim(x) and s.is_fully_replicated:
            layout = policy.variable_layout(path_name(path), _aval(x))
            s = layout if s.memory_kind is None else own(layout.with_memory_kind(s.memory_kind))
        out.append(constrain(policy, x, s, host=in_host_memory(c)))
    return jax.tree.unflatten(treedef, out)


def _variable_outputs(policy: Any, tree: Any) -> Any:
    def one(path, x):
        if is_distributed(x):  # one component per replica: stays split over them
            return jax.tree.map(lambda v: constrain(policy, v, policy.batch_sharding), x)
        # an nnx Variable that is none of the arguments': its annotation, else the rule
        if is_variable(x):
            value = x.get_value()
            if not isinstance(value, jax.Array):
                return x
            box = annotation(x, policy.mesh.axis_names)
            layout = policy.variable_layout(path_name(path), _aval(value), box)
            layout = layout if box is None else declared(layout)
            return x.replace(constrain(policy, value, layout))
        box = x if is_box(x) else None  # a linen annotation: laid out as annotated
        value = x.value if box is not None else x
        if not isinstance(value, jax.Array):
            return x
        typed = _typed_split(value) if box is None else None
        if typed is not None:  # split by its type over Explicit axes: the user's layout, kept
            return constrain(policy, value, declared(NamedSharding(policy.mesh, typed)))
        value = constrain(policy, value, policy.variable_layout(path_name(path), _aval(value), box))
        return box.replace_boxed(value) if box is not None else value

    return jax.tree_util.tree_map_with_path(
        one, tree, is_leaf=lambda v: is_distributed(v) or is_box(v) or is_variable(v))


def _typed_split(x: jax.Array) -> PartitionSpec | None:
    """The spec of traced ``x``'s type where it splits ``x`` over an Explicit axis of the program
    (then the user's layout: see the module doc), else None."""
    sharding = jax.typeof(x).sharding
    if not isinstance(sharding, NamedSharding) or sharding.mesh.are_all_axes_auto:
        return None
    explicit = {n for n, t in zip(sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True)
                if t == jax.sharding.AxisType.Explicit}
    return sharding.spec if _uses(sharding.spec, explicit) else None


def _state_like(policy: Any, state: Any, nodes_state: dict) -> Any:
    """A returned nnx ``State`` whose paths are those of the step's nnx arguments (all of them, as a
    tuple, or one): each Variable in that argument's layout. None when its paths match none."""
    entries = jax.tree_util.tree_leaves_with_path(state, is_leaf=is_variable)
    keys = [tuple(path) for path, _ in entries]
    if not keys:
        return None
    candidates = [(), *dict.fromkeys(k[:1] for k in nodes_state)]
    for prefix in candidates:
        if all(prefix + k in nodes_state for k in keys):
            layouts = [nodes_state[prefix + k] for k in keys]
            values = jax.tree.leaves(state)
            constrained = [constrain(policy, v, layout)
                           for v, layout in zip(values, layouts, strict=True)]
            return jax.tree.unflatten(jax.tree.structure(state), constrained)
    return None


def constrain_outputs(policy: Any, out: Any, arguments: Sequence[Any], nodes_state: dict,
                      out_layouts: Any = None) -> Any:
    """Constrain the outputs of a step being traced (the rules of the module doc).

    Args:
        policy: the strategy's `LayoutPolicy`.
        out: the step's traced outputs.
        arguments: the placed (concrete) positional arguments the step was called with, nnx ones
            excluded.
        nodes_state: ``{key path: layout}`` of the state of the step's nnx arguments (as one tuple
            of nodes).
        out_layouts: the caller's declaration: a pytree prefix of ``out`` of `jax.sharding.Sharding`
            / `PartitionSpec` (on the strategy's mesh) / None (no declaration for that part).
    """
    if out_layouts is not None:
        return _declared(policy, out, out_layouts, arguments, nodes_state)
    signatures = [(signature(a), a) for a in arguments]

    def like(tree):
        if nodes_state and isinstance(tree, flax_nnx().State):  # nnx arguments: nnx is imported
            matched = _state_like(policy, tree, nodes_state)
            if matched is not None:
                return matched
        sig = signature(tree)
        for s, concrete in signatures:
            if s == sig:
                constrained = _like_argument(policy, tree, concrete)
                if constrained is not None:
                    return constrained
        return None

    whole = like(out)
    if whole is not None:
        return whole
    # -> (state, metrics): one by one
    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        parts = [like(o) for o in out]
        return type(out)(p if p is not None else _rest(policy, o, nodes_state)
                         for p, o in zip(parts, out, strict=True))
    return _rest(policy, out, nodes_state)


def _rest(policy: Any, tree: Any, nodes_state: dict) -> Any:
    """Outputs that are no argument as a whole (nnx States inside still match the arguments')."""
    if nodes_state:  # nnx arguments: nnx is imported
        nnx = flax_nnx()

        def one(x):
            if isinstance(x, nnx.State):
                matched = _state_like(policy, x, nodes_state)
                if matched is not None:
                    return matched
            return _variable_outputs(policy, x)

        return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.State))
    return _variable_outputs(policy, tree)


def _declared(policy: Any, out: Any, declared: Any, arguments: Sequence[Any],
              nodes_state: dict) -> Any:
    def one(layout, subtree):
        if layout is None:
            return constrain_outputs(policy, subtree, arguments, nodes_state)
        if isinstance(layout, PartitionSpec):
            layout = NamedSharding(policy.mesh, layout)
        if not isinstance(layout, jax.sharding.Sharding):
            raise TypeError(f"out_layouts entry {layout!r} is neither a jax.sharding.Sharding, a "
                            "PartitionSpec nor None: give each output's layout, e.g. "
                            "out_layouts=(None, PartitionSpec()) for (state, metrics).")
        return jax.tree.map(lambda x: constrain(policy, x, layout), subtree)

    try:
        return jax.tree.map(one, declared, out, is_leaf=lambda x: x is None or isinstance(
            x, (PartitionSpec, jax.sharding.Sharding)))
    except ValueError as error:
        raise ValueError(f"out_layouts={declared!r} does not match the structure of the step's "
                         f"outputs ({jax.tree.structure(out)}): give a pytree prefix of the "
                         "outputs (None where jaxdist decides).") from error


def check_idle(policy, concrete, skip, declared, state_layouts, concrete_state) -> None:
    """The idle-axis check on this program's variables (resolved layouts; batches excluded)."""
    if not any(policy.mesh.shape[a] > 1 for a in policy.roles.model_axes):
        return
    specs, names, avals = list(state_layouts), [], []
    if concrete_state is not None:
        names = [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(concrete_state)]
        avals = [_aval(x) for x in jax.tree.leaves(concrete_state)]
    for i, c in enumerate(concrete):
        if i in skip or c is None or (declared is not None and i in declared):
            continue
        for path, leaf in jax.tree_util.tree_leaves_with_path(c):
            sharding = getattr(leaf, "sharding", None)
            if np.ndim(leaf) and isinstance(sharding, jax.sharding.NamedSharding) and not (
                declared is None and policy.is_batch_layout(leaf) and not policy.splits_variables):
                specs.append(sharding)
                names.append(f"argument {i}{jax.tree_util.keystr(path)}")
                avals.append(_aval(leaf))
    if specs:
        policy.warn_idle_axes(specs, "the step's variables", names, avals)


def typed_whole(policy, args, concrete, skip, batches, state, state_layouts,
                annotated) -> tuple[tuple, Any]:
    """On Explicit axes: variables whose layout jaxdist decided (not the user's, not an annotation,
    not a batch) enter the step typed whole along those axes (`typed_whole_at_entry`)."""
    batch_ids = {id(b) for b in batches}
    out = []
    for i, (a, c) in enumerate(zip(args, concrete, strict=True)):
        if i in skip or c is None:
            out.append(a)
            continue
        leaves, treedef = jax.tree.flatten(a)
        layouts = [getattr(cl, "sharding", None) for cl in jax.tree.leaves(c)]
        kept = [id(t) in batch_ids or not np.ndim(t) for t in leaves]
        out.append(jax.tree.unflatten(treedef, typed_whole_at_entry(policy, leaves, layouts, kept)))
    if state is not None and state_layouts:
        values = typed_whole_at_entry(policy, jax.tree.leaves(state), state_layouts, annotated)
        state = jax.tree.unflatten(jax.tree.structure(state), values)
    return tuple(out), state
