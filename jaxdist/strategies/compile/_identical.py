"""Which values of a replica function are the same on every replica: a dataflow reading of its jaxpr.

JAX's varying types answer a coarser question. Inside ``strategy.run`` each replica owns its copy of a mirrored
argument (it enters cast to *varying*, so that ``jax.grad`` gives local gradients, as in tf.distribute), and so
everything computed from it is varying by type, even a parameter updated with all-reduced gradients, which is
the same on every replica. Two cases that the types cannot tell apart:

* ``params - lr * all_reduce(grads)``: identical on every replica (tf.distribute's ``apply_gradients``);
* ``params - lr * grads`` with local gradients: every replica's copy drifts apart, silently.

`output_values` tells them apart by following values, not types, through the jaxpr: a value is *identical*
when it is computed only from values identical on every replica (mirrored arguments, constants, results of a
collective over every replica axis), and *different* once anything replica-specific flows into it (a batch, a
per-replica component, ``axis_index``, a host callback, a permutation between replicas). The reading is
conservative: "identical" is proven, and a primitive it does not know is different whenever an input is, or
whenever a jaxpr inside it holds a source of difference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from jaxdist.replicate.collectives import PER_REPLICA_SCOPE
from jaxdist.strategies.layout import Role

__all__ = ["DECLARED", "DIFFERENT", "IDENTICAL", "carried_inputs", "check_mirrored_outputs", "output_values"]

# Results identical on every replica when the collective spans every replica axis.
_COLLECTIVES = frozenset({
    "psum", "psum_invariant", "pmax", "pmin", "pmax_invariant", "pmin_invariant", "all_gather",
    "all_gather_invariant", "pmean",
})
# Results that differ between replicas whatever their inputs.
_SOURCES = frozenset({
    "axis_index", "ppermute", "all_to_all", "ragged_all_to_all", "reduce_scatter", "psum_scatter",
    "pure_callback", "io_callback", "rng_uniform", "rng_bit_generator",
})
# Reshaping and retyping keep a value's declaration (the probe of ``run`` stacks every output with ``x[None]``).
_KEEP_DECLARED = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type", "copy", "copy_p", "pvary",
})
# Higher-order primitives whose inner jaxpr takes the equation's inputs one for one.
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


IDENTICAL, DIFFERENT, DECLARED = "identical", "different", "declared"
"""What `output_values` says of a value: the same on every replica (proven), possibly different, or declared
different on purpose (`jaxdist.replicate.collectives.keep_per_replica`)."""


def output_values(jaxpr: Any, identical_inputs: Sequence[bool], axes: Sequence[str]) -> list[str]:
    """For each output of ``jaxpr``: `IDENTICAL` (proven the same on every replica), `DECLARED` (marked per
    replica on purpose with ``ReplicaContext.per_replica``) or `DIFFERENT`.

    Args:
        jaxpr: the replica function's jaxpr (a ``Jaxpr`` or ``ClosedJaxpr``), as traced inside ``shard_map``.
        identical_inputs: per input of ``jaxpr``, whether it is the same on every replica (a mirrored argument).
        axes: the mesh axes the replicas are laid over (a collective must span all of them to agree).

    Returns:
        One of the three per output.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> jaxpr = jax.make_jaxpr(lambda w, x: (w * 2, w * x))(jnp.ones(2), jnp.ones(2))
        >>> output_values(jaxpr, [True, False], ["replica"])
        ['identical', 'different']
    """
    inputs = [IDENTICAL if flag else DIFFERENT for flag in identical_inputs]
    return _read(_open(jaxpr), inputs, frozenset(axes))


def _open(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr


def _all_same(values: Sequence[str]) -> str:
    return IDENTICAL if all(v == IDENTICAL for v in values) else DIFFERENT


def _read(jaxpr: Any, inputs: list[str], axes: frozenset[str]) -> list[str]:
    known: dict[Any, str] = {}

    def get(v: Any) -> str:
        return IDENTICAL if isinstance(v, jcore.Literal) else known.get(v, IDENTICAL)

    for var in jaxpr.constvars:
        known[var] = IDENTICAL
    for var, value in zip(jaxpr.invars, inputs, strict=True):
        known[var] = value
    for eqn in jaxpr.eqns:
        outs = _equation(eqn, [get(v) for v in eqn.invars], axes)
        for var, value in zip(eqn.outvars, outs, strict=True):
            known[var] = value
    return [get(v) for v in jaxpr.outvars]


def _spans(eqn: Any, axes: frozenset[str]) -> bool:
    named = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    named = (named,) if isinstance(named, str) else tuple(named)
    return axes <= {a for a in named if isinstance(a, str)}


def _equation(eqn: Any, inputs: list[str], axes: frozenset[str]) -> list[str]:
    name, n_out = eqn.primitive.name.lower(), len(eqn.outvars)
    if name == "optimization_barrier" and PER_REPLICA_SCOPE in str(eqn.source_info.name_stack):
        return [DECLARED] * n_out
    if name in _SOURCES:
        return [DIFFERENT] * n_out
    if name in _KEEP_DECLARED and inputs == [DECLARED]:
        return [DECLARED] * n_out
    if name in _COLLECTIVES:
        return [IDENTICAL if _spans(eqn, axes) else _all_same(inputs)] * n_out
    if name == "scan":
        return _scan(eqn, inputs, axes)
    if name == "while":
        return _while(eqn, inputs, axes)
    if name == "cond":
        index, operands = inputs[0], inputs[1:]
        branches = [_read(_open(b), operands, axes) for b in eqn.params["branches"]]
        return [_all_same([index, *(b[i] for b in branches)]) for i in range(n_out)]
    for key in _CALL_PARAMS:
        inner = eqn.params.get(key)
        if isinstance(inner, (jcore.Jaxpr, jcore.ClosedJaxpr)) and len(_open(inner).invars) == len(inputs):
            return _read(_open(inner), inputs, axes)
    if any(_holds_source(p) for p in eqn.params.values()):
        return [DIFFERENT] * n_out
    return [_all_same(inputs)] * n_out


def _scan(eqn: Any, inputs: list[str], axes: frozenset[str]) -> list[str]:
    body = _open(eqn.params["jaxpr"])
    if "num_consts" in eqn.params:
        n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    else:  # jax >= 0.12: the inputs' structure, (consts, carry, xs), each part as many entries as leaves
        try:
            consts_part, carry_part, _ = eqn.params["ft_in"].unpack()
            n_consts, n_carry = len(list(consts_part)), len(list(carry_part))
        except (AttributeError, TypeError, ValueError):
            n_consts, n_carry = len(inputs) + 1, 0  # unknown: the conservative reading below
    if len(body.invars) != len(inputs) or n_consts + n_carry > len(inputs):  # a form not known: conservative
        return [_all_same(inputs) if not _holds_source(body) else DIFFERENT] * len(eqn.outvars)
    consts, carry, xs = inputs[:n_consts], inputs[n_consts:n_consts + n_carry], inputs[n_consts + n_carry:]
    carry = [_all_same([c]) for c in carry]
    while True:  # a carry that becomes different stays different: at most n_carry rounds
        outs = _read(body, consts + carry + xs, axes)
        joined = [_all_same([a, b]) for a, b in zip(carry, outs[:n_carry], strict=True)]
        if joined == carry:
            return carry + outs[n_carry:]
        carry = joined


def _while(eqn: Any, inputs: list[str], axes: frozenset[str]) -> list[str]:
    cond, body = _open(eqn.params["cond_jaxpr"]), _open(eqn.params["body_jaxpr"])
    n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cond_consts, body_consts = inputs[:n_cond], inputs[n_cond:n_cond + n_body]
    carry = [_all_same([c]) for c in inputs[n_cond + n_body:]]
    while True:
        if _all_same(_read(cond, cond_consts + carry, axes)) != IDENTICAL:  # replicas may loop unequally
            return [DIFFERENT] * len(carry)
        outs = _read(body, body_consts + carry, axes)
        joined = [_all_same([a, b]) for a, b in zip(carry, outs, strict=True)]
        if joined == carry:
            return carry
        carry = joined


def _holds_source(param: Any) -> bool:
    if isinstance(param, (jcore.Jaxpr, jcore.ClosedJaxpr)):
        return any(
            e.primitive.name in _SOURCES or any(_holds_source(p) for p in e.params.values())
            for e in _open(param).eqns
        )
    if isinstance(param, (tuple, list)):
        return any(_holds_source(p) for p in param)
    return False


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One leaf as the check sees it (a leaf to JAX too): its role (an argument's) or how it leaves (an
    output's), its shape and its dtype; an argument's input position, an output's `carried_inputs`."""

    what: Any
    shape: tuple[int, ...] | None
    dtype: Any
    index: int | None = None
    carries: frozenset[int] = frozenset()


