"""Train a character-level transformer LM on Python's help pages with FSDP x tensor parallelism.

A decoder-only transformer (causal self-attention, MLP, RMSNorm, learned positions) written in plain
Flax linen and annotated the Flax way (MaxText / T5X / Levanter): every parameter names its logical
axes with ``nn.with_logical_partitioning``, and one rule table maps them to the mesh. Nothing in the
model knows about devices. In the Megatron pattern, attention heads, the MLP hidden layer and the
vocabulary are split over the ``"model"`` axis; ``"embed"`` has no rule, so ``ShardedStrategy``
shards those dimensions FSDP-style over the ``"replica"`` axis::

    # mesh (replica, model) = (4, 2) on 8 devices
    strategy = jd.ShardedStrategy(model_parallelism=2, logical_axis_rules=LOGICAL_AXIS_RULES,
                                  activation_axes=ACTIVATION_AXES)

Between blocks the model constrains its activations with ``nn.with_logical_constraint(x, ("batch",
"length", "embed"))``: inside ``strategy.scope()`` the strategy's rules are Flax's rules, so the
batch axis stays split over ``"replica"``; on a strategy without rules (``OneDeviceStrategy``,
``MirroredStrategy``) it is a no-op.

The data ship with Python: the English text of its help pages (``pydoc_data/topics.py``, about 0.5
MB), character level, with the last 10% held out for validation. Run it with ``./scripts/demo-lm``
or::

    .venv/bin/python examples/char_lm.py --devices 8 --strategy fsdp_tp --steps 300
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

import jaxdist as jd


def logical_axis_rules(batch_axes: tuple[str, ...] = ("replica",),
                       model_axis: str | None = "model") -> tuple:
    """The rule table (Flax's format) naming a mesh's axes: ``batch_axes`` for the batch rows,
    ``model_axis`` (None: no tensor parallelism) for heads, MLP units and the vocabulary.
    ``"embed"``, ``"length"`` and ``"position"`` have no rule: parameters split those dimensions
    FSDP-style (``ShardedStrategy``'s fallback), activations keep them whole (Flax's).

    Example:
        >>> logical_axis_rules(("data", "fsdp"), "tensor")[:2]
        (('batch', ('data', 'fsdp')), ('heads', 'tensor'))
    """
    batch = batch_axes[0] if len(batch_axes) == 1 else tuple(batch_axes)
    rules = [("batch", batch)]  # activations: the batch rows split over the replicas
    if model_axis is not None:
        rules += [
            ("heads", model_axis),  # attention: each model shard owns whole heads
            ("mlp", model_axis),  # MLP hidden units
            ("vocab", model_axis),  # embedding rows and output logits
        ]
    return (*rules, ("kv", None))  # the dimension within a head stays whole


LOGICAL_AXIS_RULES = logical_axis_rules()
"""The rule table of the short-form mesh ``(replica, model)``."""

ACTIVATION_AXES = ("batch",)
"""Logical names of the rule table that only activations use (no parameter has a batch axis)."""


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """The transformer's sizes.

    Attributes:
        vocab_size: characters (padded up to a multiple of 8, so "vocab" splits evenly over the
            model axis).
        d_model: the residual stream's width ("embed").
        num_heads: attention heads ("heads"; a multiple of the model-axis size).
        num_layers: transformer blocks.
        mlp_dim: the MLP's hidden width ("mlp").
        max_len: the longest context (learned positions, "position").
        remat: recompute each block's activations in the backward pass (``nn.remat``): less memory,
            more FLOPs.
        context: None: the block's own attention (on a sequence split over context axes XLA gathers
            it); ``"all_gather"`` / ``"ring"``: `jaxdist.nn.dot_product_attention` in that
            context-parallel mode.
        load_balance: with ``context="ring"``: zig-zag load balancing of the causal mask.
        moe: None: each block's MLP is dense; else the keyword arguments of a `jaxdist.nn.MoE` that
            replaces it (``num_experts``, ``top_k``, ``capacity_factor``, ...; its hidden width is
            ``mlp_dim``).
        dtype: the computation's dtype (``"bfloat16"``: mixed precision; the parameters, their
            gradients and the optimizer state stay float32, the loss and the softmax compute in
            float32).
        attention: the attention kernel (`jaxdist.nn.dot_product_attention`'s ``implementation``):
            None picks cuDNN's fused kernel on an NVIDIA GPU in bfloat16, the einsums elsewhere.
    """

    vocab_size: int = 104
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    mlp_dim: int = 512
    max_len: int = 128
    remat: bool = False
    context: str | None = None
    load_balance: bool = False
    moe: tuple[tuple[str, Any], ...] | None = None
    dtype: str = "float32"
    attention: str | None = None


def _init(std: float, names: tuple) -> Any:
    return nn.with_logical_partitioning(nn.initializers.normal(std), names)


def _zeros(names: tuple) -> Any:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def _ones(names: tuple) -> Any:
    return nn.with_logical_partitioning(nn.initializers.ones_init(), names)


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    config: LMConfig

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        head_dim = cfg.d_model // cfg.num_heads
        std = cfg.d_model**-0.5
        out_std = std / (2 * cfg.num_layers) ** 0.5  # scaled residual projections (GPT-2)

        # float32 parameters, used in ``dtype``
        def weight(name: str, init: Any, shape: tuple) -> jax.Array:
            return self.param(name, init, shape).astype(dtype)

        h = nn.RMSNorm(dtype=dtype, scale_init=_ones(("embed",)), name="attn_norm")(x)
        # Projections as plain (embed, heads, kv) parameters and einsums (nn.DenseGeneral reshapes
        # its kernel after the annotation's constraint, which fails under logical rules at init).
        q, k, v = (
            nn.with_logical_constraint(
                jnp.einsum(
                    "btd,dhk->bthk",
                    h,
                    weight(name, _init(std, ("embed", "heads", "kv")),
                           (cfg.d_model, cfg.num_heads, head_dim)),
                ),
                ("batch", "length", "heads", "kv"),
            )
            for name in ("query", "key", "value")
        )
        # The backend's attention kernel (cuDNN on an NVIDIA GPU in bfloat16); on a sequence split
        # over context axes, context-parallel attention (context=None there: plain attention, XLA
        # gathers the sequence).
        attended = jd.nn.dot_product_attention(q, k, v, causal=True, segment_ids=segment_ids,
                                               context=cfg.context,
                                               load_balance=cfg.load_balance,
                                               implementation=cfg.attention)
        out = weight("attn_out", _init(out_std, ("heads", "kv", "embed")),
                     (cfg.num_heads, head_dim, cfg.d_model))
        x = nn.with_logical_constraint(x + jnp.einsum("bthk,hkd->btd", attended, out),
                                       ("batch", "length", "embed"))

        h = nn.RMSNorm(dtype=dtype, scale_init=_ones(("embed",)), name="mlp_norm")(x)
        # a mixture of experts: its experts split over the mesh's expert axes, if any
        if cfg.moe is not None:
            x = x + jd.nn.MoE(hidden_dim=cfg.mlp_dim, dtype=dtype, name="moe", **dict(cfg.moe))(h)
            return nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = nn.Dense(cfg.mlp_dim, dtype=dtype, kernel_init=_init(std, ("embed", "mlp")),
                     bias_init=_zeros(("mlp",)), name="mlp_in")(h)
        h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
        x = x + nn.Dense(
            cfg.d_model, dtype=dtype, kernel_init=_init(out_std, ("mlp", "embed")),
            bias_init=_zeros(("embed",)), name="mlp_out",
        )(h)
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class CharLM(nn.Module):
    """Decoder-only transformer: ``tokens (batch, length) int32 -> logits (batch, length, vocab)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> cfg = LMConfig(vocab_size=16, d_model=8, num_heads=2, num_layers=1, mlp_dim=16,
        ...                max_len=4)
        >>> model = CharLM(cfg)
        >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
        >>> model.apply(variables, jnp.zeros((2, 4), jnp.int32)).shape
        (2, 4, 16)
        >>> # the annotation rides along with the value
        >>> variables["params"]["embed"]["embedding"].names
        ('vocab', 'embed')
    """

    config: LMConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype,
                     embedding_init=_init(0.02, ("vocab", "embed")), name="embed")(tokens)
        positions = self.param("positions", _init(0.02, ("position", "embed")),
                               (cfg.max_len, cfg.d_model))
        x = nn.with_logical_constraint(x + positions[: tokens.shape[1]].astype(dtype),
                                       ("batch", "length", "embed"))
        block = nn.remat(Block) if cfg.remat else Block
        for i in range(cfg.num_layers):
            x = block(cfg, name=f"block_{i}")(x, segment_ids)
        x = nn.RMSNorm(dtype=dtype, scale_init=_ones(("embed",)), name="final_norm")(x)
        logits = nn.Dense(
            cfg.vocab_size,
            dtype=dtype,
            kernel_init=_init(cfg.d_model**-0.5, ("embed", "vocab")),
            bias_init=_zeros(("vocab",)),
            name="head",
        )(x)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def loss_fn(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy in nats per character (computed in float32)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           targets).mean()


# --------------------------------------------------------------------------------------------- data
def load_text() -> str:
    """The English text of Python's help pages (``pydoc_data/topics.py``, in the standard
    library)."""
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics))


@dataclasses.dataclass(frozen=True)
class CharVocab:
    """Characters <-> ids (the sorted characters of the text; the id table padded to a multiple of
    8).

    Example:
        >>> vocab = CharVocab.from_text("hello")
        >>> vocab.decode(vocab.encode("hole")), vocab.size
        ('hole', 8)
    """

    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        """The vocabulary of ``text``."""
        return cls("".join(sorted(set(text))))

    @property
    def size(self) -> int:
        """Ids in use, rounded up to a multiple of 8."""
        return -(-len(self.chars) // 8) * 8

    def encode(self, text: str) -> np.ndarray:
        """``text`` as an int32 array of ids."""
        index = {c: i for i, c in enumerate(self.chars)}
        return np.fromiter((index[c] for c in text), np.int32, len(text))

    def decode(self, ids: Any) -> str:
        """The text of ``ids`` (padding ids, which are never trained towards, print as nothing)."""
        return "".join(self.chars[i] if i < len(self.chars) else ""
                       for i in np.asarray(ids).tolist())


def split(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)``: the held-out tail of ``val_fraction`` is the validation text."""
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def train_batches(tokens: np.ndarray, batch_size: int, seq_len: int, steps: int, epoch: int,
                  seed: int) -> list:
    """``steps`` GLOBAL batches ``(x, y)`` of random windows, ``y`` = ``x`` shifted by one
    character.

    Deterministic per ``(seed, epoch)``, so a resumed run sees the same batches.
    """
    rng = np.random.default_rng((seed, epoch))
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=(steps, batch_size))
    windows = tokens[starts[..., None] + np.arange(seq_len + 1)]
    return [(w[:, :-1], w[:, 1:]) for w in windows]


