"""The transformer LM of ``examples/char_lm.py`` written in Keras 3, trained under
``ModelParallel``.

The Keras side of the ``lm-keras`` row: what a Keras user writes for the same model (``Embedding``,
``EinsumDense`` projections, ``RMSNormalization``, ``Dense`` MLP and head, AdamW, sparse
cross-entropy) and trains with ``model.fit`` under ``keras.distribution.ModelParallel`` on the same
``(batch, model)`` mesh.

The layers carry the Flax model's names, so each Keras variable has one Flax counterpart
(`flax_path`). That gives the comparison two guarantees:

- the ``LayoutMap`` is built from the layouts ``ShardedStrategy`` gives the Flax parameters (mesh
  axis ``"replica"`` renamed ``"batch"``, Keras's data axis), so both sides shard every parameter,
  and each block's output, the same way;
- the Keras model starts from the Flax model's initial parameters, and `KerasLMFit` checks that both
  compute the same initial loss (so the row compares the same model shape, not merely a similar
  one).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

import jaxdist as jd
from benchmarks.lm import LMProblem, char_lm
from benchmarks.runners import KerasLoop, import_keras

__all__ = ["KerasLMFit", "flax_path"]

_KERAS_ALIASES = {"embeddings": "embedding"}  # Keras variable name -> Flax parameter name


def flax_path(keras_path: str) -> str:
    """The Flax parameter path (``jax.tree_util.keystr`` form) of a Keras variable path of
    `build_model`'s.

    Example:
        >>> flax_path("block_0/query/kernel")
        "['params']['block_0']['query']"
        >>> flax_path("embed/embeddings")
        "['params']['embed']['embedding']"
    """
    parts = keras_path.split("/")
    if parts[-1] == "kernel" and parts[-2] in {"query", "key", "value", "attn_out", "positions"}:
        parts = parts[:-1]  # Flax keeps these as bare parameters
    parts = [_KERAS_ALIASES.get(p, p) for p in parts]
    return "['params']" + "".join(f"[{p!r}]" for p in parts)


def _build_model(keras: Any, cfg: Any) -> Any:
    """The Keras CharLM: the same computation as the Flax ``CharLM`` of ``examples/char_lm.py``."""
    ops, layers = keras.ops, keras.layers
    head_dim = cfg.d_model // cfg.num_heads

    class Positions(layers.Layer):
        """Learned positions added to the embeddings."""

        def build(self, input_shape: Any) -> None:
            self.kernel = self.add_weight(name="kernel", shape=(cfg.max_len, cfg.d_model))

        def call(self, x: Any) -> Any:
            return x + self.kernel

    class Block(layers.Layer):
        """Pre-norm transformer block."""

        def __init__(self, **kwargs: Any):
            super().__init__(**kwargs)
            self.attn_norm = layers.RMSNormalization(epsilon=1e-6, name="attn_norm")
            self.query, self.key, self.value = (
                layers.EinsumDense("btd,dhk->bthk", (None, cfg.num_heads, head_dim), name=n)
                for n in ("query", "key", "value")
            )
            self.attn_out = layers.EinsumDense("bthk,hkd->btd", (None, cfg.d_model),
                                               name="attn_out")
            self.mlp_norm = layers.RMSNormalization(epsilon=1e-6, name="mlp_norm")
            self.mlp_in = layers.Dense(cfg.mlp_dim, name="mlp_in")
            self.mlp_out = layers.Dense(cfg.d_model, name="mlp_out")

        def call(self, x: Any) -> Any:
            h = self.attn_norm(x)
            q, k, v = self.query(h), self.key(h), self.value(h)
            scores = ops.einsum("bthk,bshk->bhts", q, k) / np.sqrt(head_dim).astype(np.float32)
            length = ops.shape(x)[1]
            causal = ops.tril(ops.ones((length, length), "bool"))
            weights = ops.softmax(ops.where(causal, scores, np.finfo(np.float32).min), axis=-1)
            x = x + self.attn_out(ops.einsum("bhts,bshk->bthk", weights, v))
            h = ops.gelu(self.mlp_in(self.mlp_norm(x)), approximate=True)
            return x + self.mlp_out(h)

    # the benchmark's sequences fill the context
    tokens = keras.Input((cfg.max_len,), dtype="int32")
    x = layers.Embedding(cfg.vocab_size, cfg.d_model, name="embed")(tokens)
    x = Positions(name="positions")(x)
    for i in range(cfg.num_layers):
        x = Block(name=f"block_{i}")(x)
    x = layers.RMSNormalization(epsilon=1e-6, name="final_norm")(x)
    logits = layers.Dense(cfg.vocab_size, name="head")(x)
    return keras.Model(tokens, logits, name="char_lm")


def _by_path(tree: Any, **options: Any) -> dict[str, Any]:
    """``tree``'s leaves by Flax parameter path (`flax_path`'s form; annotation boxes' ``.value``
    dropped)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, **options)
    return {re.sub(r"\.value$", "", jax.tree_util.keystr(path)): leaf for path, leaf in leaves}


