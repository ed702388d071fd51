"""``outside_compilation``: run part of a compiled step on the host, once per replica, on its local
values.

TF's ``tpu.outside_compilation`` carved host ops out of a TPU computation. In JAX the host region is
a callback (`jax.pure_callback`, or ordered `io_callback` for side effects). Where it is called
decides how it runs:

* inside ``strategy.run`` (replica context, a `jax.shard_map`): one host call per replica, on that
  replica's values;
* inside a global-view step (``strategy.jit``, ``run_steps_on_dataset``): the region is wrapped in
  its own `jax.shard_map`, so it ALSO runs once per replica: arguments whose axis 0 is the global
  batch are split over the replicas, others are passed whole, and the replicas' results are
  concatenated along axis 0 (row-wise results give back the global batch; a scalar becomes a vector
  with one value per replica). No collective is added. (A plain callback under ``jit`` would gather
  everything to device 0 and run once.)
* outside any trace: ``host_fn(*args)`` is just called.

On a mesh with more axes than the replica axis a replica spans several devices; the host still runs
once per replica, and its result is handed to the replica's other devices.

A host function written with `jax.numpy` needs nothing more: its result shapes come from
`jax.eval_shape`, it is compiled once for the host's CPU backend (so, like any traced JAX code, its
Python side effects happen at trace time; a region that returns nothing runs as plain Python on
every call), and it is differentiable — its VJP runs on the host too, as the host region of gradient
cluster ``C.uid``. A function written with numpy (or any Python) takes ``result_shape=`` (``()``
when it returns nothing: logging, metric writers) and is never traced; differentiating it needs
``vjp=``, else it is a clear error at trace time. Regions that return nothing are ordered side
effects: each replica's calls run in step order.

Each region is gradient cluster "0", "1", ... of its computation (see `jaxdist.gradients`). Nesting
regions raises NotImplementedError, as in TF.
"""

from __future__ import annotations

import functools
import itertools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import PartitionSpec

from jaxdist.gradients.clusters import cluster, clusters, current_gradient_uid, gradient_cluster
from jaxdist.replicate.collectives import is_varying, to_varying
from jaxdist.replicate.layouts import REPLICA_AXIS
from jaxdist.replicate.trees import is_array
from jaxdist.strategies.ambient import current_computation, replica_axis, state
from jaxdist.strategies.compile import as_argnums
from jaxdist.strategies.input import check_divisible
from jaxdist.strategies.layout import Role, traced_role

__all__ = ["host_compute_core", "outside_compilation"]

_plain_clusters = itertools.count()
_plain_lock = threading.Lock()
_CALLBACK_MARKERS = ("pure_callback", "io_callback", "callback")


def _next_cluster(frame: Any) -> str:
    """The region's cluster name: numbered per strategy computation ("0", "1", ...); process-wide
    outside one."""
    if frame is not None:
        return str(frame.counter("outside_compilation"))
    with _plain_lock:
        return str(next(_plain_clusters))


def _host_device() -> jax.Device:
    return jax.local_devices(backend="cpu")[0]


def _mark(x: Any, varying: bool) -> Any:
    """Give a callback result (typed invariant by JAX) the replica-variance it really has."""
    return to_varying(x, replica_axis(REPLICA_AXIS)) if varying else x