def val_batches(tokens: np.ndarray, batch_size: int, seq_len: int,
                max_batches: int | None = None) -> list:
    """Non-overlapping windows of the validation text, in order (the ragged last batch is padded by
    the Trainer)."""
    n = (len(tokens) - 1) // seq_len
    x = tokens[: n * seq_len].reshape(n, seq_len)
    y = tokens[1 : n * seq_len + 1].reshape(n, seq_len)
    out = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, n, batch_size)]
    return out[:max_batches] if max_batches else out


# ----------------------------------------------------------------------------------------- sampling
def generate(
    model: CharLM, params: Any, vocab: CharVocab, prompt: str, length: int,
    temperature: float = 0.8, seed: int = 0
) -> str:
    """``prompt`` and ``length`` sampled characters, on the host's default device (a trained model's
    params, in any layout, are fetched once; every process of a multi-process job calls it)."""
    cfg = model.config
    # whole, even split over processes
    params = multihost_utils.process_allgather(params, tiled=True)
    params = jax.device_put(params, jax.local_devices()[0])  # one copy, off the strategy's mesh
    window = cfg.max_len

    @jax.jit
    def next_logits(params, ids, position):
        return model.apply({"params": params}, ids)[0, position]

    ids = list(vocab.encode(prompt))
    key = jax.random.key(seed)
    for _ in range(length):
        context = ids[-window:]
        padded = np.zeros((1, window), np.int32)
        padded[0, : len(context)] = context
        logits = next_logits(params, padded, len(context) - 1)[: len(vocab.chars)]
        key, sub = jax.random.split(key)
        ids.append(int(jax.random.categorical(sub, logits / temperature)))
    return vocab.decode(ids)


