"""The user's mesh as it is (Explicit or Auto axes), layouts resolved once per program, jax.jit's shape."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd

pytestmark = pytest.mark.timeout(300)


def explicit_mesh(shape=(4, 2), names=("fsdp", "tensor")):
    return jax.make_mesh(shape, names)  # jax.make_mesh's default: Explicit axes


# ------------------------------------------------------------------------------------------- the user's mesh
def test_the_users_mesh_keeps_its_axis_types():
    mesh = explicit_mesh()
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    assert jd.ShardedStrategy(mesh=mesh, batch_axes="fsdp").mesh == mesh
    auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    assert jd.MirroredStrategy(mesh=auto).mesh.axis_types == (AxisType.Auto,)
    assert jd.MirroredStrategy().mesh.axis_types == (AxisType.Auto,)  # jaxdist's own meshes: Auto, on purpose


def _shard_map_step(x):
    def local(block):
        return jax.lax.psum(block.sum(), "data")

    return jax.shard_map(local, in_specs=P("data", None), out_specs=P())(x)


@pytest.mark.parametrize("make", ["mirrored", "sharded"])
def test_a_step_calling_shard_map_on_a_make_mesh_mesh_equals_plain_jit(make):
    mesh = jax.make_mesh((8,), ("data",))
    x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
    with jax.set_mesh(mesh):
        expected = jax.jit(_shard_map_step)(jax.device_put(x, NamedSharding(mesh, P("data"))))
    strategy = jd.MirroredStrategy(mesh=mesh) if make == "mirrored" else jd.ShardedStrategy(mesh=mesh)
    got = strategy.jit(_shard_map_step, batch_argnums=0)(x)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert float(got) == pytest.approx(float(x.sum()))


def test_partition_specs_in_model_code_work_without_logical_rules():
    strategy = jd.ShardedStrategy(mesh=jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2),
                                  batch_axes="data", layout_rules=[("w", P(None, "model"))])
    w = strategy.mirror({"w": np.ones((4, 8), np.float32)})["w"]

    def step(w, x):
        h = jax.lax.with_sharding_constraint(x @ w, P("data", "model"))  # a bare spec: needs the step's mesh
        return h.sum()

    assert float(strategy.jit(step, batch_argnums=1)(w, np.ones((8, 4), np.float32))) == 256.0


# ------------------------------------------------------------------------------------------- output layouts
class Tiny(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor")), rngs=rngs)
        self.scale = nnx.Param(jnp.ones((16,)), out_sharding=(None,))  # annotated whole
        self.bias = nnx.Param(jnp.zeros((16,)))  # unannotated

    def __call__(self, x):
        return self.up(x) * self.scale + self.bias


def _sharded(mesh):
    return jd.ShardedStrategy(mesh=mesh, batch_axes="fsdp", min_shard_size=1)


def test_a_returned_nnx_state_keeps_its_tensor_parallel_layout():
    mesh = explicit_mesh()
    strategy = _sharded(mesh)
    with strategy.scope():
        model = Tiny(nnx.Rngs(0))
    assert model.up.kernel.sharding.spec == P("fsdp", "tensor")
    state = strategy.jit(lambda m, x: nnx.state(m), batch_argnums=1)(model, np.ones((8, 8), np.float32))
    assert state["up"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert state["scale"].sharding.spec in (P(), P(None))  # annotated whole: stays whole on FSDP
    assert state["bias"].sharding.spec == P("fsdp")  # unannotated: the variable layout (FSDP)


def test_in_place_nnx_updates_keep_each_variables_layout():
    mesh = explicit_mesh()
    strategy = _sharded(mesh)
    with strategy.scope():
        model = Tiny(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, __import__("optax").sgd(0.1), wrt=nnx.Param)

    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    compiled = strategy.jit(step, donate_argnames=("model", "optimizer"), batch_argnames="x")
    for _ in range(2):
        compiled(model, optimizer, np.ones((8, 8), np.float32))
        assert model.up.kernel.sharding.spec == P("fsdp", "tensor")
        assert model.scale.sharding.spec in (P(), P(None))
        assert model.bias.sharding.spec == P("fsdp")


def test_an_output_shaped_like_an_argument_keeps_its_layout_and_others_take_the_variable_layout():
    strategy = jd.ShardedStrategy(min_shard_size=1)
    state = strategy.mirror({"w": np.ones((8, 4), np.float32)})
    layout = state["w"].sharding
    new_state, grads = strategy.jit(lambda s, x: (s, {"g": s["w"] * x.sum()}), batch_argnums=1)(
        state, np.ones((8, 2), np.float32))
    assert new_state["w"].sharding == layout
    assert grads["g"].sharding.spec == strategy.variable_layout("g", grads["g"]).spec


def test_out_layouts_declares_an_outputs_layout():
    strategy = jd.ShardedStrategy(min_shard_size=1)
    w = strategy.mirror(np.ones((8, 4), np.float32))
    out = strategy.jit(lambda w: (w, w * 2), batch_argnums=(), out_layouts=(None, P()))(w)
    assert out[0].sharding == w.sharding and out[1].sharding.is_fully_replicated
    with pytest.raises(TypeError, match=r"out_layouts entry 3 is neither a jax.sharding.Sharding"):
        strategy.jit(lambda w: w, batch_argnums=(), out_layouts=3)(w)
    with pytest.raises(ValueError, match=r"does not match the structure of the step's outputs"):
        strategy.jit(lambda w: w, batch_argnums=(), out_layouts=(P(), P()))(w)


# ------------------------------------------------------------------------------------------- jax.jit's shape
def test_strategy_jit_has_jax_jits_shape():
    strategy = jd.MirroredStrategy()

    def step(w, batch, lr=0.1, *, scale=1.0):
        return w - lr * scale * batch.mean(0)

    compiled = strategy.jit(step, static_argnames=("lr",), donate_argnames="w", batch_argnames="batch")
    assert compiled.batch_argnums == (1,)
    x = np.ones((8, 2), np.float32)
    a = compiled(strategy.mirror(np.ones(2, np.float32)), x, 0.5)
    b = compiled(strategy.mirror(np.ones(2, np.float32)), batch=x, lr=0.5)
    c = compiled(w=strategy.mirror(np.ones(2, np.float32)), batch=x, lr=0.5, scale=1.0)
    np.testing.assert_allclose(a, [0.5, 0.5])
    np.testing.assert_allclose(b, a)
    np.testing.assert_allclose(c, a)
    lowered = compiled.lower(strategy.mirror(np.ones(2, np.float32)), x, 0.5)
    assert "stablehlo" in lowered.as_text() or "func" in lowered.as_text()
    assert lowered.compile().memory_analysis() is not None
    assert compiled.trace(strategy.mirror(np.ones(2, np.float32)), x, lr=0.5).jaxpr is not None


def test_jit_declaration_errors_name_the_fix():
    strategy = jd.OneDeviceStrategy()

    def step(w, batch):
        return w

    with pytest.raises(ValueError, match=r"static_argnames=\('lr',\) names 'lr', which \S*step does not take by name: "
                                         r"its parameters are \('w', 'batch'\)"):
        strategy.jit(step, static_argnames="lr")
    with pytest.raises(ValueError, match=r"both static and in batch_argnums/batch_argnames"):
        strategy.jit(step, static_argnames="batch", batch_argnums=1)
    with pytest.raises(TypeError, match=r"batch_argnames=3 must be a parameter name"):
        strategy.jit(step, batch_argnames=3)
    with pytest.raises(ValueError, match=r"donate_argnums=\(-1,\): use non-negative positions"):
        strategy.jit(step, donate_argnums=-1)
    with pytest.raises(TypeError, match=r"step: missing a required argument"):
        strategy.jit(step, batch_argnums=1)(w=np.ones(2))

    def kw_only(x, *, model):
        return x

    with pytest.raises(TypeError, match=r"nnx object passed as keyword-only argument 'model'"):
        strategy.jit(kw_only, batch_argnums=())(np.ones(2), model=nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


# -------------------------------------------------------------------------------- per-replica verbs in a step
def _loss(w, x):
    return ((x @ w) ** 2).mean()


def _micro_step(strategy, checkpoint, declare):
    def step(w, batch):
        shape = (2, batch.shape[0] // 2, batch.shape[-1])  # two micro-batches
        if declare:
            micro = batch.reshape(shape)
        else:  # Explicit axes: code says where the rows of each micro-batch go, as it must under plain jax.jit
            micro = jax.lax.reshape(batch, shape, out_sharding=P(None, "data", None))

        def body(acc, xs):
            def replica(w, xs):
                ctx = jd.get_replica_context()
                return ctx.all_reduce(jd.ReduceOp.MEAN, jax.grad(_loss)(w, xs))

            fn = jax.checkpoint(replica) if checkpoint else replica
            kwargs = {"batch_argnums": (1,)} if declare else {}
            g = strategy.run(fn, args=(w, xs), **kwargs)
            return acc + g / 2, None

        grads, _ = jax.lax.scan(body, jnp.zeros_like(w), micro)
        return grads

    return step


def _one_device_micro_grads(w, x):
    xs = x.reshape(2, -1, x.shape[-1])
    return sum(jax.grad(_loss)(w, xs[i]) for i in range(2)) / 2


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize(("explicit", "declare"), [(False, True), (True, False), (True, True)])
def test_a_users_micro_batch_loop_calling_run_inside_jit_equals_one_device(checkpoint, explicit, declare):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 3)).astype(np.float32)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    if explicit:  # the batch's type says it is a batch, also for a slice inside lax.scan: nothing to declare;
        # unannotated code (declare=True: a plain reshape) runs with the axis Auto, and declares the batch
        strategy = jd.MirroredStrategy(mesh=jax.make_mesh((8,), ("data",)))
    else:  # Auto axes: types carry no layout, so the run call declares its batch argument
        strategy = jd.MirroredStrategy()
    step = strategy.jit(_micro_step(strategy, checkpoint, declare=declare), batch_argnums=1)
    np.testing.assert_allclose(step(strategy.mirror(w), x), _one_device_micro_grads(w, x), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------- idle axes
def test_an_idle_model_axis_is_reported_for_a_compiled_step():
    mesh = explicit_mesh()
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes="fsdp")
    with strategy.scope():
        model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))  # no annotation: nothing uses "tensor"
    step = strategy.jit(lambda m, x: m(x).sum(), batch_argnums=1)
    with pytest.warns(jd.IdleAxisWarning, match=r"mesh axis 'tensor' \(size 2\).*step's variables.*288 B per "
                                                r"device of them could be split 2 ways along it but are held whole"):
        step(model, np.ones((8, 8), np.float32))


def test_compute_average_loss_in_a_step_on_an_explicit_mesh():
    strategy = jd.MirroredStrategy(mesh=jax.make_mesh((8,), ("data",)))
    loss = strategy.jit(functools.partial(jd.compute_average_loss), batch_argnums=0)(np.arange(8, dtype=np.float32))
    assert float(loss) == pytest.approx(3.5)


# ------------------------------------------------------------- a model that constrains its activations, in fit
class GuideMLP(nn.Module):
    """Flax's "Scale up Flax Modules on multiple devices": parameters annotated with ``nn.with_partitioning``,
    activations laid out by ``jax.lax.with_sharding_constraint`` in ``__call__``: a bare `PartitionSpec` (it
    names the context mesh's axes) or a `NamedSharding` on ``mesh``."""

    batch: str | None = None
    model: str | None = None
    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, x):
        init, spec = nn.initializers.lecun_normal(), P(self.batch, self.model)
        h = nn.relu(nn.Dense(16, kernel_init=nn.with_partitioning(init, (None, self.model)))(x))
        h = jax.lax.with_sharding_constraint(h, spec if self.mesh is None else NamedSharding(self.mesh, spec))
        return nn.Dense(1, kernel_init=nn.with_partitioning(init, (self.model, None)))(h)


