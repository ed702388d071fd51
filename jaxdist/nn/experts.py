"""Mixture of experts: routing, capacity, and tokens moved to their experts' devices by all-to-all.

The math of `jaxdist.nn.MoE` (linen) and `jaxdist.nn.MoELayer` (nnx), as functions of its weights:

* **routing** (float32): ``logits = x @ router``; scores by ``softmax`` or ``sigmoid``; each token
  picks its ``top_k`` experts (by score, plus the aux-loss-free bias where there is one: it steers
  the choice, never the weights), weighted by their scores (renormalised to sum to 1 with
  ``normalize_top_k``).
* **capacity per sequence** (``capacity_factor=c``): each batch row sends each expert at most
  ``ceil(c * length * top_k / num_experts)`` tokens (first come, first served, in position order,
  then by rank); the rest are dropped (their output is 0, plus the shared experts'). Per row, never
  per device: which tokens drop does not depend on the mesh, so one device's run is the reference of
  every mesh. ``capacity_factor=None`` is dropless: the capacity is the row's length (a token picks
  an expert at most once), a worst-case buffer.
* **dispatch**: ``(rows, length, d) -> (rows, experts, capacity, d)`` by a 0/1 einsum; the experts
  (stacked ``(E, ...)`` weights, a gated MLP) run on their buffers; the outputs are combined back
  weighted. Dropless with every expert local on a GPU or TPU, the picks are sorted by expert instead
  and the experts run as grouped matmuls: no worst-case buffer (on CPU ``ragged_dot`` is dense, so
  the buffer is used).
* **grouped matmuls** (``grouped_matmul=``, `GROUPED_MATMULS`): tokamax's ``ragged_dot`` (Pallas
  kernels, 3.7x `jax.lax.ragged_dot` forward + backward on an H100) where it is installed and the
  devices are GPUs or TPUs, `jax.lax.ragged_dot` elsewhere. `jaxdist.Plan.grouped_matmul` names the
  kernel.
* **expert parallelism**: inside a step of a strategy with expert axes
  (`jaxdist.ShardedStrategy(expert_axes= ...)` or ``expert_parallelism=e``), the layer runs in a
  `jax.shard_map` over the mesh: each device routes its own rows, `jax.lax.all_to_all` over the
  expert axes sends each expert's buffer to the device holding that expert (explicit collectives,
  fixed shapes) and brings the outputs back. The expert weights are split over the expert axes
  (logical name ``"expert"``), so each device holds ``1/EP`` of them and of their optimizer state.
  Runs on every backend. Dropless on GPU / TPU, the exchange is ragged instead
  (`jaxdist.nn.exchange`): only the routed rows move, each device receives them grouped by its
  local expert and runs grouped matmuls on them.
* **losses and metrics**, over the whole global batch: the Switch load-balancing loss
  ``E * sum_e f_e P_e``, the router z-loss ``mean(logsumexp(logits)^2)``, tokens per expert, the
  largest load over the mean, and the fraction of (token, expert) picks dropped.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> config = Routing(num_experts=4, top_k=2, capacity_factor=None)
    >>> weights = init_weights(jax.random.key(0), config, dim=8, hidden=16)
    >>> y, stats = apply(config, weights, jnp.ones((2, 3, 8)))
    >>> y.shape, stats.tokens_per_expert.shape, float(stats.dropped_fraction)
    ((2, 3, 8), (4,), 0.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxdist.costs.scopes import GROUPED_MATMUL_SCOPE, MOE_SCOPE
from jaxdist.nn.exchange import exchange, exchange_plan, has_ragged_exchange
from jaxdist.nn.optional import tokamax as _tokamax  # None without the extra jaxdist[tokamax]
from jaxdist.strategies import ambient
from jaxdist.strategies.layout import explicit_axes, trace_mesh
from jaxdist.strategies.plan import is_plan_mesh

__all__ = ["GROUPED_MATMULS", "ROUTERS", "Routing", "Stats", "Weights", "apply", "capacity",
           "has_tokamax", "init_weights"]

ROUTERS = ("softmax", "sigmoid")
GROUPED_MATMULS = ("ragged_dot", "tokamax")
"""The dropless path's grouped-matmul kernels: ``"ragged_dot"`` (`jax.lax.ragged_dot`, every
backend) and ``"tokamax"`` (``tokamax.ragged_dot``, the optional extra ``jaxdist[tokamax]``)."""


def has_tokamax() -> bool:
    """Whether tokamax (the optional extra ``jaxdist[tokamax]``) is importable here.

    Examples:
        >>> isinstance(has_tokamax(), bool)
        True
    """
    return _tokamax is not None


@dataclasses.dataclass(frozen=True)
class Routing:
    """How tokens are routed (static: part of the layer's definition).

    Raises:
        ValueError: for ``num_experts`` or ``top_k`` that is not an int >= 1, ``top_k >
            num_experts``, a ``capacity_factor`` that is not a number > 0 (or None), or an unknown
            ``router``.
    """

    num_experts: int
    top_k: int
    capacity_factor: float | None = None
    router: str = "softmax"
    normalize_top_k: bool = True
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu

    def __post_init__(self):
        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1.")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} > num_experts={self.num_experts}: each token picks top_k "
                f"distinct experts; use top_k <= {self.num_experts}.")
        c = self.capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
            raise ValueError(
                f"capacity_factor={c!r} cannot hold one token: give a number > 0 (1.0: each expert "
                "takes its even share of a sequence's tokens; more drops fewer) or None (dropless)."
            )
        if self.router not in ROUTERS:
            raise ValueError(f"router={self.router!r} is not one of {ROUTERS}.")


class Weights(NamedTuple):
    """The layer's weights: ``router (d, E)``, stacked experts ``gate``, ``up`` ``(E, d, h)`` and
    ``down`` ``(E, h, d)``, and the aux-loss-free routing ``bias (E,)`` (None: none)."""

    router: jax.Array
    gate: jax.Array
    up: jax.Array
    down: jax.Array
    bias: jax.Array | None = None


class Stats(NamedTuple):
    """Over the whole global batch: ``load_balance`` (Switch: 1.0 when balanced), ``z_loss``,
    ``tokens_per_expert (E,)`` (picks, before dropping), ``max_load`` (the busiest expert's picks
    over the mean), ``dropped_fraction`` (of all picks)."""

    load_balance: jax.Array
    z_loss: jax.Array
    tokens_per_expert: jax.Array
    max_load: jax.Array
    dropped_fraction: jax.Array


def capacity(config: Routing, length: int) -> int:
    """How many tokens of one sequence of ``length`` each expert takes.

    Examples:
        >>> capacity(Routing(8, 2, capacity_factor=1.0), 16), capacity(Routing(8, 2), 16)
        (4, 16)
    """
    if config.capacity_factor is None:
        return length
    return min(length, max(1, math.ceil(config.capacity_factor * length * config.top_k
                                        / config.num_experts)))


def init_weights(key: jax.Array, config: Routing, dim: int, hidden: int,
                 dtype: Any = jnp.float32) -> Weights:
    """Weights for ``config`` on inputs of width ``dim`` with experts of ``hidden`` units (lecun
    normal)."""
    k = jax.random.split(key, 4)
    init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2,
                                                out_axis=-1, batch_axis=(0,))
    e = config.num_experts
    return Weights(jax.nn.initializers.lecun_normal()(k[0], (dim, e), dtype),
                   init(k[1], (e, dim, hidden), dtype), init(k[2], (e, dim, hidden), dtype),
                   init(k[3], (e, hidden, dim), dtype))


def apply(config: Routing, weights: Weights, x: jax.Array, *, ragged: bool | None = None,
          grouped_matmul: str | None = None) -> tuple[jax.Array, Stats]:
    """The layer on ``x`` (``(rows, ..., d)``: each row a sequence, its middle axes its tokens).
    Inside a step of a strategy with expert axes of size > 1, with expert parallelism (see the
    module doc); anywhere else on whatever holds ``x``, all experts local.

    Args:
        config: the routing.
        weights: the layer's weights.
        x: the input.
        ragged: dropless: the picks sorted by expert, grouped matmuls (`jax.lax.ragged_dot`) and,
            with expert parallelism, a ragged exchange that moves only the routed rows (True); the
            worst-case buffer (False); None: ragged where the devices have ragged collectives (GPU,
            TPU), the buffer on CPU (where ``ragged_dot`` is dense). True on CPU with expert
            parallelism emulates the exchange (`jaxdist.nn.exchange`): same numbers, padded bytes.
        grouped_matmul: the ragged path's grouped-matmul kernel (`GROUPED_MATMULS`): ``"tokamax"``
            or ``"ragged_dot"``; None: tokamax where it is installed and the devices are GPUs or
            TPUs, `jax.lax.ragged_dot` elsewhere.

    Returns:
        ``(y, stats)``: ``y`` shaped like ``x``, and the `Stats` over the global batch.

    Raises:
        ValueError: when the expert axes do not divide ``num_experts``, for an unknown
            ``grouped_matmul``, ``grouped_matmul="tokamax"`` where tokamax is not installed, or a
            ``grouped_matmul`` for a call that takes no ragged path (``capacity_factor`` set, or not
            ``ragged``).
    """
    if grouped_matmul is not None and grouped_matmul not in GROUPED_MATMULS:
        raise ValueError(
            f"grouped_matmul={grouped_matmul!r} is not one of {GROUPED_MATMULS}: 'tokamax' is "
            "tokamax's ragged_dot (GPU / TPU kernels), 'ragged_dot' jax.lax.ragged_dot (None: "
            "tokamax where installed on a GPU or TPU, jax.lax.ragged_dot elsewhere).")
    if grouped_matmul == "tokamax" and _tokamax is None:
        raise ValueError(
            "grouped_matmul='tokamax' needs tokamax, which is not importable here: pip install "
            "'jaxdist[tokamax]' (or tokamax), or pass grouped_matmul='ragged_dot' (or None).")
    shape = x.shape
    rows = shape[0] if x.ndim > 1 else 1
    x3 = x.reshape(rows, -1, shape[-1])
    cap = capacity(config, x3.shape[1])
    policy = _expert_policy()
    if policy is not None and is_plan_mesh(policy.mesh):  # a plan compiles on simulated CPUs
        native = False
    else:
        device = policy.mesh.devices.flat[0] if policy is not None else jax.devices()[0]
        native = has_ragged_exchange(device.platform, device.device_kind)
    asked = ragged
    ragged = config.capacity_factor is None and (native if ragged is None else ragged)
    if grouped_matmul is not None and not ragged:
        why = "ragged=False" if asked is False else "these devices have no ragged exchange"
        fix = ("layer does not take (capacity_factor is set: it drops tokens by capacity); pass "
               "capacity_factor=None" if config.capacity_factor is not None
               else f"call does not take ({why}); pass ragged=True")
        raise ValueError(f"grouped_matmul={grouped_matmul!r} chooses the grouped matmuls of the "
                         f"dropless ragged path, which this {fix} or leave grouped_matmul=None.")
    kernel = grouped_matmul or ("tokamax" if native and _tokamax is not None else "ragged_dot")
    if config.capacity_factor is not None:
        path = "dropping_all_to_all" if policy is not None else "dropping_local"
    elif policy is not None:
        path = (f"dropless_ragged_all_to_all{'' if native else '_emulated'}" if ragged
                else "dropless_padded_all_to_all")
    else:
        path = "dropless_ragged_local" if ragged else "dropless_local"
    with jax.named_scope(MOE_SCOPE + path):  # Plan.moe_dispatch reads it from the program
        if policy is not None:
            y, sums = _expert_parallel(policy, config, weights, x3, cap, ragged, native, kernel)
        elif ragged:
            y, sums = _grouped(config, weights, x3, kernel)
        else:
            y, sums = _local(config, weights, x3, cap, (), ())
    return y.reshape(shape), _stats(config, sums)


# --------------------------------------------------------------------------------------- per device
def _route(config: Routing, weights: Weights, x: jax.Array):
    logits = jnp.einsum("bld,de->ble", x.astype(jnp.float32), weights.router.astype(jnp.float32))
    scores = jax.nn.softmax(logits, -1) if config.router == "softmax" else jax.nn.sigmoid(logits)
    choice = (scores if weights.bias is None
              else scores + jax.lax.stop_gradient(weights.bias.astype(jnp.float32)))
    _, experts = jax.lax.top_k(choice, config.top_k)  # (b, l, k)
    picked = jnp.take_along_axis(scores, experts, -1)
    if config.normalize_top_k:
        picked = picked / jnp.sum(picked, -1, keepdims=True)
    return logits, scores, experts, picked


def _local(config: Routing, weights: Weights, x: jax.Array, cap: int, expert_axes: tuple,
           batch_axes: tuple):
    """One device's rows ``x (b, l, d)``: routed, sent to the experts (over ``expert_axes`` when
    any), combined. Returns ``(y, sums)``: the statistics' sums over ``batch_axes`` (all rows)."""
    b, length, _ = x.shape
    e, k = config.num_experts, config.top_k
    logits, scores, experts, picked = _route(config, weights, x)
    onehot = jax.nn.one_hot(experts, e, dtype=jnp.int32)  # (b, l, k, e)
    # Each pick's place in its expert's buffer: first come, first served (position, then rank).
    position = jnp.cumsum(onehot.reshape(b, length * k, e), axis=1).reshape(b, length, k, e) - 1
    position = jnp.sum(position * onehot, -1)  # (b, l, k)
    kept = position < cap
    slot = jax.nn.one_hot(jnp.where(kept, position, cap), cap, dtype=x.dtype)  # dropped: no slot
    dispatch = jnp.einsum("blke,blkc->blec", onehot.astype(x.dtype), slot)
    combine = jnp.einsum("blk,blke,blkc->blec", (picked * kept).astype(x.dtype),
                         onehot.astype(x.dtype), slot)
    h = jnp.einsum("bld,blec->becd", x, dispatch)  # each expert's buffer of this device's rows
    if expert_axes:  # each device gets its experts' buffers from every device of the expert group
        h = jax.lax.all_to_all(h, expert_axes, 1, 0, tiled=True)  # (b * EP, e / EP, c, d)
    gate = jnp.einsum("gecd,edh->gech", h, weights.gate.astype(x.dtype))
    up = jnp.einsum("gecd,edh->gech", h, weights.up.astype(x.dtype))
    out = jnp.einsum("gech,ehd->gecd", config.activation(gate) * up, weights.down.astype(x.dtype))
    if expert_axes:
        out = jax.lax.all_to_all(out, expert_axes, 0, 1, tiled=True)  # back: (b, e, c, d)
    y = jnp.einsum("becd,blec->bld", out, combine)
    sums = _sums(onehot, scores, logits, jnp.sum(kept).astype(jnp.float32), b * length)
    if batch_axes:
        sums = jax.lax.psum(sums, batch_axes)
    return y, sums


