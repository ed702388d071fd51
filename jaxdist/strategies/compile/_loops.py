"""On-device loops: ``run_steps_on_dataset`` runs many steps in ONE program (tf's steps_per_run).

The batches of ``iterations`` steps are taken from the iterator, checked for static shapes, stacked
and placed once (``(iterations, global_batch, ...)``, axis 1 split over the replicas, like TPU
infeed), and a `jax.lax.scan` runs the step over them on the devices: the host works once per call.

``step_fn(ctx, state, *inputs) -> state`` is a global-view step (as for ``strategy.jit``; it may
call ``strategy.run``), ``ctx`` its `MultiStepContext`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.replicate.collectives import reduce_stacked
from jaxdist.replicate.ops import ReduceOp
from jaxdist.replicate.trees import abstract
from jaxdist.replicate.values import PerReplica
from jaxdist.strategies import ambient
from jaxdist.strategies.compile._cache import ProgramCache
from jaxdist.strategies.compile._jit import StrategyFunction
from jaxdist.strategies.input import check_divisible
from jaxdist.strategies.layout import LayoutPolicy, explicit_axes, in_trace

__all__ = ["MultiStepContext", "run_steps_on_dataset"]


class MultiStepContext:
    """What a multi-step loop returns, and what its step function records (tf's MultiStepContext).

    Inside ``step_fn``: ``set_last_step_output`` and ``set_non_tensor_output``. After the loop:
    ``last_step_outputs`` (a dict), ``non_tensor_outputs`` (a dict) and ``loop_values`` (the state
    after the last step).

    Examples:
        >>> import numpy as np, jaxdist as jd
        >>> strategy = jd.OneDeviceStrategy()
        >>> def step_fn(ctx, total, x):
        ...     ctx.set_last_step_output("batch_sum", x.sum(), aggregation=jd.ReduceOp.SUM)
        ...     return total + x.sum()
        >>> batches = iter([np.full((2, 1), i, np.float32) for i in range(3)])
        >>> ctx = strategy.run_steps_on_dataset(step_fn, batches, iterations=3,
        ...                                     initial_loop_values=0.0)
        >>> float(ctx.loop_values), float(ctx.last_step_outputs["batch_sum"])
        (6.0, 4.0)
    """

    def __init__(self) -> None:
        self._last_step_outputs: dict[str, Any] = {}
        self._aggregations: dict[str, ReduceOp | None] = {}
        self._non_tensor_outputs: dict[str, Any] = {}
        self._pending: dict[str, Any] | None = None
        self.loop_values: Any = None
        self._lowered: Callable[[], Any] | None = None

    def set_last_step_output(self, name: str, output: Any,
                             aggregation: ReduceOp | str | None = None) -> None:
        """Record ``output`` of the current step under ``name``; after the loop, the last step's
        value is kept.

        Args:
            name: the key in ``last_step_outputs``.
            output: a pytree of arrays or `PerReplica` values (what ``strategy.run`` returned).
            aggregation: a `ReduceOp` (or "sum" / "mean") to return the value reduced across
                replicas once; None to keep one value per replica (`PerReplica` stays `PerReplica`).

        Raises:
            RuntimeError: when called outside the step function, or inside a replica function.
            ValueError: for an unknown aggregation or a non-string name.
        """
        if not isinstance(name, str):
            raise ValueError(f"name={name!r} must be a string (the key in last_step_outputs).")
        op = None if aggregation is None else ReduceOp.parse(aggregation, "aggregation")
        if self._pending is None:
            raise RuntimeError("set_last_step_output is called from inside step_fn while "
                               "run_steps_on_dataset traces it.")
        if ambient.current_replica() is not None:
            raise RuntimeError("set_last_step_output was called inside a replica function: call it "
                               "in step_fn with the value strategy.run returned (a PerReplica), "
                               "and give an aggregation to reduce it.")
        self._aggregations[name] = op
        self._pending[name] = output

    def set_non_tensor_output(self, name: str, output: Any) -> None:
        """Record a Python (non-array) value from the step function, kept as is in
        ``non_tensor_outputs``."""
        self._non_tensor_outputs[name] = output

    @property
    def last_step_outputs(self) -> dict[str, Any]:
        """The values recorded by ``set_last_step_output`` in the last step, by name."""
        return dict(self._last_step_outputs)

    @property
    def non_tensor_outputs(self) -> dict[str, Any]:
        """The values recorded by ``set_non_tensor_output``, by name."""
        return dict(self._non_tensor_outputs)

    # the loop drives the context: one step's recording while tracing, the results after
    def _begin_step(self) -> None:
        self._pending = {}

    def _end_step(self) -> dict[str, Any]:
        pending, self._pending = self._pending, None
        return pending

    def _finish(self, outputs: dict, aggregations: dict, non_tensor: dict, loop_values: Any,
                lower: Callable) -> None:
        self._last_step_outputs = dict(outputs)
        self._aggregations = dict(aggregations)
        self._non_tensor_outputs = dict(non_tensor)
        self.loop_values = loop_values
        self._lowered = lower

    def lower(self) -> Any:
        """The lowered loop program (for ``jd.gradients.clusters`` and
        ``jd.tpu.host_compute_core``)."""
        if self._lowered is None:
            raise RuntimeError("lower() is available after run_steps_on_dataset has compiled the "
                               "loop.")
        return self._lowered()


def _reduce_in_trace(policy: LayoutPolicy, op: ReduceOp | None, value: Any) -> Any:
    n = policy.num_replicas

    def one(v):
        if isinstance(v, PerReplica):
            if op is None:  # keep one value per replica, each on its replica's device
                return PerReplica(jax.lax.with_sharding_constraint(
                    v.stacked, in_trace(policy.batch_sharding)), v.owner)
            return reduce_stacked(v.stacked, op)
        v = jnp.asarray(v)
        return v * n if op is ReduceOp.SUM else v

    return jax.tree.map(one, value, is_leaf=lambda x: isinstance(x, PerReplica))


def _take(iterator: Iterator[Any], iterations: int) -> list[Any]:
    batches = []
    for _ in range(iterations):
        try:
            batches.append(next(iterator))
        except StopIteration:
            break
    if not batches:
        raise StopIteration
    if len(batches) < iterations:
        raise ValueError(f"the iterator ended after {len(batches)} of iterations={iterations} "
                         "batches: an on-device loop runs a fixed number of steps; drop the "
                         f"remainder (make the number of batches a multiple of {iterations}) or "
                         f"pad, or pass iterations={len(batches)} for the last call.")
    return batches


def _check_static(batches: list[Any], n: int) -> None:
    first_leaves, first_tree = jax.tree.flatten(batches[0])
    for i, batch in enumerate(batches):
        leaves, tree = jax.tree.flatten(batch)
        if tree != first_tree:
            raise ValueError(f"batch {i} has structure {tree}, batch 0 has {first_tree}: batches "
                             "must agree.")
        for a, b in zip(leaves, first_leaves, strict=True):
            if np.shape(a) != np.shape(b):
                raise ValueError(f"batch {i} has a leaf of shape {np.shape(a)} where batch 0 has "
                                 f"{np.shape(b)}: on-device loops need static shapes; drop the "
                                 "remainder (a ragged last batch) or pad it to the same shape.")
    for leaf in first_leaves:
        if not np.shape(leaf):
            raise ValueError("a batch leaf is a scalar: every leaf needs a batch axis 0 to split "
                             "over the replicas.")
        check_divisible(np.shape(leaf)[0], n)


def _stack(policy: LayoutPolicy, batches: list[Any]) -> Any:
    """Stack the batches on a new axis 0 and place them, each step's batch in the layout a call
    gives a batch (`LayoutPolicy.batch_layout`: rows over the replicas, a sequence over the context
    axes), in one transfer."""

    def stack(*leaves):
        layout = policy.batch_layout(np.ndim(leaves[0]), np.shape(leaves[0]))
        sharding = NamedSharding(layout.mesh, PartitionSpec(None, *layout.spec),
                                 memory_kind=layout.memory_kind)
        if all(isinstance(x, jax.Array) for x in leaves):
            return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*leaves)
        host = np.stack([np.asarray(x) for x in leaves])
        # each device of this process gets its own columns of the stack, from host views
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(stack, *batches)


def run_steps_on_dataset(policy: LayoutPolicy, programs: ProgramCache, step_fn: Callable[..., Any],
                         iterator: Iterator[Any], iterations: int, initial_loop_values: Any = None,
                         donate: bool = False) -> MultiStepContext:
    """Run ``step_fn`` over ``iterations`` batches of ``iterator`` in one compiled on-device loop.

    See `Strategy.run_steps_on_dataset`.
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn={step_fn!r} is not callable: pass step_fn(ctx, state, *inputs) "
                        "-> state.")
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise ValueError(f"iterations={iterations!r} must be an int >= 1 (the steps run per call).")
    if not isinstance(iterator, Iterator):
        raise TypeError(f"iterator={type(iterator).__name__} is not an iterator: pass "
                        "iter(dataset), so that consecutive calls continue where the last one "
                        "stopped.")
    batches = _take(iterator, iterations)
    _check_static(batches, policy.num_replicas)
    stacked = _stack(policy, batches)
    has_state = initial_loop_values is not None
    ctx = MultiStepContext()
    treedef = jax.tree.structure(batches[0])
    shapes = tuple((np.shape(x), jax.dtypes.result_type(x)) for x in jax.tree.leaves(batches[0]))
    key = ("steps_loop", iterations, has_state, donate, treedef, shapes)
    state = initial_loop_values if has_state else ()
    with policy.call_scope((state, stacked)):  # built and called on the strategy's mesh
        program, info = programs.get(
            step_fn, key, lambda weak_step: _build(policy, programs, weak_step, has_state,
                                                   iterations, donate),
            reason=((iterations, has_state, donate), shapes))
        new_state, outputs = program(state, stacked)
    ctx._finish(
        dict(zip(info["names"], outputs, strict=True)), info["aggregations"], info["non_tensor"],
        new_state if has_state else None,
        # abstract: the state may be donated; step_fn is kept alive while the context can lower
        lambda step_fn=step_fn: program.lower(*abstract((state, stacked), keep_sharding=True)))
    return ctx


