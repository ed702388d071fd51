"""The char-level transformer LM example (tiny config): every strategy trains it as one device does;
under FSDP x tensor parallelism its parameters and optimizer state are laid out as annotated; its
checkpoints restore onto other strategies."""


import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from registry import assert_variable_layout, load_char_lm

import jaxdist as jd
from jaxdist.replicate.layouts import path_name

lm = load_char_lm()
TEXT = lm.load_text()
VOCAB = lm.CharVocab.from_text(TEXT)
TRAIN, VAL = lm.split(VOCAB.encode(TEXT))
CONFIG = lm.LMConfig(vocab_size=VOCAB.size, d_model=32, num_heads=4, num_layers=1, mlp_dim=64,
                     max_len=16)
STEPS = 20
BATCHES = lm.train_batches(TRAIN, 16, 16, STEPS, epoch=0, seed=0)
MODEL = lm.CharLM(CONFIG)


def _initial_variables():
    """The model's variables (annotations included) drawn on the host: the same start for every
    strategy, without compiling the initializer once per strategy (XLA's CPU compile of the RNG is
    the slow part)."""
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(MODEL.init, jax.random.key(0), np.zeros((1, CONFIG.max_len), np.int32))

    def draw(path, s):
        if path_name(path).endswith("scale"):
            return np.ones(s.shape, s.dtype)
        return (rng.normal(size=s.shape) * 0.1).astype(s.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


VARIABLES = _initial_variables()


def _strategy(name):
    return {
        "mirrored": lambda: jd.MirroredStrategy(),
        "fsdp_tp": lambda: jd.ShardedStrategy(
            model_parallelism=2,
            min_shard_size=1,
            logical_axis_rules=lm.LOGICAL_AXIS_RULES,
            activation_axes=lm.ACTIVATION_AXES,
        ),
        "tpu": lambda: jd.TPUStrategy(steps_per_run=5),
        "mesh_hsdp_tp": lambda: lm.mesh_strategy(lm.parse_mesh("data=2,fsdp=2,tensor=2"), "tensor",
                                                 ("fsdp",)),
        "one_device": lambda: jd.OneDeviceStrategy(),
    }[name]()


class _Losses(jd.training.Callback):
    def __init__(self):
        self.values = []

    def on_step_end(self, trainer, step, metrics):
        # one loss, or a loop's stacked losses
        self.values.extend(np.ravel(metrics["loss"]).tolist())


def _train(strategy):
    # eps = the learning rate: rounding noise stays noise (registry.adam)
    trainer = jd.training.Trainer(
        strategy, MODEL, optax.adamw(1e-2, eps=1e-2), lm.loss_fn, clip_grad_norm=1.0,
        variables=VARIABLES
    )
    losses = _Losses()
    # as the demo: the model's activation constraints use the strategy's rules
    with strategy.scope():
        trainer.fit(BATCHES, steps=STEPS, verbose=0, callbacks=[losses])
    return trainer, np.asarray(losses.values)


_results = {}


def _trained(name):
    if name not in _results:
        _results[name] = _train(_strategy(name))
    return _results[name]


def _params(trainer):
    return jax.device_get(nn.unbox(trainer.params))


# FSDP alone: fsdp_tp's FSDP over "replica" (its layouts checked below) with tensor parallelism.
@pytest.mark.parametrize("name", ["mirrored", "fsdp_tp", *(pytest.param(n, marks=pytest.mark.slow)
                                                         for n in ("tpu", "mesh_hsdp_tp"))])
def test_lm_trained_20_steps_equals_one_device(name):
    reference, want = _trained("one_device")
    trainer, got = _trained(name)
    assert len(got) == STEPS and want[-1] < want[0] - 0.2  # it learns
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(_params(trainer)), jax.tree.leaves(_params(reference)),
        strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_fsdp_tp_lays_params_and_optimizer_state_out_as_annotated():
    trainer, _ = _trained("fsdp_tp")
    strategy = trainer.strategy
    assert dict(strategy.mesh.shape) == {"replica": 4, "model": 2}
    layouts = strategy.variable_layouts(trainer.params)
    # Megatron: heads, MLP hidden and vocab over "model"; the unruled "embed" FSDP over "replica"
    want = {
        "embed/embedding": P("model", "replica"),
        "positions": P(None, "replica"),
        "block_0/query": P("replica", "model"),
        "block_0/attn_out": P("model", None, "replica"),
        "block_0/mlp_in/kernel": P("replica", "model"),
        "block_0/mlp_in/bias": P("model"),
        "block_0/mlp_out/kernel": P("model", "replica"),
        "head/kernel": P("replica", "model"),
        "final_norm/scale": P("replica"),
    }
    assert {k: layouts[k] for k in want} == want
    boxes = jax.tree_util.tree_leaves_with_path(
        trainer.params, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )
    for path, box in boxes:  # the arrays really are laid out so
        assert box.value.sharding.spec == layouts[path_name(path)], path_name(path)
    followed = 0
    opt_boxes = jax.tree_util.tree_leaves_with_path(
        trainer.state.opt_state, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )
    for path, box in opt_boxes:  # Adam's moments: the layout of their parameter
        if not isinstance(box, nn.Partitioned):
            continue  # the step count
        param = next(p for p in layouts if path_name(path).endswith("/" + p))
        assert box.value.sharding.spec == layouts[param], path_name(path)
        followed += 1
    assert followed == 2 * len(boxes)


@pytest.mark.parametrize("target", ["one_device", "mirrored"])
def test_checkpoint_written_under_fsdp_tp_restores_onto(target, tmp_path):
    trainer, _ = _trained("fsdp_tp")
    trainer.save(tmp_path)
    strategy = _strategy(target)
    restored = jd.training.Trainer(
        strategy, MODEL, optax.adamw(1e-2, eps=1e-2), lm.loss_fn, clip_grad_norm=1.0,
        variables=VARIABLES
    )
    assert restored.restore(tmp_path, batch=BATCHES[0]) == STEPS
    assert_variable_layout(strategy, (restored.state.params, restored.state.opt_state),
                           "restored state")
    jax.tree.map(np.testing.assert_array_equal, _params(restored), _params(trainer))
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(restored.state.opt_state),
        jax.device_get(trainer.state.opt_state)
    )