# ----------------------------------------------------------------------------------------- training
def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,fsdp=2,tensor=2"`` as ``{"data": 2, "fsdp": 2, "tensor": 2}`` (axis order kept).

    Raises:
        ValueError: for an entry that is not ``name=size`` with a size >= 1, or a name given twice.

    Example:
        >>> parse_mesh("data=2,fsdp=4")
        {'data': 2, 'fsdp': 4}
    """
    axes: dict[str, int] = {}
    for entry in text.split(","):
        name, _, size = entry.partition("=")
        name = name.strip()
        if not name or not size.strip().isdigit() or int(size) < 1 or name in axes:
            raise ValueError(f"--mesh {text!r}: {entry!r} is not name=size (size >= 1, each name "
                             "once); e.g. --mesh data=2,fsdp=2,tensor=2")
        axes[name] = int(size)
    return axes


def mesh_strategy(
    axes: dict[str, int], model_axis: str | None, fsdp_axes: tuple[str, ...] | None,
    plan: bool = False
) -> jd.Strategy:
    """``ShardedStrategy`` on a mesh with the user's axis names over every device of every process:
    the batch over every axis but ``model_axis`` and ``"context"``, the sequence over ``"context"``
    (context parallelism), the experts of MoE blocks over ``"expert"`` (expert parallelism; a batch
    axis outside them), FSDP over ``fsdp_axes`` (default: all the batch and context axes), tensor
    parallelism over ``model_axis``. With ``plan``, a mesh of another size than the devices present
    is a plan mesh (``jd.plan_mesh``: plans only)."""
    count = int(np.prod(list(axes.values())))
    context_axes = ("context",) if "context" in axes else ()
    expert_axes = ("expert",) if "expert" in axes else ()
    if plan and count != len(jax.devices()):
        model_axis = model_axis if model_axis in axes else None
        batch_axes = tuple(a for a in axes if a != model_axis and a not in context_axes)
        return jd.ShardedStrategy(
            mesh=jd.plan_mesh(axes), batch_axes=batch_axes, fsdp_axes=fsdp_axes,
            context_axes=context_axes,
            expert_axes=expert_axes, logical_axis_rules=logical_axis_rules(batch_axes, model_axis),
            activation_axes=ACTIVATION_AXES,
        )
    if count != len(jax.devices()):
        raise ValueError(f"--mesh {axes} has {count} devices, but there are {len(jax.devices())} "
                         "(all processes): make the sizes multiply to the device count.")
    if model_axis is not None and model_axis not in axes:
        raise ValueError(f"--model-axis {model_axis!r} is not an axis of --mesh {list(axes)}.")
    # Auto axes: the model is written without layout annotations, so XLA propagates layouts through
    # it.
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes),
                         axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
    batch_axes = tuple(a for a in axes if a != model_axis and a not in context_axes)
    return jd.ShardedStrategy(
        mesh=mesh, batch_axes=batch_axes, fsdp_axes=fsdp_axes, context_axes=context_axes,
        expert_axes=expert_axes,
        logical_axis_rules=logical_axis_rules(batch_axes, model_axis),
        activation_axes=ACTIVATION_AXES,
    )


def make_strategy(name: str, model_parallelism: int = 2) -> jd.Strategy:
    """The strategy called ``name``: ``fsdp_tp`` (FSDP x tensor parallelism), ``fsdp``,
    ``mirrored``, ``multi_worker`` (data parallel over every process of a cluster: SLURM,
    ``jaxdist.launch``, ...), ``one_device`` or ``tpu``."""
    if name == "fsdp_tp":
        return jd.ShardedStrategy(
            model_parallelism=model_parallelism, logical_axis_rules=LOGICAL_AXIS_RULES,
            activation_axes=ACTIVATION_AXES
        )
    if name == "fsdp":
        return jd.ShardedStrategy()
    if name == "mirrored":
        return jd.MirroredStrategy()
    if name == "multi_worker":
        # connects the processes: before any JAX computation
        return jd.MultiWorkerMirroredStrategy()
    if name == "tpu":
        return jd.TPUStrategy(steps_per_run=10)
    return jd.OneDeviceStrategy()


def make_optimizer(steps: int, learning_rate: float = 3e-3) -> optax.GradientTransformation:
    """AdamW with a linear warmup and cosine decay over ``steps``; the learning rate is logged."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, min(100, steps // 10 + 1), max(steps, 2), learning_rate / 10
    )
    return optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, b2=0.99, weight_decay=0.01)


