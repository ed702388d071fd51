"""Placement: the one rule for which values a step takes as they are and where the others go.

`kept` decides a leaf (an array on the strategy's mesh, a tracer, a Python value that is no batch);
the rest are placed: a batch leaf split on axis 0 over the batch axes (`place_batch`, built with
`jax.make_array_from_process_local_data`, so no process transfers rows it does not own), a variable
in the variable layout (`argument_layouts`). Calls (`jaxdist.strategies.compile`), plans, on-device
loops and distributed input (`jaxdist.strategies.input._dataset`) all ask here.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from jaxdist.replicate.layouts import on_mesh, put
from jaxdist.strategies.layout import LayoutPolicy, mark_placed_batch, nnx_layouts


def check_divisible(batch: int, replicas: int, where: str = "global batch",
                    axes: tuple[str, ...] = ()) -> int:
    """``replicas``, after checking that it divides ``batch`` rows (``axes``: for the message).

    Raises:
        ValueError: naming the counts, the batch axes and the two nearest batch sizes that work.

    Examples:
        >>> check_divisible(64, 8)
        8
        >>> check_divisible(5, 8)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: num_replicas_in_sync=8 does not divide global batch 5: each replica needs at ...
    """
    if batch % replicas:
        up = -(-batch // replicas) * replicas
        down = batch // replicas * replicas
        over = f" (the product of batch_axes={axes})" if len(axes) > 1 else ""
        fix = (f"drop the remainder (batch {down}) or pad to {up}" if down else
               f"each replica needs at least one row: give at least {replicas} rows (a multiple of "
               f"{replicas}), or a strategy with fewer replicas (jd.OneDeviceStrategy(), or "
               "devices= / batch_axes= naming fewer)")
        raise ValueError(f"num_replicas_in_sync={replicas}{over} does not divide {where} "
                         f"{batch}: {fix}.")
    return replicas


def text_kind(x: Any) -> str | None:
    """What ``x`` is when it is text or objects, which no JAX array holds (``"str"``, ``"numpy dtype
    <U1"``), or None for anything else.

    Examples:
        >>> import numpy as np
        >>> import jax.numpy as jnp
        >>> (text_kind(np.array(["a"])), text_kind(np.zeros(2)), text_kind("a"),
        ...  text_kind(np.ones(2, jnp.bfloat16)))
        ('numpy dtype <U1', None, 'str', None)
    """
    if isinstance(x, (str, bytes)):
        return type(x).__name__
    # str, bytes, object, raw void (bfloat16 and float8 are "void" kinds with types of their own)
    if isinstance(x, (np.ndarray, np.generic)) and (x.dtype.kind in "USO"
                                                    or x.dtype.type is np.void):
        return f"numpy dtype {x.dtype}"
    return None


def refuse_text(leaves: Iterable[tuple[Any, Any]], name: Callable[[Any], str], fix: str) -> None:
    """A `TypeError` for the first of ``leaves`` (``(path, leaf)`` pairs) that holds text or objects
    (`text_kind`), which no JAX array holds: ``name(path)`` names the leaf, ``fix`` says what to do
    instead.

    Examples:
        >>> import numpy as np
        >>> refuse_text([("x", np.zeros(2)), ("y", np.array(["a"]))], str,
        ...             "Encode it.")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: y holds text or objects (numpy dtype <U1): JAX arrays hold numbers and bools ...
    """
    for path, x in leaves:
        dtype = text_kind(x)
        if dtype is not None:
            raise TypeError(f"{name(path)} holds text or objects ({dtype}): JAX arrays hold "
                            f"numbers and bools only. {fix}")


def check_batch_leaves(batch: Any, replicas: int, where: str | None = None) -> None:
    """Name the plain mistakes in a batch before JAX or the row split meets them: a leaf of text or
    objects; leaves whose rows differ where the replicas cannot split them (a ragged batch, whose
    fix is not a divisible row count).

    Args:
        batch: the batch (a pytree; its host or device arrays).
        replicas: the replicas that split its rows.
        where: how the message names the batch (default ``"the batch"``).

    Raises:
        TypeError: for a leaf of strings, bytes or objects, naming it and the fix.
        ValueError: for leaves with different rows that the replicas do not all divide, naming them.

    Examples:
        >>> import numpy as np
        >>> check_batch_leaves({"x": np.zeros((64, 4)), "y": np.zeros(64)}, 8)
        >>> check_batch_leaves((np.zeros((64, 4)), np.zeros(60)), 8)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: the batch is ragged: its leaves have different rows ([0]: 64, [1]: 60), ...
    """
    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    name = where or "the batch"
    refuse_text(flat,
                lambda path: f"{name} leaf {jax.tree_util.keystr(path) or '(the batch itself)'}",
                "Encode it before the batch (e.g. token ids or a vocabulary lookup as int32), or "
                "keep it out of the batch (a separate, non-batch argument).")
    rows = {jax.tree_util.keystr(path): np.shape(x)[0] for path, x in flat if np.ndim(x)}
    if len(set(rows.values())) > 1 and any(r % replicas for r in rows.values()):
        shown = ", ".join(f"{path}: {r}" for path, r in rows.items())
        raise ValueError(
            f"{name} is ragged: its leaves have different rows ({shown}), and axis 0 of every leaf "
            f"is the batch the {replicas} replicas split. Give every leaf the same rows (one per "
            "example; a last short batch: drop it or pad every leaf to "
            f"{-(-max(rows.values()) // replicas) * replicas}), or move an array that is not per "
            "example out of the batch.")


def check_sequence(policy: LayoutPolicy, shape: tuple[int, ...], where: str | None = None) -> None:
    """Check that ``policy``'s context axes divide the sequence dimension of a leaf of ``shape``.

    Raises:
        ValueError: naming the sequence length, the context axes and their sizes, and the fix.

    Examples:
        >>> import jax, jaxdist as jd
        >>> cp = jd.strategies.LayoutPolicy(mesh=jax.make_mesh((2, 4), ("data", "context")),
        ...                                 batch_axes="data", context_axes="context")
        >>> check_sequence(cp, (2, 10))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: sequence length 10 (axis 1 of the global batch) is not divisible by the ...
    """
    n, axis = policy.context_size, policy.sequence_axis
    if n == 1 or len(shape) <= axis or shape[axis] % n == 0 or shape[axis] == 1:
        return
    sizes = {a: policy.mesh.shape[a] for a in policy.context_axes}
    raise ValueError(
        f"sequence length {shape[axis]} (axis {axis} of {where or 'the global batch'}) is not "
        f"divisible by the context axes {policy.context_axes} of sizes {sizes} ({n} parts): pad "
        f"the sequence to {-(-shape[axis] // n) * n} (a multiple of {n}), or pick a context_axes / "
        f"context_parallelism that divides {shape[axis]}."
    )


def replicas_on_this_process(policy: LayoutPolicy) -> int:
    """How many of ``policy``'s replicas this process's devices hold."""
    return len(policy.local_replicas)


def place_batch(policy: LayoutPolicy, batch: Any, *, process_local: bool = False,
                where: str | None = None) -> Any:
    """Place one batch (a pytree of arrays) split on axis 0 over ``policy``'s replicas (with context
    axes, its sequence dimension over them too: `LayoutPolicy.batch_layout`).

    Args:
        policy: the layout policy whose replicas get the rows.
        batch: the global batch, or with ``process_local=True`` this process's rows only.
        process_local: whether ``batch`` holds only this process's rows.
        where: how errors name the batch (e.g. ``"argument 1 (in batch_argnums)"``).

    Returns:
        The batch as global `jax.Array`s laid out with ``policy``'s batch sharding.

    Raises:
        ValueError: for a scalar leaf, a batch the replicas do not divide evenly, or a sequence the
            context axes do not divide.
    """
    n_proc = jax.process_count()
    if process_local and n_proc > 1 and policy.replicas_span_processes:
        raise ValueError("per-process input (distribute_datasets_from_function) on a mesh whose "
                         f"replicas span processes (mesh {dict(policy.mesh.shape)}, batch axes "
                         f"{policy.batch_axes}: a model axis crosses processes), so no process "
                         "owns a replica's rows alone: pass GLOBAL batches "
                         "(experimental_distribute_dataset, the same batch on every process), or "
                         "put the processes on a batch axis of the mesh.")
    leaves, treedef = jax.tree.flatten(batch)
    if any(np.ndim(x) and np.shape(x)[0] == 0 for x in leaves):  # a mean over it is NaN, silently
        raise ValueError(
            f"{where or 'the batch'} has 0 rows (an empty batch, shapes "
            f"{[np.shape(x) for x in leaves]}): a mean over it is NaN. Skip empty batches before "
            "the step (or pad them and weight the padding out).")
    layouts = _batch_layouts(policy, batch, leaves, treedef, where, process_local)
    todo = [i for i, layout in enumerate(layouts) if layout is not None]
    if todo:
        if n_proc == 1:
            moved = _place_rows([layouts[i] for i in todo], [leaves[i] for i in todo])
        else:
            moved = [_place_process_rows(layouts[i], leaves[i], process_local, n_proc)
                     for i in todo]
        for i, m in zip(todo, moved, strict=True):
            leaves[i] = m
    for leaf in leaves:  # the role these arrays carry (where the layout alone cannot say: FSDP)
        mark_placed_batch(leaf)
    return jax.tree.unflatten(treedef, leaves)


# policy -> {signature: layouts}
_HOST_BATCH_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _batch_layouts(policy: LayoutPolicy, batch: Any, leaves: list[Any], treedef: Any,
                   where: str | None, process_local: bool) -> list[Any]:
    """`argument_layouts` of a batch, as a list over its leaves. A batch of host arrays (a training
    loop's, every step) is laid out by its structure and shapes alone: decided once per signature
    (its checks made then), not leaf by leaf at every step."""
    replicas = replicas_on_this_process(policy) if process_local else policy.num_replicas
    if not all(type(x) is np.ndarray for x in leaves):
        check_batch_leaves(batch, replicas, where)
        return treedef.flatten_up_to(argument_layouts(policy, batch, True, where,
                                                      process_local=process_local))
    key = (treedef, tuple((x.shape, x.dtype) for x in leaves), process_local)
    known = _HOST_BATCH_LAYOUTS.setdefault(policy, {})
    layouts = known.get(key)
    if layouts is None:
        check_batch_leaves(batch, replicas, where)  # once per signature, as the layouts
        layouts = treedef.flatten_up_to(argument_layouts(policy, batch, True, where,
                                                         process_local=process_local))
        if len(known) >= 64:  # bounded: a few signatures per run (a last partial batch, evaluation)
            known.pop(next(iter(known)))
        known[key] = layouts
    return layouts


def sharding_off(sharding: Any, mesh: Any) -> bool:
    """Whether an array with ``sharding`` must be moved to be on ``mesh``: not on it (`on_mesh`),
    except one not laid out over any mesh (a single device's) on exactly the mesh's devices, which
    jax.jit takes as is. An array on another mesh over the same devices (say the user's, with
    Explicit axes) is moved: one program does not mix meshes."""
    if on_mesh(sharding, mesh):
        return False
    own = getattr(sharding, "mesh", None)
    return (own is not None and not own.empty) or sharding.device_set != set(mesh.devices.flat)


def kept(policy: LayoutPolicy, x: Any, batch: bool) -> bool:
    """Whether a step takes argument leaf ``x`` as it is (the one rule of calls, plans, on-device
    loops and distributed input): an array (or a `jax.ShapeDtypeStruct` with a sharding) on the
    strategy's mesh, except a batch leaf every replica holds whole (its rows are what the replicas
    share out); a Python value that is no batch leaf; a tracer (the step called inside another's
    trace). Anything else is placed: a batch leaf split over the replicas (a scalar one is an
    error), a variable in the variable layout.

    Examples:
        >>> import jax, numpy as np, jaxdist as jd
        >>> policy = jd.strategies.LayoutPolicy(jax.devices()[:1])
        >>> kept(policy, 0.1, batch=False), kept(policy, np.ones(2), batch=False)
        (True, False)
    """
    # a step called inside another's trace: its values pass through
    if isinstance(x, jax.core.Tracer):
        return True
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = x.sharding
        if sharding is None or sharding_off(sharding, policy.mesh):
            return False
        return not (batch and policy.num_replicas > 1 and np.ndim(x) >= 1
                    and sharding.is_fully_replicated)
    return not batch and not isinstance(x, (np.ndarray, np.generic))


def shardings_of(leaves: list[Any]) -> set[Any]:
    """The distinct shardings of ``leaves`` (None for a value without one). A `jax.Array`'s is read
    in C (``_sharding``, the attribute behind its ``sharding`` property); where some leaf has none
    (Python and host values, tracers, another array type) they are read again through
    ``sharding``."""
    found = set(map(getattr, leaves, itertools.repeat("_sharding"), itertools.repeat(None)))
    if None in found:
        found = set(map(getattr, leaves, itertools.repeat("sharding"), itertools.repeat(None)))
    return found


def all_on_mesh(leaves: list[Any], mesh: Any, shardings: set[Any] | None = None) -> bool:
    """Whether every array among ``leaves`` is a `jax.Array` on ``mesh`` (Python scalars and other
    non-arrays count as placed): decided on their distinct shardings (``shardings``, when read
    already), not leaf by leaf."""
    shardings = shardings_of(leaves) if shardings is None else shardings
    if None in shardings and any(isinstance(x, (np.ndarray, np.generic)) for x in leaves):
        return False
    return all(s is None or not sharding_off(s, mesh) for s in shardings)


def needs_placing(a: Any, policy: LayoutPolicy, batch: bool) -> bool:
    """Whether argument ``a`` holds a leaf a call places (`kept`)."""
    mesh = policy.mesh
    for x in jax.tree.leaves(a):
        if not batch and getattr(getattr(x, "sharding", None), "mesh", None) is mesh:
            continue  # the common case, checked without a call
        if not kept(policy, x, batch):
            return True
    return False


def argument_layouts(policy: LayoutPolicy, value: Any, batch: bool, where: str | None = None, *,
                     process_local: bool = False) -> Any:
    """The layout a step's call gives each leaf of argument ``value`` (a pytree; ``batch``: a
    declared batch), None for a leaf it takes as it is (`kept`): what a call places and what a plan
    describes, by one rule.

    Raises:
        ValueError: for a batch leaf that is a scalar, or whose rows the replicas (or sequence the
            context axes) do not divide.

    Examples:
        >>> import jax, numpy as np, jaxdist as jd
        >>> policy = jd.strategies.LayoutPolicy(jax.devices()[:1])
        >>> argument_layouts(policy, {"x": np.ones((4, 2)), "lr": 0.1},
        ...                  batch=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: batch leaf ['lr'] is a scalar: every leaf of a batch needs a batch axis 0 ...
    """
    if batch:
        def one(path, x):
            if kept(policy, x, True):
                return None
            leaf = f"{where or 'batch'} leaf {jax.tree_util.keystr(path) or '<root>'}"
            return batch_leaf_layout(policy, np.shape(x), leaf, where, process_local=process_local)

        return jax.tree_util.tree_map_with_path(one, value)
    leaves = jax.tree.leaves(value)
    if all(kept(policy, x, False) for x in leaves):
        return jax.tree.map(lambda _: None, value)
    shapes = jax.tree.map(lambda x: x if kept(policy, x, False) else jax.ShapeDtypeStruct(
        np.shape(x), jax.dtypes.result_type(x)), value)
    layouts = policy.variable_shardings(shapes)
    return jax.tree.map(lambda x, layout: None if kept(policy, x, False) else layout, value,
                        layouts)


def batch_leaf_layout(policy: LayoutPolicy, shape: tuple[int, ...], leaf: str,
                      where: str | None = None, *,
                      process_local: bool = False) -> jax.sharding.Sharding:
    """The layout a batch leaf of ``shape`` is placed in (`LayoutPolicy.batch_layout`), after the
    checks every placement makes (calls and plans alike).

    Args:
        policy: the layout policy.
        shape: the leaf's (global, or with ``process_local`` this process's) shape.
        leaf: how errors name the leaf (``"argument 1 (in batch_argnums) leaf ['x']"``).
        where: how errors name the batch.
        process_local: whether ``shape`` holds only this process's rows.

    Raises:
        ValueError: for a scalar leaf, rows the replicas do not divide, or a sequence the context
            axes do not.
    """
    if not shape:
        raise ValueError(f"{leaf} is a scalar: every leaf of a batch needs a batch axis 0 to split "
                         "over the replicas (pass scalars as separate, non-batch arguments).")
    if process_local:
        check_divisible(shape[0], replicas_on_this_process(policy), "per-process batch"
                        if where is None else f"the per-process rows of {where}", policy.batch_axes)
    else:
        check_divisible(shape[0], policy.num_replicas, "global batch" if where is None
                        else f"the rows of {where}", policy.batch_axes)
    check_sequence(policy, shape, where)
    return policy.batch_layout(len(shape), shape)


def _place_rows(shardings: list[Any], values: list[Any]) -> list[jax.Array]:
    """One process holds the whole global batch: on accelerators one `jax.device_put` of every leaf
    (one batched transfer); on CPU devices each device's rows are views of the host array (cheaper
    there than a copy per leaf)."""
    if not shardings or any(d.platform != "cpu" for d in shardings[0].device_set):
        return jax.device_put(values, shardings)
    moved = []
    for sharding, x in zip(shardings, values, strict=True):
        if isinstance(x, jax.Array):
            moved.append(jax.device_put(x, sharding))
        else:
            host = np.asarray(x)
            moved.append(jax.make_array_from_callback(host.shape, sharding,
                                                      lambda index, host=host: host[index]))
    return moved


def _place_process_rows(sharding, x: Any, process_local: bool, n_proc: int) -> jax.Array:
    """Several processes: each transfers only the rows its own devices hold."""
    shape = np.shape(x)
    if process_local:
        return jax.make_array_from_process_local_data(sharding, np.asarray(x),
                                                      (shape[0] * n_proc, *shape[1:]))
    # the global batch: each process transfers the rows of its own devices, wherever they are
    host = x if isinstance(x, jax.Array) else np.asarray(x)
    return jax.make_array_from_callback(shape, sharding, lambda index: np.asarray(host[index]))


def place_nnx_defaults(policy: LayoutPolicy, state: Any) -> Any:
    """nnx state Flax put on the ambient mesh whole by default (no partitioning annotation) takes
    the strategy's variable layout; annotated variables keep the layout their annotation gives
    them."""
    values = jax.tree.leaves(state)
    if not any(isinstance(x, jax.Array) and np.ndim(x) and x.sharding.is_fully_replicated
               for x in values):
        return state
    layouts, annotated = nnx_layouts(policy, state)
    moved = [
        put(x, layout) if (not a and isinstance(x, jax.Array) and layout is not None
                           and x.sharding != layout) else x
        for x, layout, a in zip(values, layouts, annotated, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(state), moved)