def _guide_case(case):
    """``(strategy, model)``: each strategy with the model naming its mesh's axes (on Explicit axes a
    NamedSharding constraint is an assert in JAX, the guide's own code fails there: bare specs only)."""
    auto, named = AxisType.Auto, case.endswith("named")
    if case.startswith("sharded"):
        mesh = jax.make_mesh((4, 2), ("data", "model"), **({"axis_types": (auto,) * 2} if "auto" in case else {}))
        return (jd.ShardedStrategy(mesh=mesh, batch_axes="data", min_shard_size=1),
                GuideMLP("data", "model", mesh if named else None))
    if case.startswith("mirrored"):
        mesh = jax.make_mesh((8,), ("data",), **({"axis_types": (auto,)} if "auto" in case else {}))
        return jd.MirroredStrategy(mesh=mesh), GuideMLP("data", None, mesh if named else None)
    strategy = jd.OneDeviceStrategy()
    return strategy, GuideMLP(None, None, strategy.mesh if named else None)


@pytest.mark.parametrize("case", ["sharded_explicit_bare", "sharded_auto_bare", "sharded_auto_named",
                                  "mirrored_explicit_bare", "mirrored_auto_named", "one_device_bare",
                                  "one_device_named"])
def test_a_model_constraining_its_activations_fits_evaluates_and_predicts_without_a_scope_as_plain_jit(case):
    """The Trainer's loss check, state, steps, evaluation and prediction trace the model on the strategy's mesh,
    as strategy.jit does: no ``strategy.scope()`` needed, and the numbers are plain jax.jit's."""
    strategy, model = _guide_case(case)
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=16).astype(np.float32)) for _ in range(3)]

    def loss(out, y):
        return ((out[:, 0] - y) ** 2).mean()

    trainer = jd.training.Trainer(strategy, model, optax.sgd(0.1), loss)
    params = jax.device_get(trainer.init(data[0]).params)  # the loss check and the state: before any step
    trainer.fit(data, steps=3, verbose=0)
    evaluated, predicted = trainer.evaluate(data)["loss"], trainer.predict(data[0][0])

    # plain jax.jit on the same devices, under JAX's own context mesh (its axes Auto: on Explicit axes JAX
    # makes the guide's constraints asserts, which the unsplit arguments of plain jit fail)
    mesh = strategy.mesh
    auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    with jax.set_mesh(auto):
        apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
        step = jax.jit(lambda p, x, y: jax.tree.map(
            lambda w, g: w - 0.1 * g, p, jax.grad(lambda p: loss(model.apply({"params": p}, x), y))(p)))
        for x, y in data:
            params = step(params, x, y)
        expected = np.mean([float(loss(apply(params, x), y)) for x, y in data])
        outputs = np.asarray(apply(params, data[0][0]))
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
    jax.tree.map(close, jax.device_get(trainer.params), jax.device_get(params))
    close(evaluated, expected)
    close(predicted, outputs)