class ProgressLines(jd.training.Callback):
    """Progress lines: step, train loss (nats/char), learning rate, tokens/s and MFU over the last
    log window (the Trainer's ``tokens_per_sec`` and ``mfu`` logs; MFU needs the devices' peak
    FLOP/s: none on CPU)."""

    def __init__(self, total: int):
        self.total = total

    def on_log(self, trainer: Any, step: int, logs: Mapping[str, Any]) -> None:
        if jax.process_index():
            return  # one process prints
        rate = f" lr {logs['learning_rate']:.2e}" if "learning_rate" in logs else ""
        if "moe_max_load" in logs:  # the router's metrics (jd.nn.MoE layers)
            rate += (f" experts: max load {logs['moe_max_load']:.2f} dropped "
                     f"{logs['moe_dropped_fraction']:.1%} aux {logs['moe_aux_loss']:.4f}")
        mfu = logs.get("mfu")
        # shown where the device's peak is known
        mfu = f" MFU {mfu:.1%}" if isinstance(mfu, float) else ""
        print(
            f"step {step}/{self.total} loss {logs['loss']:.3f}{rate} tokens/s "
            f"{logs.get('tokens_per_sec', 0):,.0f}{mfu}",
            flush=True,
        )

    def on_eval_end(self, trainer: Any, step: int, metrics: Mapping[str, float]) -> None:
        if jax.process_index():
            return
        print(f"step {step}/{self.total} val loss {metrics['loss']:.3f}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=None,
                        help="simulated CPU devices per process (default: 8, or jaxdist.launch's "
                             "--cpu-devices)")
    parser.add_argument("--strategy", choices=("fsdp_tp", "fsdp", "mirrored", "multi_worker",
                                               "one_device", "tpu"),
                        default="fsdp_tp")
    parser.add_argument("--mesh", default=None,
                        help="your own mesh over every device of every process, e.g. "
                             "data=2,fsdp=2,tensor=2 (ShardedStrategy; overrides --strategy); an "
                             "axis named context splits the sequence (context parallelism), e.g. "
                             "data=2,context=4")
    parser.add_argument("--context-attention", choices=("all_gather", "ring"), default="all_gather",
                        help="with a context axis: how attention sees the split sequence")
    parser.add_argument("--load-balance", action="store_true",
                        help="with --context-attention ring: zig-zag load balancing of the causal "
                             "mask")
    parser.add_argument("--model-axis", default=None,
                        help="the --mesh axis for tensor parallelism (default: 'tensor' or 'model' "
                             "if present)")
    parser.add_argument("--fsdp-axes", default=None,
                        help="the --mesh axes FSDP shards over, comma-separated (default: every "
                             "batch axis; a subset is HSDP, e.g. fsdp)")
    parser.add_argument("--model-parallelism", type=int, default=2,
                        help="devices per replica on the model axis")
    parser.add_argument("--moe", default=None,
                        help="mixture-of-experts blocks: jd.nn.MoE keyword arguments, e.g. "
                             "experts=8,top_k=2 (and capacity=1.0 to drop past a capacity; "
                             "dropless by default); an 'expert' --mesh axis splits the experts")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32,
                        help="GLOBAL batch, split over the replicas")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--remat", action="store_true",
                        help="recompute each block in the backward pass")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype; bfloat16: mixed precision (float32 parameters and "
                             "optimizer state)")
    parser.add_argument("--attention", choices=("einsum", "xla", "cudnn"), default=None,
                        help="attention kernel (default: cuDNN on an NVIDIA GPU in bfloat16, the "
                             "einsums elsewhere)")
    parser.add_argument("--val-batches", type=int, default=None,
                        help="validate on this many batches (default: all)")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save here every --checkpoint-every steps and resume from here (a "
                             "restarted or preempted job continues where it stopped)")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--step-timeout", type=float, default=None,
                        help="seconds a step may take before the process exits with status 124 (a "
                             "stuck or dead peer ends the job instead of hanging it; default: not "
                             "watched)")
    parser.add_argument("--compilation-cache", default=None,
                        help="a directory for JAX's persistent compilation cache (a restart loads "
                             "its programs)")
    parser.add_argument("--sample-length", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plan", action="store_true",
                        help="print the train step's plan (memory, FLOPs, collectives per device) "
                             "and exit; a --mesh of more devices than present is planned without "
                             "them (jd.plan_mesh)")
    parser.add_argument("--search", action="store_true",
                        help="rank layouts x remat x micro-batches for --plan-devices devices by "
                             "plan, and exit")
    parser.add_argument("--plan-devices", type=int, default=None,
                        help="devices --search plans for (default: all)")
    parser.add_argument("--accelerator", default="h100", help="what plans estimate step times for")
    parser.add_argument("--memory-per-device", default=None,
                        help="--search's budget: bytes, or an accelerator name (default: "
                             "--accelerator's memory)")
    parser.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        help="peak FLOP/s of one device, for MFU where the Trainer knows no datasheet figure",
    )
    return parser.parse_args(argv)