def _once_per_replica(call: Callable, xs: list, result_shape: Any) -> Any:
    """``call(*xs)`` (a callback) run once per replica, also where other mesh axes are still
    automatic. Callbacks need every mesh axis manual. Inside ``strategy.run`` on a (replica, model)
    mesh only the replica axis is, so the call goes into a nested `jax.shard_map` over the other
    axes: it runs on the first device of those axes (the host still runs once per replica) and its
    result is summed with the others' zeros, handing every device of the replica the same value.
    """
    mesh = jax.sharding.get_abstract_mesh()
    auto = () if mesh.empty else tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    if not auto:
        return call(*xs)

    def zeros(*_):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), result_shape)

    def broadcast(o):
        o = o if all(is_varying(o, a) for a in auto) else jax.lax.pcast(o, auto, to="varying")
        if o.dtype == jnp.bool_:
            return jax.lax.psum(o.astype(jnp.int32), auto).astype(jnp.bool_)
        return jax.lax.psum(o, auto)

    def first_device_only(*xs):
        first = functools.reduce(operator.and_, [jax.lax.axis_index(a) == 0 for a in auto])
        return jax.tree.map(broadcast, jax.lax.cond(first, call, zeros, *xs))

    return jax.shard_map(first_device_only, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
                         axis_names=set(auto))(*xs)


class _Region:
    """One host region: its host function on the dynamic (array) arguments, result shapes, VJP."""

    def __init__(self, host_fn, statics, result_shape, vjp, traceable, ordered, name):
        # statics: (positions, values) of non-array arguments, passed through unchanged
        self.host_fn, self.statics, self.result_shape = host_fn, statics, result_shape
        self.vjp = vjp
        self.traceable, self.ordered, self.name = traceable, ordered, name
        self._compiled = None

    def full_args(self, dynamic):
        positions, values = self.statics
        args, it_d, it_s = [], iter(dynamic), iter(values)
        for i in range(len(positions) + len(dynamic)):
            args.append(next(it_s) if i in positions else next(it_d))
        return args

    def call(self, *dynamic):
        return self.host_fn(*self.full_args(dynamic))

    def run_host(self, *dynamic):
        """Runs on the host, in the callback: numpy in, numpy out."""
        state.host_regions += 1
        try:
            with jax.default_device(_host_device()):
                if self.traceable and self.result_shape is not None:  # compiled once for the host
                    if self._compiled is None:
                        self._compiled = jax.jit(self.call)
                    out = self._compiled(*dynamic)
                else:  # side-effect regions and opaque functions run as Python, every call
                    out = self.call(*dynamic)
        finally:
            state.host_regions -= 1
        if self.result_shape is None:
            return None
        return jax.tree.map(lambda o, s: np.asarray(o, dtype=s.dtype).reshape(s.shape), out,
                            self.result_shape)

    def backward(self, name: str, xs: tuple, cotangent: Any) -> tuple[_Region, list[int]]:
        """The region computing this region's input gradients on the host: itself differentiable
        when this one is traceable (a gradient of a gradient then lands in ``name.uid2``)."""
        n = len(xs)
        floats = [i for i, x in enumerate(xs) if jnp.issubdtype(x.dtype, jnp.inexact)]
        ct_tree = jax.tree.structure(cotangent)
        positions = self.statics[0]
        dynamic_positions = [i for i in range(len(positions) + n) if i not in positions]

        def pullback(*leaves):
            primals, ct = leaves[:n], jax.tree.unflatten(ct_tree, leaves[n:])
            if self.vjp is not None:
                grads = self.vjp(tuple(self.full_args(primals)), ct)
                grads = [grads[dynamic_positions[i]] for i in range(n)]
            else:
                _, pull = jax.vjp(self.call, *primals)
                grads = pull(ct)
            return tuple(grads[i] for i in floats)

        shapes = tuple(jax.ShapeDtypeStruct(xs[i].shape, xs[i].dtype) for i in floats)
        region = _Region(pullback, (frozenset(), ()), shapes, None,
                         self.vjp is None and self.traceable, False, name)
        return region, floats


