"""Context parallelism: a batch's sequence split over context axes, and attention that is correct on
it.

Every model here computes on ``(data=2, context=4)`` (Explicit axes, ``jax.make_mesh``'s default)
and ``(context=8)`` (Auto) what it computes on one device (fp32,
rtol 1e-5): loss, gradients and parameters over a few SGD steps, with causal masks, both attention
modes, with and without load balancing, with padding and packed segments.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

import jaxdist as jd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from char_lm import CharLM, LMConfig, logical_axis_rules

AUTO = jax.sharding.AxisType.Auto
B, L = 4, 32
MODES = {  # id: (context, load_balance)
    "all_gather": ("all_gather", False),
    "ring": ("ring", False),
    "ring_balanced": ("ring", True),
    "all_gather_balanced": ("all_gather", True),
}


def mesh(kind: str) -> jax.sharding.Mesh:
    if kind == "data2_context4":
        return jax.make_mesh((2, 4), ("data", "context"))  # jax.make_mesh's default: Explicit axes
    return jax.make_mesh((8,), ("context",), axis_types=(AUTO,))


def cp_strategy(kind: str, **kwargs) -> jd.ShardedStrategy:
    m = mesh(kind)
    batch_axes = ("data",) if "data" in m.axis_names else ()
    return jd.ShardedStrategy(mesh=m, batch_axes=batch_axes, context_axes="context",
                              min_shard_size=1, **kwargs)


def assert_close(got, want, rtol=1e-5, atol=1e-6):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------------ layouts
def test_context_axes_split_the_sequence_and_fsdp_uses_them():
    strategy = cp_strategy("data2_context4")
    assert strategy.num_replicas_in_sync == 2 and strategy.context_axes == ("context",)
    roles = strategy.policy.roles
    assert roles.fsdp_axes == ("data", "context") and roles.model_axes == ()
    batch = strategy.experimental_distribute_values({"x": np.zeros((4, 32), np.int32),
                                                     "w": np.ones(4)})
    assert batch["x"].sharding.spec == PartitionSpec("data", "context")
    assert batch["w"].sharding.spec == PartitionSpec("data")
    assert {s.data.shape for s in batch["x"].addressable_shards} == {(2, 8)}
    # "length" (and "batch") map to the context (batch) axes for activations, unless the rules say
    # otherwise.
    assert ("length", "context") in strategy.logical_axis_rules and (
        "batch",
        "data",
    ) in strategy.logical_axis_rules
    own = cp_strategy("data2_context4", logical_axis_rules=[("length", None)])
    assert ("length", None) in own.logical_axis_rules and ("length",
                                                           "context") not in own.logical_axis_rules
    # FSDP splits variables over data x context by default (their devices would hold the same
    # weights).
    assert strategy.variable_layouts({"w": jnp.zeros((16, 8))})["w"] == PartitionSpec(
        ("data", "context")
    )


def test_short_form_context_parallelism_and_a_context_only_mesh():
    strategy = jd.ShardedStrategy(context_parallelism=4, min_shard_size=1)
    assert dict(strategy.mesh.shape) == {"replica": 2,
                                         "context": 4} and strategy.num_replicas_in_sync == 2
    x = strategy.experimental_distribute_values(np.zeros((2, 8, 3), np.float32))
    assert x.sharding.spec == PartitionSpec("replica", "context")
    only = cp_strategy("context8")
    assert only.num_replicas_in_sync == 1
    # FSDP over context
    assert only.variable_layouts({"w": jnp.zeros((16, 8))})["w"] == PartitionSpec("context")
    assert only.experimental_distribute_values(np.zeros((1, 16),
                                                        np.int32)).sharding.spec == PartitionSpec(
        None, "context")


# The trainer tests' model: 12 tokens, 3 per context device of (data=2, context=4), an odd block
# (one query/key chunk per block; a smaller program); 2 x 2 zig-zag chunks of 3 on context=2.
TRAINER_CONFIG = LMConfig(vocab_size=32, d_model=16, num_heads=2, num_layers=1, mlp_dim=32,
                          max_len=12)


@functools.cache
def trainer_variables():
    """The trainer tests' starting variables (annotations included), drawn on the host: one start
    for every strategy and attention mode (the parameters depend on neither), without an RNG
    initializer compiled for each strategy's layout (the slow part of a trainer's state)."""
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(CharLM(TRAINER_CONFIG).init, jax.random.key(0),
                            jnp.ones((1, TRAINER_CONFIG.max_len), jnp.int32))

    def draw(path, s):
        if jax.tree_util.keystr(path).endswith("['scale']"):  # the norms' scales: ones
            return np.ones(s.shape, s.dtype)
        return (rng.normal(size=s.shape) * 0.1).astype(s.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.mark.slow
def test_a_distributed_dataset_and_the_trainer_split_the_sequence():
    strategy = cp_strategy("data2_context4")
    batches = [(np.ones((4, 16), np.int32), np.ones((4, 16), np.int32))] * 2
    x, y = next(iter(strategy.experimental_distribute_dataset(batches)))
    assert x.sharding.spec == PartitionSpec("data", "context") == y.sharding.spec
    cfg = dataclasses.replace(TRAINER_CONFIG, context="ring")
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 32, (4, 12)).astype(np.int32),
                rng.integers(0, 32, (4, 12)).astype(np.int32))
               for _ in range(2)]

    def train(strategy):
        trainer = jd.training.Trainer(strategy, CharLM(cfg), optax.sgd(0.1), lambda logits, y: (
            optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()), seed=0,
                                      tokens_per_example=12, variables=trainer_variables())
        with strategy.scope():
            history = trainer.fit(batches, steps=2, verbose=0, log_every=1)
        return trainer, history

    trainer, history = train(strategy)
    reference, ref_history = train(jd.OneDeviceStrategy())
    np.testing.assert_allclose(history.metric("loss"), ref_history.metric("loss"), rtol=1e-5)
    assert_close(nn.unbox(trainer.params), nn.unbox(reference.params))
    assert history.metric("tokens_per_sec")


# -------------------------------------------------------------------------------------- the char LM
def lm_step(params, batch, config, packed):
    def loss(p):
        logits = CharLM(config).apply({"params": p}, batch["x"], batch["seg"] if packed else None)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return (ce * batch["w"]).sum() / batch["w"].sum()

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), value, grads


def lm_batches(packed: bool, steps: int = 3) -> list[dict]:
    rng = np.random.default_rng(7)
    out = []
    for _ in range(steps):
        x = rng.integers(1, 32, (B, L)).astype(np.int32)
        seg = np.ones((B, L), np.int32)
        w = np.ones((B, L), np.float32)
        if packed:  # packed documents (segments 1, 2, 3) and right padding (segment 0, weight 0)
            seg = np.sort(rng.integers(1, 4, (B, L)), axis=1).astype(np.int32)
            for row, pad in enumerate((0, 5, 11, 3)):
                seg[row, L - pad:] = 0
                w[row, L - pad:] = 0.0
                x[row, L - pad:] = 0
        out.append({"x": x, "y": np.roll(x, -1, axis=1), "w": w, "seg": seg})
    return out


def lm_config(context, load_balance):
    return LMConfig(vocab_size=32, d_model=16, num_heads=2, num_layers=1, mlp_dim=32, max_len=L,
                    context=context, load_balance=load_balance)


def lm_init(config):
    # boxed: annotated
    return CharLM(config).init(jax.random.key(0), jnp.ones((1, L), jnp.int32))["params"]


def lm_strategy(kind):
    """The example's own rules, whose 'batch' rule names the data axis."""
    return cp_strategy(kind, logical_axis_rules=logical_axis_rules(("data",), None),
                       activation_axes=("batch",))