# Element-wise primitives: an output of one carries the inputs of its own shape (``p - lr * g`` carries ``p``).
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "max", "min", "select_n", "convert_element_type", "pvary", "copy",
    "integer_pow", "pow", "sqrt", "rsqrt", "exp", "log", "abs", "sign", "clamp", "tanh", "logistic", "square",
    "add_any", "optimization_barrier", "stop_gradient", "reduce_precision", "nextafter", "rem", "floor", "ceil",
    "round", "expm1", "log1p",
})


_RESHAPING = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims"})


def _size(var: Any) -> int | None:
    shape = getattr(getattr(var, "aval", None), "shape", None)
    return None if shape is None else int(np.prod(shape))


def carried_inputs(jaxpr: Any) -> list[frozenset[int]]:
    """For each output of ``jaxpr``, the inputs it carries element-wise: reached from them by element-wise
    arithmetic alone (``params - lr * grads`` carries ``params``; a gradient, reached through matrix products
    and sums over the batch, carries nothing). What tells an updated value from a result of the same shape.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> jaxpr = jax.make_jaxpr(lambda w, x: (w - 0.1 * x, x @ w))(jnp.ones((2, 2)), jnp.ones((2, 2)))
        >>> carried_inputs(jaxpr)
        [frozenset({0, 1}), frozenset()]
    """
    inner = _open(jaxpr)
    return _carry(inner, [frozenset({i}) for i in range(len(inner.invars))])


