"""A tiny transformer LM whose layers go through `jd.nn.Pipeline` (shared by the pipeline tests and
worker)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdist as jd

VOCAB, D_MODEL, HEADS, MLP, LENGTH = 32, 16, 2, 32, 8
# for meshes with a "tensor" axis
RULES = [("mlp", "tensor"), ("heads", "tensor"), ("vocab", "tensor")]


def _init(names):
    return nn.with_logical_partitioning(nn.initializers.normal(0.05), names)


def _layer(mdl: nn.Module, x, pad, deterministic: bool):
    """One pre-norm attention + MLP layer with dropout (the body of `Block` and of the scan-shaped
    `ScanBlock`)."""
    h = nn.LayerNorm(
        use_bias=False, scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
    )(x)
    qkv = mdl.param("qkv", _init(("embed", "qkv", "heads", "kv")),
                    (D_MODEL, 3, HEADS, D_MODEL // HEADS))
    q, k, v = jnp.einsum("btd,dchk->cbthk", h, qkv)
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(D_MODEL // HEADS)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool)) & pad[:, None, None, :]
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    out = mdl.param("out", _init(("heads", "kv", "embed")), (HEADS, D_MODEL // HEADS, D_MODEL))
    x = x + nn.Dropout(mdl.dropout)(jnp.einsum("bhqs,bshk,hkd->bqd", weights, v, out),
                                    deterministic)
    h = nn.LayerNorm(
        use_bias=False, scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
    )(x)
    h = nn.gelu(nn.Dense(MLP, kernel_init=_init(("embed", "mlp")), use_bias=False)(h))
    h = nn.Dense(D_MODEL, kernel_init=_init(("mlp", "embed")), use_bias=False)(h)
    return x + nn.Dropout(mdl.dropout)(h, deterministic)


class Block(nn.Module):
    """What `jd.nn.Pipeline` takes: ``block(x, pad, deterministic=...) -> x``; ``pad`` is per
    example."""

    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, pad, *, deterministic: bool = True):
        return _layer(self, x, pad, deterministic)


class ScanBlock(nn.Module):
    """The same layer shaped for ``nn.scan`` (``(carry, x) -> (carry, y)``): the user's plain-scan
    model."""

    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, pad):
        return _layer(self, x, pad, True), None


class PipelineLM(nn.Module):
    num_layers: int = 8
    num_microbatches: int = 2
    schedule: str = "gpipe"
    repeats: int = 1
    dropout: float = 0.0
    remat: bool = False

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        x = nn.Embed(VOCAB, D_MODEL, embedding_init=_init(("vocab", "embed")))(tokens)
        pad = tokens != 0
        x = jd.nn.Pipeline(
            block=Block(self.dropout), num_layers=self.num_layers,
            num_microbatches=self.num_microbatches,
            schedule=self.schedule, repeats=self.repeats, remat=self.remat, name="layers",
        )(x, pad, deterministic=not train)
        x = nn.LayerNorm(use_bias=False)(x)
        return nn.Dense(VOCAB, kernel_init=_init(("embed", "vocab")), use_bias=False)(x)


def batches(n: int, batch: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(1, VOCAB, (batch, LENGTH + 1)).astype(np.int32)
        tokens[0, -3:] = 0  # some padding: the per-example mask is split with the micro-batches
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


OPTIMIZER = optax.sgd(0.5)


def make_step(model: nn.Module, train: bool):
    def loss_fn(params, batch, rng):
        logits = model.apply(params, batch["inputs"], train=train, rngs={"dropout": rng} if train
                             else None)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def step(state, batch):
        params, opt_state, rng = state
        rng, sub = jax.random.split(rng)
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, sub)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, rng), (loss, grads)

    return step


def init_state(model: nn.Module, seed: int = 0):
    params = model.init(jax.random.key(seed), jnp.ones((8, LENGTH), jnp.int32))
    return params, OPTIMIZER.init(params), jax.random.key(seed + 1)