@functools.cache
def lm_params():
    # The parameters depend on neither the attention mode nor the strategy: one init program serves
    # every case and reference, each strategy laying the values out (compiles are most of these
    # tests' time).
    return jax.jit(lm_init, static_argnums=0)(lm_config(None, False))


def run_lm(strategy, config, packed):
    start = lm_params()
    params = strategy.create_variables(lambda: start)
    step = strategy.jit(lm_step, static_argnums=(2, 3), batch_argnums=1)
    trace = []
    with strategy.scope():
        for batch in lm_batches(packed):
            params, loss, grads = step(params, batch, config, packed)
            trace.append((loss, grads))
    return params, trace


def lm_reference(config, packed):
    # on one device every mode is the same plain attention: one reference for all
    if config.context is not None:
        config = lm_config("all_gather", False)
    return _lm_reference(config, packed)


@functools.cache
def _lm_reference(config, packed):
    return run_lm(jd.OneDeviceStrategy(), config, packed)


# Each case guards a (mode, batch) no other test does; compiles are most of their time. Cases not
# run here, as covered elsewhere (an attention mode runs the same code on any mesh, model and batch;
# what is named checks each piece):
# - all-gather causal on (data=2, context=4): that mesh and mode with segments below; all-gather
#   without segments: the linen and nnx tests.
# - ring causal on (data=2, context=4): the trainer test (this model, mesh and mode), linen
#   SelfAttention.
# - balanced ring causal on (data=2, context=4): packed below; balanced ring without segments: the
#   CP x FSDP x TP test.
# - packed unbalanced ring: packed balanced ring below (the ring passes segments with K/V blocks
#   either way).
# - all-gather causal and balanced ring packed on (context=8): both modes on (context=8): the nnx
#   test; this model on jaxdist's default rules: the trainer test; FSDP over the context axis alone:
#   the short-form test; balanced ring packed: below on (data=2, context=4) (and across two
#   processes: the multi-process test); the zig-zag order for any N: load_balance.py.
@pytest.mark.parametrize(("kind", "mode", "packed"), [
    pytest.param("data2_context4", "all_gather", True, id="data2_context4-all_gather-packed_padded",
                 marks=pytest.mark.slow),  # the quick tier's all-gather: the nnx test
    pytest.param("data2_context4", "ring_balanced", True,
                 id="data2_context4-ring_balanced-packed_padded"),
])
def test_char_lm_with_context_parallel_attention_equals_one_device(kind, mode, packed):
    config = lm_config(*MODES[mode])
    strategy = lm_strategy(kind)
    params, trace = run_lm(strategy, config, packed)
    ref_params, ref_trace = lm_reference(config, packed)
    for (loss, grads), (ref_loss, ref_grads) in zip(trace, ref_trace, strict=True):
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        assert_close(nn.unbox(grads), nn.unbox(ref_grads), atol=1e-6)
    assert_close(nn.unbox(params), nn.unbox(ref_params))
    # FSDP over context too
    assert strategy.variable_layouts(params)["block_0/mlp_in/kernel"] != PartitionSpec()