def _keras_axis(axis: str | None) -> str | None:
    """A jaxdist mesh axis's name on the Keras mesh: ``"replica"`` is Keras's data axis,
    ``"batch"``."""
    return "batch" if axis == "replica" else axis


def _layout_map(keras: Any, cfg: Any, strategy: jd.Strategy, problem: LMProblem) -> Any:
    """A ``LayoutMap`` giving every Keras variable its Flax counterpart's layout under ``strategy``
    (and each block's output the batch split), on a ``DeviceMesh`` of the strategy's devices with
    axes renamed (`_keras_axis`)."""
    mesh = strategy.mesh
    keras_mesh = keras.distribution.DeviceMesh(
        mesh.devices.shape, [_keras_axis(a) for a in mesh.axis_names],
        mesh.devices.flatten().tolist()
    )
    shardings = strategy.variable_shardings(problem.host_state[0])
    specs = _by_path(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    layout_map = keras.distribution.LayoutMap(keras_mesh)
    for variable in _build_model(keras, cfg).variables:  # a throwaway build, for the variable paths
        spec = specs[flax_path(variable.path)].spec
        axes = tuple(_keras_axis(a) for a in spec) + (None,) * (len(variable.shape) - len(spec))
        layout_map[re.escape(variable.path)] = axes
    for i in range(cfg.num_layers):
        layout_map[re.escape(f"block_{i}/output")] = ("batch", None, None)
    return layout_map


class KerasLMFit(KerasLoop):
    """``model.fit`` of the Keras CharLM under ``ModelParallel`` with ``strategy``'s layouts, on the
    problem's host batches (see `runners.KerasLoop`), ``steps_per_execution`` steps per compiled
    call.

    Raises:
        Unavailable: when keras is missing (`runners.import_keras`).
        AssertionError: when the Keras model's initial loss differs from the Flax model's (not the
            same model).
    """

    def __init__(self, strategy: jd.Strategy, problem: LMProblem, steps_per_execution: int = 1):
        keras = import_keras()
        cfg = problem.model.config
        distribution = keras.distribution.ModelParallel(
            layout_map=_layout_map(keras, cfg, strategy, problem), batch_dim_name="batch"
        )
        params = _by_path(problem.host_state[0])
        x, y = problem.host_batches[0]
        with distribution.scope():
            model = _build_model(keras, cfg)
            for variable in model.variables:
                variable.assign(np.asarray(params[flax_path(variable.path)]))
            model.compile(
                optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.01, epsilon=1e-8),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=steps_per_execution,
                jit_compile=True,
            )
            keras_loss = float(model.compute_loss(x, y, model(x)))
        flax_loss = float(char_lm().loss_fn(problem.model.apply(problem.host_state[0], x), y))
        if not np.isclose(keras_loss, flax_loss, rtol=1e-4):
            raise AssertionError(f"Keras CharLM initial loss {keras_loss} != Flax CharLM's "
                                 f"{flax_loss}")
        super().__init__(distribution, model, problem.host_batches, steps_per_execution)
