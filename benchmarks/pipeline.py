"""Pipeline parallelism: per-device weight + optimizer bytes with PP = 1, 2, 4, 8, and the bubble
table.

``python -m benchmarks.pipeline [--out PATH.md]`` on 8 simulated CPU devices (no timing: bytes and
FLOPs are properties of the compiled program, the same on any machine).

* **Bytes**: a transformer LM (embedding, ``L`` pipelined blocks, head) with Adam, on ``(stage=PP,
  data=8/PP)`` with no FSDP (``fsdp_axes=()``), so that only the stage axis splits anything: the
  layer weights and their Adam moments on one device, against the target ``1/PP`` of the unpipelined
  layers + the non-layer weights.
* **Bubble**: the pipeline alone (blocks only, loss = mean square), unrolled so that XLA's cost
  analysis counts every iteration: the compiled FLOPs of the pipelined train step summed over its
  devices, over the same step on one device, against ``(R M + PP - 1) / (R M)``, for ``M = PP, 2 PP,
  4 PP`` and ``R = 1, 2``.
"""

from __future__ import annotations

import argparse
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdist as jd  # noqa: E402

AUTO = jax.sharding.AxisType.Auto
D, HEADS, MLP, T, VOCAB = 64, 4, 256, 16, 256


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(use_bias=False)(x)
        qkv = nn.Dense(3 * D, use_bias=False)(h).reshape(*x.shape[:2], 3, HEADS, D // HEADS)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        w = jax.nn.softmax(jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(D // HEADS), axis=-1)
        x = x + nn.Dense(D, use_bias=False)(jnp.einsum("bhqs,bshk->bqhk", w, v).reshape(x.shape))
        h = nn.LayerNorm(use_bias=False)(x)
        return x + nn.Dense(D, use_bias=False)(nn.gelu(nn.Dense(MLP, use_bias=False)(h)))


class LM(nn.Module):
    layers: int
    micro: int = 8

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens)
        x = jd.nn.Pipeline(block=Block(), num_layers=self.layers, num_microbatches=self.micro,
                           name="layers")(x)
        return nn.Dense(VOCAB, use_bias=False)(nn.LayerNorm(use_bias=False)(x))


def strategy(pp: int) -> jd.ShardedStrategy:
    mesh = jax.make_mesh((pp, 8 // pp), ("stage", "data"), axis_types=(AUTO, AUTO))
    return jd.ShardedStrategy(mesh=mesh, batch_axes="data", fsdp_axes=(), stage_axes="stage",
                              min_shard_size=1)


def bytes_table(layers: int = 8) -> list[str]:
    model, opt = LM(layers), optax.adam(1e-3)

    def init():
        params = model.init(jax.random.key(0), jnp.ones((8, T), jnp.int32))
        return params, opt.init(params)

    shapes = jax.eval_shape(init)

    def nbytes(tree, layer_part):
        total = 0
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if ("layers" in jax.tree_util.keystr(path)) == layer_part:
                total += (leaf.addressable_shards[0].data.nbytes
                          if hasattr(leaf, "addressable_shards")
                          else (np.prod(leaf.shape) * leaf.dtype.itemsize))
        return int(total)

    base_layers, base_other = nbytes(shapes, True), nbytes(shapes, False)
    rows = ["| PP | layer weights + Adam / device | other weights + Adam / device | total / device "
            "| target (layers / PP + other) | total / unpipelined |", "|---|---|---|---|---|---|",
            f"| 1 | {base_layers:,} | {base_other:,} | {base_layers + base_other:,} | "
            f"{base_layers + base_other:,} | 1.000 |"]
    for pp in (2, 4, 8):
        state = strategy(pp).create_variables(init)
        lay, other = nbytes(state, True), nbytes(state, False)
        target = base_layers // pp + base_other
        rows.append(f"| {pp} | {lay:,} | {other:,} | {lay + other:,} | {target:,} | "
                    f"{(lay + other) / (base_layers + base_other):.3f} |")
    return rows


def _flops(compiled) -> float:
    return jd.program_cost(compiled).flops


def bubble_table(layers: int = 8, rows_per_micro: int = 4) -> list[str]:
    out = ["| PP | M | R | pipelined FLOPs (all devices) | one-device FLOPs | ratio | (R M + PP - "
           "1) / (R M) | difference |", "|---|---|---|---|---|---|---|---|"]
    for pp in (2, 4):
        for repeats in (1, 2):
            for micro in (pp, 2 * pp, 4 * pp):
                if layers % (pp * repeats):
                    continue
                pipe = jd.nn.Pipeline(block=Block(), num_layers=layers, num_microbatches=micro,
                                      schedule="gpipe" if repeats == 1 else "circular",
                                      repeats=repeats, unroll=True)
                x = jnp.ones((micro * rows_per_micro, T, D))
                params = pipe.init(jax.random.key(0), x)

                def step(p, x, pipe=pipe):
                    return jax.grad(lambda p: jnp.mean(pipe.apply(p, x) ** 2))(p)

                one = _flops(jax.jit(step).lower(params, x).compile())
                mesh = jax.make_mesh((pp, 1), ("stage", "data"), axis_types=(AUTO, AUTO),
                                     devices=jax.devices()[:pp])
                s = jd.ShardedStrategy(mesh=mesh, batch_axes="data", stage_axes="stage",
                                       min_shard_size=1)
                placed = s.create_variables(lambda params=params: params)
                piped = pp * _flops(s.jit(step, batch_argnums=(1,)).lower(placed, x).compile())
                formula = (repeats * micro + pp - 1) / (repeats * micro)
                ratio = piped / one
                out.append(f"| {pp} | {micro} | {repeats} | {piped:.3e} | {one:.3e} | {ratio:.3f} "
                           f"| {formula:.3f} | {100 * (ratio / formula - 1):+.1f}% |")
                print(out[-1], flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lines = ["## Per-device bytes (weights + Adam state), 8 layers, (stage=PP, data=8/PP), no FSDP",
             "",
             *bytes_table(), "",
             "## Bubble: compiled FLOPs of the pipelined train step vs one device", "",
             *bubble_table()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