def test_char_lm_without_context_aware_attention_still_equals_one_device():
    """The promise holds for a model whose attention knows nothing of the split sequence: XLA
    gathers it."""
    config = lm_config(None, False)
    # the char LM cases' init program
    params, trace = run_lm(lm_strategy("data2_context4"), config, False)
    ref_params, ref_trace = lm_reference(config, False)
    np.testing.assert_allclose([float(t[0]) for t in trace], [float(t[0]) for t in ref_trace],
                               rtol=1e-5)
    assert_close(nn.unbox(params), nn.unbox(ref_params))


# -------------------------------------------------------------------------- linen and nnx attention
class LinenBlock(nn.Module):
    mode: str

    @nn.compact
    def __call__(self, x, mask):
        context, balance = MODES[self.mode]
        attn = functools.partial(jd.nn.dot_product_attention, causal=True, context=context,
                                 load_balance=balance)
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, attention_fn=attn)(
            x, mask=mask
        )
        return nn.Dense(4)(x + h)


def linen_step(params, batch, mode):
    def loss(p):
        # (B, 1, L, L): Flax's padding mask
        mask = nn.make_attention_mask(batch["w"] > 0, batch["w"] > 0)
        out = LinenBlock(mode).apply({"params": p}, batch["x"], mask)
        return ((out - batch["y"]) ** 2 * batch["w"][..., None]).mean()

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value, grads


def block_batches(length=L, steps=2):
    rng = np.random.default_rng(3)
    out = []
    for _ in range(steps):
        # padding
        valid = (np.arange(length)[None]
                 < np.array([length, length - 6, length - 13, length - 1])[:, None])
        out.append({"x": rng.normal(size=(B, length, 8)).astype(np.float32),
                    "y": rng.normal(size=(B, length, 4)).astype(np.float32),
                    "w": valid.astype(np.float32)})
    return out


@functools.cache
def linen_params(mode):
    # one init program for the strategy and the one-device reference
    return jax.jit(lambda: LinenBlock(mode).init(jax.random.key(1), jnp.ones((1, L, 8)),
                                                  None)["params"])()


def run_linen(strategy, mode):
    start = linen_params(mode)
    params = strategy.create_variables(lambda: start)
    step = strategy.jit(linen_step, static_argnums=2, batch_argnums=1)
    trace = []
    for batch in block_batches():
        params, loss, grads = step(params, batch, mode)
        trace.append((loss, grads))
    return params, trace


