"""Pipeline parallelism: `jd.nn.Pipeline` on a strategy's stage axes equals the plain scan on one
device.

A tiny transformer LM (``pipeline_model.py``) whose layers go through the pipeline layer is trained
a few steps (SGD, fp32) on ``(stage=4, data=2)``, ``(stage=2, fsdp=2, tensor=2)`` and ``(stage=8)``,
GPipe and circular, dropout off and on (same rngs), and compared with the same model and parameters
run as a plain scan on one device: losses, gradients and parameters to rtol 1e-5. The parameters are
exactly ``nn.scan``'s; every error path is run.

Compiling is most of these tests' time (each pipelined step about 5 s on XLA:CPU): the cases share
what they can (one-device references, variable initialisers, the step whose HLO is inspected)
through the session's persistent compilation cache (conftest.py), and the tests over about 8 s are
marked ``slow`` (``./scripts/test --quick`` keeps one equivalence case and every error path).
"""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from pipeline_model import (
    LENGTH,
    RULES,
    Block,
    PipelineLM,
    ScanBlock,
    batches,
    init_state,
    make_step,
)

import jaxdist as jd

AUTO = jax.sharding.AxisType.Auto
STEPS = 2


def mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(names))


STRATEGIES = {
    "stage4_data2": lambda: jd.ShardedStrategy(
        mesh=mesh((4, 2), ("stage", "data")), batch_axes="data", stage_axes="stage",
        min_shard_size=1),
    "stage2_fsdp2_tensor2": lambda: jd.ShardedStrategy(  # jax.make_mesh's default: Explicit axes
        mesh=jax.make_mesh((2, 2, 2), ("stage", "fsdp", "tensor")), batch_axes="fsdp",
        stage_axes="stage", min_shard_size=1, logical_axis_rules=RULES),
    "stage8": lambda: jd.ShardedStrategy(
        mesh=mesh((8, 1), ("stage", "data")), batch_axes="data", stage_axes="stage",
        min_shard_size=1),
}
# (strategy, schedule, repeats, layers, micro-batches, dropout): every mesh, both schedules,
# micro-batches fewer than, as many as and more than the stages. Dropout is on (its keys per
# micro-batch, layer and stage) but in one case: without it the plain scan runs the whole batch at
# once, so that case checks the pipeline's split into micro-batches and merge. The dropout cases
# share one one-device reference (8 layers, 4 micro-batches: see `reference`). Dropped from the 8
# cases of earlier versions (all with dropout but two), each covered by those kept: on (stage=8),
# the circular schedule and dropout (the 8-stage ring: the (stage=8) case; the circular schedule and
# the keys per stage: the other meshes' cases); GPipe on (stage=2, fsdp=2, tensor=2) (that mesh: its
# circular case, the same loop with the layers' all-to-all and stage 0's buffer on top; GPipe: the
# other GPipe cases); (stage=4, data=2) without dropout, either schedule (no dropout: the (stage=8)
# case; the schedules on that mesh: its dropout cases).
CASES = [
    # the quick tier's case (and the HLO that test_..._permute reads)
    ("stage4_data2", "gpipe", 1, 8, 4, 0.1),
    # M = S: each micro-batch is back at stage 0 as the stage frees
    ("stage4_data2", "circular", 2, 8, 4, 0.1),
    # M > S: micro-batches wait in stage 0's buffer
    ("stage2_fsdp2_tensor2", "circular", 2, 8, 4, 0.1),
    ("stage8", "gpipe", 1, 8, 4, 0.0),  # M < S: at least half the ring idles at every iteration
]
QUICK = CASES[0]


def run(step, state, data):
    losses, first_grads = [], None
    for batch in data:
        state, (loss, grads) = step(state, batch)
        losses.append(float(loss))
        first_grads = grads if first_grads is None else first_grads
    return state, np.array(losses), first_grads


