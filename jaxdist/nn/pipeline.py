"""`Pipeline`: a stack of identical blocks, run as a pipeline over a strategy's stage axes (GPipe,
circular).

A drop-in for the user's ``nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True,
"dropout": True}, length=L)``: the parameters are exactly that scan's (``params[<pipeline
name>]["block"]``, every leaf with a leading axis of size ``L`` whose logical name is ``"layers"``),
so one model definition and one checkpoint serve every strategy:

* off a stage axis (one device, Mirrored, FSDP / tensor parallelism without ``stage_axes``) the
  layers run as the plain scan;
* under a `ShardedStrategy` with ``stage_axes`` (``pipeline_parallelism=k``), the strategy splits
  the ``"layers"`` axis over the stages (stage ``s`` holds layers ``[s L/S, (s+1) L/S)``), and the
  layer runs MaxText's SPMD pipeline: every stage at once inside ``jax.shard_map`` over the stage
  axes only (data, FSDP and tensor axes stay with XLA), activations shifted to the next stage with
  ``lax.ppermute``, one ``lax.scan`` over ``M x R + S - 1`` iterations (``M`` micro-batches, ``R``
  circular repeats, ``S`` stages); the backward pass is autodiff's (GPipe: all forwards, then all
  backwards), each layer rematerialised with ``remat``. Stage ``s`` idles for ``S - 1`` iterations:
  the bubble, ``(S - 1) / (R M + S - 1)``.

Schedules. ``"gpipe"``: each stage runs its ``L / S`` consecutive layers once per micro-batch.
``"circular"`` (``repeats=R``): each micro-batch goes ``R`` times around the stages, running ``L /
(S R)`` layers per visit: the bubble shrinks ``R``-fold for the same ``M``. The stored layout is
nn.scan's (stage ``s`` holds a contiguous block of layers), and a circular visit ``r`` of stage
``s`` runs layers ``[(r S + s) K, (r S + s + 1) K)`` (``K = L / (S R)``), so the step first moves
each layer to the stage that runs it (an all-to-all of ``(R - 1) / R`` of the layer weights, and its
transpose for the gradients); GPipe moves no weights. 1F1B and interleaved 1F1B are not offered:
they interleave one micro-batch's backward with later micro-batches' forwards, and in one SPMD
program autodiff runs the whole backward after the whole forward.

Micro-batches: a batch of ``B`` rows (per replica ``B / D``) is split into ``M`` micro-batches of
``B / M`` rows, micro-batch ``m`` taking rows ``m, m + M, m + 2M, ...`` (so that each keeps its rows
on the data axes they are on). ``M`` must divide the per-replica batch. Extra arguments (masks,
positions) whose leading dimension is the batch's are split the same way; others, and keyword
arguments, go whole to every layer.

Randomness: with a ``"dropout"`` rng, layer ``l`` of micro-batch ``m`` draws from ``fold_in(k_l,
m)``, ``k_l`` the ``l``-th of ``split(make_rng("dropout"), L)``, in every path (pipelined or plain),
so a model gives the same numbers under every strategy. (Dropout masks are drawn per micro-batch, so
they differ from a plain ``nn.scan`` over the whole batch; without dropout the plain scan's numbers
are the pipeline's.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jaxdist.strategies import ambient
from jaxdist.strategies.layout import LAYERS, explicit_axes, is_box

__all__ = ["SCHEDULES", "Pipeline", "bubble_fraction"]

SCHEDULES = ("gpipe", "circular")
"""The schedules `Pipeline` runs."""


def bubble_fraction(num_stages: int, num_microbatches: int, repeats: int = 1) -> float:
    """The idle share of a pipelined step: ``(S - 1) / (R M + S - 1)``.

    The step runs ``R M + S - 1`` iterations of ``L / (S R)`` layers on one micro-batch per stage
    where an unpipelined one would run ``R M``: its compiled FLOPs are ``(R M + S - 1) / (R M)`` of
    the unpipelined step's.

    Examples:
        >>> bubble_fraction(4, 4), bubble_fraction(4, 16), bubble_fraction(4, 4, repeats=2)
        (0.42857142857142855, 0.15789473684210525, 0.2727272727272727)
    """
    return (num_stages - 1) / (repeats * num_microbatches + num_stages - 1)


def _checked(block: nn.Module, x: jax.Array, y: Any) -> jax.Array:
    if not isinstance(y, jax.Array) or y.shape != x.shape or y.dtype != x.dtype:
        raise ValueError(
            f"block {type(block).__name__} returned {getattr(y, 'shape', type(y).__name__)} "
            f"{getattr(y, 'dtype', '')} for an input of {x.shape} {x.dtype}: a pipelined block "
            "maps x to an x of the same shape and dtype (return the new x only, not a (carry, "
            "output) pair).")
    return y


def _unbox(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.value if is_box(x) else x, tree, is_leaf=is_box)


def _box_layers(tree: Any) -> Any:
    """Leaves the scan left unboxed (the block annotates nothing) get the logical names ``("layers",
    None, ...)``, so a strategy with stage axes splits them over the stages."""

    def box(x):
        return x if is_box(x) else nn.LogicallyPartitioned(x, (LAYERS, *[None] * (np.ndim(x) - 1)))

    return jax.tree.map(box, tree, is_leaf=is_box)


class Pipeline(nn.Module):
    """``num_layers`` copies of ``block`` run one after the other: a pipeline over a strategy's
    stage axes, the plain ``nn.scan`` elsewhere (see the module doc).

    Attributes:
        block: a linen module for ONE layer, called ``block(x, *args, **kwargs) -> x`` (same shape
            and dtype); created where you write it (e.g. inside the parent's ``@nn.compact``): the
            pipeline clones it, and its parameters live under ``params[<pipeline name>]["block"]``.
            Only ``"params"`` variables (no BatchNorm statistics, no cache).
        num_layers: ``L``, the number of layers (the leading axis of every parameter).
        num_microbatches: ``M``: the batch is split into ``M`` micro-batches; must divide the
            per-replica batch.
        schedule: ``"gpipe"`` or ``"circular"``.
        repeats: ``R``, the circular schedule's trips around the stages (1 for ``"gpipe"``).
        remat: recompute each layer's activations in the backward pass: True (``jax.checkpoint``),
            False, or a ``jax.checkpoint_policies`` policy.
        unroll: unroll the loops over layers and pipeline iterations (longer compiles; XLA's cost
            analysis, which counts a loop's body once, then counts every iteration: how the bubble
            is measured).

    Raises (when called):
        ValueError: for an unknown ``schedule``, ``repeats`` or ``num_microbatches`` < 1, ``repeats
            > 1`` with ``"gpipe"``, ``num_microbatches`` that does not divide the per-replica batch,
            ``num_layers`` that the stages x repeats do not divide, a circular schedule with fewer
            micro-batches than stages, or a block that returns another shape or holds variables
            other than ``"params"``.

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxdist as jd
        >>> class Block(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return x + nn.Dense(x.shape[-1])(nn.relu(x))
        >>> model = jd.nn.Pipeline(block=Block(), num_layers=4, num_microbatches=2)
        >>> x = jnp.ones((4, 8))
        >>> params = model.init(jax.random.key(0), x)
        >>> nn.unbox(params)["params"]["block"]["Dense_0"]["kernel"].shape
        (4, 8, 8)
        >>> mesh = jax.make_mesh((4, 2), ("stage", "data"),
        ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
        >>> pp = jd.ShardedStrategy(mesh=mesh, batch_axes="data", stage_axes="stage",
        ...                         min_shard_size=1)
        >>> placed = pp.create_variables(model.init, jax.random.key(0), x)
        >>> placed["params"]["block"]["Dense_0"]["kernel"].value.sharding.spec
        P('stage',)
        >>> y = pp.jit(model.apply, batch_argnums=(1,))(placed, x)
        >>> bool(jnp.allclose(y, model.apply(params, x), rtol=1e-5))
        True
    """

    block: nn.Module
    num_layers: int
    num_microbatches: int = 1
    schedule: str = "gpipe"
    repeats: int = 1
    remat: bool | Callable[..., Any] = False
    unroll: bool = False

    def _check(self) -> None:
        if not isinstance(self.block, nn.Module):
            raise ValueError(f"block={self.block!r} is not a flax.linen Module: pass one layer, "
                             "e.g. block=Block(64).")
        for name in ("num_layers", "num_microbatches", "repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {SCHEDULES}.")
        if self.schedule == "gpipe" and self.repeats != 1:
            raise ValueError(
                f"repeats={self.repeats} with schedule='gpipe': GPipe runs each stage's layers "
                "once per micro-batch; use schedule='circular' for repeats > 1.")

    def _check_batch(self, x: jax.Array, replicas: int) -> None:
        if np.ndim(x) < 1:
            raise ValueError(f"Pipeline got an input of shape {np.shape(x)}: it needs a leading "
                             "batch dimension.")
        batch, m = x.shape[0], self.num_microbatches
        if batch % replicas or (batch // replicas) % m:
            per = batch // replicas if batch % replicas == 0 else batch / replicas
            raise ValueError(
                f"num_microbatches={m} does not divide the per-replica batch {per} (global batch "
                f"{batch} over {replicas} replica(s)): pick num_microbatches among the divisors of "
                f"{per}, or make the global batch a multiple of {m * replicas}.")

    def _layer_fn(self, kwargs: dict[str, Any], dropout: bool) -> Callable:
        """``(params_of_one_layer, key, x, args) -> x``: one layer, applied functionally."""
        block = self.block.clone(parent=None, name=None)

        def layer(params, key, x, args):
            rngs = {"dropout": jax.random.wrap_key_data(key)} if dropout else None
            y = block.apply({"params": params}, x, *args, rngs=rngs, **kwargs)
            return _checked(self.block, x, y)

        if self.remat is True:
            layer = jax.checkpoint(layer)
        elif callable(self.remat):
            layer = jax.checkpoint(layer, policy=self.remat)
        return layer

    def _run_layers(self, layer: Callable, params: Any, keys: jax.Array, x: jax.Array, m: Any,
                    args: tuple) -> Any:
        """``x`` through the stacked layers of ``params`` (leading axis: layers), micro-batch
        ``m``'s keys."""

        def body(h, per_layer):
            p, k = per_layer
            key = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(k), m))
            return layer(p, key, h, args), None

        return lax.scan(body, x, (params, keys), unroll=self.unroll)[0]

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        self._check()
        if self.is_initializing():
            return self._init_scan(x, args, kwargs)
        variables = self.variables
        extra = sorted(c for c, tree in variables.items() if c != "params" and "block" in tree)
        if extra:
            raise ValueError(
                f"block {type(self.block).__name__} holds variables of collection(s) {extra}: "
                "Pipeline carries only 'params' (no BatchNorm statistics or caches) from layer to "
                "layer.")
        params = _unbox(variables["params"]["block"])
        dropout = self.has_rng("dropout")
        base = self.make_rng("dropout") if dropout else jax.random.key(0)
        if not jnp.issubdtype(base.dtype, jax.dtypes.prng_key):
            base = jax.random.wrap_key_data(base)
        keys = jax.random.key_data(jax.random.split(base, self.num_layers))
        layer = self._layer_fn(kwargs, dropout)
        computation = ambient.current_computation()
        policy = (computation.policy if computation is not None and computation.kind == "global"
                  else None)
        stages = policy.roles.size(policy.roles.stage_axes) if policy is not None else 1
        # the plain scan (micro-batches only draw the dropout masks): M must divide the batch
        if stages == 1:
            self._check_batch(x, 1)
            return self._plain(layer, params, keys, x, args, dropout)
        self._check_batch(x, policy.num_replicas)
        return self._pipelined(layer, params, keys, x, args, policy, stages)

    def _init_scan(self, x: jax.Array, args: tuple, kwargs: dict[str, Any]) -> jax.Array:
        """The parameters are created by ``nn.scan`` itself (that scan's, rng for rng)."""

        def body(module, carry, *xs):
            return _checked(module, carry, module(carry, *xs, **kwargs)), None

        scan = nn.scan(body, variable_axes={"params": 0}, length=self.num_layers,
                       split_rngs={"params": True, "dropout": True},
                       in_axes=(nn.broadcast,) * len(args),
                       metadata_params={nn.PARTITION_NAME: LAYERS})
        # A block created outside any module is this module's child "block" already; one created in
        # the parent's @nn.compact belongs to the parent: clone it here, under the same name.
        block = self.block if self.block.parent is self else self.block.clone(parent=self,
                                                                              name="block")
        y = scan(block, x, *args)[0]
        # Unannotated leaves get the "layers" name too (only the box is added).
        self.put_variable("params", "block", _box_layers(self.variables["params"]["block"]))
        return y

    def _split(self, x: jax.Array, batch: int) -> jax.Array:
        # micro-batch i: rows i, i + M, ... (each keeps its rows on their data shards)
        m = self.num_microbatches
        return x.reshape(batch // m, m, *x.shape[1:]).swapaxes(0, 1)

    def _merge(self, xs: jax.Array) -> jax.Array:
        return xs.swapaxes(0, 1).reshape(-1, *xs.shape[2:])

    def _split_args(self, args: tuple, batch: int) -> tuple[tuple, tuple[bool, ...]]:
        split = tuple(isinstance(a, jax.Array | np.ndarray) and np.ndim(a) >= 1
                      and a.shape[0] == batch for a in args)
        return tuple(self._split(jnp.asarray(a), batch) if s else a
                     for a, s in zip(args, split, strict=True)), split

    def _plain(self, layer, params, keys, x, args, dropout) -> jax.Array:
        if not dropout or self.num_microbatches == 1:
            return self._run_layers(layer, params, keys, x, 0, args)
        batch = x.shape[0]
        xs = self._split(x, batch)
        margs, split = self._split_args(args, batch)

        def one(m, xm, am):
            full = tuple(a if s else b for a, b, s in zip(am, margs, split, strict=True))
            return self._run_layers(layer, params, keys, xm, m, full)

        batched = tuple(a if s else None for a, s in zip(margs, split, strict=True))
        ys = jax.vmap(one, in_axes=(0, 0, tuple(0 if s else None for s in split)))(
            jnp.arange(self.num_microbatches), xs, batched)
        return self._merge(ys)

    def _pipelined(self, layer, params, keys, x, args, policy, stages) -> jax.Array:
        explicit = explicit_axes(policy.mesh)
        if not explicit:
            return self._pipeline_loop(layer, params, keys, x, args, policy, stages)
        # On Explicit axes (a layout is part of a value's type) the loop's reshapes and constraints
        # run with the axes Auto; the output comes back typed as the input was.
        return jax.sharding.auto_axes(
            lambda p, k, h, a: self._pipeline_loop(layer, p, k, h, a, policy, stages),
            axes=explicit, out_sharding=jax.typeof(x).sharding)(params, keys, x, args)

    def _pipeline_loop(self, layer, params, keys, x, args, policy, stages) -> jax.Array:
        roles = policy.roles
        num_layers, repeats, m_count = self.num_layers, self.repeats, self.num_microbatches
        if num_layers % (stages * repeats):
            raise ValueError(
                f"num_layers={num_layers} is not divisible by the {stages} stages x "
                f"repeats={repeats}: each stage runs num_layers / (stages x repeats) layers per "
                f"visit; use a multiple of {stages * repeats} layers, or another stage count or "
                "repeats.")
        if repeats > 1 and m_count < stages:
            raise ValueError(
                f"num_microbatches={m_count} is less than the {stages} stages with "
                "schedule='circular': a micro-batch comes back to stage 0 before the stage is "
                f"free; use num_microbatches >= {stages}.")
        per = num_layers // (stages * repeats)
        stage_spec = PartitionSpec(roles.entry("stage"))
        ambient_mesh = jax.sharding.get_abstract_mesh()  # the step's, Explicit axes made Auto
        mesh = (ambient_mesh if tuple(ambient_mesh.axis_names) == tuple(policy.mesh.axis_names)
                else policy.mesh)

        # (L, ...) -> (S, R, K, ...): visit r of stage s runs layers (r S + s) K ...
        def by_stage(a):
            a = a.reshape(repeats, stages, per, *a.shape[1:]).swapaxes(0, 1)
            return jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(mesh, stage_spec))

        staged, staged_keys = jax.tree.map(by_stage, params), by_stage(keys)
        batch = x.shape[0]
        xs = self._split(x, batch)
        margs, split = self._split_args(args, batch)
        axes = roles.stage_axes
        iterations = repeats * m_count + stages - 1
        run_layers = self._run_layers

        def stage_fn(w, k, xs, margs):
            w, k = jax.tree.map(lambda a: a[0], (w, k))
            s = lax.axis_index(axes)
            zeros = lax.pcast(jnp.zeros_like(xs[0]), axes, to="varying")
            buf = lax.pcast(jnp.zeros_like(xs), axes, to="varying") if repeats > 1 else None
            outs = lax.pcast(jnp.zeros_like(xs), axes, to="varying")

            def step(carry, t):
                recv, buf, outs = carry
                first = xs[t % m_count]
                if repeats > 1:
                    first = jnp.where(t < m_count, first, buf[t % m_count])
                h = jnp.where(s == 0, first, recv)
                tt = t - s
                m = tt % m_count
                r = jnp.clip(tt // m_count, 0, repeats - 1)
                am = tuple(a[m] if sp else a for a, sp in zip(margs, split, strict=True))
                y = run_layers(layer, jax.tree.map(lambda a: a[r], w), k[r], h, m, am)
                recv = lax.ppermute(y, axes, [(i, (i + 1) % stages) for i in range(stages)])
                done = (t - stages + 1) % m_count  # the micro-batch the last stage just finished
                if repeats > 1:  # stage 0 keeps it until its next visit
                    buf = lax.dynamic_update_index_in_dim(buf, recv, done, 0)
                final = t - stages + 1 >= (repeats - 1) * m_count
                kept = lax.dynamic_index_in_dim(outs, done, 0, keepdims=False)
                outs = lax.dynamic_update_index_in_dim(outs, jnp.where(final, y, kept), done, 0)
                return (recv, buf, outs), None

            (_, _, outs), _ = lax.scan(step, (zeros, buf, outs), jnp.arange(iterations),
                                       unroll=self.unroll)
            return outs[None]

        arg_specs = tuple(PartitionSpec() for _ in margs)
        run = jax.shard_map(stage_fn, mesh=mesh, out_specs=stage_spec, axis_names=set(axes),
                            in_specs=(stage_spec, stage_spec, PartitionSpec(), arg_specs))
        outs = run(staged, staged_keys, xs, tuple(jnp.asarray(a) for a in margs))
        return self._merge(outs[-1])