def _build(policy: LayoutPolicy, programs: ProgramCache, step_fn: Callable, has_state: bool,
           iterations: int, donate: bool):
    info: dict[str, Any] = {}

    def one_step(state, batch, trace_ctx):
        inputs = batch if isinstance(batch, tuple) else (batch,)
        trace_ctx._begin_step()
        with ambient.computation(policy, "global", jax.tree.leaves(inputs), jax.tree.leaves(state)):
            new_state = (step_fn(trace_ctx, state, *inputs) if has_state
                         else step_fn(trace_ctx, *inputs))
        pending = trace_ctx._end_step()
        names = tuple(sorted(pending))
        aggregations = {k: trace_ctx._aggregations[k] for k in names}
        outs = tuple(_reduce_in_trace(policy, aggregations[k], pending[k]) for k in names)
        info.update(names=names, aggregations=aggregations, non_tensor=trace_ctx.non_tensor_outputs)
        if has_state:
            want, got = jax.tree.structure(state), jax.tree.structure(new_state)
            if want != got:
                raise ValueError(f"step_fn returned a state of structure {got}, but the loop "
                                 f"carries {want} (initial_loop_values): return the updated state "
                                 "with the same structure.")
        return (new_state if has_state else ()), outs

    def loop(state, stacked):
        first = jax.tree.map(lambda x: x[0], stacked)
        with ambient.probe():
            _, out_shapes = jax.eval_shape(lambda s, b: one_step(s, b, MultiStepContext()), state,
                                           first)
        # on Explicit axes a layout is part of the type: the loop's initial outputs carry it too
        typed = bool(explicit_axes(policy.mesh))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype,
                                                 out_sharding=s.sharding if typed else None),
                             out_shapes)
        trace_ctx = MultiStepContext()

        def body(carry, batch):
            state, _ = carry
            return one_step(state, batch, trace_ctx), None

        (state, outs), _ = jax.lax.scan(body, (state, zeros), stacked, length=iterations)
        return state, outs

    donate_argnums = (0,) if donate and has_state else None
    return StrategyFunction(policy, programs, loop, donate_argnums=donate_argnums,
                            batch_argnums=(1,)), info