@functools.cache
def initial_state(layers):
    """Every case's starting state, made once per layer count: the variables do not depend on the
    micro-batches, schedule, repeats or dropout (the pipeline layer creates them with ``nn.scan``
    whatever those are), so one init program serves every case and reference; each case's strategy
    lays these values out (`_pipelined`)."""
    return jax.jit(lambda: init_state(PipelineLM(layers)))()


@functools.cache
def reference(layers, micro, dropout):
    """The same model on one device (no strategy: the pipeline layer runs the plain scan, whatever
    the schedule and repeats, which only the pipelined loop reads: one reference serves both
    schedules)."""
    model = PipelineLM(layers, micro, dropout=dropout)
    return run(jax.jit(make_step(model, dropout > 0)), initial_state(layers), batches(STEPS))


def assert_trees_close(actual, expected, what):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(nn.unbox(actual)),
                            jax.tree.leaves(nn.unbox(expected)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{what}{jax.tree_util.keystr(path)}")


def _case_id(case):
    return f"{case[0]}-{case[1]}-{'dropout' if case[5] else 'no_dropout'}"


def _pipelined(name, schedule, repeats, layers, micro, dropout):
    """The case's strategy, its variables (`initial_state`, laid out by the strategy: the
    Trainer test creates a pipelined model's variables in place) and its step (not compiled
    yet)."""
    strategy = STRATEGIES[name]()
    model = PipelineLM(layers, micro, schedule, repeats, dropout)
    start = initial_state(layers)
    state = strategy.create_variables(lambda: start)
    return strategy, state, strategy.jit(make_step(model, dropout > 0), batch_argnums=(1,))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,schedule,repeats,layers,micro,dropout", [
    pytest.param(*c, id=_case_id(c), marks=() if c == QUICK else pytest.mark.slow) for c in CASES])
def test_pipeline_equals_plain_scan_on_one_device(name, schedule, repeats, layers, micro, dropout):
    expected_state, expected_losses, expected_grads = reference(layers, micro, dropout)
    strategy, state, step = _pipelined(name, schedule, repeats, layers, micro, dropout)
    kernel = state[0]["params"]["layers"]["block"]["Dense_0"]["kernel"].value
    assert kernel.sharding.spec[0] == "stage"  # the layers are split over the stages
    assert kernel.addressable_shards[0].data.shape[0] == layers // strategy.mesh.shape["stage"]
    state, losses, grads = run(step, state, batches(STEPS))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_trees_close(grads, expected_grads, "gradient ")
    assert_trees_close(state[0], expected_state[0], "parameter ")
    assert (
        state[0]["params"]["layers"]["block"]["Dense_0"]["kernel"].value.sharding.spec[0] == "stage"
    )


def test_pipeline_activations_move_by_collective_permute():
    """The compiled step moves activations between stages by collective-permute (a GPipe step: no
    weights move between stages). The quick equivalence case's step: the same program, which the
    session's persistent compilation cache holds once that case ran."""
    _, state, step = _pipelined(*QUICK)
    assert "collective-permute" in step.lower(state, batches(1)[0]).compile().as_text()