# The only balanced all-gather case, and the only padding mask. Not run here, as covered: balanced
# ring on (context=8) with this mask (both modes cut the mask's rows and key columns with the same
# code, checked here; balanced ring: the char LM's ring_balanced case; ring on (context=8): the nnx
# test).
@pytest.mark.parametrize(("kind", "mode"), [("data2_context4", "all_gather_balanced")])
def test_linen_attention_with_a_padding_mask_equals_one_device(kind, mode):
    params, trace = run_linen(cp_strategy(kind), mode)
    ref_params, ref_trace = run_linen(jd.OneDeviceStrategy(), mode)
    assert_close([t[0] for t in trace], [t[0] for t in ref_trace])
    assert_close([t[1] for t in trace], [t[1] for t in ref_trace])
    assert_close(params, ref_params)


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated:DeprecationWarning")
def test_linen_self_attention_takes_the_attention_fn():
    attn = functools.partial(jd.nn.dot_product_attention, causal=True, context="ring")
    module = nn.SelfAttention(num_heads=2, qkv_features=16, attention_fn=attn)
    x = np.random.default_rng(0).normal(size=(B, L, 8)).astype(np.float32)
    params = jax.jit(module.init)(jax.random.key(0), x)
    strategy = cp_strategy("data2_context4")
    got = strategy.jit(lambda p, x: module.apply(p, x), batch_argnums=1)(params, x)
    causal = nn.make_causal_mask(x[..., 0])
    ref = jax.jit(nn.SelfAttention(num_heads=2, qkv_features=16, attention_fn=lambda q, k, v, **_: (
        # Flax's own attention, causal
        nn.dot_product_attention(q, k, v, mask=causal))).apply)(params, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


class NnxBlock(nnx.Module):
    """Attention layers in the given modes, one after the other (one program checks them all: fewer
    compiles)."""

    def __init__(self, modes, rngs):
        def attention(mode):
            context, balance = MODES[mode]
            fn = functools.partial(jd.nn.dot_product_attention, causal=True, context=context,
                                   load_balance=balance)
            return nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=16, decode=False,
                                          attention_fn=fn, rngs=rngs)

        self.attns = nnx.List([attention(mode) for mode in modes])
        self.out = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        for attn in self.attns:
            x = x + attn(x)
        return self.out(x)


def nnx_step(model, optimizer, batch):
    def loss(m):
        return ((m(batch["x"]) - batch["y"]) ** 2).mean()

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value, grads


def run_nnx(strategy, modes, length):
    with strategy.scope():
        model = NnxBlock(modes, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = strategy.jit(nnx_step, batch_argnums=2)
    trace = []
    for batch in block_batches(length):
        trace.append(step(model, optimizer, {"x": batch["x"], "y": batch["y"]}))
    return nnx.state(model, nnx.Param), trace


# Both modes on (context=8), one layer each in one program, in 24 tokens (3 per device: an odd
# block, one query/key chunk per block). Not run here, as covered: balanced ring on (data=2,
# context=4) (the char LM's ring_balanced case; without segments: the CP x FSDP x TP test),
# unbalanced ring on it (the trainer test).
@pytest.mark.parametrize(("kind", "modes", "length"), [("context8", ("all_gather", "ring"), 24)],
                         ids=[
    "context8-all_gather+ring-24"])
def test_nnx_multi_head_attention_equals_one_device(kind, modes, length):
    params, trace = run_nnx(cp_strategy(kind), modes, length)
    ref_params, ref_trace = run_nnx(jd.OneDeviceStrategy(), modes, length)
    assert_close([t[0] for t in trace], [t[0] for t in ref_trace])
    assert_close([t[1] for t in trace], [t[1] for t in ref_trace])
    assert_close(params, ref_params)


# ------------------------------------------------------------------------------------------- errors
def attention_step(strategy, **kwargs):
    def step(q, k, v):
        return jd.nn.dot_product_attention(q, k, v, **kwargs)

    return strategy.jit(step, batch_argnums=(0, 1, 2))


def qkv(length=L, key_length=None):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, length, 2, 4)).astype(np.float32)
    k = rng.normal(size=(B, key_length or length, 2, 4)).astype(np.float32)
    return q, k, k