def _local_call(region: _Region, dynamic: list, replicated: bool, varying_in: list[bool]) -> Any:
    """The region on local values: a callback, differentiable through a custom VJP that runs on the
    host."""
    if region.result_shape is None or region.ordered:
        # Side effects: no gradient flows through them (stop_gradient lets a logging region sit in a
        # differentiated step, where an io_callback itself has no JVP).
        def side_effect(*xs):
            return io_callback(region.run_host, region.result_shape, *xs, ordered=True)

        with cluster(region.name):
            return _once_per_replica(side_effect, [jax.lax.stop_gradient(x) for x in dynamic],
                                     region.result_shape)

    def callback(*xs):
        return jax.pure_callback(region.run_host, region.result_shape, *xs,
                                 vmap_method="sequential")

    def forward(*xs):
        with cluster(region.name):
            out = _once_per_replica(callback, list(xs), region.result_shape)
        return jax.tree.map(lambda o: _mark(o, replicated), out)

    @jax.custom_vjp
    def host_region(*xs):
        return forward(*xs)

    def fwd(*xs):
        # Calling the region (not the bare callback) keeps fwd differentiable: grad of grad works.
        return host_region(*xs), xs

    def bwd(xs, cotangent):
        if not region.traceable and region.vjp is None:
            raise TypeError(
                f"outside_compilation region {region.name!r} "
                f"({getattr(region.host_fn, '__name__', region.host_fn)}) is being differentiated, "
                "but its host function is opaque (it was given result_shape=, so it is not traced "
                "with jax.numpy): pass vjp=lambda args, cotangent: grads, or write it with "
                "jax.numpy and drop result_shape.")
        # cluster C.uid, uid the gradient invocation tracing this
        name = gradient_cluster(region.name, current_gradient_uid())
        back, floats = region.backward(name, xs, cotangent)
        ct_leaves = jax.tree.leaves(cotangent)
        grads = _local_call(back, [*xs, *ct_leaves], replicated,
                            [*varying_in, *([True] * len(ct_leaves))])
        out: list[Any] = [None] * len(xs)
        for i, g in zip(floats, grads, strict=True):
            if replicated and not varying_in[i]:
                # An input shared by all replicas (invariant) gets the sum of the replicas'
                # contributions, as jax.grad of a replicated input does.
                g = jax.lax.psum(_mark(g, True), replica_axis(REPLICA_AXIS))
            out[i] = g
        return tuple(out)

    host_region.defvjp(fwd, bwd)
    return host_region(*dynamic)


