"""Plans: a step's memory, FLOPs and collectives per device, compiled for the strategy's layout,
never run."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from registry import load_char_lm

import jaxdist as jd

pytestmark = pytest.mark.timeout(300)

# a batch larger than the weights: XLA partitions the MLP as FSDP (gather weights)
D, H, B = 256, 1024, 8192
F32 = 4


def mlp_params():
    f = jnp.float32
    return {"w1": jax.ShapeDtypeStruct((D, H), f), "b1": jax.ShapeDtypeStruct((H,), f),
            "w2": jax.ShapeDtypeStruct((H, D), f), "b2": jax.ShapeDtypeStruct((D,), f)}


def mlp_loss(p, x):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    return ((h @ p["w2"] + p["b2"] - x) ** 2).mean()


def sgd_step(p, x):
    loss, g = jax.value_and_grad(mlp_loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss


def auto_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def strategies():
    return {
        "mirrored": jd.MirroredStrategy(),
        "fsdp": jd.ShardedStrategy(),
        "fsdp_tp": jd.ShardedStrategy(mesh=auto_mesh((4, 2), ("fsdp", "tensor")), batch_axes="fsdp",
                                      layout_rules=[("w1", P("fsdp", "tensor")),
                                                    ("w2", P("tensor", "fsdp"))]),
        "hsdp": jd.ShardedStrategy(mesh=auto_mesh((2, 4), ("data", "fsdp")),
                                   batch_axes=("data", "fsdp"), fsdp_axes="fsdp"),
    }


# Per device, analytic: (w1, b1, w2, b2) split into these many parts, and the batch's rows.
# min_shard_size=1024 elements (the default) keeps b2 (256) whole: the documented exception.
SPLITS = {"mirrored": (1, 1, 1, 1, 8), "fsdp": (8, 8, 8, 1, 8), "fsdp_tp": (8, 4, 8, 1, 4),
          "hsdp": (4, 4, 4, 1, 8)}


@pytest.mark.parametrize("name", list(SPLITS))
def test_argument_bytes_per_device_equal_the_analytic_figure(name):
    plan = strategies()[name].plan(
        sgd_step, mlp_params(), jax.ShapeDtypeStruct((B, D), jnp.float32), batch_argnums=1
    )
    w1, b1, w2, b2, rows = SPLITS[name]
    params = F32 * (D * H / w1 + H / b1 + H * D / w2 + D / b2)
    batch = F32 * B * D / rows
    assert plan.state_bytes == {"p": params, "batch": batch}
    assert plan.argument_bytes == pytest.approx(params + batch, rel=0.01)  # XLA's memory analysis
    assert (plan.peak_bytes
            == plan.argument_bytes + plan.output_bytes - plan.alias_bytes + plan.temp_bytes)
    assert plan.largest_arrays[0].bytes == max(batch, F32 * D * H / w1)
    assert {a.path: a.bytes for a in plan.largest_arrays}["x"] == batch
    # each kind names the mesh axes it runs over
    assert all(c.axes for c in plan.collectives.values())


def test_collectives_fsdp_gathers_and_scatters_mirrored_all_reduces():
    made = strategies()
    x = jax.ShapeDtypeStruct((B, D), jnp.float32)
    mirrored = made["mirrored"].plan(sgd_step, mlp_params(), x, batch_argnums=1)
    whole = F32 * (2 * D * H + H + D)
    assert set(mirrored.collectives) == {"all-reduce"}
    # every gradient
    assert mirrored.collectives["all-reduce"].bytes == pytest.approx(whole, rel=0.05)
    assert mirrored.collectives["all-reduce"].axes == ("replica",)
    fsdp = made["fsdp"].plan(sgd_step, mlp_params(), x, batch_argnums=1)
    split = F32 * (2 * D * H + H)  # b2 stays whole (min_shard_size): its gradient is all-reduced
    assert fsdp.collectives["all-gather"].bytes == pytest.approx(split, rel=0.05)
    assert fsdp.collectives["reduce-scatter"].bytes == pytest.approx(split, rel=0.05)
    assert fsdp.collectives["all-gather"].axes == ("replica",)
    assert fsdp.collectives["all-gather"].wire_bytes == pytest.approx(split * 7 / 8, rel=0.05)
    assert fsdp.network_bytes < mirrored.network_bytes * 1.1


@pytest.mark.parametrize("devices", [8, 32])
def test_a_plan_never_runs_the_step(devices):
    calls = []

    def step(w, x):
        jax.debug.callback(lambda v: calls.append(v), x.sum())
        return w - 0.1 * jax.grad(lambda w: ((x @ w) ** 2).mean())(w)

    # compiled here / in a subprocess
    mesh = None if devices == 8 else jd.plan_mesh({"replica": devices})
    strategy = jd.ShardedStrategy(mesh=mesh, min_shard_size=1)
    plan = strategy.jit(step, batch_argnums=1).plan(np.zeros((64, 32), np.float32),
                                                    np.zeros((64, 64), np.float32))
    assert calls == []
    assert plan.state_bytes == {"w": 64 * 32 * 4 // devices, "batch": 64 * 64 * 4 // devices}


def test_flops_count_each_loop_iteration():
    layers, rows, width = 8, 512, 256

    def loss(w, x):
        def body(h, wi):
            return jnp.tanh(h @ wi), None
        return (jax.lax.scan(body, x, w)[0] ** 2).mean()

    def step(w, x):
        return w - 0.1 * jax.grad(loss)(w, x)

    w = jax.ShapeDtypeStruct((layers, width, width), jnp.float32)
    x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    plan = jd.MirroredStrategy().plan(step, w, x, batch_argnums=1)
    # forward + two backward dots per layer, per device
    analytic = 3 * 2 * (rows // 8) * width * width * layers
    assert plan.flops == pytest.approx(analytic, rel=0.10)
    assert plan.unknown_loops == 0


def test_program_cost_agrees_with_xla_on_a_program_without_loops():
    p = {"w1": jnp.ones((64, 256)), "w2": jnp.ones((256, 64))}
    compiled = (
        jax.jit(lambda p, x: jax.grad(lambda p: mlp_loss({**p, "b1": 0.0, "b2": 0.0}, x))(p))
        .lower(p, jnp.ones((32, 64)))
        .compile()
    )
    cost = jd.program_cost(compiled.as_text())
    xla = compiled.cost_analysis()
    assert cost.flops == pytest.approx(xla["flops"], rel=0.01)
    assert cost.bytes_accessed == pytest.approx(xla["bytes accessed"], rel=0.05)


def test_replicated_bytes_name_the_variable_a_typo_left_whole():
    mesh = auto_mesh((4, 2), ("data", "tensor"))
    x = jax.ShapeDtypeStruct((64, D), jnp.float32)
    good = jd.ShardedStrategy(mesh=mesh, batch_axes="data", fsdp_axes=(),
                              layout_rules=[("w1", P(None, "tensor")), ("w2", P("tensor", None))])
    plan = good.plan(sgd_step, mlp_params(), x, batch_argnums=1)
    # the bias of the split layer: small, named
    assert [a.path for a in plan.replicated] == ["p.b1"]
    typo = jd.ShardedStrategy(mesh=mesh, batch_axes="data", fsdp_axes=(),
                              layout_rules=[("w_1", P(None, "tensor")), ("w2", P("tensor", None))])
    plan = typo.plan(sgd_step, mlp_params(), x, batch_argnums=1)
    assert plan.replicated[0].path == "p.w1" and plan.replicated[0].axes == ("tensor",)
    assert plan.replicated_bytes == F32 * (D * H + H)
    assert "p.w1" in str(plan)


def test_fits_estimate_and_the_table():
    plan = jd.ShardedStrategy().plan(
        sgd_step, mlp_params(), jax.ShapeDtypeStruct((B, D), jnp.float32), batch_argnums=1
    )
    assert plan.fits(plan.peak_bytes) and not plan.fits(plan.peak_bytes - 1)
    assert plan.fits("h100")
    e = plan.estimate("h100")
    assert e.step_s == max(e.compute_s, e.memory_s, e.network_s) > 0
    assert e.compute_s == pytest.approx(plan.flops / 989.4e12)
    assert plan.estimate("b200").step_s < plan.estimate("a100").step_s
    text = str(plan)
    for heading in ("Memory per device", "Collectives per device per step", "all-gather",
                    "Largest arrays"):
        assert heading in text


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_fits_refuses_a_budget_that_is_not_a_positive_int(bad):
    plan = jd.OneDeviceStrategy().plan(lambda w: w * 2, jnp.ones(4))
    with pytest.raises(ValueError, match=r"memory_per_device=.* positive number of bytes"):
        plan.fits(bad)


def test_an_unknown_accelerator_lists_the_known_ones():
    plan = jd.OneDeviceStrategy().plan(lambda w: w * 2, jnp.ones(4))
    with pytest.raises(ValueError, match=r"accelerator='tpu-v9' .* 'h100'"):
        plan.estimate("tpu-v9")


def test_a_batch_the_replicas_do_not_divide_is_an_error_naming_it():
    # the message a call gives (one check for both)
    with pytest.raises(ValueError,
                       match=r"=8 does not divide the rows of argument 1 \('x'\) 12: .* pad to 16"):
        jd.MirroredStrategy().plan(lambda w, x: x @ w, jnp.ones((4, 4)), jnp.ones((12, 4)),
                                   batch_argnums=1)


def test_placed_arguments_keep_their_layout_and_keyword_arguments_count():
    strategy = jd.ShardedStrategy(min_shard_size=1)
    w = strategy.create_variables(lambda: jnp.zeros((64, 8)))
    plan = strategy.jit(lambda w, x: (x @ w).sum(), batch_argnames="x").plan(
        w, x=np.zeros((16, 64), np.float32)
    )
    assert plan.state_bytes == {"w": 64 * 8 * 4 // 8, "batch": 16 * 64 * 4 // 8}


def test_a_typed_prng_key_argument_is_sized_by_its_dtype():
    def step(w, key):
        return w + jax.random.normal(key, w.shape), jax.random.split(key)[0]

    plan = jd.MirroredStrategy().plan(step, jnp.zeros((4, 4)), jax.random.key(0))
    assert plan.state_bytes["key"] == jax.random.key(0).dtype.itemsize == 8


# -------------------------------------------------------------------------------------- plan meshes
def test_plan_mesh_strategies_plan_but_do_not_run():
    mesh = jd.plan_mesh({"data": 16, "fsdp": 32, "tensor": 8})
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("data", "fsdp"), fsdp_axes="fsdp",
                                  min_shard_size=1, layout_rules=[("w", P("fsdp", "tensor"))])
    assert strategy.num_replicas_in_sync == 512
    w = strategy.create_variables(lambda: {"w": jnp.zeros((1024, 512))})["w"]
    assert isinstance(w, jax.ShapeDtypeStruct) and w.sharding.spec == P("fsdp", "tensor")
    step = strategy.jit(lambda w, x: (x @ w).sum(), batch_argnums=1)
    with pytest.raises(RuntimeError,
                       match=r"calling .*<lambda> needs devices.*plan mesh.*step\.plan"):
        step(w, np.zeros((512, 1024), np.float32))
    with pytest.raises(RuntimeError, match=r"strategy.mirror needs devices"):
        strategy.mirror({"w": np.zeros(4)})


@pytest.mark.parametrize("shape", [{}, {"data": 0}, {"": 2}, [("data", 2)]])
def test_plan_mesh_refuses_a_bad_shape(shape):
    with pytest.raises(ValueError, match="shape="):
        jd.plan_mesh(shape)


@pytest.mark.parametrize("types", [(AxisType.Auto,), "Explicit"])
def test_plan_mesh_refuses_bad_axis_types(types):
    with pytest.raises(ValueError, match=r"axis_types=.* one per axis"):
        jd.plan_mesh({"data": 4, "fsdp": 2}, types)


def test_a_plan_mesh_with_explicit_axes_plans_code_written_for_them():
    mesh = jd.plan_mesh({"fsdp": 32, "tensor": 2}, AxisType.Explicit)
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes="fsdp", min_shard_size=1,
                                  logical_axis_rules=[("mlp", "tensor")], activation_axes=("mlp",))

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: ((x @ w) ** 2).mean())(w)

    plan = strategy.plan(step, jax.ShapeDtypeStruct((64, 32), jnp.float32),
                         jax.ShapeDtypeStruct((64, 64), jnp.float32), batch_argnums=1)
    assert plan.state_bytes == {"w": 64 * 32 * 4 // 32, "batch": 64 * 64 * 4 // 32}
    assert plan.mesh == {"fsdp": 32, "tensor": 2}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("devices", [64, 512])
def test_a_plan_on_a_large_simulated_mesh_holds_its_share_of_fsdp_state(devices):
    strategy = jd.ShardedStrategy(mesh=jd.plan_mesh({"fsdp": devices}), min_shard_size=1)
    params = {"w1": jax.ShapeDtypeStruct((512, 1024), jnp.float32),
              "w2": jax.ShapeDtypeStruct((1024, 512), jnp.float32)}
    x = jax.ShapeDtypeStruct((devices * 4, 512), jnp.float32)

    def step(p, x):
        g = jax.grad(lambda p: ((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2).mean())(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    plan = strategy.plan(step, params, x, batch_argnums=1)
    whole = F32 * 2 * 512 * 1024
    assert plan.state_bytes["p"] == whole / devices
    assert plan.argument_bytes == whole / devices + F32 * 4 * 512
    assert plan.mesh == {"fsdp": devices} and "subprocess" in plan.compiled_on
    assert plan.collectives["all-gather"].axes == ("fsdp",)


# -------------------------------------------------------------------------------------- the char LM
LM_CONFIG = dict(vocab_size=104, d_model=64, num_heads=4, num_layers=2, mlp_dim=256, max_len=64)
LM_BATCH, LM_SEQ = 16, 64


def _lm_plan(strategy_name):
    lm = load_char_lm()
    if strategy_name == "hsdp":
        strategy = lm.mesh_strategy({"data": 2, "fsdp": 4}, None, ("fsdp",))
    else:
        strategy = lm.make_strategy(strategy_name)
    model = lm.CharLM(lm.LMConfig(**LM_CONFIG))
    trainer = jd.training.Trainer(strategy, model, lm.make_optimizer(100), lm.loss_fn)
    tokens = jax.ShapeDtypeStruct((LM_BATCH, LM_SEQ), jnp.int32)
    with strategy.scope():
        plan = trainer.plan((tokens, tokens))
    assert trainer.state is None  # planned from shapes: nothing initialized
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, LM_SEQ), jnp.int32))
    return strategy, plan, params


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mirrored", "fsdp_tp", "hsdp"])  # FSDP alone: in both of them
def test_the_char_lm_plan_holds_the_analytic_state_and_flops(name):
    strategy, plan, params = _lm_plan(name)
    if name == "mirrored":
        per_device = {k: F32 * math.prod(s.value.shape) for k, s in _flat(params).items()}
    else:
        layouts = strategy.variable_layouts(params)
        sizes = dict(strategy.mesh.shape)
        per_device = {k: F32 * math.prod(s.value.shape) // math.prod(
            sizes[n] for e in layouts[k] for n in (e if isinstance(e, tuple) else (e,)) if n)
            for k, s in
            _flat(params).items()}
    assert plan.state_bytes["params"] == sum(per_device.values())
    assert plan.state_bytes["batch"] == 2 * LM_BATCH * LM_SEQ * 4 // strategy.num_replicas_in_sync
    assert plan.argument_bytes == pytest.approx(sum(plan.state_bytes.values()), rel=0.01)
    # FLOPs per step, all devices: 6 x parameters x tokens (embedding lookups aside) + attention's
    # 12 x layers x length x d_model per token (forward and backward of QK^T and AV).
    cfg = LM_CONFIG
    n = sum(math.prod(s.value.shape) for s in _flat(params).values())
    embeddings = cfg["vocab_size"] * cfg["d_model"] + cfg["max_len"] * cfg["d_model"]
    tokens = LM_BATCH * LM_SEQ
    analytic = (
        6 * (n - embeddings) * tokens + 12 * cfg["num_layers"] * LM_SEQ * cfg["d_model"] * tokens
    )
    assert plan.flops * plan.num_devices == pytest.approx(analytic, rel=0.10)


def _flat(params):
    from jaxdist.replicate.layouts import path_name

    return {path_name(p): box for p, box in jax.tree_util.tree_leaves_with_path(
        params, is_leaf=lambda x: hasattr(x, "names"))}


# --------------------------------------------------------------------------------------- the search
class _DeepMLP(nn.Module):
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = jax.nn.relu((nn.remat(nn.Dense) if self.remat else nn.Dense)(1024)(x))
        return nn.Dense(1)(x)


def _build(strategy, remat, grad_accum_steps):
    return jd.training.Trainer(strategy, _DeepMLP(remat), optax.adam(1e-3),
                               lambda o, y: ((o[:, 0] - y) ** 2).mean(),
                               grad_accum_steps=grad_accum_steps)


def test_the_search_finds_a_sharded_layout_where_mirrored_does_not_fit():
    batch = (jax.ShapeDtypeStruct((256, 1024), jnp.float32),
             jax.ShapeDtypeStruct((256,), jnp.float32))
    seen = []
    found = jd.strategies.plan_search(_build, batch, num_devices=8, memory_per_device=40 << 20,
                                    remat=(False,),
                                    layouts=("mirrored", "fsdp", "hsdp"), hsdp_groups=(2,),
                                    grad_accum_steps=(1, 3), progress=seen.append)
    assert sorted(map(id, seen)) == sorted(map(id, found))
    by_layout = {(c.layout, c.grad_accum_steps): c for c in found}
    mirrored = by_layout["mirrored", 1]
    assert not mirrored.fits and mirrored.plan.peak_bytes > 40 << 20
    assert mirrored.plan.state_bytes["params"] == 4 * (4 * 1024 * 1024 + 4 * 1024 + 1024 + 1)
    best = found[0]
    assert best.fits and best.layout in ("fsdp", "hsdp")
    assert best.plan.state_bytes["params"] < mirrored.plan.state_bytes["params"] / 3
    steps = [c.estimate.step_s for c in found if c.fits]
    assert steps == sorted(steps)
    undivided = by_layout["fsdp", 3]  # 256 rows are not 3 micro-batches of 8 replicas
    assert undivided.plan is None and "3" in undivided.error and "not planned" in str(undivided)
    assert "fits" in str(best)


def test_the_search_tries_expert_axis_sizes_for_a_moe_model():
    class MoENet(nn.Module):
        remat: bool = False

        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(x + jd.nn.MoE(num_experts=8, top_k=2, hidden_dim=256,
                                             capacity_factor=1.0)(x))

    def build(strategy, remat, grad_accum_steps):
        return jd.training.Trainer(strategy, MoENet(remat), optax.adam(1e-3),
                                   lambda o, y: ((o[:, :, 0] - y) ** 2).mean(),
                                   grad_accum_steps=grad_accum_steps)

    batch = (jax.ShapeDtypeStruct((16, 4, 128), jnp.float32),
             jax.ShapeDtypeStruct((16, 4), jnp.float32))
    found = jd.strategies.plan_search(build, batch, num_devices=8, memory_per_device=1 << 30,
                                    remat=(False,),
                                    layouts=("mirrored", "fsdp_ep"), expert_parallelism=(4, 3))
    by_mesh = {tuple(c.mesh.items()): c for c in found}
    # 3 does not divide the 8 devices: no candidate
    assert set(by_mesh) == {(("data", 8),), (("fsdp", 2), ("expert", 4))}
    ep4, mirrored = by_mesh[("fsdp", 2), ("expert", 4)], by_mesh[("data", 8),]
    # the tokens' trips to their experts and back
    assert ep4.plan.collectives["all-to-all"].count >= 2
    assert ep4.plan.state_bytes["params"] < mirrored.plan.state_bytes["params"] / 3


def test_the_search_refuses_an_unknown_layout_and_a_bad_device_count():
    with pytest.raises(ValueError, match=r"layouts=.*'zero'.* choose among"):
        jd.strategies.plan_search(_build, None, num_devices=8, memory_per_device=1 << 30,
                                  layouts=("zero",))
    with pytest.raises(ValueError, match=r"num_devices=0 must be an int >= 1"):
        jd.strategies.plan_search(_build, None, num_devices=0, memory_per_device=1 << 30)


def test_a_failed_or_slow_compile_elsewhere_says_so():
    from jaxdist.strategies.plan import compile_elsewhere

    with pytest.raises(RuntimeError,
                       match=r"compiling the plan for 2 simulated CPU devices failed"):
        compile_elsewhere("this is not a module", 2)
    with pytest.raises(RuntimeError,
                       match=r"took longer than timeout=0.01 s: pass a larger timeout"):
        compile_elsewhere("module {}", 2, timeout=0.01)


def test_create_variables_on_a_plan_mesh_refuses_a_non_callable():
    strategy = jd.MirroredStrategy(mesh=jd.plan_mesh({"data": 64}))
    with pytest.raises(TypeError, match=r"init_fn=3 .* is not callable"):
        strategy.create_variables(3)
    w = strategy.create_variables(lambda: jnp.zeros((4, 4)))
    assert w.sharding.is_fully_replicated and w.sharding.mesh.size == 64


def test_nnx_modules_are_planned_in_their_layout_and_left_as_they_are():
    strategy = jd.ShardedStrategy(min_shard_size=1)
    with strategy.scope():
        model = nnx.Linear(64, 256, rngs=nnx.Rngs(0))
    before = model.kernel[...].sharding

    def step(m, x):
        return (m(x) ** 2).mean()

    plan = strategy.jit(step, batch_argnums=1).plan(model, np.zeros((64, 64), np.float32))
    assert plan.state_bytes == {"m": (64 * 256 + 256) * 4 // 8, "batch": 64 * 64 * 4 // 8}
    assert model.kernel[...].sharding == before  # nothing moved into the FSDP layout by planning
    trainer = jd.training.Trainer(strategy, nnx.Linear(64, 8, rngs=nnx.Rngs(0)), optax.sgd(0.1),
                                  lambda out, y: ((out[:, 0] - y) ** 2).mean())
    plan = trainer.plan(
        (jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.float32))
    )
    assert plan.state_bytes["params"] == (64 * 8 + 8) * 4 // 8


@pytest.mark.parametrize("mesh", [None, {"data": 32}])
def test_a_per_replica_step_plans_its_explicit_all_reduce(mesh):
    strategy = jd.MirroredStrategy(mesh=None if mesh is None else jd.plan_mesh(mesh))

    def replica_fn(w, x):
        g = jax.grad(lambda w: ((x @ w) ** 2).mean())(w)
        return w - 0.1 * jd.get_replica_context().all_reduce("mean", g)

    step = strategy.jit(lambda w, x: strategy.run(replica_fn, args=(w, x), batch_argnums=(1,)),
                        batch_argnums=1)
    plan = step.plan(
        jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((64, 64), jnp.float32)
    )
    assert (plan.collectives["all-reduce"].count == 1
            and plan.collectives["all-reduce"].bytes == 64 * 32 * 4)
    assert plan.state_bytes["batch"] == 64 * 64 * 4 // strategy.num_replicas_in_sync


def test_bfloat16_collectives_count_16_bits_though_xla_cpu_computes_them_in_float32():
    bf16 = jnp.bfloat16
    params = {"w1": jax.ShapeDtypeStruct((D, H), bf16), "w2": jax.ShapeDtypeStruct((H, D), bf16)}
    x = jax.ShapeDtypeStruct((B, D), bf16)

    def step(p, x):
        loss, g = jax.value_and_grad(
            lambda p: ((jax.nn.relu(x @ p["w1"]) @ p["w2"] - x) ** 2).mean()
        )(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    whole = 2 * 2 * D * H  # bytes of both bfloat16 weights
    mirrored = jd.MirroredStrategy().plan(step, params, x, batch_argnums=1)
    assert mirrored.collectives["all-reduce"].bytes == pytest.approx(whole, rel=0.05)
    fsdp = jd.ShardedStrategy().plan(step, params, x, batch_argnums=1)
    assert fsdp.collectives["all-gather"].bytes == pytest.approx(whole, rel=0.05)
    assert fsdp.collectives["reduce-scatter"].bytes == pytest.approx(whole, rel=0.05)


@pytest.mark.slow
def test_the_char_lm_example_prints_its_plan_and_trains_nothing(capsys):
    lm = load_char_lm()
    result = lm.main(["--plan", "--mesh", "data=4,fsdp=16", "--fsdp-axes", "fsdp", "--layers", "1",
                      "--d-model", "32", "--seq-len", "16", "--batch-size", "64", "--steps", "2"])
    out = capsys.readouterr().out
    assert math.isnan(result)
    assert (
        "Plan for mesh {'data': 4, 'fsdp': 16} (64 devices)" in out and "Memory per device" in out
    )
    assert "fits h100 (80 GB): True" in out and "trained" not in out


def test_the_plan_names_the_kernels_of_the_program_it_lowered_not_of_a_cached_one():
    """JAX's persistent compilation cache keys a program without its op names (the named scopes): a
    program loaded from it carries the names of the first one compiled with the same operations
    (the tests' processes cache every program: conftest.py). The plan reads the kernels' scopes
    from the module it lowered."""

    def kernel(name):
        def f(x):
            with jax.named_scope(f"jaxdist_attention_{name}"):
                return jnp.tanh(x) * 3.0  # the same operations under either name
        return f

    x = np.full((3, 7), 0.5, np.float32)
    strategy = jd.OneDeviceStrategy()
    assert strategy.jit(kernel("xla")).plan(x).attention == ("xla",)
    assert strategy.jit(kernel("einsum")).plan(x).attention == ("einsum",)