def parse_moe(text: str | None) -> tuple[tuple[str, Any], ...] | None:
    """``"experts=8,top_k=2,capacity=1.0"`` as `jaxdist.nn.MoE` keyword arguments (None: no MoE).

    Raises:
        ValueError: for an entry that is not ``experts=``, ``top_k=`` or ``capacity=`` with a
            number.

    Example:
        >>> parse_moe("experts=8,top_k=2")
        (('num_experts', 8), ('top_k', 2))
    """
    if not text:
        return None
    names = {"experts": ("num_experts", int), "top_k": ("top_k", int),
             "capacity": ("capacity_factor", float)}
    out = []
    for entry in text.split(","):
        key, _, value = entry.partition("=")
        if key.strip() not in names:
            raise ValueError(f"--moe {text!r}: {entry!r} is not experts=N, top_k=K or capacity=C; "
                             "e.g. --moe experts=8,top_k=2")
        name, kind = names[key.strip()]
        try:
            out.append((name, kind(value)))
        except ValueError:
            raise ValueError(f"--moe {text!r}: {entry!r} needs a number after '='") from None
    return tuple(out)


def plan_or_search(args: argparse.Namespace, strategy: jd.Strategy, trainer: Any, cfg: LMConfig,
                   say: Any) -> None:
    """``--plan``: the train step's plan on ``strategy``; ``--search``: layouts x remat x
    micro-batches ranked by plan. Nothing is trained, initialized or allocated."""
    tokens = jax.ShapeDtypeStruct((args.batch_size, args.seq_len), jnp.int32)
    if args.plan:
        with strategy.scope():
            plan = trainer.plan((tokens, tokens))
        say(plan)
        say(f"fits {args.accelerator} ({jd.costs.ACCELERATORS[args.accelerator].memory / 1e9:.0f} "
            f"GB): {plan.fits(args.accelerator)}")
        return
    memory = args.memory_per_device or args.accelerator
    memory = int(memory) if str(memory).isdigit() else memory

    def build(strategy: jd.Strategy, remat: bool, grad_accum_steps: int) -> Any:
        return jd.training.Trainer(strategy, CharLM(dataclasses.replace(cfg, remat=remat)),
                                   make_optimizer(args.steps, args.learning_rate), loss_fn,
                                   clip_grad_norm=1.0, grad_accum_steps=grad_accum_steps)

    found = jd.strategies.plan_search(
        build, (tokens, tokens), num_devices=args.plan_devices or len(jax.devices()),
        memory_per_device=memory,
        accelerator=args.accelerator, grad_accum_steps=(1, 2), rules=logical_axis_rules,
        activation_axes=ACTIVATION_AXES, progress=lambda c: say("planned:", c, flush=True),
    )
    say("ranked (fits first, fastest first):")
    for c in found:
        say(c)


