"""`MoE`: a mixture-of-experts layer for Flax linen, expert-parallel on a strategy's expert axes.

A drop-in feed-forward block ``(..., d) -> (..., d)`` (axis 0: the batch's rows; each row one
sequence). Its math is `jaxdist.nn.experts` (routing in float32, capacity per sequence, all-to-all
over the expert axes); outside a strategy, or with no expert axes, it computes the same thing with
every expert local, so a one-device run is its own reference.

Weights, stacked over the experts and annotated with logical names, so expert parallelism composes
with FSDP and tensor parallelism by the strategy's rules: ``router (d, E)`` ``("embed", None)``;
``wi_gate``, ``wi_up`` ``(E, d, h)`` ``("expert", "embed", "mlp")``; ``wo (E, h, d)`` ``("expert",
"mlp", "embed")``; shared experts ``shared_wi_gate``, ``shared_wi_up`` ``(d, s h)`` and
``shared_wo``. With ``router_bias=True`` the aux-loss-free bias ``(E,)`` lives in the
``"router_bias"`` collection (not a parameter: update it with `update_router_bias`).

The auxiliary loss (``load_balance_weight`` x the Switch load-balancing loss + ``z_loss_weight`` x
the router z-loss) is sown in the ``"moe_losses"`` collection and the router metrics in
``"moe_metrics"`` on every call but ``init`` (whose variables hold weights only): apply with
``mutable=["moe_losses", "moe_metrics"]`` and add `moe_loss` of what comes back to the loss.

Examples:
    >>> import jax, jax.numpy as jnp, jaxdist as jd
    >>> layer = jd.nn.MoE(num_experts=4, top_k=2, hidden_dim=16, capacity_factor=1.0)
    >>> x = jnp.ones((2, 8, 8))
    >>> variables = layer.init(jax.random.key(0), x)
    >>> sorted(variables)  # weights only
    ['params']
    >>> y, sown = layer.apply(variables, x, mutable=["moe_losses", "moe_metrics"])
    >>> y.shape, float(jd.nn.moe_loss(sown)) > 0, len(sown["moe_losses"]["aux_loss"])
    ((2, 8, 8), True, 1)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxdist.nn.experts import Routing, Stats, Weights, apply

__all__ = ["SOWN", "MoE", "moe_loss", "moe_metrics", "update_router_bias"]

SOWN = ("moe_losses", "moe_metrics")
"""The collections `MoE` sows into on every call (that call's values, not state between steps)."""

EXPERT_WEIGHTS = {"wi_gate": ("expert", "embed", "mlp"), "wi_up": ("expert", "embed", "mlp"),
                  "wo": ("expert", "mlp", "embed")}
"""The stacked expert weights' names and logical axes."""


def stacked_init() -> Callable:
    """Lecun-normal per expert: fan-in is each expert's own input width (axis 0: the experts)."""
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2,
                                            out_axis=-1, batch_axis=(0,))


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer (see the module doc).

    Attributes:
        num_experts: how many experts (stacked on a leading axis, split over the expert axes).
        top_k: experts per token.
        hidden_dim: each expert's hidden width.
        capacity_factor: tokens each expert takes per sequence, as a multiple of its even share
            (``length * top_k / num_experts``); the rest drop. None: dropless.
        router: ``"softmax"`` or ``"sigmoid"`` scores.
        normalize_top_k: renormalise the picked experts' weights to sum to 1.
        shared_experts: how many always-on experts (one gated MLP of ``shared_experts * hidden_dim``
            units).
        activation: the gate's activation (``silu``: SwiGLU experts).
        load_balance_weight: the Switch load-balancing loss's weight in the sown loss.
        z_loss_weight: the router z-loss's weight in the sown loss.
        router_bias: route with the aux-loss-free bias (collection ``"router_bias"``; see
            `update_router_bias`).
        ragged: dropless only: sort the picks by expert, run grouped matmuls and (expert parallel)
            exchange only the routed rows (True), or use worst-case buffers (False); None: ragged on
            GPU / TPU, buffers on CPU. See `jaxdist.nn.experts.apply`.
        grouped_matmul: the ragged path's grouped-matmul kernel: ``"tokamax"`` (the optional extra
            ``jaxdist[tokamax]``) or ``"ragged_dot"`` (`jax.lax.ragged_dot`); None: tokamax where
            installed on a GPU or TPU, ``ragged_dot`` elsewhere. See `jaxdist.nn.experts.apply`.
        dtype: the computation's dtype (None: the input's); the router always computes in float32.
        param_dtype: the weights' dtype.
    """

    num_experts: int
    top_k: int
    hidden_dim: int
    capacity_factor: float | None = None
    router: str = "softmax"
    normalize_top_k: bool = True
    shared_experts: int = 0
    activation: Callable[[jax.Array], jax.Array] = nn.silu
    load_balance_weight: float = 0.01
    z_loss_weight: float = 0.0
    router_bias: bool = False
    ragged: bool | None = None
    grouped_matmul: str | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        config = Routing(self.num_experts, self.top_k, self.capacity_factor, self.router,
                         self.normalize_top_k, self.activation)
        d, e, h = x.shape[-1], self.num_experts, self.hidden_dim
        router = self.param(
            "router", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", None)),
            (d, e), self.param_dtype)
        shapes = {"wi_gate": (e, d, h), "wi_up": (e, d, h), "wo": (e, h, d)}
        stacked = {name: self.param(name, nn.with_logical_partitioning(stacked_init(), axes),
                                    shapes[name], self.param_dtype)
                   for name, axes in EXPERT_WEIGHTS.items()}
        bias = (self.variable("router_bias", "bias", jnp.zeros, (e,), jnp.float32).value
                if self.router_bias else None)
        dtype = self.dtype or x.dtype
        weights = Weights(router, stacked["wi_gate"], stacked["wi_up"], stacked["wo"], bias)
        y, stats = apply(config, weights, x.astype(dtype), ragged=self.ragged,
                         grouped_matmul=self.grouped_matmul)
        if self.shared_experts:
            width = self.shared_experts * h

            def dense(name, features, axes):
                init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)
                return nn.DenseGeneral(features, use_bias=False, dtype=dtype,
                                       param_dtype=self.param_dtype, kernel_init=init, name=name)

            xs = x.astype(dtype)
            hidden = self.activation(dense("shared_wi_gate", width, ("embed", "mlp"))(xs))
            y = y + dense("shared_wo", d, ("mlp", "embed"))(
                hidden * dense("shared_wi_up", width, ("embed", "mlp"))(xs))
        # init returns weights only: sown values never ride along as variables
        if not self.is_initializing():
            self.sow("moe_losses", "aux_loss", self.load_balance_weight * stats.load_balance
                     + self.z_loss_weight * stats.z_loss)
            for name, value in stats._asdict().items():
                self.sow("moe_metrics", name, value)
        return y


def moe_loss(sown: Any) -> jax.Array:
    """The sum of the auxiliary losses the MoE layers sowed: ``sown`` is what ``apply(..., mutable=[
    "moe_losses", ...])`` returned (or its ``"moe_losses"`` collection); 0 when there is none.

    Examples:
        >>> float(moe_loss({"moe_losses": {"layer": {"aux_loss": (1.5,)}}}))
        1.5
    """
    losses = sown.get("moe_losses", sown) if isinstance(sown, dict) else sown
    return sum((jnp.asarray(v, jnp.float32) for v in jax.tree.leaves(losses)), jnp.float32(0))


def moe_metrics(sown: Any) -> dict[str, jax.Array]:
    """The router metrics the MoE layers sowed, as scalars over every layer: ``moe_max_load`` (the
    largest of the layers' busiest-expert loads over the mean), ``moe_dropped_fraction`` and
    ``moe_load_balance`` (their means); empty when there is none.

    Examples:
        >>> import jax.numpy as jnp
        >>> m = moe_metrics({"moe_metrics": {"a": {"max_load": (2.0,), "dropped_fraction": (0.5,),
        ...                                        "load_balance": (1.0,)}}})
        >>> {k: float(v) for k, v in m.items()}
        {'moe_max_load': 2.0, 'moe_dropped_fraction': 0.5, 'moe_load_balance': 1.0}
    """
    layers = sown.get("moe_metrics", {}) if isinstance(sown, dict) else {}
    found: dict[str, list] = {"max_load": [], "dropped_fraction": [], "load_balance": []}

    def visit(tree):
        if isinstance(tree, dict):
            for key, value in tree.items():
                if key in found:
                    found[key].extend(jnp.asarray(v, jnp.float32) for v in jax.tree.leaves(value))
                else:
                    visit(value)

    visit(layers)
    if not found["max_load"]:
        return {}
    return {"moe_max_load": jnp.max(jnp.stack(found["max_load"])),
            "moe_dropped_fraction": jnp.mean(jnp.stack(found["dropped_fraction"])),
            "moe_load_balance": jnp.mean(jnp.stack(found["load_balance"]))}


def update_router_bias(bias: jax.Array, stats: Stats | jax.Array, rate: float = 1e-3) -> jax.Array:
    """The aux-loss-free balancing step (DeepSeek-V3): each expert's routing bias moves by ``rate``
    towards balance: down where it took more picks than the mean, up where fewer. ``stats``: the
    layer's `Stats`, or its ``tokens_per_expert``.

    Examples:
        >>> import jax.numpy as jnp
        >>> update_router_bias(jnp.zeros(3), jnp.array([4.0, 1.0, 1.0]), rate=0.1).tolist()
        [-0.10000000149011612, 0.10000000149011612, 0.10000000149011612]
    """
    load = getattr(stats, "tokens_per_expert", stats)
    return bias + rate * jnp.sign(jnp.mean(load) - load)
