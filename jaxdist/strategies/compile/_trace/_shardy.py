"""Guards against XLA's Shardy partitioner where it miscomputes convolutions (upstream, in JAX too).

Two members of one family, both silent (wrong numbers, no error), both measured with jax 0.12:

* **split kernels, replicated batch**: a conv net whose kernels are split (FSDP, tensor parallelism)
  while every device holds the whole batch. A step of a strategy that splits variables and receives
  no distributed batch therefore gathers its variables at entry (`gather_at_entry`;
  `LayoutPolicy.splits_variables`).
* **grouped convolutions over a split batch**: per-example gradients of a convolution
  (``jax.vmap(jax.grad(loss))``, what DP-SGD computes) trace to a convolution whose groups are the
  examples (``feature_group_count`` or ``batch_group_count`` > 1, grouped along the dimension that
  holds the batch). Shardy splits that dimension like a plain contraction: every example outside the
  first device's rows gets a zero gradient. `call_guarded` runs a step whose batch is split with
  every grouped convolution's grouped dimensions kept whole (its other dimensions stay free for the
  partitioner), which it computes right, at the cost of XLA gathering that convolution's operands
  (``strategy.run`` of the per-example gradients computes only each replica's examples). Where the
  grouped dimensions are whole already (a depthwise conv over a split batch) nothing changes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.strategies.layout import in_trace, trace_mesh

__all__ = ["call_guarded", "gather_at_entry", "grouped_convolutions"]

_CONV = jax.lax.conv_general_dilated_p
_FREE = PartitionSpec.UNCONSTRAINED


def gather_at_entry(policy, args, concrete_args, state, concrete_state, skip) -> tuple[tuple, Any]:
    """Constrain split variables to replicated at entry (the protection for split kernels with a
    replicated batch: `LayoutPolicy.splits_variables`)."""
    full = in_trace(policy.replicated_sharding)

    def gather(t, c):
        sharding = getattr(c, "sharding", None)
        if sharding is None or sharding.is_fully_replicated or not np.ndim(t):
            return t
        return jax.lax.with_sharding_constraint(t, full)

    out = tuple(a if i in skip or c is None else jax.tree.map(gather, a, c)
                for i, (a, c) in enumerate(zip(args, concrete_args, strict=True)))
    if state is not None and concrete_state is not None:
        state = jax.tree.map(gather, state, concrete_state)
    return out, state


def _grouped(eqn: Any) -> bool:
    return eqn.primitive is _CONV and (eqn.params["feature_group_count"] > 1
                                       or eqn.params["batch_group_count"] > 1)


def _subjaxprs(params: dict) -> list[tuple[str, Any]]:
    """The jaxprs among an equation's parameters (``jaxpr``, ``branches``, ...), by name."""
    found = []
    for name, value in params.items():
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) for v in values):
            found.append((name, value))
    return found


def grouped_convolutions(jaxpr: Any) -> int:
    """How many grouped convolutions ``jaxpr`` (a `jax.extend.core.Jaxpr` or ``ClosedJaxpr``) holds,
    nested jaxprs included, except the bodies of ``shard_map`` (per-replica code: the partitioner
    never splits them).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> conv = lambda w, x: jax.lax.conv_general_dilated(
        ...     x[None], w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        >>> per_example = jax.vmap(jax.grad(lambda w, x: jnp.sin(conv(w, x)).sum()),
        ...                        in_axes=(None, 0))
        >>> grouped_convolutions(jax.make_jaxpr(per_example)(jnp.ones((3, 3, 2, 4)),
        ...                                                  jnp.ones((8, 5, 5, 2))))
        1
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    count = 0
    for eqn in jaxpr.eqns:
        if _grouped(eqn):
            count += 1
        elif eqn.primitive.name != "shard_map":
            for _, value in _subjaxprs(eqn.params):
                count += sum(grouped_convolutions(v)
                             for v in (value if isinstance(value, tuple) else (value,)))
    return count


def _whole_along(x: jax.Array, dim: int, mesh: Any) -> jax.Array:
    spec = [_FREE] * x.ndim
    spec[dim] = None
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def _guarded_conv(lhs: jax.Array, rhs: jax.Array, *, mesh: Any, **params: Any) -> jax.Array:
    """The convolution of ``params`` with its grouped dimensions whole: the lhs dimension split into
    groups (its feature dimension for ``feature_group_count``, its batch dimension for
    ``batch_group_count``), the kernel's output features and the output's features (grouped in both
    cases)."""
    dn = params["dimension_numbers"]
    grouped = dn.lhs_spec[1] if params["feature_group_count"] > 1 else dn.lhs_spec[0]
    lhs = _whole_along(lhs, grouped, mesh)
    rhs = _whole_along(rhs, dn.rhs_spec[0], mesh)
    return _whole_along(_CONV.bind(lhs, rhs, **params), dn.out_spec[1], mesh)


def _rewrite(jaxpr: Any, mesh: Any) -> Any:
    """``jaxpr`` (open or closed), each grouped convolution replaced by `_guarded_conv`."""
    closed = isinstance(jaxpr, jcore.ClosedJaxpr)
    inner = jaxpr.jaxpr if closed else jaxpr
    eqns = []
    for eqn in inner.eqns:
        if _grouped(eqn):
            guard = jax.jit(functools.partial(_guarded_conv, mesh=mesh, **eqn.params))
            call = jax.make_jaxpr(guard)(*(v.aval for v in eqn.invars)).jaxpr.eqns
            # one call equation on the convolution's own operands (its variables take their place)
            eqns.append(call[0].replace(invars=list(eqn.invars), outvars=list(eqn.outvars)))
            continue
        subs = [] if eqn.primitive.name == "shard_map" else _subjaxprs(eqn.params)
        if subs and any(grouped_convolutions(v) for _, value in subs
                        for v in (value if isinstance(value, tuple) else (value,))):
            params = dict(eqn.params)
            for name, value in subs:
                params[name] = (tuple(_rewrite(v, mesh) for v in value) if isinstance(value, tuple)
                                else _rewrite(value, mesh))
            eqn = eqn.replace(params=params)
        eqns.append(eqn)
    inner = inner.replace(eqns=eqns)
    return jcore.ClosedJaxpr(inner, jaxpr.consts) if closed else inner


def call_guarded(policy: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in the trace of a step whose batch is split, its grouped convolutions
    computed with their groups whole (see the module docstring). ``fn`` is traced once: where it
    holds no grouped convolution, its program is what it would have been.

    Args:
        policy: the strategy's `LayoutPolicy` (its mesh, as the trace types it).
        fn: the step's code; pure (nnx objects merged and split inside it).
        *args: its positional arguments (tracers of the step's trace).
        **kwargs: its keyword arguments.

    Returns:
        What ``fn`` returns.
    """
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
    if grouped_convolutions(closed):
        mesh = trace_mesh(policy.mesh)
        if not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
            # On Explicit axes the types decide (JAX refuses a per-example conv gradient over a
            # batch split in its type: such a step runs Auto, where this guard applies).
            closed = _rewrite(closed, mesh)
    out = jcore.jaxpr_as_fun(closed)(*jax.tree.leaves((args, kwargs)))
    return jax.tree.unflatten(jax.tree.structure(shapes), out)