def test_a_sequence_the_context_axes_do_not_divide_is_an_error_naming_length_sizes_and_fix():
    strategy = cp_strategy("data2_context4")
    with pytest.raises(ValueError,
                                         match=r"sequence length 30 \(axis 1 of argument 0 \(in "
                                               r"batch_argnums\)\) is not "
                                         r"divisible by the context axes \('context',\) of sizes "
                                         r"\{'context': 4\} "
                                         r"\(4 parts\): pad the sequence to 32"):
        attention_step(strategy, causal=True)(*qkv(30))
    with pytest.raises(ValueError,
                       match=r"sequence length 10 \(axis 1 of the global batch\) is not divisible"):
        strategy.experimental_distribute_values(np.zeros((2, 10, 3), np.float32))
    # Load balancing needs 2 x N chunks: 36 splits over 4 devices, not into 8 zig-zag chunks.
    with pytest.raises(ValueError,
                                         match=r"sequence length 36 is not divisible by 8 \(2 x 4 "
                                               r"zig-zag chunks for "
                                         r"load_balance=True\): the context axes \('context',\) of "
                                         r"sizes "
                                         r"\{'context': 4\} split it into 4 parts. Pad the "
                                         r"sequence to 40"):
        attention_step(strategy, causal=True, context="ring", load_balance=True)(*qkv(36))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"load_balance": True}, ValueError,
     r"load_balance=True balances causal attention.*pass causal=True, or drop"),
    ({"context": "ulysses"}, ValueError,
     r"context='ulysses' is not one of \('all_gather', 'ring'\)"),
    ({"window": 4}, TypeError, r"unexpected keyword argument\(s\) \['window'\]"),
    ({"qk_attn_weights_einsum": object()}, NotImplementedError, r"qk_attn_weights_einsum"),
])
def test_bad_attention_arguments_are_errors(kwargs, error, match):
    q, k, v = qkv()
    with pytest.raises(error, match=match):
        jd.nn.dot_product_attention(q, k, v, **kwargs)


def test_what_context_parallelism_cannot_do_is_an_error_naming_the_fix():
    strategy = cp_strategy("data2_context4")
    with pytest.raises(NotImplementedError,
                       match=r"pass deterministic=True \(or dropout_rate=0.0\)"):
        attention_step(strategy, dropout_rate=0.1, dropout_rng=jax.random.key(0))(*qkv())
    with pytest.raises(ValueError, match=r"query length 32 != key length 16.*pass context=None"):
        attention_step(strategy)(*qkv(32, 16))
    step = strategy.jit(lambda x: jd.nn.dot_product_attention(x[None], x[None], x[None]),
                        batch_argnums=0)
    with pytest.raises(ValueError,
                       match=r"query has shape \(1, 4, 32, 2, 4\).*\(batch, length, heads, "
                             r"head_dim\)"):
        step(qkv()[0])
    # context=None: plain attention even on a context axis (XLA gathers the sequence).
    q, k, v = qkv()
    np.testing.assert_allclose(np.asarray(attention_step(strategy, context=None)(q, k, v)),
                               np.asarray(jax.jit(jd.nn.dot_product_attention)(q, k, v)), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"batch_axes": "data", "context_axes": "data"},
                                                     r"context_axes='data' names 'data', which is "
                                                     r"also in batch_axes=\('data',\): a batch's "
                                                     r"rows are split over"),
    ({"batch_axes": "data", "context_axes": "seq"},
     r"context_axes='seq' names axis 'seq', but the mesh axes are"),
    ({"batch_axes": "data", "context_axes": "context", "context_parallelism": 4},
     r"mesh= and context_parallelism=4 both given.*context_axes=\('context',\)"),
    ({"batch_axes": "data", "context_axes": "context", "sequence_axis": 0},
     r"sequence_axis=0 must be an int >= 1"),
])
def test_bad_context_axes_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jd.ShardedStrategy(mesh=mesh("data2_context4"), **kwargs)


def test_bad_short_form_context_parallelism_is_an_error():
    with pytest.raises(
        ValueError, match=r"context_parallelism=3 must be an int >= 1 that divides the 8 devices"
    ):
        jd.ShardedStrategy(context_parallelism=3)
    with pytest.raises(ValueError,
                       match=r"context_parallelism=4 x model_parallelism=4 must divide the 8 "
                             r"devices"):
        jd.ShardedStrategy(context_parallelism=4, model_parallelism=4)
    with pytest.raises(ValueError,
                                         match=r"context_axes='context' name axes of a mesh: pass "
                                               r"mesh= too .*"
                                         r"context_parallelism=k adds 'context'"):
        jd.strategies.LayoutPolicy(jax.devices(), context_axes="context")