def test_short_form_pipeline_parallelism():
    strategy = jd.ShardedStrategy(pipeline_parallelism=2, min_shard_size=1)
    assert dict(strategy.mesh.shape) == {"stage": 2, "replica": 4}
    assert strategy.num_replicas_in_sync == 4 and strategy.policy.roles.stage_axes == ("stage",)
    model = PipelineLM(4, 2)
    x = jnp.ones((8, LENGTH), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), x)
    placed = strategy.create_variables(lambda: params)
    y = strategy.jit(model.apply, batch_argnums=(1,))(placed, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(jax.jit(model.apply)(params, x)),
                               rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------- parameters
class PlainScanLM(nn.Module):
    """The user's model before the pipeline: nn.scan over the scan-shaped block, named like the
    pipeline's."""

    num_layers: int = 4

    @nn.compact
    def __call__(self, x, pad):
        scan = nn.scan(ScanBlock, variable_axes={"params": 0},
                       split_rngs={"params": True, "dropout": True}, length=self.num_layers,
                       in_axes=nn.broadcast, metadata_params={nn.PARTITION_NAME: "layers"})
        return scan(name="block")(x, pad)[0]


def test_parameters_are_nn_scan_parameters():
    x = jax.random.normal(jax.random.key(1), (4, LENGTH, 16))
    pad = jnp.ones((4, LENGTH), bool)
    plain = jax.jit(PlainScanLM(4).init)(jax.random.key(0), x, pad)
    pipe = jd.nn.Pipeline(block=Block(), num_layers=4, num_microbatches=2)
    ours = jax.jit(pipe.init)(jax.random.key(0), x, pad)
    assert jax.tree.structure(nn.unbox(ours)) == jax.tree.structure(nn.unbox(plain))
    assert_trees_close(ours, plain, "parameter ")
    names = jax.tree.leaves(
        jax.tree.map(lambda b: b.names, ours, is_leaf=lambda b: isinstance(b, nn.Partitioned)),
        is_leaf=lambda n: isinstance(n, tuple),
    )
    assert all(n[0] == "layers" for n in names)
    np.testing.assert_allclose(jax.jit(pipe.apply)(plain, x, pad),
                               jax.jit(PlainScanLM(4).apply)(plain, x, pad), rtol=1e-5, atol=1e-6)


def test_unannotated_block_parameters_get_the_layers_name():
    class Tiny(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(x.shape[-1])(x)

    params = jd.nn.Pipeline(block=Tiny(), num_layers=4).init(jax.random.key(0), jnp.ones((2, 8)))
    kernel = params["params"]["block"]["Dense_0"]["kernel"]
    assert isinstance(kernel, nn.LogicallyPartitioned) and kernel.names == ("layers", None, None)
    strategy = STRATEGIES["stage4_data2"]()
    assert strategy.variable_layouts(params)["params/block/Dense_0/kernel"] == P("stage")


# ------------------------------------------------------------------------------------------- errors
def _apply(strategy, model, batch=8):
    """``model.apply`` under the strategy, traced only: every error here is raised while laying out
    the variables or tracing, before anything is compiled or run (the variables are shapes, in the
    layout create_variables gives them)."""
    x = jnp.ones((batch, LENGTH), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((8, LENGTH), jnp.int32))
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                          strategy.variable_shardings(shapes))
    return strategy.jit(model.apply, batch_argnums=(1,)).trace(params, x)


def test_microbatches_must_divide_the_per_replica_batch():
    with pytest.raises(ValueError,
                       match=re.escape("num_microbatches=3 does not divide the per-replica batch 4 "
                                       "(global batch 8 over 2 replica(s))")):
        _apply(STRATEGIES["stage4_data2"](), PipelineLM(8, 3))
    with pytest.raises(
        ValueError, match=re.escape("num_microbatches=3 does not divide the per-replica batch 8")
    ):
        x = jnp.ones((8, LENGTH), jnp.int32)  # one device: the plain scan (traced only, as above)
        jax.eval_shape(lambda: PipelineLM(8, 3).apply(PipelineLM(8, 3).init(jax.random.key(0), x),
                                                      x))


def test_layers_must_divide_into_stages_and_repeats():
    with pytest.raises(ValueError,
                       match=re.escape("num_layers=6 (the 'layers' axis of 'params/layers/block/")):
        # laying out the variables already refuses them
        _apply(STRATEGIES["stage4_data2"](), PipelineLM(6, 2))
    with pytest.raises(
        ValueError, match=re.escape("num_layers=4 is not divisible by the 4 stages x repeats=2")
    ):
        _apply(STRATEGIES["stage4_data2"](), PipelineLM(4, 4, "circular", 2))


def test_configuration_errors_on_an_explicit_mesh_are_raised_as_themselves():
    """On jax.make_mesh's default mesh the step is traced with Explicit axes first (refused by
    types: a ShardingTypeError), then Auto, where the pipeline's own check fails: that ValueError,
    which names the fix, is the error raised (the Explicit refusal is a note on it)."""
    explicit = jd.ShardedStrategy(mesh=jax.make_mesh((4, 2), ("stage", "data")), batch_axes="data",
                                  stage_axes="stage", min_shard_size=1)
    with pytest.raises(
        ValueError, match=re.escape("num_microbatches=3 does not divide the per-replica batch 4")
    ) as info:
        _apply(explicit, PipelineLM(8, 3))
    assert any("traced first with the mesh's axes" in n for n in info.value.__notes__)
    with pytest.raises(
        ValueError, match=re.escape("num_layers=4 is not divisible by the 4 stages x repeats=2")
    ):
        _apply(explicit, PipelineLM(4, 4, "circular", 2))


def test_circular_needs_as_many_microbatches_as_stages():
    with pytest.raises(ValueError, match=re.escape("num_microbatches=2 is less than the 4 stages")):
        _apply(STRATEGIES["stage4_data2"](), PipelineLM(8, 2, "circular", 2))


@pytest.mark.parametrize("kwargs,message", [
    ({"schedule": "1f1b"}, "schedule='1f1b' is not one of ('gpipe', 'circular')"),
    ({"repeats": 2}, "repeats=2 with schedule='gpipe'"),
    ({"num_microbatches": 0}, "num_microbatches=0 must be an int >= 1"),
    ({"num_layers": 2.0}, "num_layers=2.0 must be an int >= 1"),
])
def test_bad_pipeline_arguments(kwargs, message):
    args = {"block": Block(), "num_layers": 4, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        jd.nn.Pipeline(**args).init(jax.random.key(0), jnp.ones((2, LENGTH, 16)),
                                    jnp.ones((2, LENGTH), bool))


def test_block_that_changes_the_shape_is_an_error():
    class Grow(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(x.shape[-1] + 1)(x)

    pipe = jd.nn.Pipeline(block=Grow(), num_layers=2)
    message = "block Grow returned (2, 5) float32 for an input of (2, 4) float32"
    with pytest.raises(ValueError, match=re.escape(message)):
        pipe.init(jax.random.key(0), jnp.ones((2, 4)))


def test_stage_axis_without_a_pipeline_layer_warns_that_stages_are_idle():
    strategy = STRATEGIES["stage4_data2"]()
    dense = nn.Dense(8)
    with pytest.warns(jd.IdleAxisWarning,
                      match=re.escape("stage axis 'stage' (size 4) splits none of the variables "
                                      "created here")) as caught:
        strategy.create_variables(dense.init, jax.random.key(0), jnp.ones((2, 8)))
    assert "the stage devices are idle" in str(caught[0].message)


@pytest.mark.parametrize("kwargs,message", [
    ({"mesh": "stage_data", "batch_axes": ("data", "stage"), "stage_axes": "stage"},
     "stage_axes='stage' names 'stage', which is also in batch_axes=('data', 'stage')"),
    ({"mesh": "stage_data", "batch_axes": "data", "stage_axes": "pipe"},
     "stage_axes='pipe' names axis 'pipe', but the mesh axes are ('stage', 'data')"),
    ({"stage_axes": "stage"},
     "stage_axes='stage' name axes of a mesh: pass mesh= too (without it the strategy builds"),
    ({"pipeline_parallelism": 3},
     "pipeline_parallelism=3 must be an int >= 1 that divides the 8 devices"),
    ({"mesh": "stage_data", "batch_axes": "data", "pipeline_parallelism": 2},
     "mesh= and pipeline_parallelism=2 both given: on a user mesh, name its stage axes with "
     "stage_axes=('stage',)"),
])
def test_bad_stage_axes(kwargs, message):
    if kwargs.get("mesh") == "stage_data":
        kwargs = {**kwargs, "mesh": mesh((4, 2), ("stage", "data"))}
    with pytest.raises(ValueError, match=re.escape(message)):
        jd.ShardedStrategy(**kwargs)


# ----------------------------------------------------------------------------------------- training
def _trainer(strategy, grad_accum_steps=2):
    import optax

    def ce(logits, targets):
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return jd.training.Trainer(strategy, PipelineLM(4, 2, dropout=0.1, remat=True), optax.sgd(0.5),
                               ce,
                               grad_accum_steps=grad_accum_steps, train_kwargs={"train": True},
                               seed=3,
                               # XLA counts a scanned loop once: say what a step costs
                               flops_per_step=1e6)


def _data():
    return [{"x": b["inputs"], "y": b["targets"]} for b in batches(4, batch=16)]


class _Steps(jd.training.Callback):
    """Records the steps a fit trains."""

    def __init__(self):
        self.steps = []

    def on_step_end(self, trainer, step, metrics):
        self.steps.append(step)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_fit_pipelined_checkpoint_restores_on_one_device_and_fsdp(tmp_path):
    """Trainer.fit with grad_accum_steps=2 (each accumulation micro-batch is split again into the
    pipeline's micro-batches), checkpointing at steps 2 and 4; the checkpoints written pipelined
    restore exactly on FSDP, and on OneDevice, where the run resumed at step 2 continues
    identically."""
    straight = _trainer(STRATEGIES["stage4_data2"]())
    straight.fit(_data(), steps=4, checkpoint_dir=tmp_path, checkpoint_every=2, verbose=0)
    fsdp = _trainer(jd.ShardedStrategy(min_shard_size=1))
    assert fsdp.restore(tmp_path, batch=_data()[0]) == 4  # the latest
    assert_trees_close(fsdp.state.params, straight.state.params, "FSDP: parameter ")
    resumed, trained = _trainer(jd.OneDeviceStrategy()), _Steps()
    resumed.fit(_data(), steps=4, checkpoint_dir=tmp_path, restore_step=2, verbose=0,
                callbacks=[trained])
    assert trained.steps == [3, 4] and resumed.step == 4  # resumed at 2, and trained
    assert_trees_close(resumed.state.params, straight.state.params, "OneDevice: parameter ")


def test_explicit_axes_mesh():
    """jax.make_mesh's default Explicit axes: the pipeline loop runs with them Auto, its output
    typed as its input."""

    class Tiny(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(x.shape[-1])(nn.relu(x))

    model = jd.nn.Pipeline(block=Tiny(), num_layers=4, num_microbatches=2)
    x = jax.random.normal(jax.random.key(1), (4, 8))
    params = model.init(jax.random.key(0), x)
    strategy = jd.ShardedStrategy(mesh=jax.make_mesh((4, 2), ("stage", "data")), batch_axes="data",
                                  stage_axes="stage", min_shard_size=1)
    placed = strategy.create_variables(lambda: params)

    def loss(p, x):
        return jnp.sum(model.apply(p, x) ** 2)

    value, grads = strategy.jit(jax.value_and_grad(loss), batch_argnums=(1,))(placed, x)
    expected_value, expected_grads = jax.value_and_grad(loss)(params, x)
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    assert_trees_close(grads, expected_grads, "gradient ")


def test_block_with_other_variables_or_an_input_without_batch_is_an_error():
    class Counting(nn.Module):
        @nn.compact
        def __call__(self, x):
            calls = self.variable("counters", "calls", lambda: jnp.zeros((), jnp.int32))
            calls.value += 1
            return x + nn.Dense(x.shape[-1])(x)

    class Plain(nn.Module):  # the same parameters, no counter
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(x.shape[-1])(x)

    pipe = jd.nn.Pipeline(block=Counting(), num_layers=2)
    x = jnp.ones((2, 4))
    params = jd.nn.Pipeline(block=Plain(), num_layers=2).init(jax.random.key(0), x)
    params = {**params, "counters": {"block": {"calls": jnp.zeros((2,), jnp.int32)}}}
    with pytest.raises(ValueError,
                       match=re.escape("block Counting holds variables of collection(s) "
                                       "['counters']")):
        pipe.apply(params, x, mutable=["counters"])
    with pytest.raises(
        ValueError, match=re.escape("Pipeline got an input of shape (): it needs a leading batch")
    ):
        pipe.apply({"params": params["params"]}, jnp.float32(1))


# ------------------------------------------------------------------------------ the bubble, planned
# a layer's matmuls outweigh the loop's bookkeeping and gradient sums
BUBBLE_BATCH, BUBBLE_WIDTH = 1024, 128


class WideLayer(nn.Module):
    """The bubble's layer: one matmul of ``BUBBLE_WIDTH`` squared per row (the property is the
    loop's iteration count, whatever the layer; a small one compiles in a fraction of the LM layer's
    time)."""

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1], use_bias=False)(nn.relu(x))


@functools.cache
def _total_step_flops(pipeline_parallelism, micro, repeats):
    """A training step's FLOPs over all devices, planned (compiled, never run): every device's
    program (`Plan.flops`, per device, loop bodies counted once per iteration) times the devices.
    The step trains a pipeline layer alone: no embedding or head, which are not pipelined (every
    stage would run them whole)."""
    model = jd.nn.Pipeline(block=WideLayer(), num_layers=8, num_microbatches=micro,  # no unroll
                           schedule="circular" if repeats > 1 else "gpipe", repeats=repeats)
    x = jax.ShapeDtypeStruct((BUBBLE_BATCH, BUBBLE_WIDTH), jnp.float32)

    def step(params, x):
        grads = jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

    if pipeline_parallelism > 1:
        strategy = jd.ShardedStrategy(pipeline_parallelism=pipeline_parallelism, min_shard_size=1)
    else:
        strategy = jd.OneDeviceStrategy()
    plan = strategy.jit(step, batch_argnums=(1,)).plan(
        jax.eval_shape(model.init, jax.random.key(0), x), x
    )
    assert plan.unknown_loops == 0  # every loop's trip count is known: each iteration is counted
    return plan.flops * strategy.mesh.size


@pytest.mark.timeout(600)
# both factors of the bubble vary; both schedules
@pytest.mark.parametrize("micro,repeats", [(2, 1), (4, 2)])
def test_planned_flops_show_the_bubble(micro, repeats):
    """The plan counts the pipeline loop's ``R M + S - 1`` iterations: the layers' total work
    pipelined is ``(R M + S - 1) / (R M)`` times the plain scan's (S = 2 stages).

    Total work is each plan's per-device FLOPs times its devices: a training step of 8 layers
    pipelined (``pipeline_parallelism=2``, 8 devices: 2 stages x 4 replicas) against the same step's
    plain scan on one device. A pipelined device runs ``R M + S - 1`` iterations of ``L / (S R)``
    layers on a micro-batch of ``B / (4 M)`` rows where the plain scan runs ``L`` layers on ``B``
    rows once: over the 8 devices, ``(R M + S - 1) / (R M)`` times the work, forward and backward.
    What remains beyond the formula (0.5% and 1.2% here) is the loop's own bookkeeping and what
    scales with the parameters, not the rows: each iteration adds its layers' gradients into the sum
    over iterations, and each replica updates its stage's layers.
    """
    stages = 2
    pipelined = _total_step_flops(stages, micro, repeats)
    plain = _total_step_flops(1, 1, 1)  # M and R change nothing here
    expected = (repeats * micro + stages - 1) / (repeats * micro)
    assert expected == pytest.approx(1 / (1 - jd.nn.bubble_fraction(stages, micro, repeats)))
    assert pipelined / plain == pytest.approx(expected, rel=0.05)