def test_the_example_takes_a_user_mesh_with_its_axis_names():
    trainer, _ = _trained("mesh_hsdp_tp")  # --mesh data=2,fsdp=2,tensor=2 --fsdp-axes fsdp
    strategy = trainer.strategy
    assert strategy.mesh.axis_names == ("data", "fsdp",
                                        "tensor") and strategy.num_replicas_in_sync == 4
    layouts = strategy.variable_layouts(trainer.params)
    # HSDP: FSDP within 'fsdp' only, TP on 'tensor'
    assert layouts["block_0/mlp_in/kernel"] == P("fsdp", "tensor")
    assert layouts["embed/embedding"] == P("tensor", "fsdp")
    assert lm.parse_mesh("data=2,fsdp=4") == {"data": 2, "fsdp": 4}
    for bad in ("data=2,data=4", "data", "data=0", "=2"):
        with pytest.raises(ValueError, match="is not name=size"):
            lm.parse_mesh(bad)
    with pytest.raises(ValueError, match=r"has 6 devices, but there are 8"):
        lm.mesh_strategy({"data": 2, "fsdp": 3}, None, None)
    with pytest.raises(ValueError, match=r"--model-axis 'model' is not an axis"):
        lm.mesh_strategy({"data": 2, "fsdp": 4}, "model", None)


def test_the_example_trains_a_moe_lm_on_an_expert_axis_like_one_device():
    import dataclasses

    config = dataclasses.replace(CONFIG, moe=lm.parse_moe("experts=8,top_k=2,capacity=1.0"))
    model = lm.CharLM(config)
    # jitted: one compile of the initializer instead of one per eager op (the variables are the same
    # either way)
    variables = jax.jit(model.init)(jax.random.key(0), np.zeros((1, CONFIG.max_len), np.int32))

    def train(strategy):
        trainer = jd.training.Trainer(strategy, model, optax.adamw(1e-2, eps=1e-2), lm.loss_fn,
                                      variables=variables)
        with strategy.scope():
            history = trainer.fit(BATCHES[:4], steps=4, log_every=1, verbose=0)
        return trainer, history

    expected = train(jd.OneDeviceStrategy())[1]
    trainer, got = train(lm.mesh_strategy(lm.parse_mesh("data=2,expert=4"), None, None))
    assert trainer.strategy.expert_axes == ("expert",)
    assert trainer.strategy.variable_layouts(trainer.params)["block_0/moe/wi_gate"] == P("expert")
    for name in ("loss", "moe_aux_loss", "moe_dropped_fraction"):
        assert len(got.metric(name)) == 4, name
        np.testing.assert_allclose(got.metric(name), expected.metric(name), rtol=1e-5, err_msg=name)
    assert lm.parse_moe(None) is None
    for bad in ("experts", "experts=x", "layers=2"):
        with pytest.raises(ValueError, match="--moe"):
            lm.parse_moe(bad)


def test_bfloat16_mixed_precision_keeps_float32_parameters_and_optimizer_state():
    # --dtype bfloat16: the model computes in bfloat16 (attention through
    # jd.nn.dot_product_attention), its parameters, their gradients and the optimizer state stay
    # float32; the loss is the float32 one's, to bf16.
    import dataclasses

    model = lm.CharLM(dataclasses.replace(CONFIG, dtype="bfloat16"))
    x, y = BATCHES[0]
    # Under jax.jit: the same dtypes and values as run op by op, at one compile per function instead
    # of one per op; the logits, the loss and the gradients come from one program (its forward pass
    # is the gradients').
    def loss_and_logits(v):
        logits = model.apply(v, x)
        return lm.loss_fn(logits, y), logits

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_and_logits, has_aux=True))(
        nn.unbox(VARIABLES))
    assert logits.dtype == jax.numpy.bfloat16
    assert {leaf.dtype for leaf in jax.tree.leaves(nn.unbox(VARIABLES))} == {np.dtype(np.float32)}
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype(np.float32)}
    want = jax.jit(lambda v: lm.loss_fn(MODEL.apply(v, x), y))(VARIABLES)
    np.testing.assert_allclose(float(loss), float(want), rtol=2e-2)
    trainer = jd.training.Trainer(jd.OneDeviceStrategy(), model, optax.adamw(1e-2), lm.loss_fn,
                                  variables=VARIABLES)
    history = trainer.fit(BATCHES[:3], steps=3, log_every=1, verbose=0)
    assert all(np.isfinite(history.metric("loss")))
    assert {leaf.dtype for leaf in jax.tree.leaves(trainer.state)
            if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating)} == {np.dtype(np.float32)}
    args = lm.parse_args(["--dtype", "bfloat16", "--attention", "xla"])
    assert (args.dtype, args.attention) == ("bfloat16", "xla")