def _sums(onehot, scores, logits, kept, tokens: int) -> tuple:
    """The statistics' sums over a device's rows: picks and scores per expert, the z-loss's sum,
    the picks kept, the tokens (`_stats` turns their global sums into `Stats`)."""
    return (jnp.sum(onehot, (0, 1, 2)).astype(jnp.float32), jnp.sum(scores, (0, 1)),
            jnp.sum(jax.nn.logsumexp(logits, -1) ** 2), kept, jnp.float32(tokens))


class _Picks(NamedTuple):
    """One device's routing, its (token, expert) picks sorted by expert: ``rows`` (the picked
    tokens' inputs), ``token`` (each row's token), ``weight`` (its combine weight), ``sizes (E,)``
    (rows per expert) and ``sums`` (the statistics' sums over its rows, as `_local` gives them)."""

    rows: jax.Array
    token: jax.Array
    weight: jax.Array
    sizes: jax.Array
    sums: tuple


def _sorted_picks(config: Routing, weights: Weights, x: jax.Array) -> _Picks:
    b, length, d = x.shape
    e, k = config.num_experts, config.top_k
    logits, scores, experts, picked = _route(config, weights, x)
    flat = experts.reshape(-1)  # (tokens * k,): token t's picks at t * k ... t * k + k - 1
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sums = _sums(jax.nn.one_hot(experts, e, dtype=jnp.int32), scores, logits,
                 jnp.float32(b * length * k), b * length)
    return _Picks(x.reshape(b * length, d)[token], token, picked.reshape(-1)[order].astype(x.dtype),
                  jnp.bincount(flat, length=e).astype(jnp.int32), sums)