def outside_compilation(host_fn: Callable[..., Any], *args: Any, result_shape: Any = None,
                        vjp: Callable[[tuple, Any], tuple] | None = None, ordered: bool = False,
                        batch_argnums: int | Sequence[int] | None = None) -> Any:
    """Run ``host_fn(*args)`` on the host, once per replica on its local values, from inside a
    compiled step.

    Args:
        host_fn: the host function. Written with jax.numpy: shapes are inferred and it is
            differentiable (its VJP runs on the host). Written with numpy / Python: pass
            ``result_shape``.
        *args: its arguments (arrays; Python scalars and other values are passed through unchanged).
        result_shape: for an opaque (numpy / Python) ``host_fn``: a pytree of `jax.ShapeDtypeStruct`
            describing ONE replica's result, ``()`` when it returns nothing (a side-effect region).
            None: infer it by tracing ``host_fn`` with jax.numpy.
        vjp: for an opaque ``host_fn`` that must be differentiated: ``vjp(args, cotangent) ->
            grads`` (one gradient per argument), run on the host.
        ordered: run as an ordered side effect (each replica's calls in step order); not
            differentiable. Regions without a result (logging, metric writers) are always ordered.
        batch_argnums: in the global view (``strategy.jit``, ``run_steps_on_dataset``): the
            positions in ``args`` whose rows are split over the replicas (every other argument
            reaches each replica whole). Without it, the step's own batch arguments are split, its
            other arguments are whole, and a value computed in the step (rank >= 1, say logits) is
            an error that asks for this declaration. Inside ``run`` the replica's values are already
            local and this is not needed.

    Returns:
        ``host_fn``'s result: this replica's inside ``run``; in the global view the replicas'
        results concatenated along axis 0 (a scalar result becomes one value per replica).

    Raises:
        NotImplementedError: when called inside another outside_compilation region.
        ValueError: in the global view, for an undeclared argument computed in the step, or a
            declared batch the replicas do not divide.
        TypeError: when an opaque ``host_fn`` is differentiated without ``vjp``, or ``host_fn``
            cannot be traced with jax.numpy and no ``result_shape`` was given.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np, jaxdist as jd
        >>> strategy = jd.MirroredStrategy()
        >>> rows = []
        >>> def replica_fn(x):  # the first region appends on the host
        ...     jd.tpu.outside_compilation(lambda v: rows.append(v.shape), x, result_shape=())
        ...     return jd.tpu.outside_compilation(jnp.sin, x)
        >>> x = strategy.experimental_distribute_values(np.zeros((16, 2), np.float32))
        >>> out = strategy.run(replica_fn, args=(x,))
        >>> jax.effects_barrier(); sorted(set(rows)), len(rows)
        ([(2, 2)], 8)
    """
    if not callable(host_fn):
        raise TypeError(f"host_fn={host_fn!r} is not callable: pass the function to run on the "
                        "host.")
    if state.host_regions:
        raise NotImplementedError("Cannot nest outside_compilation clusters")
    frame = current_computation()
    leaves = jax.tree.leaves(args)
    traced = frame is not None or any(isinstance(x, jax.core.Tracer) for x in leaves)
    if not traced:
        return host_fn(*args)
    if vjp is not None and not callable(vjp):
        raise TypeError(f"vjp={vjp!r} is not callable: pass vjp(args, cotangent) -> grads.")

    positions, statics, dynamic = set(), [], []
    for i, a in enumerate(args):
        if is_array(a):
            dynamic.append(a)
        else:
            positions.add(i)
            statics.append(a)
    statics_pair = (frozenset(positions), tuple(statics))
    name = _next_cluster(frame)
    kind = frame.kind if frame is not None else "plain"
    axis = replica_axis(REPLICA_AXIS)
    if kind == "replica" and axis != frame.policy.replica_axis:
        raise NotImplementedError(
            f"outside_compilation inside strategy.run(..., axis_name={axis!r}) is not supported: a "
            "host callback in a program on the renamed mesh mixes two meshes, which JAX rejects. "
            "Keep the replica axis's name for replica functions with host regions (run without "
            "axis_name), or move the region into the global-view step (strategy.jit).")

    if kind == "global":
        policy = frame.policy
        n = policy.num_replicas
        split = _global_view_split(args, dynamic, positions, batch_argnums, policy)
        local_shapes = [jax.ShapeDtypeStruct((np.shape(x)[0] // n, *np.shape(x)[1:]) if s
                                             else np.shape(x), jnp.result_type(x))
                        for x, s in zip(dynamic, split, strict=True)]
    else:
        # Inside a replica program traced without JAX's varying types (as jax.pmap runs it) every
        # value is the replica's own: its gradient is the replica's own too, never summed over the
        # replicas.
        split = ([is_varying(x, axis) or not frame.typed for x in dynamic] if kind == "replica"
                 else [False] * len(dynamic))
        local_shapes = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in dynamic]

    region = _make_region(host_fn, statics_pair, local_shapes, result_shape, vjp, ordered, name)
    if kind != "global":
        return _local_call(region, dynamic, kind == "replica", split)

    # Global view: one call per replica through a shard_map of its own (see the module doc).
    in_specs = tuple(PartitionSpec(policy.replica_axis) if s else PartitionSpec() for s in split)
    spec = PartitionSpec(policy.replica_axis)

    def per_replica(*xs):
        out = _local_call(region, list(xs), True, split)
        if out is None:
            return None
        return jax.tree.map(lambda o: o[None] if o.ndim == 0 else o, out)

    # Manual over the replica axis only: `_once_per_replica` runs the call on one device of any
    # other axis.
    mapped = jax.shard_map(per_replica, mesh=policy.mesh, in_specs=in_specs,
                           out_specs=spec if region.result_shape is not None else PartitionSpec(),
                           axis_names=set(policy.batch_axes))
    return mapped(*dynamic)


