"""Bring your own run: a state trained elsewhere placed onto a trainer's layout (``load_state``).

A run trained in plain JAX / Flax comes as pieces: parameters, an optax state, maybe a model state,
and a step. `loaded_leaves` checks each piece leaf by leaf against the state the trainer would build
itself, and `place_like` puts each leaf onto that state's layout with
`jaxdist.replicate.layouts.put`, so a loaded state is laid out exactly as a built or restored one.

Leaves are matched by their names, not by the containers holding them: a dict key, an attribute name
and a sequence index all read as one name (`jaxdist.replicate.layouts.path_name`), and Flax boxes
and nnx Variables are looked into. So an optax state orbax restored without a target (NamedTuples
as dicts, tuples as lists), an ``nnx.State`` and an ``nnx.Optimizer``'s ``opt_state`` fit as they
are, the nnx ones also with each Variable's value one level down, under ``value``.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from jaxdist.replicate.layouts import path_name, put
from jaxdist.strategies.layout import is_annotated, is_box, is_variable, unboxed
from jaxdist.training.step import TrainState, state_keys

__all__ = ["Pieces", "assemble", "checked_pieces", "count_mismatch", "loaded_leaves", "place_like",
           "step_counts"]

_SHOWN = 4  # differences named in one error
_VARIABLE_VALUE = ("value", "raw_value")  # the key of an nnx Variable's value saved without nnx


def _flat(tree: Any) -> list[tuple[tuple, Any]]:
    """``[(path, leaf)]`` of ``tree`` with Flax boxes and nnx Variables as leaves (None is none)."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_annotated)[0]


def _dtype(value: Any) -> Any:
    """The value's own dtype (not canonicalized: a float64 host array is float64)."""
    return value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype


def _describe(leaf: Any) -> str:
    value = unboxed(leaf)
    return (f"{tuple(np.shape(value))} {_dtype(value)}" if _is_value(value)
            else f"a {type(value).__name__}")


def _is_value(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic, jax.Array, jax.ShapeDtypeStruct))


def loaded_leaves(given: Any, like: Any, argument: str) -> list[Any]:
    """The leaves of ``given`` in the order of ``like``'s (boxes and Variables unboxed), checked.

    Args:
        given: what the caller passed (a pytree of host or device arrays).
        like: the structure, shapes and dtypes it must have (arrays or `jax.ShapeDtypeStruct`s).
        argument: the argument's name, which starts every path in the errors (``"params"``).

    Returns:
        One value per leaf of ``like`` (flattened with boxes and Variables as leaves), in its order.

    Raises:
        ValueError: for a leaf of ``like`` that ``given`` lacks, a leaf of ``given`` that ``like``
            lacks, a shape or dtype that differs, or a leaf that is not an array; the message names
            each such leaf (the first few) by its path under ``argument``.

    Examples:
        >>> import numpy as np, jax
        >>> S = jax.ShapeDtypeStruct
        >>> like = (S((2,), np.float32), {"b": S((), np.int32)})
        >>> given = [np.ones(2, np.float32), {"b": np.int32(3)}]
        >>> [a.tolist() for a in loaded_leaves(given, like, "x")]
        [[1.0, 1.0], 3]
        >>> try:
        ...     loaded_leaves([np.ones(3, np.float32), {}], like, "opt_state")
        ... except ValueError as error:
        ...     print(str(error).split(":")[0])
        opt_state does not fit this trainer's model and optimizer
    """
    wanted = [(path_name(path), path, leaf) for path, leaf in _flat(like)]
    have: dict[str, tuple[tuple, Any]] = {}
    for path, leaf in _flat(given):
        name = path_name(path)
        if name in have:
            raise ValueError(
                f"{argument} holds two leaves named {name!r} "
                f"({jax.tree_util.keystr(have[name][0])} and {jax.tree_util.keystr(path)}): leaves "
                "are matched by name, so each name must be given once; pass one of them.")
        have[name] = (path, leaf)
    names = {name for name, _, _ in wanted}
    for name in [n for n in have if n not in names and n.rsplit("/", 1)[-1] in _VARIABLE_VALUE]:
        # an nnx Variable as orbax saves it: its value one level down
        if name.rsplit("/", 1)[0] in names:
            have.setdefault(name.rsplit("/", 1)[0], have.pop(name))
    problems, out = [], []
    for name, path, want in wanted:
        found = have.pop(name, None)
        where = argument + jax.tree_util.keystr(path)
        if found is None:
            problems.append(f"{where} ({_describe(want)}) is missing")
            continue
        value = unboxed(found[1])
        kind = (np.integer if isinstance(value, int) else np.floating if isinstance(value, float)
                else None)
        if kind is not None and not isinstance(value, bool) and np.shape(unboxed(want)) == () and \
                jax.dtypes.issubdtype(unboxed(want).dtype, kind):  # orbax restores ints so
            value = np.asarray(value, unboxed(want).dtype)
        if not _is_value(value):
            problems.append(f"{where} is {_describe(value)}, not an array")
        elif (np.shape(value), _dtype(value)) != (np.shape(unboxed(want)), _dtype(unboxed(want))):
            problems.append(f"{where} is {_describe(value)} where the trainer has "
                            f"{_describe(want)}")
        out.append(value)
    problems += [f"{argument}{jax.tree_util.keystr(path)} ({_describe(leaf)}) is extra: the "
                 "trainer has no such leaf" for path, leaf in have.values()]
    if problems:
        more = len(problems) - _SHOWN
        shown = "; ".join(problems[:_SHOWN]) + (f"; and {more} more" if more > 0 else "")
        fix = {
            "params": "pass the parameters of this Trainer's model (the model that trained them)",
            "opt_state": "pass the state of the optimizer the Trainer was given (the same optax "
                         "transformation, so that its schedule continues), or leave opt_state out "
                         "to start a fresh one",
            "model_state": "pass the model's other variables (linen: the collections besides "
                           "'params'; nnx: every variable that is not an nnx.Param), or leave "
                           "model_state out",
        }.get(argument, "pass values of the trainer's structure")
        raise ValueError(f"{argument} does not fit this trainer's model and optimizer: {shown}. "
                         f"Fix: {fix}.")
    return out