def _carry(jaxpr: Any, inputs: list[frozenset[int]]) -> list[frozenset[int]]:
    known: dict[Any, frozenset[int]] = dict(zip(jaxpr.invars, inputs, strict=True))

    def get(v: Any) -> frozenset[int]:
        return frozenset() if isinstance(v, jcore.Literal) else known.get(v, frozenset())

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        call = next((eqn.params[k] for k in _CALL_PARAMS if isinstance(eqn.params.get(k), (jcore.Jaxpr,
                     jcore.ClosedJaxpr)) and len(_open(eqn.params[k]).invars) == len(eqn.invars)), None)
        if call is not None:
            outs = _carry(_open(call), [get(v) for v in eqn.invars])
        elif name in _RESHAPING and eqn.invars and _size(eqn.invars[0]) == _size(eqn.outvars[0]):
            outs = [get(eqn.invars[0])] * len(eqn.outvars)  # the same elements (the probe's ``x[None]``)
        elif name in _ELEMENTWISE:
            shape = eqn.outvars[0].aval.shape if eqn.outvars else ()
            carried = frozenset().union(*(get(v) for v in eqn.invars
                                          if getattr(v.aval, "shape", None) == shape))
            outs = [carried] * len(eqn.outvars)
        else:
            outs = [frozenset()] * len(eqn.outvars)
        known.update(zip(eqn.outvars, outs, strict=True))
    return [get(v) for v in jaxpr.outvars]


def _subtrees(tree: Any, where: str, depth: int) -> list[tuple[str, Any]]:
    """``tree`` and its subtrees down to ``depth`` levels, each with the path that names it."""
    found = [(where, tree)]
    if depth and not isinstance(tree, _Leaf):
        for path, child in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]:
            found += _subtrees(child, where + jax.tree_util.keystr(path), depth - 1)
    return found


def _signature(tree: Any) -> tuple[Any, tuple] | None:
    if isinstance(tree, _Leaf):
        return None  # a lone array: too easily the shape of an unrelated result
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves)) if leaves else None


def _dtype(dtype: Any) -> Any:
    """``dtype`` comparable with another: numpy's, or JAX's own (a typed PRNG key's ``key<fry>``) as it is."""
    return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)