def _tokamax_ragged_dot(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    """``tokamax.ragged_dot`` with `jax.lax.ragged_dot`'s zeros in the rows past ``sum(sizes)`` (its
    GPU kernels leave them unwritten: garbage there would reach the activation, and NaN its
    gradient)."""
    out = _tokamax.ragged_dot(lhs, rhs, sizes)
    live = jnp.arange(lhs.shape[0])[:, None] < jnp.sum(sizes)
    return jnp.where(live, out, jnp.zeros((), out.dtype))


def _grouped_experts(config: Routing, weights: Weights, rows: jax.Array, sizes: jax.Array,
                     kernel: str) -> jax.Array:
    """The experts on ``rows`` grouped by expert (``sizes`` rows each; rows past their sum give 0),
    with the grouped-matmul ``kernel`` (in its named scope: plans report it,
    `jaxdist.Plan.grouped_matmul`)."""
    dot = _tokamax_ragged_dot if kernel == "tokamax" else jax.lax.ragged_dot
    with jax.named_scope(GROUPED_MATMUL_SCOPE + kernel):
        gate = dot(rows, weights.gate.astype(rows.dtype), sizes)
        up = dot(rows, weights.up.astype(rows.dtype), sizes)
        return dot(config.activation(gate) * up, weights.down.astype(rows.dtype), sizes)


def _combine(picks: _Picks, out: jax.Array, shape: tuple) -> jax.Array:
    """Each pick's output added back to its token, weighted: ``(b, l, d)``."""
    b, length, d = shape
    return (jnp.zeros((b * length, d), out.dtype).at[picks.token].add(out * picks.weight[:, None])
            .reshape(shape))


def _grouped(config: Routing, weights: Weights, x: jax.Array, kernel: str):
    """Dropless, every expert local: the picks sorted by expert, the experts as grouped matmuls
    (``kernel``), the outputs added back to their tokens weighted; ``(y, sums)`` as `_local`."""
    picks = _sorted_picks(config, weights, x)
    out = _grouped_experts(config, weights, picks.rows, picks.sizes, kernel)
    return _combine(picks, out, x.shape), picks.sums


def _ragged_local(config: Routing, weights: Weights, x: jax.Array, expert_axes: tuple,
                  batch_axes: tuple, native: bool, kernel: str = "ragged_dot"):
    """Dropless expert parallelism on one device's rows ``x (b, l, d)``: its picks sorted by expert,
    each expert's slice sent to the device holding it by a ragged exchange (only the routed rows
    move), received grouped by local expert, the experts as grouped matmuls on them, the outputs
    sent back the same way and combined. Returns ``(y, sums)`` as `_local`."""
    picks = _sorted_picks(config, weights, x)
    b, length, d = x.shape
    tokens = b * length
    plan = exchange_plan(picks.sizes, expert_axes)
    devices = jax.lax.axis_size(expert_axes)
    # A source sends each local expert at most one row per token: the most a device can receive.
    buffer = devices * tokens * min(config.top_k, config.num_experts // devices)
    received = exchange(picks.rows, jnp.zeros((buffer, d), x.dtype), plan, axis_name=expert_axes,
                        native=native, slice_rows=tokens)
    out = _grouped_experts(config, weights, received, plan.group_sizes, kernel)
    back = exchange(out, jnp.zeros_like(picks.rows), plan.back(), axis_name=expert_axes,
                    native=native, slice_rows=tokens)
    sums = picks.sums if not batch_axes else jax.lax.psum(picks.sums, batch_axes)
    return _combine(picks, back, x.shape), sums


def _stats(config: Routing, sums) -> Stats:
    picks, score_sums, z_sum, kept, tokens = sums
    e, k = config.num_experts, config.top_k
    f = picks / (tokens * k)
    p = score_sums / tokens
    mean = jnp.mean(picks)
    return Stats(load_balance=e * jnp.sum(f * p), z_loss=z_sum / tokens, tokens_per_expert=picks,
                 max_load=jnp.max(picks) / jnp.maximum(mean, 1.0),
                 dropped_fraction=1.0 - kept / (tokens * k))


# ---------------------------------------------------------------------------------- expert parallel
def _expert_policy() -> Any | None:
    """The layout policy of the strategy step being traced, when it has expert axes of size > 1."""
    frame = ambient.current_computation()
    if frame is None or frame.kind != "global":
        return None
    policy = frame.policy
    axes = getattr(policy, "expert_axes", ())
    if not axes or policy.roles.size(axes) == 1:
        return None
    return policy


def _expert_parallel(policy: Any, config: Routing, weights: Weights, x: jax.Array, cap: int,
                     ragged: bool, native: bool, kernel: str = "ragged_dot"):
    roles = policy.roles
    axes, batch = tuple(roles.expert_axes), tuple(roles.batch_axes)
    ep = roles.size(axes)
    if config.num_experts % ep:
        raise ValueError(
            f"num_experts={config.num_experts} is not divisible by the {ep} devices of "
            f"expert_axes={axes} (sizes {[policy.mesh.shape[a] for a in axes]}): each device holds "
            f"num_experts / {ep} experts; use a multiple of {ep} experts, or expert axes whose "
            f"sizes multiply to a divisor of {config.num_experts}.")
    rows = roles.size(batch)
    if x.shape[0] % rows:
        raise ValueError(
            f"jd.nn.MoE got {x.shape[0]} rows (sequences), which the {rows} devices of "
            f"batch_axes={batch} do not divide: each device routes its own rows; the layer's input "
            "keeps the batch's rows on axis 0.")
    mesh = trace_mesh(policy.mesh)  # Auto where the step runs the mesh's Explicit axes Auto
    expert_entry, batch_entry = roles.entry("expert"), roles.replica_axis
    x_spec, w_spec = PartitionSpec(batch_entry), PartitionSpec(expert_entry)
    specs = Weights(PartitionSpec(), w_spec, w_spec, w_spec,
                    None if weights.bias is None else PartitionSpec())
    if explicit_axes(policy.mesh):  # sharding in types: retyped to the layouts the layer needs
        x = jax.sharding.reshard(x, x_spec)
        weights = Weights(*(w if w is None else jax.sharding.reshard(w, s)
                            for w, s in zip(weights, specs, strict=True)))

    def local(w: Weights, rows_x: jax.Array):
        if ragged:
            return _ragged_local(config, w, rows_x, axes, batch, native, kernel)
        return _local(config, w, rows_x, cap, axes, batch)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, x_spec),
                       out_specs=(x_spec, (PartitionSpec(),) * 5))
    return fn(weights, x)

