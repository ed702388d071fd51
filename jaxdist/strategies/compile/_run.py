"""The per-replica view: how `Strategy.run` turns a replica function into a `jax.shard_map` program.

Each argument leaf is classified once per call signature, by declaration or by what the value
carries (`jaxdist.strategies.layout.classify`):

* with ``batch_argnums``: the declared arguments are batches (each replica sees its own rows; host
  arrays are split over the replicas), every other array is mirrored;
* without: an array whose layout makes it a batch (axis 0 split over the replicas, e.g. from a
  distributed dataset) is a batch; inside a ``strategy.jit`` step the step's own batch / variable
  arguments keep their role, and a value computed in the step (rank >= 1) is refused with an error
  that names ``batch_argnums``; any other array is mirrored (tf.distribute's rule);
* `PerReplica` / `SyncOnRead`: each replica sees its own component;
* Python scalars and non-array leaves are compile-time constants (a new value recompiles).

Mirrored values enter the replica function cast to *varying* over the replica axis
(`jax.lax.pcast`), so each replica owns its copy and ``jax.grad`` gives LOCAL gradients, as in
tf.distribute (left invariant, shard_map's ``grad`` would sum them over replicas); the all-reduce is
explicit: ``ctx.all_reduce(MEAN, grads)``.

An output proven the same on every replica (`jaxdist.strategies.compile._identical`: an all-reduce
result, a constant, a parameter updated with all-reduced gradients) comes back mirrored, whatever
JAX's varying types say of it; everything else comes back as `PerReplica`, a `SyncOnRead` as one.
The first call of each program checks on device that every output it returns mirrored is the same
on every replica (`jaxdist.strategies.compile._mirror_check`), and an output computed element-wise
from a mirrored argument that is not proven the same is refused. pmap-era code that names its axis
(``axis_name=``) runs with JAX's varying-type check off, as ``jax.pmap`` runs it; so does, by
default, code that only that check refuses (see `_vma`). To know which is which, the function is
traced once abstractly before the real program is built, and that trace also turns a collective
over an axis name the program does not bind into a ``ValueError`` naming the fix
(`_unbound_axis_error`). Programs live in the strategy's `ProgramCache` (weak on ``fn``); a later
call with the structure, types, avals and layouts of one the full path ran goes straight to its
program (`ReplicaRunner._fast_key`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.replicate.collectives import AxisName, axis_names, is_varying, to_varying
from jaxdist.replicate.layouts import is_on_mesh, put
from jaxdist.replicate.trees import fn_name, hashable, is_distributed, is_module, placed_leaves
from jaxdist.replicate.values import (
    CapturedSyncOnRead,
    PerReplica,
    SyncOnRead,
    assigned,
    in_replica,
    local_view,
    noticing_captures,
    store_components,
)
from jaxdist.strategies import ambient
from jaxdist.strategies.compile._agreement import agree, fingerprint
from jaxdist.strategies.compile._cache import ProgramCache
from jaxdist.strategies.compile._identical import (
    DECLARED,
    IDENTICAL,
    check_mirrored_outputs,
    program_values,
    updated_inputs,
)
from jaxdist.strategies.compile._mirror_check import agreement, raise_on_disagreement
from jaxdist.strategies.compile._vma import first_trace
from jaxdist.strategies.input import (
    PADDED,
    check_batch_leaves,
    holds_padded,
    padding_weights,
    place_batch,
)
from jaxdist.strategies.layout import (
    LayoutPolicy,
    Role,
    classify,
    explicit_axes,
    in_trace,
    trace_mesh,
)
from jaxdist.strategies.replica_context import ReplicaContext

__all__ = ["ReplicaRunner", "check_axis_name"]


def check_axis_name(policy: LayoutPolicy, axis_name: Any) -> AxisName:
    """``axis_name`` validated as the name to bind the replica axis to inside ``run``.

    On a mesh whose batch is split over several axes (``("data", "fsdp")``), the replica axis is
    their tuple, which JAX collectives take as it is; it cannot be renamed to one name.

    Raises:
        ValueError: for a name that is not a non-empty string, that names another axis of the mesh,
            or that would rename several batch axes.

    Examples:
        >>> import jax
        >>> check_axis_name(LayoutPolicy(jax.devices()[:2]), "batch")
        'batch'
    """
    if axis_name is None or axis_name == policy.replica_axis:
        return policy.replica_axis
    if len(policy.batch_axes) > 1:
        raise ValueError(f"axis_name={axis_name!r}: this strategy's batch is split over the mesh "
                         f"axes {policy.batch_axes}, which replica functions name together: use "
                         "axis_name=strategy.axis_name (that tuple) in lax.pmean / psum / "
                         "BatchNorm(axis_name=...), or put the replicas on one mesh axis.")
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"axis_name={axis_name!r} must be a non-empty string: the name your "
                         "replica function uses for the data-parallel axis (pmap-era code: "
                         "axis_name='batch').")
    others = [a for a in policy.mesh.axis_names if a != policy.replica_axis]
    if axis_name in others:
        raise ValueError(f"axis_name={axis_name!r} is already the name of another axis of the mesh "
                         f"{tuple(policy.mesh.axis_names)}: pick a name the mesh does not use for "
                         "the replica axis.")
    return axis_name


class ReplicaRunner:
    """Compiles and caches the shard_map programs behind `Strategy.run` for one strategy.

    Args:
        policy: the strategy's layout policy.
        programs: the strategy's program cache.
        owner: the strategy (what `ReplicaContext.strategy` and the per-replica values it returns
            name).
    """

    def __init__(self, policy: LayoutPolicy, programs: ProgramCache, owner: Any):
        self._policy = policy
        self._programs = programs
        self._owner = owner
        self._warned = [False]

    def __call__(self, fn: Callable, args: tuple, kwargs: dict,
                 batch_argnums: tuple[int, ...] | None, axis_name: str,
                 check_vma: bool | None = None, check_mirrored: str = "first") -> Any:
        # The fast path (`_fast_key`): the roles the full path gave such a call follow from its
        # layouts and declaration alone, so every check it made holds again.
        fast = self._fast_key(args, kwargs, batch_argnums, axis_name, check_vma)
        if fast is not None:
            key, layouts, plain = fast
            for seen, program in self._programs.peek(fn, key) or ():
                # (the same aval and sharding objects, compared by identity first)
                if seen == layouts:
                    with self._policy.call_scope(plain):
                        return program(*plain, arguments=plain, every=check_mirrored == "every",
                                       tracing=False)[0]
        flat, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_distributed)
        frame = ambient.current_computation()
        if (frame is None or frame.policy is not self._policy) and any(
                isinstance(x, jax.core.Tracer) for x in flat):
            raise ValueError("strategy.run got traced arguments outside this strategy's compiled "
                             "computations (e.g. inside a plain jax.jit or jax.grad): there it "
                             "cannot tell distributed batches from mirrored values. Compile the "
                             "enclosing step with strategy.jit (or run_steps_on_dataset), or call "
                             "run eagerly.")
        # a declared batch's plain mistakes (text, ragged rows), named as such
        for i in batch_argnums or ():
            if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args[i])):
                check_batch_leaves(args[i], self._policy.num_replicas, f"args[{i}] of strategy.run")
        kinds = []
        for leaf in flat:
            if is_distributed(leaf) and leaf.owner is not None and leaf.owner is not self._owner:
                raise ValueError(f"strategy.run got a {type(leaf).__name__} of another strategy "
                                 f"({leaf.owner!r}) but runs on {self._owner!r}: per-replica "
                                 "values belong to the strategy that made them; reduce or gather "
                                 "it there first (strategy.reduce / strategy.gather), or run on "
                                 "that strategy.")
        for i, a in enumerate(args):
            for path, leaf in jax.tree_util.tree_flatten_with_path(a, is_leaf=is_distributed)[0]:
                declared = None if batch_argnums is None else i in batch_argnums
                where = f"args[{i}]{jax.tree_util.keystr(path)}"
                kinds.append(classify(self._policy, leaf, declared, where, "strategy.run",
                                      self._warned))
        for path, leaf in jax.tree_util.tree_flatten_with_path(kwargs, is_leaf=is_distributed)[0]:
            declared = None if batch_argnums is None else False
            where = f"kwargs{jax.tree_util.keystr(path)}"
            kinds.append(classify(self._policy, leaf, declared, where, "strategy.run",
                                  self._warned))
        kinds = tuple(kinds)
        # a padded batch's (remainder="pad") row weights enter after the arguments
        weights = next((w for x, k in zip(flat, kinds, strict=True) if k == Role.BATCH
                        for w in [padding_weights(x)] if w is not None), None)
        statics = tuple(x if k == Role.STATIC else None for x, k in zip(flat, kinds, strict=True))
        dynamic, aux = [], []
        for x, k in zip(flat, kinds, strict=True):
            if k == Role.STATIC:
                aux.append(None)
                continue
            if k in (Role.PER_REPLICA, Role.SYNC_ON_READ):
                aux.append(x.aggregation if k == Role.SYNC_ON_READ else None)
                x = x.stacked
            else:
                aux.append(None)
                if not isinstance(x, jax.core.Tracer):
                    if k == Role.VARIABLE:
                        x = self._place_mirrored(x)
                    elif not is_on_mesh(x, self._policy.mesh):
                        x = place_batch(self._policy, x,
                                        where="a batch_argnums argument of strategy.run")
            dynamic.append(x)
        if weights is not None:
            dynamic.append(weights)
        avals = tuple((np.shape(x), jax.dtypes.result_type(x)) for x in dynamic)
        # Inside a step whose Explicit axes run Auto (jaxdist.strategies.layout._axis_types) the
        # program is another one. Inside any compiled step too: there it may not store into the
        # sync-on-read values it captured.
        traced = any(isinstance(x, jax.core.Tracer) for x in dynamic)
        key = (treedef, kinds, hashable(statics), tuple(aux), avals, axis_name,
               explicit_axes(self._policy.mesh), weights is not None, check_vma, traced)
        aux = tuple(aux)
        name = fn_name(fn)
        with self._policy.call_scope(dynamic):  # built (probed) and called on the strategy's mesh
            program = self._programs.get(
                fn, key, lambda weak_fn: self._build(weak_fn, treedef, kinds, statics, aux, dynamic,
                                                     axis_name, name, weights is not None,
                                                     check_vma),
                reason=(hashable(statics), avals))
            out, updated = program(*dynamic, arguments=flat, every=check_mirrored == "every")
        # sync-on-read arguments updated in place: kept, as in tf.distribute
        for i, components in updated.items():
            store_components(flat[i], components)
        if (fast is not None and frame is None and not updated and weights is None
                and len(dynamic) == len(flat)
                and all(d is x for d, x in zip(dynamic, fast[2], strict=True))
                and not any(k in (Role.STATIC, Role.SYNC_ON_READ) for k in kinds)):
            # nothing placed, no statics, no sync-on-read values: such calls next take the fast path
            known = self._programs.peek(fn, fast[0])
            if known is None:
                self._programs.put(fn, fast[0], known := [])
            known.insert(0, (fast[1], program))
            del known[_FAST_SIGNATURES:]
        return out

    def _fast_key(self, args: tuple, kwargs: dict, batch_argnums: tuple[int, ...] | None,
                  axis_name: str, check_vma: bool | None) -> tuple[tuple, tuple, list] | None:
        """``(key, layouts, leaves)`` of a call the fast path may serve: its leaves (flattened
        through per-replica values), each leaf's type, aval and layout, and a key of the rest the
        full path's decision rests on (structure, declaration). None where it rests on more (a
        ``layout_role`` hook, which arrays the input functions placed where variables may split, a
        padded batch's weights, an enclosing computation). Layouts are compared, not hashed: JAX
        shares aval and sharding objects between a program's arrays, so a steady call's compare by
        identity."""
        policy = self._policy
        if (batch_argnums is None
            and not policy.roles_by_layout) or ambient.current_computation() is not None:
            return None
        leaves, treedef = jax.tree.flatten((args, kwargs))
        if PADDED and holds_padded(leaves):
            return None
        # (a jax.Array's ``_sharding``: the attribute behind its ``sharding`` property, read in C)
        try:
            layouts = tuple([(type(x), x.aval, x._sharding) for x in leaves])
        except AttributeError:
            # a leaf that is no placed array (a static, a tracer): the full path only
            return None
        return ("fast", treedef, batch_argnums, axis_name, check_vma), layouts, leaves

    def _place_mirrored(self, x: Any) -> Any:
        if isinstance(x, jax.Array) and getattr(x.sharding, "mesh", None) is self._policy.mesh:
            return x  # already on the mesh (replicated, or another layout the program will gather)
        return put(x, self._policy.replicated_sharding)

    def _build(self, fn, treedef, kinds, statics, aux, dynamic, axis_name, name, padded,
               check_vma=None) -> Callable:
        policy, owner = self._policy, self._owner
        # The replica axis under the caller's name (pmap-era code: "batch"): the same devices in the
        # same order, so arguments on the strategy's mesh enter without a copy.
        names = tuple(axis_name if a == policy.replica_axis else a for a in policy.mesh.axis_names)
        # inside a step whose Explicit axes run Auto: the mesh with them Auto
        typed = trace_mesh(policy.mesh)
        mesh = (typed if names == policy.mesh.axis_names
                else Mesh(typed.devices, names, axis_types=typed.axis_types))
        split = PartitionSpec(axis_name)
        dyn_kinds = [k for k in kinds if k != Role.STATIC] + [Role.BATCH] * padded
        in_specs = tuple(split if k != Role.VARIABLE else PartitionSpec() for k in dyn_kinds)
        out_info: dict[str, Any] = {}
        # sync-on-read values the function uses without getting them
        captured: list[SyncOnRead] = []
        n_dyn = len(dyn_kinds)
        # off: the program runs as jax.pmap runs it (_vma.py); outputs are proven either way
        vma = {"check": True}

        def body(*local, probe=False, agree_on=None):
            it = iter(local[:n_dyn])
            leaves, synced = [], []
            for k, static, agg in zip(kinds, statics, aux, strict=True):
                if k == Role.STATIC:
                    leaves.append(static)
                    continue
                x = next(it)
                if k == Role.VARIABLE:
                    # each replica owns its copy: local gradients (see module doc)
                    x = to_varying(x, axis_name)
                elif k == Role.PER_REPLICA:
                    x = x[0]
                elif k == Role.SYNC_ON_READ:
                    # its component in a jax.Ref: updates leave loops and jits
                    x = in_replica(x[0], agg, owner)
                    synced.append((len(leaves), x))
                leaves.append(x)
            call_args, call_kwargs = jax.tree.unflatten(treedef, leaves)
            ctx = ReplicaContext(owner, policy.num_replicas, axis_name,
                                 batch_weights=local[n_dyn - 1] if padded else None)
            with contextlib.ExitStack() as views:
                for value, component in zip(captured, local[n_dyn:], strict=True):
                    # this replica's, for the trace
                    views.enter_context(local_view(value, component[0]))
                if probe:
                    views.enter_context(noticing_captures())
                with ambient.computation(policy, "replica", axis_name=axis_name,
                                         typed=vma["check"]), \
                        ambient.replica(ctx):
                    out = fn(*call_args, **call_kwargs)
                kept = [to_varying(value.read(), axis_name)[None] for value in captured]
                # A sync-on-read argument or captured value returned (``return seen.assign_add()``):
                # read while its view is open, and given back as the very object (`_passed_back`).
                out, passed = _passed_back(out, synced, captured)
            # Sync-on-read arguments updated in place (``assign_add``): their new components leave
            # after the outputs and are stored back in the objects passed in (`__call__`).
            if probe:
                out_info["updated"] = tuple(i for i, obj in synced if assigned(obj))
            updated = [to_varying(obj.read(), axis_name)[None] for i, obj in synced
                       if i in out_info["updated"]]
            updated += kept
            out_leaves, out_tree = jax.tree.flatten(
                out, is_leaf=lambda v: isinstance(v, SyncOnRead))
            if probe:
                # Leaves that are not values (an Equinox module's functions and Python settings:
                # ``eqx.filter_jit``'s rule) leave as they are.
                out_info["statics"] = tuple(_VALUE if value else v for v, value in zip(
                    out_leaves, _values_of(out), strict=True))
            out_leaves = [v for v, static in zip(out_leaves, out_info["statics"], strict=True)
                          if static is _VALUE]
            values = [to_varying(jax.numpy.asarray(v.read()), axis_name)
                      if isinstance(v, SyncOnRead) else jax.numpy.asarray(v) for v in out_leaves]
            if probe:  # every output gets a replica axis so one out_spec fits all of them
                out_info.update(tree=out_tree, kinds=tuple(
                    ("sync", v.aggregation) if isinstance(v, SyncOnRead)
                    else ("per_replica" if not vma["check"] or is_varying(x, axis_name)
                          else "mirrored", None)
                    for v, x in zip(out_leaves, values, strict=True)
                ), passed=tuple(passed.get(id(v)) for v in out_leaves))
                return (*(x[None] for x in values), *updated)
            results = (*(x if how == "mirrored" else x[None]
                         for x, how in zip(values, out_info["how"], strict=True)), *updated)
            if agree_on is None:
                return results
            return (*results, agreement([values[i] for i in agree_on], axis_name))

        # Pass 1: trace abstractly to learn which outputs vary across replicas.
        # Manual over the replica axis only: a model axis (if any) stays with XLA's partitioner.
        manual = ({"axis_names": set(axis_names(axis_name))}
                  if mesh.axis_names != axis_names(axis_name) else {})
        traced = any(isinstance(x, jax.core.Tracer) for x in dynamic)
        explicit = bool(explicit_axes(policy.mesh))
        avals = [jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x),
                                      sharding=NamedSharding(mesh, spec) if explicit else None)
                 for x, spec in zip(dynamic, in_specs, strict=True)]

        def probe(check_vma: bool) -> None:
            vma["check"] = check_vma
            probe_fn = jax.shard_map(functools.partial(body, probe=True), mesh=mesh,
                                     in_specs=(*in_specs, *[split] * len(captured)),
                                     out_specs=split, check_vma=check_vma, **manual)
            hidden = [jax.ShapeDtypeStruct(v.stacked.shape, v.stacked.dtype,
                                           sharding=NamedSharding(mesh, split) if explicit
                                           else None)
                      for v in captured]
            with ambient.probe(), _eager_mesh(mesh, policy, traced), _context_mesh(mesh, policy):
                try:
                    out_info["jaxpr"] = jax.make_jaxpr(probe_fn)(*avals, *hidden)
                    return
                except CapturedSyncOnRead as found:  # pass it in, out of sight, and trace again
                    if traced or any(found.value is v for v in captured):
                        raise ValueError(_captured_message(name)) from None
                    captured.append(found.value)
            probe(check_vma)

        try:
            vma["check"] = first_trace(probe, check_vma, name)
            traced_jaxpr = out_info["jaxpr"]
        except (NameError, AssertionError, ValueError):
            unbound = _unbound_axis_error(probe)
            if unbound is None:
                raise
            raise ValueError(_unbound_message(name, axis_name, mesh)) from unbound
        # Which outputs are the same on every replica is proven from the program's values, never
        # taken from JAX's types alone (they fail open for a primitive they do not know). Varying by
        # type but proven the same (a mirrored value updated with all-reduced gradients): mirrored.
        # Taking a mirrored argument's place but not proven the same: refused.
        n_out = len(out_info["kinds"])  # then the updated sync-on-read components
        try:
            values = program_values(traced_jaxpr, {a: mesh.shape[a] for a in axis_names(axis_name)})
        except ValueError as stall:
            # a collective in a loop some replicas may leave early: named before it runs
            raise ValueError(f"strategy.run({name}): {stall}") from None
        out_tree = out_info["tree"]
        kinds_out = [(_refine(kind, value), agg)
                     for (kind, agg), value in zip(out_info["kinds"], values[:n_out], strict=True)]
        out_statics = out_info["statics"]
        out_paths = [p for p, static in zip(_leaf_paths(out_tree), out_statics, strict=True)
                     if static is _VALUE]
        check_mirrored_outputs(name, treedef, kinds, out_paths, [k for k, _ in kinds_out],
                               updated_inputs(traced_jaxpr)[:n_out])
        # How each output leaves the replica program: "mirrored" (one value: out_spec P()),
        # "stacked" (one copy per replica), or "identical": proven the same but varying by type,
        # where the type check is on: stacked, then each device's own copy taken as the replicated
        # value (`_own_copies`: nothing is sent).
        how = tuple("stacked" if kind not in ("mirrored", "identical")
                    else "mirrored" if kind == "mirrored" or not vma["check"] else "identical"
                    for kind, _ in kinds_out)
        out_info["how"] = how
        n_updated = len(out_info["updated"]) + len(captured)
        # what the first call checks on device
        checked = [i for i, h in enumerate(how) if h != "stacked"]
        out_specs = (*(PartitionSpec() if h == "mirrored" else split for h in how),
                     *[split] * n_updated)

        # Pass 2: the real program, with exact output layouts (on the strategy's own mesh); a second
        # one, for the first call (and every call with JAXDIST_CHECK_MIRRORED=every), also says on
        # device whether each output returned as mirrored is the same on every replica.
        in_specs = (*in_specs, *[split] * len(captured))
        out_shardings = tuple(in_trace(policy.batch_sharding if h == "stacked"
                                       else policy.replicated_sharding)
                              for h in (*how, *["stacked"] * n_updated))

        def build(check: bool) -> Callable:
            shard_mapped = jax.shard_map(
                functools.partial(body, agree_on=checked if check else None), mesh=mesh,
                in_specs=in_specs,
                out_specs=(*out_specs, PartitionSpec()) if check else out_specs,
                check_vma=vma["check"], **manual)

            def mapped(*dyn):
                # on Explicit axes an input's type must be its in_spec: mirrored values enter whole
                if explicit:
                    dyn = [jax.sharding.reshard(x, NamedSharding(mesh, spec))
                           for x, spec in zip(dyn, in_specs, strict=True)]
                # traced under the renamed mesh (also inside strategy.scope())
                with _context_mesh(mesh, policy):
                    results = shard_mapped(*dyn)
                return (*_own_copies(results[:n_out], how, mesh, split, manual), *results[n_out:])

            return jax.jit(mapped, out_shardings=(
                (*out_shardings, in_trace(policy.replicated_sharding)) if check else out_shardings))

        compiled = build(False)
        first = {"checked": None if checked else True, "compiled": build(True) if checked else None}
        # every process must run this same program (agreement.py)
        if policy.spans_processes and not traced:
            with _eager_mesh(mesh, policy, False):
                agree(f"strategy.run({name})",
                      fingerprint(compiled.lower(*dynamic, *(v.stacked for v in captured))))
        mirrored_paths = [out_paths[i] for i in checked]

        def program(*dyn, arguments=(), every=False, tracing=None):
            if tracing is None:
                tracing = any(isinstance(x, jax.core.Tracer) for x in dyn)
            # Inside a compiled step the check is a host callback, on request only (it would run at
            # every call); called eagerly, the first call and every call on request.
            verify = checked and (every or (first["checked"] is None and not tracing))
            with _eager_mesh(mesh, policy, tracing):
                results = (first["compiled"] if verify else compiled)(
                    *dyn, *(v.stacked for v in captured))
            if verify and tracing:
                *results, agreed = results
                jax.debug.callback(functools.partial(raise_on_disagreement, name, mirrored_paths),
                                   agreed)
            elif verify:
                *results, agreed = results
                raise_on_disagreement(name, mirrored_paths, agreed)
                # compiled now, so that the second call costs what every later one does
                if first["checked"] is None:
                    with _eager_mesh(mesh, policy, False):
                        compiled.lower(*dyn, *(v.stacked for v in captured)).compile()
                first["checked"] = True
            n_args = len(out_info["updated"])
            for value, components in zip(captured, results[n_out + n_args:], strict=True):
                # updated in place, as tf.distribute's metrics are
                store_components(value, components)
            wrapped = list(results[:n_out])
            for i, (kind, agg), passed in wrapping:
                if kind in ("per_replica", "declared"):
                    wrapped[i] = PerReplica(wrapped[i], owner)
                elif passed is not None:
                    # the object passed in (updated in place), as TF's assign_add returns it
                    wrapped[i] = (arguments[passed[1]] if passed[0] == "argument"
                                  else captured[passed[1]])
                else:
                    wrapped[i] = SyncOnRead(wrapped[i], agg, owner)
            updated = dict(zip(out_info["updated"], results[n_out:n_out + n_args],
                               strict=True)) if n_args else {}
            return out_tree.unflatten(
                wrapped if values_only else _with_statics(out_statics, wrapped)), updated

        # Per call, only the outputs that leave as other than the array itself are visited.
        wrapping = [(i, (kind, agg), passed) for i, ((kind, agg), passed)
                    in enumerate(zip(kinds_out, out_info["passed"], strict=True))
                    if kind in ("per_replica", "declared", "sync") or passed is not None]
        values_only = all(static is _VALUE for static in out_statics)

        return program


# fast-path signatures kept per function and call structure (most recent first)
_FAST_SIGNATURES = 8


# an output leaf that is a value (an array, a number, a sync-on-read value), not a static
_VALUE = object()


def _values_of(out: Any) -> list[bool]:
    """Per leaf of a replica function's output (a `SyncOnRead` one leaf): whether it leaves the
    program as a value, as `jaxdist.replicate.trees.placed_leaves` says (an Equinox module's Python
    settings do not)."""
    flags: list[bool] = []
    for node in jax.tree.leaves(out, is_leaf=lambda v: isinstance(v, SyncOnRead) or is_module(v)):
        flags += [True] if isinstance(node, SyncOnRead) else placed_leaves(node)
    return flags


def _with_statics(statics: tuple, values: Sequence[Any], fill: Any = _VALUE) -> list[Any]:
    """The output leaves in order: ``values`` where the outputs have values, the recorded statics
    elsewhere (or ``fill`` in their place, when given)."""
    it = iter(values)
    out = [next(it) if static is _VALUE else static if fill is _VALUE else fill
           for static in statics]
    assert next(it, None) is None
    return out


def _passed_back(out: Any, arguments: Sequence[tuple[int, SyncOnRead]],
                 captured: Sequence[SyncOnRead]) -> tuple[Any, dict]:
    """``out`` with each sync-on-read argument (``arguments``: their replica views) or captured
    value that it returns replaced by its component read now (its view closes when the replica
    function's trace ends), and ``{id(replacement): ("argument", i) | ("captured", j)}``: ``i`` the
    argument's flat index, ``j`` the captured value's, whose objects ``run`` then returns."""
    found: dict[int, tuple[str, int]] = {}
    where = ({id(v): ("argument", i) for i, v in arguments}
             | {id(v): ("captured", j) for j, v in enumerate(captured)})
    if not where:
        return out, found

    def back(v: Any) -> Any:
        if not isinstance(v, SyncOnRead) or id(v) not in where:
            return v
        read = SyncOnRead(v.read(), v.aggregation, v.owner, local=True)
        found[id(read)] = where[id(v)]
        return read

    return jax.tree.map(back, out, is_leaf=lambda v: isinstance(v, SyncOnRead)), found


def _captured_message(fn: str) -> str:
    return (f"strategy.run({fn}) inside a compiled step reads or updates a sync-on-read value it "
            "does not get as an argument (captured from the enclosing code): a compiled step "
            "cannot update the objects around it, and would read the value they held when it was "
            "traced. Pass the value to the step and to run as an argument, and return it from the "
            "step: `seen = step(seen, batch)` with `strategy.run(fn, args=(seen, batch))` inside, "
            "the replica function returning `seen.assign_add(...)` or updating it in place.")


def _refine(kind: str, value: str) -> str:
    """How an output leaves ``run``, by what the program's values prove (`program_values`), whatever
    its type: "mirrored" (proven the same, invariant by type), "identical" (proven the same, varying
    by type), "declared" (per replica on purpose) or "per_replica"; a sync-on-read value stays
    one."""
    if kind == "sync":
        return kind
    if value == IDENTICAL:
        return "mirrored" if kind == "mirrored" else "identical"
    return "declared" if value == DECLARED else "per_replica"


def _leaf_paths(tree: Any) -> list[str]:
    """The path of each leaf of ``tree`` (a treedef), as ``output[0]['w']``."""
    marked = jax.tree.unflatten(tree, range(tree.num_leaves))
    return ["output" + jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(marked)[0]]


def _own_copies(results: Sequence[Any], how: Sequence[str], mesh: Mesh, split: PartitionSpec,
                manual: dict) -> list[Any]:
    """``results`` with each "identical" one (stacked: one copy per replica, every copy the same
    value) made one replicated value from each device's own copy.

    The replica program cannot return such a value as replicated: its type is varying (each replica
    owns its copy of the mirrored arguments it came from), and the type check would refuse it. A
    second, trivial program without the check does: each device keeps its copy and the result is
    declared replicated, so no byte is sent (taking replica 0's copy would broadcast it). The values
    were proven the same on every replica first (`jaxdist.strategies.compile._identical`).
    """
    picked = [i for i, h in enumerate(how) if h == "identical"]
    if not picked:
        return list(results)
    own = jax.shard_map(lambda *copies: tuple(c[0] for c in copies), mesh=mesh, in_specs=split,
                        out_specs=PartitionSpec(), check_vma=False, **manual)(
        *(results[i] for i in picked))
    out = list(results)
    for i, value in zip(picked, own, strict=True):
        out[i] = value
    return out


def _context_mesh(mesh: Mesh, policy: LayoutPolicy) -> Any:
    """A renamed mesh is the context mesh while its shard_map traces (``scope()`` sets another)."""
    if mesh is trace_mesh(policy.mesh):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def _eager_mesh(mesh: Mesh, policy: LayoutPolicy, traced: bool) -> Any:
    """Called eagerly, a program on a renamed mesh runs with that mesh as the concrete context mesh
    (JAX lowers ``axis_index`` on a partly manual mesh through it; ``scope()`` sets another)."""
    if mesh is policy.mesh or traced:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


def _unbound_axis_error(probe: Callable[[bool], None]) -> NameError | None:
    """JAX's error for a collective over an axis name the program does not bind, found by tracing
    again; None when the first trace failed otherwise (the function's own ``assert`` or NameError).

    JAX fails such a collective in several ways (a ``NameError``, a bare ``AssertionError`` inside
    ``psum``, a ``ValueError`` for a tuple of names). Traced again without the value-type check (on
    the failure path only), every one is a ``NameError`` that, unlike Python's own for an undefined
    variable, carries no ``name``: the type and that attribute tell, never the message text.
    """
    try:
        probe(False)
    except NameError as again:
        return again if again.name is None else None
    except Exception:  # the replica function's own error: the caller re-raises the first one
        return None
    return None


def _unbound_message(fn: str, axis_name: AxisName, mesh: Mesh) -> str:
    return (f"strategy.run({fn}): the replica function runs a collective (lax.pmean / psum / "
            "axis_index / all_gather, or a flax BatchNorm(axis_name=...)) over an axis name that "
            "is not bound here (JAX's error above names it): the names bound are the mesh axes "
            f"{tuple(mesh.axis_names)}, the replicas under {axis_name!r}. pmap-era code names its "
            "device axis; bind that name to the replicas with strategy.run(fn, args=..., "
            "axis_name=<that name>) (or create the strategy with axis_name=<that name>).")