def place_like(values: list[Any], like: Any) -> Any:
    """``values`` (one per leaf of ``like``, from `loaded_leaves`) placed on ``like``'s shardings
    and assembled in its structure (boxes and Variables as in ``like``).

    Each value is copied (donating the state never deletes the caller's arrays). Host values must
    be the same on every process; a global `jax.Array` is resharded on the devices.

    Examples:
        >>> import jax, numpy as np, jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> like = strategy.mirror({"w": np.zeros(2, np.float32)})
        >>> place_like([np.ones(2, np.float32)], like)["w"].sharding == like["w"].sharding
        True
    """
    flat, treedef = jax.tree_util.tree_flatten(like, is_leaf=is_annotated)
    placed = []
    for value, want in zip(values, flat, strict=True):
        array = put(value, unboxed(want).sharding, copy=True)
        if is_box(want):
            array = want.replace_boxed(array)
        elif is_variable(want):
            array = want.replace(array)
        placed.append(array)
    return jax.tree_util.tree_unflatten(treedef, placed)


def step_counts(opt_state: Any) -> dict[str, int]:
    """``{path: value}`` of the step counts an optax state holds (its integer scalar leaves named
    ``count``), read from the devices (one scalar each).

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> step_counts(optax.adam(1e-3).init({"w": jnp.zeros(2)}))
        {'[0].count': 0}
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        last = path[-1] if path else None
        name = getattr(last, "name", getattr(last, "key", None))
        value = unboxed(leaf)
        if (name == "count" and np.ndim(value) == 0
                and jax.dtypes.issubdtype(_dtype(value), np.integer)):
            shard = value.addressable_data(0) if isinstance(value, jax.Array) else value
            out[jax.tree_util.keystr(path)] = int(np.asarray(shard))
    return out


def count_mismatch(counts: dict[str, int], step: int, fresh: bool) -> None:
    """Warn when an optimizer state's step counts (`step_counts`) disagree with the trainer's
    ``step``: a schedule reads the one, the RNG and checkpoints the other, so the run would differ
    from the one being continued.

    Args:
        counts: the loaded optimizer state's counts.
        step: the trainer's step after the load.
        fresh: the optimizer state is a fresh one (``load_state`` got no ``opt_state``).

    Warns:
        UserWarning: naming the counts, the step and what to pass.

    Examples:
        >>> count_mismatch({"[0].count": 20}, 20, fresh=False)  # they agree: silent
    """
    differ = {path: n for path, n in counts.items() if n != step}
    if not differ:
        return
    shown = ", ".join(f"opt_state{path} = {n}" for path, n in list(differ.items())[:_SHOWN])
    if fresh:
        why = (f"the optimizer state is a fresh one ({shown}: no opt_state was given) while the "
               f"step is {step}: its schedule and moments start over; pass the run's opt_state to "
               "continue them")
    else:
        why = (f"the optimizer state counts {shown} while the trainer's step is {step}: the "
               "learning-rate schedule follows the optimizer's count, the RNG, checkpoints and "
               f"fit's totals the step; pass step={next(iter(differ.values()))} if the run took "
               "that many steps")
    warnings.warn(f"load_state: {why}.", UserWarning, stacklevel=4)  # load_state's caller


class Pieces(NamedTuple):
    """What ``load_state`` was given, checked: each piece's values in the order of the trainer's
    leaves (None: not given)."""

    params: list
    opt_state: list | None
    model_state: list | None


def checked_pieces(like: TrainState, params: Any, opt_state: Any, model_state: Any) -> Pieces:
    """`loaded_leaves` of each piece given (None: not given) against the trainer's state ``like``.

    Raises:
        ValueError: as `loaded_leaves`, for the first piece that does not fit.

    Examples:
        >>> import jax, numpy as np
        >>> like = TrainState(*jax.eval_shape(lambda: (0, {"w": np.zeros(2, np.float32)}, (), {},
        ...                                            0)))
        >>> checked_pieces(like, {"w": np.ones(2, np.float32)}, None, None).params
        [array([1., 1.], dtype=float32)]
    """
    return Pieces(loaded_leaves(params, like.params, "params"),
                  None if opt_state is None else _optimizer_leaves(opt_state, like.opt_state),
                  None if model_state is None
                  else loaded_leaves(model_state, like.model_state, "model_state"))


def _optimizer_leaves(given: Any, like: Any) -> list:
    """`loaded_leaves` of an optimizer state. With ``clip_grad_norm`` the state is
    ``(EmptyState(), the optimizer's)``: the optimizer's own state (a run without the trainer's
    clipping) fits it too, as the clip holds no leaves."""
    if not (isinstance(like, tuple) and len(like) == 2 and not jax.tree.leaves(like[0])):
        return loaded_leaves(given, like, "opt_state")
    try:
        return loaded_leaves(given, like, "opt_state")
    except ValueError as whole:  # named as the optimizer's own state: the tree a user's run has
        try:
            return loaded_leaves(given, like[1], "opt_state")  # the same leaves, in the same order
        except ValueError:
            # Fits neither: the error against whichever tree the user passed names what differs
            if (len(jax.tree.leaves(given)) == len(jax.tree.leaves(like))
                    and isinstance(given, tuple) and len(given) == 2):
                raise whole from None
            raise


def assemble(like: TrainState, pieces: Pieces, base: TrainState | None,
             optimizer: optax.GradientTransformation, seed: int, step: int) -> TrainState:
    """The `TrainState` at ``step`` made of ``pieces``, each placed in ``like``'s layout.

    What was not given comes from ``base`` (the trainer's state, if any): its model state and base
    key; else the base key a trainer seeded with ``seed`` builds. A missing optimizer state is
    ``optimizer.init`` of the placed parameters, computed where it lives. Warns (`count_mismatch`)
    when the optimizer's step counts and ``step`` differ.

    Examples:
        >>> import jax, numpy as np, optax, jaxdist as jd
        >>> tx, params = optax.sgd(0.1), {"w": np.zeros(2, np.float32)}
        >>> like = jd.OneDeviceStrategy().mirror(
        ...     TrainState(np.int32(0), params, tx.init(params), {}, np.zeros(2, np.uint32)))
        >>> state = assemble(like, Pieces([np.ones(2, np.float32)], None, None), None, tx, 0, 5)
        >>> int(state.step), state.params["w"].tolist()
        (5, [1.0, 1.0])
    """
    params = place_like(pieces.params, like.params)
    if pieces.opt_state is not None:
        opt_state = place_like(pieces.opt_state, like.opt_state)
    else:
        # from the placed (possibly split) parameters: never whole on every device
        layouts = jax.tree.map(lambda a: a.sharding, like.opt_state)
        opt_state = jax.jit(optimizer.init, out_shardings=layouts)(params)
    if pieces.model_state is not None or base is None:
        model_state = place_like(pieces.model_state or [], like.model_state)
    else:
        model_state = base.model_state
    rng = base.rng if base is not None else put(state_keys(jax.random.key(seed))[1],
                                                like.rng.sharding)
    count_mismatch(step_counts(opt_state), step, fresh=pieces.opt_state is None)
    return TrainState(put(np.int32(step), like.step.sharding), params, opt_state, model_state, rng)
