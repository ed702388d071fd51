"""Flax nnx counterparts of jaxdist's linen layers, named as Flax names them: ``jd.nn.nnx.MoE``.

`MoE` is `jaxdist.nn.MoE`'s layer as an ``nnx.Module``: the same math (`jaxdist.nn.experts`), the
same weights and logical names (``out_sharding`` metadata, laid out by the strategy's rules: experts
over the expert axes). After each call its ``aux_loss`` (an ``nnx.Intermediate``:
``load_balance_weight`` x the load-balancing loss + ``z_loss_weight`` x the z-loss) and ``stats``
(``nnx.Intermediate``s named as `jaxdist.nn.experts.Stats`' fields) hold the call's values: add
``layer.aux_loss[...]`` to the training loss.

Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jaxdist as jd
    >>> layer = jd.nn.nnx.MoE(8, num_experts=4, top_k=2, hidden_dim=16, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 3, 8))).shape, float(layer.aux_loss[...]) > 0
    ((2, 3, 8), True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.nn.experts import Routing, Stats, Weights, apply
from jaxdist.nn.moe import EXPERT_WEIGHTS, stacked_init

__all__ = ["MoE"]


class MoE(nnx.Module):
    """A mixture-of-experts feed-forward layer on inputs of width ``dim`` (arguments as
    `jaxdist.nn.MoE`'s)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, hidden_dim: int, *,
                 capacity_factor: float | None = None, router: str = "softmax",
                 normalize_top_k: bool = True, shared_experts: int = 0,
                 activation: Callable[[jax.Array], jax.Array] = nnx.silu,
                 load_balance_weight: float = 0.01, z_loss_weight: float = 0.0,
                 router_bias: bool = False, ragged: bool | None = None,
                 grouped_matmul: str | None = None, dtype: Any = None,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.config = Routing(num_experts, top_k, capacity_factor, router, normalize_top_k,
                              activation)
        e, h = num_experts, hidden_dim
        lecun = nnx.initializers.lecun_normal()

        # laid out by the strategy (its rules), not eagerly by Flax's ambient mesh
        def param(value, names):
            return nnx.Param(value, out_sharding=names, eager_sharding=False)

        self.router = param(lecun(rngs.params(), (dim, e), param_dtype), ("embed", None))
        shapes = {"wi_gate": (e, dim, h), "wi_up": (e, dim, h), "wo": (e, h, dim)}
        for name, shape in shapes.items():
            setattr(self, name, param(stacked_init()(rngs.params(), shape, param_dtype),
                                      EXPERT_WEIGHTS[name]))
        self.bias = nnx.data(nnx.BatchStat(jnp.zeros((e,), jnp.float32)) if router_bias else None)
        shared = None
        if shared_experts:
            width = shared_experts * h
            shared = nnx.Dict(
                wi_gate=param(lecun(rngs.params(), (dim, width), param_dtype), ("embed", "mlp")),
                wi_up=param(lecun(rngs.params(), (dim, width), param_dtype), ("embed", "mlp")),
                wo=param(lecun(rngs.params(), (width, dim), param_dtype), ("mlp", "embed")))
        self.shared = nnx.data(shared)
        self.activation = activation
        self.load_balance_weight, self.z_loss_weight = load_balance_weight, z_loss_weight
        self.dtype, self.ragged, self.grouped_matmul = dtype, ragged, grouped_matmul
        self.aux_loss = nnx.Intermediate(jnp.zeros((), jnp.float32))
        self.stats = nnx.Dict({
            name: nnx.Intermediate(jnp.zeros((e,) if name == "tokens_per_expert" else ()))
            for name in Stats._fields})

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.dtype or x.dtype
        bias = None if self.bias is None else self.bias[...]
        weights = Weights(self.router[...], self.wi_gate[...], self.wi_up[...], self.wo[...], bias)
        y, stats = apply(self.config, weights, x.astype(dtype), ragged=self.ragged,
                         grouped_matmul=self.grouped_matmul)
        if self.shared is not None:
            xs, s = x.astype(dtype), self.shared
            hidden = (self.activation(xs @ s["wi_gate"][...].astype(dtype))
                      * (xs @ s["wi_up"][...].astype(dtype)))
            y = y + hidden @ s["wo"][...].astype(dtype)
        self.aux_loss[...] = (self.load_balance_weight * stats.load_balance
                              + self.z_loss_weight * stats.z_loss)
        for name, value in stats._asdict().items():
            self.stats[name][...] = value
        return y