# ---------------------------------------------------------------------- CP x FSDP x TP, checkpoints
@pytest.mark.slow
def test_cp_x_fsdp_x_tp_equals_one_device_and_its_checkpoint_restores_on_one_device(tmp_path):
    three = jax.make_mesh((2, 2, 2), ("data", "context", "tensor"), axis_types=(AUTO,) * 3)
    strategy = jd.ShardedStrategy(mesh=three, batch_axes="data", context_axes="context",
                                  min_shard_size=1,
                                  logical_axis_rules=logical_axis_rules(("data",), "tensor"),
                                  activation_axes=("batch",))
    # The trainer test's model and length (12 = 2 x 2 zig-zag chunks of 3): its one-device programs
    # serve here.
    cfg = dataclasses.replace(TRAINER_CONFIG, context="ring", load_balance=True)
    rng = np.random.default_rng(1)
    batches = [(rng.integers(0, 32, (4, 12)).astype(np.int32),
                rng.integers(0, 32, (4, 12)).astype(np.int32))
               for _ in range(2)]

    def trainer_on(s):
        return jd.training.Trainer(s, CharLM(cfg), optax.sgd(0.1), lambda logits, y: (
            optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()), seed=0,
                                  variables=trainer_variables())

    trainer, reference = trainer_on(strategy), trainer_on(jd.OneDeviceStrategy())
    for t in (trainer, reference):
        with t.strategy.scope():
            t.fit(batches, steps=2, verbose=0)
    assert_close(nn.unbox(trainer.params), nn.unbox(reference.params))
    layouts = strategy.variable_layouts(trainer.params)
    # FSDP over data x context
    assert layouts["block_0/query"] == PartitionSpec(("data", "context"), "tensor")
    assert layouts["block_0/mlp_in/kernel"] == PartitionSpec(("data", "context"), "tensor")
    trainer.save(tmp_path)
    restored = trainer_on(jd.OneDeviceStrategy())
    assert restored.restore(tmp_path, batch=batches[0]) == 2
    for got, want in zip(jax.tree.leaves(nn.unbox(restored.params)),
                         jax.tree.leaves(nn.unbox(trainer.params)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert len(got.sharding.device_set) == 1


# -------------------------------------------------------------------------- 2 processes x 4 devices
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_processes_with_the_context_axis_across_them_train_like_one_device(tmp_path):
    """Slow because of its 2-process job: ring attention's step compiled in each process (one mode:
    the others are covered on one process)."""
    import subprocess

    from registry import LAUNCH, launch_env

    here = Path(__file__).resolve().parent
    env = launch_env()
    out = tmp_path / "result.npz"
    proc = subprocess.run(
        [*LAUNCH, "-n", "2", "--cpu-devices", "4", "--timeout", "250",
         str(here / "multiprocess" / "context_worker.py"), str(out)],
        env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    sys.path.insert(0, str(here / "multiprocess"))
    import context_worker as worker

    with np.load(out) as result:
        for mode in worker.MODES:
            cfg = worker.config(mode)
            one = jd.OneDeviceStrategy()
            params = one.create_variables(worker.init, cfg)
            step = one.jit(worker.step, static_argnums=2, batch_argnums=1)
            losses = []
            for batch in worker.data():
                params, loss = step(params, batch, cfg)
                losses.append(float(loss))
            np.testing.assert_allclose(result[f"{mode}/losses"], losses, rtol=1e-5)
            for path, leaf in jax.tree_util.tree_leaves_with_path(params):
                np.testing.assert_allclose(result[f"{mode}/params{jax.tree_util.keystr(path)}"],
                                           np.asarray(leaf),
                                           rtol=1e-5, atol=1e-6,
                                           err_msg=f"{mode} {jax.tree_util.keystr(path)}")


def test_the_example_takes_a_context_axis():
    import char_lm as lm

    strategy = lm.mesh_strategy({"data": 2, "context": 4}, None, None)
    assert strategy.context_axes == ("context",) and strategy.num_replicas_in_sync == 2
    args = lm.parse_args(["--mesh", "data=2,context=4", "--context-attention", "ring",
                          "--load-balance"])
    assert (args.context_attention, args.load_balance) == ("ring", True)


def test_a_declared_sequence_axis_is_the_one_split():
    strategy = cp_strategy("data2_context4", sequence_axis=2)  # e.g. (batch, channels, length)
    x = strategy.experimental_distribute_values(np.zeros((2, 3, 8), np.float32))
    assert x.sharding.spec == PartitionSpec("data", None, "context")
    assert strategy.experimental_distribute_values(
        np.zeros((2, 3), np.float32)
    ).sharding.spec == PartitionSpec("data")  # no sequence dimension: rows only