def _global_view_split(args: tuple, dynamic: list, static_positions: set, batch_argnums: Any,
                       policy: Any) -> list:
    """Which array arguments of a region in the global view are split over the replicas: the
    declared ones, or without a declaration the step's own batch arguments (their role,
    `jaxdist.strategies.layout._roles`)."""
    positions = [i for i in range(len(args)) if i not in static_positions]
    if batch_argnums is not None:
        declared = as_argnums(batch_argnums, "batch_argnums")
        bad = [i for i in declared if not 0 <= i < len(args) or i in static_positions]
        if bad:
            raise ValueError(
                f"batch_argnums={declared!r} names positions {bad} that are not array arguments of "
                f"the region (it has {len(args)} arguments).")
        split = [i in declared for i in positions]
        for x, s in zip(dynamic, split, strict=True):
            if s:
                if not np.ndim(x):
                    raise ValueError("outside_compilation batch_argnums names a scalar: a batch "
                                     "needs an axis 0.")
                check_divisible(np.shape(x)[0], policy.num_replicas,
                                "the rows of a batch_argnums argument")
        return split
    declaration = "outside_compilation(host_fn, *args, batch_argnums=(i, ...))"
    return [traced_role(policy, x, f"args[{i}]", declaration) is Role.BATCH
            for i, x in zip(positions, dynamic, strict=True)]


def _make_region(host_fn, statics, local_shapes, result_shape, vjp, ordered, name) -> _Region:
    traceable = result_shape is None
    if traceable:
        probe_args = _Region(host_fn, statics, None, None, True, ordered, name).full_args(
            local_shapes)
        state.host_regions += 1
        try:
            # (through a function of its own: jax 0.12 crashes when it traces a numpy ufunc a second
            # time after a failed first trace, as strategy.run's relaxed varying-type check does)
            result_shape = jax.eval_shape(lambda *a: host_fn(*a), *probe_args)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
                TypeError) as err:
            raise TypeError(
                "outside_compilation could not trace "
                f"host_fn={getattr(host_fn, '__name__', host_fn)!r} with jax.numpy to infer its "
                f"result ({type(err).__name__}): pass result_shape= (a pytree of "
                "jax.ShapeDtypeStruct for one replica's result, or () when it returns nothing) "
                "and, to differentiate it, vjp=.") from err
        finally:
            state.host_regions -= 1
    if result_shape is not None and not jax.tree.leaves(result_shape):
        result_shape = None
    return _Region(host_fn, statics, result_shape, vjp, traceable, ordered, name)


def host_compute_core(lowered: Any, num_replicas: int) -> list[str]:
    """``"cluster:core"`` for every host region of a compiled computation and every core running it.

    Args:
        lowered: the lowered computation (``step.lower(...)``, ``ctx.lower()`` of a steps loop) or
            its text.
        num_replicas: the replicas (cores) of the strategy that runs it.

    Returns:
        Sorted ``"cluster:core"`` strings, e.g. ``["0:0", "0:1", "0.uid:0", "0.uid:1"]``.

    Examples:
        >>> import jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> step = strategy.jit(lambda x: jd.tpu.outside_compilation(jnp.cos, x), batch_argnums=0)
        >>> jd.tpu.host_compute_core(step.lower(jnp.ones(2)), strategy.num_replicas_in_sync)
        ['0:0', '0:1']
    """
    regions = [name for name, ops in clusters(lowered).items()
               if any(op.rsplit("/", 1)[-1].startswith(_CALLBACK_MARKERS) for op in ops)]
    return sorted(f"{name}:{core}" for name in regions for core in range(num_replicas))