def main(argv: list[str] | None = None) -> float:
    """Train, validate, sample; returns the final validation loss (nats/char)."""
    args = parse_args(argv)
    # Simulated devices must be set before JAX starts a backend (importing jax or jaxdist starts
    # none).
    if args.devices is not None or "JAX_NUM_CPU_DEVICES" not in os.environ:
        jax.config.update("jax_num_cpu_devices", args.devices or 8)
    if args.compilation_cache:
        jd.configure_compilation_cache(args.compilation_cache)
    if args.mesh:
        axes = parse_mesh(args.mesh)
        model_axis = args.model_axis or next((a for a in ("tensor", "model") if a in axes), None)
        fsdp_axes = tuple(args.fsdp_axes.split(",")) if args.fsdp_axes else None
        # a job of several processes (jaxdist.launch, SLURM, ...): connect them first
        jd.initialize_cluster()
        strategy = mesh_strategy(axes, model_axis, fsdp_axes, plan=args.plan)
    else:
        strategy = make_strategy(args.strategy, args.model_parallelism)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)  # one process prints

    text = load_text()
    vocab = CharVocab.from_text(text)
    train_tokens, val_tokens = split(vocab.encode(text))
    cfg = LMConfig(
        vocab_size=vocab.size,
        d_model=args.d_model,
        num_layers=args.layers,
        mlp_dim=4 * args.d_model,
        max_len=args.seq_len,
        remat=args.remat,
        context=args.context_attention if getattr(strategy, "context_axes", ()) else None,
        load_balance=args.load_balance,
        moe=parse_moe(args.moe),
        dtype=args.dtype,
        attention=args.attention,
    )
    model = CharLM(cfg)
    tokens_per_step = args.batch_size * args.seq_len
    say(
        f"{strategy!r}: {len(train_tokens):,} train / {len(val_tokens):,} val characters, vocab "
        f"{len(vocab.chars)}; {cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} "
        f"heads, {cfg.dtype} compute; global batch {args.batch_size} x "
        f"{args.seq_len} characters; {args.steps} steps",
        flush=True,
    )

    trainer = jd.training.Trainer(
        strategy,
        model,
        make_optimizer(args.steps, args.learning_rate),
        loss_fn,
        clip_grad_norm=1.0,
        seed=args.seed,
        tokens_per_example=args.seq_len,
        peak_flops=args.peak_flops,
    )

    if args.plan or args.search:
        plan_or_search(args, strategy, trainer, cfg, say)
        return float("nan")

    def data_fn(epoch: int) -> list:
        return train_batches(train_tokens, args.batch_size, args.seq_len, args.steps, epoch,
                             args.seed)

    val_data = val_batches(val_tokens, args.batch_size, args.seq_len, args.val_batches)
    start = time.perf_counter()
    # traced in the scope: the model's nn.with_logical_constraint use the strategy's rules
    with strategy.scope():
        trainer.fit(
            data_fn, steps=args.steps, log_every=args.log_every, verbose=0,
            callbacks=[ProgressLines(args.steps)],
            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every
            if args.checkpoint_dir else None, step_timeout=args.step_timeout,
        )
    seconds = time.perf_counter() - start
    if isinstance(strategy, jd.ShardedStrategy):
        layouts = strategy.variable_layouts(trainer.params)
        for path in ("embed/embedding", "block_0/query", "block_0/mlp_in/kernel",
                     "block_0/mlp_out/kernel", "block_0/moe/wi_gate"):
            if path in layouts:
                say(f"  {path:24s} {layouts[path]}")
    val_loss = trainer.evaluate(val_data)["loss"]
    say(
        f"trained {args.steps} steps in {seconds:.1f}s "
        f"({args.steps * tokens_per_step / seconds:,.0f} tokens/s, compilation included)"
    )
    sample = generate(model, trainer.params, vocab, "The ", args.sample_length, seed=args.seed)
    say("sample:", repr(sample))
    say(f"final val loss: {val_loss:.6f}")
    return val_loss


if __name__ == "__main__":
    main()
