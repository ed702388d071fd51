"""The per-replica view: how `Strategy.run` turns a replica function into one `jax.shard_map` program.

Each argument leaf is classified once per call signature, by declaration or by what the value carries:

* with ``batch_argnums``: the declared arguments are batches (each replica sees its own rows; host arrays
  are split over the replicas), every other array is mirrored;
* without: an array whose layout makes it a batch (axis 0 split over the replicas, e.g. from a distributed
  dataset; `Strategy.layout_role`) is a batch; inside a ``strategy.jit`` step, the tracers of the step's own
  batch / variable arguments keep their role, and a value computed in the step (rank >= 1) is refused with
  an error that names ``batch_argnums``; any other array is mirrored (tf.distribute's rule for values that
  are not distributed);
* `PerReplica` / `SyncOnRead`: each replica sees its own component;
* Python scalars and non-array leaves are compile-time constants (a new value recompiles, as in tf.function).

tf.distribute semantics for gradients: mirrored values enter the replica function cast to *varying* over the
replica axis (`jax.lax.pcast`), so each replica owns its copy and ``jax.grad`` gives LOCAL gradients. (Left
invariant, shard_map's ``grad`` would return gradients already summed over replicas.) The all-reduce is
explicit: ``ctx.all_reduce(MEAN, grads)``.

Outputs: a value that is invariant over the replica axis by JAX's type system (an all-reduce, aggregate or
all-gather result, a constant) comes back mirrored (a replicated `jax.Array`); a varying value comes back as
`PerReplica`; a `SyncOnRead` comes back as one. Since every replica owns its copy of a mirrored argument,
values computed from it are varying by type (as in tf.distribute, where they come back PerReplica too); to
return an updated mirrored value, combine the replicas' updates with ``ctx.aggregate``.
To know which is which, the function is traced once abstractly before the real program is built; the program
is cached in the strategy's `ProgramCache` (weak on ``fn``), so steady-state calls cost one dispatch.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxdist.replicate.collectives import is_varying, to_varying
from jaxdist.replicate.layouts import REPLICA_AXIS, batch_sharded, is_on_mesh, put, replicated
from jaxdist.replicate.values import PerReplica, SyncOnRead
from jaxdist.strategies import tracing
from jaxdist.strategies.context import enter_replica
from jaxdist.strategies.global_view import UndeclaredBatchWarning
from jaxdist.strategies.input import place_batch
from jaxdist.strategies.replica_context import ReplicaContext
from jaxdist.strategies.tracing import computation, current_computation, role_of

if TYPE_CHECKING:
    from jaxdist.strategies.base import Strategy

__all__ = ["ReplicaRunner"]

# Leaf kinds.
_MIRRORED, _BATCH, _PER_REPLICA, _SYNC, _STATIC = range(5)
_REPLICA_SPEC = PartitionSpec(REPLICA_AXIS)


def _is_distributed(x: Any) -> bool:
    return isinstance(x, (PerReplica, SyncOnRead))


class ReplicaRunner:
    """Compiles and caches the shard_map programs behind `Strategy.run` for one strategy."""

    def __init__(self, strategy: Strategy):
        self._strategy = strategy
        self._warned_ambiguous = False

    def _classify(self, leaf: Any, declared: bool | None, where: str) -> int:
        """The kind of one argument leaf; ``declared``: True / False when ``batch_argnums`` says whether its
        argument is a batch, None when nothing was declared."""
        strategy = self._strategy
        if _is_distributed(leaf):
            if leaf.owner is not None and leaf.owner is not strategy:
                raise ValueError(
                    f"strategy.run got a {type(leaf).__name__} of another strategy ({leaf.owner!r}) but runs "
                    f"on {strategy!r}: per-replica values belong to the strategy that made them; reduce or "
                    "gather it there first (strategy.reduce / strategy.gather), or run on that strategy."
                )
            return _SYNC if isinstance(leaf, SyncOnRead) else _PER_REPLICA
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            return _STATIC  # Python scalars, strings, callables: compile-time constants, as in tf.function
        if declared is not None:
            return _BATCH if declared else _MIRRORED
        if isinstance(leaf, jax.core.Tracer):
            role = role_of(leaf, strategy)
            if role is None and np.ndim(leaf) >= 1:
                raise ValueError(
                    f"strategy.run got {where}, an array of shape {tuple(np.shape(leaf))} computed inside the "
                    "step, whose role jaxdist cannot know: only the step's own batch arguments are split over "
                    "the replicas, and a value derived from one (say x / 255) might be a batch or a variable. "
                    "Declare the roles: strategy.run(fn, args=..., batch_argnums=(i, ...)) lists the batch "
                    "arguments (every other one is mirrored; batch_argnums=() if none is a batch)."
                )
            return _BATCH if role == "batch" else _MIRRORED
        role = strategy.layout_role(leaf)
        if role is None and np.ndim(leaf) >= 1 and is_on_mesh(leaf, strategy.mesh) and not self._warned_ambiguous:
            self._warned_ambiguous = True
            warnings.warn(
                f"strategy.run on {strategy!r} got {where}, split over the replicas on axis 0 like a batch but "
                "not placed by this strategy's input functions: its variables can have that layout too, so it is "
                "taken as a variable (every replica sees all of it). Declare the roles: strategy.run(fn, "
                "args=..., batch_argnums=(i, ...)) lists the batch arguments.",
                UndeclaredBatchWarning,
                stacklevel=4,
            )
        return _BATCH if role == "batch" else _MIRRORED

    def __call__(self, fn: Callable, args: tuple, kwargs: dict, batch_argnums: tuple[int, ...] | None) -> Any:
        flat, treedef = jax.tree.flatten((args, kwargs), is_leaf=_is_distributed)
        frame = current_computation()
        if (frame is None or frame.strategy is not self._strategy) and any(
            isinstance(x, jax.core.Tracer) for x in flat
        ):
            raise ValueError(
                "strategy.run got traced arguments outside this strategy's compiled computations (e.g. inside a "
                "plain jax.jit or jax.grad): there it cannot tell distributed batches from mirrored values. "
                "Compile the enclosing step with strategy.jit (or run_steps_on_dataset), or call run eagerly."
            )
        kinds = []
        for i, a in enumerate(args):
            for path, leaf in jax.tree_util.tree_flatten_with_path(a, is_leaf=_is_distributed)[0]:
                declared = None if batch_argnums is None else i in batch_argnums
                kinds.append(self._classify(leaf, declared, f"args[{i}]{jax.tree_util.keystr(path)}"))
        for path, leaf in jax.tree_util.tree_flatten_with_path(kwargs, is_leaf=_is_distributed)[0]:
            declared = None if batch_argnums is None else False
            kinds.append(self._classify(leaf, declared, f"kwargs{jax.tree_util.keystr(path)}"))
        kinds = tuple(kinds)
        statics = tuple(x if k == _STATIC else None for x, k in zip(flat, kinds, strict=True))
        dynamic, aux = [], []
        for x, k in zip(flat, kinds, strict=True):
            if k == _STATIC:
                aux.append(None)
                continue
            if k in (_PER_REPLICA, _SYNC):
                aux.append(x.aggregation if k == _SYNC else None)
                x = x.stacked
            else:
                aux.append(None)
                if not isinstance(x, jax.core.Tracer):
                    if k == _MIRRORED:
                        x = self._place_mirrored(x)
                    elif not is_on_mesh(x, self._strategy.mesh):
                        x = place_batch(self._strategy, x, where="a batch_argnums argument of strategy.run")
            dynamic.append(x)
        avals = tuple((np.shape(x), jax.dtypes.result_type(x)) for x in dynamic)
        key = (treedef, kinds, _hashable(statics), tuple(aux), avals)
        aux = tuple(aux)
        program = self._strategy.programs.get(
            fn, key, lambda weak_fn: self._build(weak_fn, treedef, kinds, statics, aux, dynamic),
            reason=(_hashable(statics), avals),
        )
        return program(*dynamic)

    def _place_mirrored(self, x: Any) -> Any:
        mesh = self._strategy.mesh
        if isinstance(x, jax.Array) and getattr(x.sharding, "mesh", None) is mesh:
            return x  # already on the mesh (replicated, or another layout the program will gather)
        return put(x, replicated(mesh))

    def _build(self, fn, treedef, kinds, statics, aux, dynamic) -> Callable:
        strategy = self._strategy
        dyn_kinds = [k for k in kinds if k != _STATIC]
        in_specs = tuple(_REPLICA_SPEC if k != _MIRRORED else PartitionSpec() for k in dyn_kinds)
        out_info: dict[str, Any] = {}

        def body(*local, probe=False):
            it = iter(local)
            leaves = []
            for k, static, agg in zip(kinds, statics, aux, strict=True):
                if k == _STATIC:
                    leaves.append(static)
                    continue
                x = next(it)
                if k == _MIRRORED:
                    x = to_varying(x)  # each replica owns its copy: local gradients (see module doc)
                elif k == _PER_REPLICA:
                    x = x[0]
                elif k == _SYNC:
                    x = SyncOnRead(x[0], agg, strategy, local=True)
                leaves.append(x)
            call_args, call_kwargs = jax.tree.unflatten(treedef, leaves)
            with computation(strategy, "replica"), enter_replica(ReplicaContext(strategy)):
                out = fn(*call_args, **call_kwargs)
            out_leaves, out_tree = jax.tree.flatten(out, is_leaf=lambda v: isinstance(v, SyncOnRead))
            results, specs, wrappers = [], [], []
            for v in out_leaves:
                if isinstance(v, SyncOnRead):
                    results.append(to_varying(jax.numpy.asarray(v.read()))[None])
                    specs.append(_REPLICA_SPEC)
                    wrappers.append(("sync", v.aggregation))
                else:
                    v = jax.numpy.asarray(v)
                    if is_varying(v):
                        results.append(v[None])
                        specs.append(_REPLICA_SPEC)
                        wrappers.append(("per_replica", None))
                    else:
                        results.append(v)
                        specs.append(PartitionSpec())
                        wrappers.append(("mirrored", None))
            out_info.update(tree=out_tree, specs=tuple(specs), wrappers=tuple(wrappers))
            if probe:  # every output gets a replica axis so one out_spec fits all of them
                return tuple(r if s == _REPLICA_SPEC else r[None] for r, s in zip(results, specs, strict=True))
            return tuple(results)

        # Pass 1: trace abstractly to learn which outputs vary across replicas.
        # Manual over the replica axis only: a model axis (if any) stays with XLA's partitioner.
        manual = {"axis_names": {REPLICA_AXIS}} if len(strategy.mesh.axis_names) > 1 else {}
        probe_fn = jax.shard_map(
            functools.partial(body, probe=True), mesh=strategy.mesh, in_specs=in_specs, out_specs=_REPLICA_SPEC,
            **manual,
        )
        with tracing.probe():
            jax.eval_shape(
                probe_fn, *[jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x)) for x in dynamic]
            )
        out_tree, out_specs, wrappers = out_info["tree"], out_info["specs"], out_info["wrappers"]

        # Pass 2: the real program, with exact output layouts.
        mapped = jax.shard_map(body, mesh=strategy.mesh, in_specs=in_specs, out_specs=out_specs, **manual)
        out_shardings = tuple(
            batch_sharded(strategy.mesh) if s == _REPLICA_SPEC else replicated(strategy.mesh) for s in out_specs
        )
        compiled = jax.jit(mapped, out_shardings=out_shardings)

        def program(*dyn):
            results = compiled(*dyn)
            wrapped = []
            for r, (kind, agg) in zip(results, wrappers, strict=True):
                if kind == "per_replica":
                    wrapped.append(PerReplica(r, strategy))
                elif kind == "sync":
                    wrapped.append(SyncOnRead(r, agg, strategy))
                else:
                    wrapped.append(r)
            return jax.tree.unflatten(out_tree, wrapped)

        return program


def _hashable(statics: tuple) -> Any:
    try:
        hash(statics)
        return statics
    except TypeError:
        return tuple(id(s) for s in statics)