def check_mirrored_outputs(
    fn: str, treedef: Any, roles: Sequence[Role], dynamic: Sequence[Any],
    out_tree: Any, out_kinds: Sequence[str], out_shapes: Sequence[tuple[int, ...]], out_dtypes: Sequence[Any],
    out_carries: Sequence[frozenset[int]],
) -> None:
    """Refuse a replica function whose output takes the place of a mirrored argument but differs between
    replicas (tf.distribute refuses to update a mirrored variable from replica context without aggregating).

    An output subtree takes an argument's place when it has the argument's structure, shapes and dtypes
    (``state -> new_state``) and carries it (`carried_inputs`: a leaf reached from the argument's leaf at the
    same path by element-wise arithmetic, as an update is; per-replica gradients of the same structure are
    not); it is refused when such a leaf is not provably identical (`output_values`) and was not declared per
    replica: typically parameters updated with each replica's local gradients.

    Args:
        fn: the replica function's name, for the message.
        treedef, roles: the structure of ``(args, kwargs)`` and each leaf's role.
        dynamic: the array leaves (those whose role is not static), in order.
        out_tree, out_kinds, out_shapes, out_dtypes: the outputs' structure and, per leaf, how it leaves the
            program ("per_replica" where its replicas' values may differ; "static": not an array, such as an
            Equinox module's functions, which only the structure keeps), its shape and dtype.
        out_carries: per output leaf, the positions in ``dynamic`` it carries (`carried_inputs`).

    Raises:
        ValueError: naming the output, the argument it replaces, and the two fixes (all-reduce the gradients;
            declare the value per replica on purpose).
    """
    arrays = iter(enumerate(dynamic))
    leaves = []
    for role in roles:
        if role == Role.VARIABLE:
            i, x = next(arrays)
            leaves.append(_Leaf(role, tuple(np.shape(x)), _dtype(jax.dtypes.result_type(x)), index=i))
        elif role == Role.STATIC:
            leaves.append(None)  # not an array (an Equinox module's functions): part of the structure only
        else:
            next(arrays)
            leaves.append(_Leaf(role, None, None))
    args, kwargs = jax.tree.unflatten(treedef, leaves)
    places: dict[Any, list[tuple[str, Any]]] = {}
    for where, sub in [*_subtrees(tuple(args), "args", 2), *_subtrees(dict(kwargs), "kwargs", 1)][1:]:
        sig = _signature(sub)
        if sig is not None and all(leaf.what == Role.VARIABLE for leaf in jax.tree.leaves(sub)):
            places.setdefault(sig, []).append((where, sub))
    if not places:
        return
    outs = jax.tree.unflatten(out_tree, [
        None if k == "static" else _Leaf(k, tuple(s), _dtype(d), carries=c)
        for k, s, d, c in zip(out_kinds, out_shapes, out_dtypes, out_carries, strict=True)
    ])
    for where, sub in _subtrees(outs, "output", 2):
        for argument, arg_sub in places.get(_signature(sub), ()):
            differ = [jax.tree_util.keystr(p) or "" for (p, leaf), given in zip(
                jax.tree_util.tree_flatten_with_path(sub)[0], jax.tree.leaves(arg_sub), strict=True)
                if leaf.what == "per_replica" and given.index in leaf.carries]
            if differ:
                raise ValueError(_message(fn, where, argument, differ))


def _message(fn: str, output: str, argument: str, differ: list[str]) -> str:
    shown = ", ".join(f"{output}{p}" for p in differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3
                                                              else "")
    return (
        f"strategy.run({fn}): {output} takes the place of the mirrored argument {argument} (same structure, "
        f"shapes and dtypes) but differs between replicas ({shown}): each replica updated its own copy, e.g. "
        "with its local gradients, and the copies drift apart. tf.distribute's optimizer.apply_gradients "
        "all-reduces the gradients for you; here, combine them before the update: grads = "
        "jd.get_replica_context().all_reduce(jd.ReduceOp.SUM, grads) (SUM of losses scaled by "
        "jd.compute_average_loss; MEAN of plain per-replica means). A value each replica keeps apart on purpose "
        "(local SGD, an ensemble, a residual) is declared where it is returned: "
        "jd.get_replica_context().per_replica(new_value); it then comes back as jd.PerReplica."
    )
