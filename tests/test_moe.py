"""Mixture of experts: `jd.nn.MoE` with expert parallelism equals one device, on the meshes users
build.

A small MoE language model (embedding, one attention-free MoE block with a residual, a vocabulary
head) is trained a few optax steps on one device and through `ShardedStrategy` with expert axes;
loss, parameters and the router's statistics must agree (fp32, rtol 1e-5). Dropping runs with tokens
actually dropped.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxdist as jd
from tests.registry import adam

pytestmark = pytest.mark.timeout(300)

VOCAB, WIDTH, LENGTH, ROWS, EXPERTS = 32, 16, 8, 8, 8


class MoELM(nn.Module):
    capacity_factor: float | None = 1.0
    shared_experts: int = 0
    router: str = "softmax"
    ragged: bool | None = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        x = x + jd.nn.MoE(num_experts=EXPERTS, top_k=2, hidden_dim=2 * WIDTH,
                          capacity_factor=self.capacity_factor,
                          shared_experts=self.shared_experts, router=self.router,
                          z_loss_weight=1e-3, ragged=self.ragged)(
                                nn.LayerNorm()(x))
        return nn.Dense(VOCAB)(x)


def _tokens(seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (ROWS, LENGTH)).astype(np.int32)


def make_step(model, tx):
    """A next-token training step of a linen LM, its MoE layers' losses added and router metrics
    returned."""

    def loss_fn(params, tokens):
        logits, sown = model.apply(params, tokens, mutable=["moe_losses", "moe_metrics"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
        return loss + jd.nn.moe_loss(sown), sown.get("moe_metrics", {})

    def step(params, opt_state, tokens):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    return step


def _train(strategy, model, steps=3):
    tokens = _tokens()
    tx = adam(1e-2)
    step = make_step(model, tx)
    params = model.init(jax.random.key(0), tokens[:2])
    assert list(params) == ["params"]  # nothing sown at init
    if strategy is None:
        run, state = jax.jit(step), (params, tx.init(params))
    else:
        run = strategy.jit(step, batch_argnums=2)
        placed = strategy.create_variables(lambda: params)
        state = (placed, strategy.create_variables(lambda: tx.init(params)))
    losses = []
    for _ in range(steps):
        *state, loss, metrics = run(*state, tokens)
        losses.append(float(loss))
    return losses, jax.device_get(state[0]), jax.device_get(metrics), state


def _close(got, expected):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, expected)


@pytest.fixture(scope="session")  # session: see conftest.py's doc
def references():
    return {cf: _train(None, MoELM(capacity_factor=cf)) for cf in (1.0, None)}


MESHES = {
    "data2_expert4": lambda: jd.ShardedStrategy(mesh=jax.make_mesh((2, 4), ("data", "expert")),
                                                batch_axes=("data", "expert"),
                                                expert_axes="expert"),
    "expert8": lambda: jd.ShardedStrategy(mesh=jax.make_mesh((8,), ("expert",)),
                                          expert_axes="expert", min_shard_size=1),
    "short_form_ep4": lambda: jd.ShardedStrategy(expert_parallelism=4),
}


# The short form builds a (replica, expert) mesh of data2_expert4's shape: its dropless case would
# run data2_expert4-dropless's path again, so it trains the dropping case only. expert8 trains the
# dropping case only too: padded dropless goes through the same local exchange with another
# capacity (data2_expert4-dropless runs it).
@pytest.mark.parametrize("mesh,capacity_factor", [
    pytest.param(mesh, cf, id=f"{mesh}-{name}")
    for mesh in MESHES for cf, name in ((1.0, "dropping"), (None, "dropless"))
    if not (mesh != "data2_expert4" and cf is None)])
def test_a_moe_lm_with_expert_parallelism_equals_one_device(references, mesh, capacity_factor):
    expected_losses, expected_params, expected_metrics, _ = references[capacity_factor]
    strategy = MESHES[mesh]()
    assert strategy.policy.roles.size(strategy.expert_axes) > 1
    losses, params, metrics, _ = _train(strategy, MoELM(capacity_factor=capacity_factor))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    _close(params, expected_params)
    _close(metrics, expected_metrics)
    # the step's own, nothing from init
    (dropped,) = jax.tree.leaves(metrics["MoE_0"]["dropped_fraction"])
    # dropping really drops; dropless never
    assert (float(dropped) > 0) == (capacity_factor is not None), dropped


def test_dropless_ragged_exchange_equals_one_device(references):
    # The ragged path (picks sorted by expert, counts exchanged, only routed rows moved, grouped
    # matmuls): on CPU its exchange runs emulated (XLA:CPU has no ragged all-to-all); the code
    # around it is the GPU / TPU path's. On (expert=8), values and gradients of the layer:
    # test_every_grouped_matmul_kernel_equals_the_worst_case_buffer.
    expected_losses, expected_params, expected_metrics, _ = references[None]
    strategy = MESHES["data2_expert4"]()
    losses, params, metrics, state = _train(strategy, MoELM(capacity_factor=None, ragged=True))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    _close(params, expected_params)
    _close(metrics, expected_metrics)
    model = MoELM(capacity_factor=None, ragged=True)
    plan = strategy.jit(lambda p, t: model.apply(p, t, mutable=["moe_losses"])[0],
                        batch_argnums=1).plan(
        state[0], _tokens())
    assert plan.moe_dispatch == ("dropless_ragged_all_to_all_emulated",), plan.moe_dispatch


def test_expert_fsdp_and_tensor_parallelism_on_one_mesh_equal_one_device(references):
    expected_losses, expected_params, _, _ = references[1.0]
    mesh = jax.make_mesh((2, 2, 2), ("data", "expert", "tensor"))
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("data", "expert"), expert_axes="expert",
                                  min_shard_size=1, logical_axis_rules=[("mlp", "tensor")])
    losses, params, _, state = _train(strategy, MoELM(capacity_factor=1.0))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    _close(params, expected_params)
    kernel = state[0]["params"]["MoE_0"]["wi_gate"]
    kernel = getattr(kernel, "value", kernel)
    assert kernel.sharding.spec == P("expert", None, "tensor"), kernel.sharding.spec


def test_every_device_holds_a_share_of_each_expert_weight_and_its_adam_moments():
    strategy = jd.ShardedStrategy(mesh=jax.make_mesh((2, 4), ("data", "expert")),
                                  batch_axes=("data", "expert"), expert_axes="expert")
    model = MoELM()
    params = strategy.create_variables(model.init, jax.random.key(0), _tokens()[:2])
    opt_state = strategy.create_variables(adam(1e-2).init, params)
    for name in ("wi_gate", "wi_up", "wo"):
        for tree in (params, opt_state[0].mu, opt_state[0].nu):
            leaf = tree["params"]["MoE_0"][name]
            leaf = getattr(leaf, "value", leaf)
            shard = leaf.addressable_shards[0].data.shape
            assert shard[0] == EXPERTS // 4 and shard[1:] == leaf.shape[1:], (
                name,
                shard,
                leaf.shape,
            )


def test_the_plan_counts_the_layers_all_to_alls():
    strategy = MESHES["data2_expert4"]()
    model = MoELM()
    params = strategy.create_variables(model.init, jax.random.key(0), _tokens()[:2])

    def forward(params, tokens):
        return model.apply(params, tokens, mutable=["moe_losses"])[0].sum()

    plan = strategy.jit(forward, batch_argnums=1).plan(params, _tokens())
    assert plan.collectives["all-to-all"].count >= 2, plan.collectives  # to the experts and back
    assert plan.moe_dispatch == (
        "dropping_all_to_all",
    ) and "MoE dispatch: dropping all to all" in str(plan)
    local = (
        jd.MirroredStrategy().jit(forward, batch_argnums=1).plan(jax.device_get(params), _tokens())
    )
    assert local.moe_dispatch == ("dropping_local",) and "all-to-all" not in local.collectives


class NnxMoELM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.moe = jd.nn.nnx.MoE(WIDTH, num_experts=EXPERTS, top_k=2, hidden_dim=2 * WIDTH,
                                 capacity_factor=1.0, shared_experts=1, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.moe(x))


def _train_nnx(strategy, steps=3):
    tokens = _tokens()
    model = NnxMoELM(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, adam(1e-2), wrt=nnx.Param)

    def step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens)
            ce = optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], tokens[:, 1:]
            ).mean()
            return ce + model.moe.aux_loss[...]

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    run = nnx.jit(step) if strategy is None else strategy.jit(step, batch_argnums=2)
    losses = [float(run(model, optimizer, tokens)) for _ in range(steps)]
    return losses, [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_the_nnx_layer_with_expert_parallelism_equals_one_device():
    expected_losses, expected_params = _train_nnx(None)
    losses, params = _train_nnx(MESHES["data2_expert4"]())
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    _close(params, expected_params)


class OwnMoE(nn.Module):
    """A user's own MoE: its own router and dense dispatch, experts stacked (E, ...), no
    annotations."""

    @nn.compact
    def __call__(self, x):
        e = 4
        router = self.param("router", nn.initializers.lecun_normal(), (x.shape[-1], e))
        w = self.param("experts", nn.initializers.lecun_normal(), (e, x.shape[-1], x.shape[-1]))
        gates = jax.nn.softmax(x @ router, -1)  # (b, l, e): every expert, weighted (dense dispatch)
        return jnp.einsum("ble,bld,edf->blf", gates, x, w)


def test_a_users_own_moe_placed_on_the_expert_axis_by_a_layout_rule_equals_one_device():
    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(VOCAB, WIDTH)(tokens)
            return nn.Dense(VOCAB)(x + OwnMoE()(x))

    expected = _train(None, LM())
    got = _train(jd.ShardedStrategy(mesh=jax.make_mesh((2, 4), ("data", "expert")),
                                    batch_axes=("data", "expert"),
                                    expert_axes="expert",
                                    layout_rules=[("OwnMoE_0/experts", P("expert"))]), LM())
    assert got[3][0]["params"]["OwnMoE_0"]["experts"].sharding.spec[0] == "expert"
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
    _close(got[1], expected[1])


def test_moe_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"top_k=5 > num_experts=4"):
        jd.nn.MoE(num_experts=4, top_k=5, hidden_dim=8).init(jax.random.key(0), jnp.ones((2, 4, 8)))
    with pytest.raises(ValueError, match=r"capacity_factor=0 cannot hold one token"):
        jd.nn.MoE(num_experts=4, top_k=1, hidden_dim=8, capacity_factor=0).init(
            jax.random.key(0), jnp.ones((2, 4, 8))
        )
    with pytest.raises(ValueError,
                       match=r"expert_axes='tensor' names 'tensor', which is not in batch_axes"):
        jd.ShardedStrategy(mesh=jax.make_mesh((4, 2), ("data", "tensor")), batch_axes="data",
                           expert_axes="tensor")
    with pytest.raises(ValueError, match=r"expert_axes=.* a mirroring strategy"):
        jd.strategies.LayoutPolicy(mesh=jax.make_mesh((8,), ("expert",)), expert_axes="expert")
    with pytest.raises(
        ValueError, match=r"expert_parallelism=3 must be an int >= 1 that divides the 8 devices"
    ):
        jd.ShardedStrategy(expert_parallelism=3)
    with pytest.raises(ValueError, match=r"router='relu' is not one of \('softmax', 'sigmoid'\)"):
        jd.nn.experts.Routing(4, 1, router="relu")
    with pytest.raises(ValueError, match=r"num_experts=0 must be an int >= 1"):
        jd.nn.experts.Routing(0, 1)
    with pytest.raises(ValueError,
                                         match=r"expert_axes='expert' name axes of a mesh: pass "
                                               r"mesh= too .*"
                                         r"expert_parallelism=k adds 'expert'"):
        jd.ShardedStrategy(expert_axes="expert")
    with pytest.raises(ValueError,
                       match=r"mesh= and expert_parallelism=2 both given: "
                             r".*expert_axes=\('expert',\)"):
        jd.ShardedStrategy(mesh=jax.make_mesh((8,), ("expert",)), expert_axes="expert",
                           expert_parallelism=2)
    with pytest.raises(ValueError,
                                         match=r"pipeline_parallelism=2 x expert_parallelism=8 "
                                               r"must divide the 8 devices "
                                         r"\(the mesh would be \(stage, replica, expert\)\)"):
        jd.ShardedStrategy(expert_parallelism=8, pipeline_parallelism=2)
    model = jd.nn.MoE(num_experts=6, top_k=2, hidden_dim=8)
    x = jnp.ones((8, 4, 8))
    strategy = jd.ShardedStrategy(mesh=jax.make_mesh((8,), ("expert",)), expert_axes="expert")
    with pytest.raises(ValueError,
                       match=r"splits axis 0 \(size 6\) of variable 'params/wi_gate' into 8 parts"):
        strategy.create_variables(model.init, jax.random.key(0), x)
    # Experts kept whole by the user's own rule: the layer itself refuses to split 6 experts 8 ways.
    strategy = jd.ShardedStrategy(mesh=jax.make_mesh((8,), ("expert",)), expert_axes="expert",
                                  logical_axis_rules=[("expert", None)])
    params = strategy.create_variables(model.init, jax.random.key(0), x)
    with pytest.raises(ValueError,
                       match=r"num_experts=6 is not divisible by the 8 devices of "
                             r"expert_axes=\('expert'"):
        strategy.jit(model.apply, batch_argnums=1)(params, x)


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_the_trainer_adds_the_moe_losses_and_logs_the_router_metrics(kind):
    tokens = _tokens()
    batches = [(tokens, np.roll(tokens, -1, axis=1))] * 3

    def ce(logits, targets):
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def fit(strategy):
        model = MoELM() if kind == "linen" else NnxMoELM(nnx.Rngs(0))
        trainer = jd.training.Trainer(strategy, model, adam(1e-2), ce, seed=0)
        return trainer.fit(batches, steps=3, log_every=1, verbose=0)

    expected = fit(jd.OneDeviceStrategy())
    got = fit(MESHES["data2_expert4"]())
    for name in ("loss", "moe_aux_loss", "moe_max_load", "moe_dropped_fraction"):
        assert len(got.metric(name)) == 3, (name, got)  # logged at every step
        np.testing.assert_allclose(got.metric(name), expected.metric(name), rtol=1e-5, err_msg=name)
    assert all(v > 0 for v in got.metric("moe_aux_loss"))
    assert all(v >= 1 for v in got.metric("moe_max_load"))


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_dropless_grouped_matmuls_equal_the_worst_case_buffer(router):
    from jaxdist.nn import experts

    config = experts.Routing(num_experts=EXPERTS, top_k=2, router=router)
    weights = experts.init_weights(jax.random.key(0), config, WIDTH, 2 * WIDTH)
    x = jax.random.normal(jax.random.key(1), (4, LENGTH, WIDTH))

    def run(ragged):
        def loss(w, x):
            y, stats = experts.apply(config, w, x, ragged=ragged)
            return jnp.sum(y ** 2) + stats.load_balance, (y, stats)

        (_, (y, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(weights, x)
        return y, stats, grads

    # jitted: op by op, each of the paths' ops compiled a program of its own
    _close(jax.jit(run, static_argnums=0)(True), jax.jit(run, static_argnums=0)(False))
    plan = (jd.OneDeviceStrategy().jit(lambda w, x: experts.apply(config, w, x, ragged=True)[0])
            .plan(weights, x))
    assert plan.moe_dispatch == ("dropless_ragged_local",)


def test_rows_the_batch_axes_do_not_divide_are_an_error_inside_the_layer():
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("data", "expert"), expert_axes="expert")
    model = jd.nn.MoE(num_experts=EXPERTS, top_k=2, hidden_dim=8)
    params = strategy.create_variables(model.init, jax.random.key(0), jnp.ones((8, 4, 8)))

    # the layer sees 4 rows of its 8: the batch axes' 8 devices cannot each route their own
    def folded(params, x):
        return model.apply(params, x.reshape(4, 8, 8))

    with pytest.raises(ValueError,
                       match=r"jd.nn.MoE got 4 rows \(sequences\), which the 8 devices of "
                             r"batch_axes="):
        strategy.jit(folded, batch_argnums=1)(params, np.ones((8, 4, 8), np.float32))


@functools.cache
def _one_device_grads(ragged):
    """The one-device values and gradients of the expert layer on the tests' (8, LENGTH, WIDTH)
    input, computed once for every test that compares with them."""
    from jaxdist.nn import experts

    config = experts.Routing(num_experts=EXPERTS, top_k=2)
    weights = experts.init_weights(jax.random.key(0), config, WIDTH, 2 * WIDTH)
    x = jax.random.normal(jax.random.key(1), (8, LENGTH, WIDTH))
    return jax.device_get(jax.jit(_moe_grads(config, weights, x, ragged=ragged))(weights, x))


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "padded"])
@pytest.mark.parametrize("names,expert_axes", [(("data", "e1", "e2"), ("e1", "e2")),
                                               (("e1", "data", "e2"), ("e2", "e1"))],
                         ids=["inner", "apart_reversed"])
def test_expert_axes_of_several_mesh_axes_equal_one_device(names, expert_axes, ragged):
    # Experts split over two axes (in mesh order or not, apart or not): each device's share and its
    # tokens' exchange follow the axes' order as given, in values and gradients.
    from jaxdist.nn import experts

    config = experts.Routing(num_experts=EXPERTS, top_k=2)
    weights = experts.init_weights(jax.random.key(0), config, WIDTH, 2 * WIDTH)
    x = jax.random.normal(jax.random.key(1), (8, LENGTH, WIDTH))

    def loss(w, x):
        y, stats = experts.apply(config, w, x, ragged=ragged)
        return jnp.sum(y ** 2) + stats.load_balance, y

    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    strategy = jd.ShardedStrategy(mesh=jax.make_mesh((2, 2, 2), names), batch_axes=names,
                                  expert_axes=expert_axes)
    got, expected = (jax.device_get(strategy.jit(grad, batch_argnums=1)(weights, x)),
                     _one_device_grads(ragged))
    # Gradients of order 10: atol 1e-5 is float32 rounding of another summation order, relative to
    # the scale.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, expected)


def test_a_plan_on_a_mesh_without_devices_names_the_dispatch_path():
    # A plan for a mesh of any size (jd.plan_mesh) compiles on simulated CPU devices in a
    # subprocess: it plans the path that compiles there (the padded exchange) and says so.
    from jaxdist.nn import experts

    config = experts.Routing(num_experts=EXPERTS, top_k=2)
    weights = jax.device_get(experts.init_weights(jax.random.key(0), config, WIDTH, 2 * WIDTH))
    strategy = jd.ShardedStrategy(mesh=jd.plan_mesh({"data": 4, "expert": 8}),
                                  batch_axes=("data", "expert"), expert_axes="expert")
    step = strategy.jit(lambda w, x: experts.apply(config, w, x)[0].sum(), batch_argnums=1)
    plan = step.plan(weights, np.ones((64, LENGTH, WIDTH), np.float32))
    assert plan.moe_dispatch == ("dropless_padded_all_to_all",), plan.moe_dispatch
    assert plan.collectives["all-to-all"].axes == ("expert",)


# --------------------------------------------------------------------------- grouped-matmul kernels
def _tokamax_param():
    from jaxdist.nn import experts

    return pytest.param("tokamax", marks=pytest.mark.skipif(
        not experts.has_tokamax(),
        reason="tokamax (the optional extra jaxdist[tokamax]) is not installed"))


def _moe_grads(config, weights, x, **kwargs):
    from jaxdist.nn import experts

    def loss(w, x):
        y, stats = experts.apply(config, w, x, **kwargs)
        return jnp.sum(y ** 2) + stats.load_balance, y

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


@pytest.mark.parametrize("kernel", ["ragged_dot", _tokamax_param()])
def test_every_grouped_matmul_kernel_equals_the_worst_case_buffer(kernel):
    # Every expert local (grouped matmuls over all the picks) and expert parallel (the ragged
    # exchange, emulated on CPU: the receive buffer has rows past the groups), values and gradients;
    # the plan names the kernel.
    from jaxdist.nn import experts

    config = experts.Routing(num_experts=EXPERTS, top_k=2)
    weights = experts.init_weights(jax.random.key(0), config, WIDTH, 2 * WIDTH)
    x = jax.random.normal(jax.random.key(1), (8, LENGTH, WIDTH))
    expected = _one_device_grads(ragged=False)
    grouped = _moe_grads(config, weights, x, ragged=True, grouped_matmul=kernel)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 jax.device_get(jax.jit(grouped)(weights, x)), expected)
    strategy = MESHES["expert8"]()
    step = strategy.jit(grouped, batch_argnums=1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 jax.device_get(step(weights, x)), expected)
    plan = step.plan(weights, x)
    assert plan.grouped_matmul == (kernel,) and f"Grouped matmuls: {kernel}" in str(plan)
    assert plan.moe_dispatch == ("dropless_ragged_all_to_all_emulated",)


def test_the_kernel_named_runs_and_rows_past_the_groups_stay_zero(monkeypatch):
    # A stand-in for tokamax whose kernel leaves NaN in the rows past the groups (tokamax's GPU
    # kernels leave them unwritten): forced, it runs; the expert-parallel buffer's extra rows stay
    # out of values and gradients.
    from jaxdist.nn import experts

    calls = []

    def ragged_dot(lhs, rhs, sizes):
        calls.append(lhs.shape)
        out = jax.lax.ragged_dot(lhs, rhs, sizes)
        return jnp.where(jnp.arange(lhs.shape[0])[:, None] < jnp.sum(sizes), out, jnp.nan)

    monkeypatch.setattr(experts, "_tokamax",
                        type("Tokamax", (), {"ragged_dot": staticmethod(ragged_dot)}))
    assert experts.has_tokamax()
    config = experts.Routing(num_experts=EXPERTS, top_k=2)
    weights = experts.init_weights(jax.random.key(0), config, WIDTH, 2 * WIDTH)
    x = jax.random.normal(jax.random.key(1), (8, LENGTH, WIDTH))
    expected = _one_device_grads(ragged=False)
    strategy = MESHES["expert8"]()
    got = strategy.jit(_moe_grads(config, weights, x, ragged=True, grouped_matmul="tokamax"),
                       batch_argnums=1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 jax.device_get(got(weights, x)), expected)
    assert len(calls) == 3  # gate, up, down: traced once
    # Unforced on CPU (no ragged collectives, so not the GPU / TPU kernel): jax.lax.ragged_dot, even
    # with tokamax.
    auto = (jd.OneDeviceStrategy().jit(lambda w, x: experts.apply(config, w, x, ragged=True)[0])
            .plan(weights, x))
    assert auto.grouped_matmul == ("ragged_dot",) and len(calls) == 3


def test_bad_grouped_matmul_kernels_are_errors_naming_the_fix(monkeypatch):
    from jaxdist.nn import experts

    config = experts.Routing(num_experts=EXPERTS, top_k=2)
    weights = experts.init_weights(jax.random.key(0), config, WIDTH, 2 * WIDTH)
    x = jnp.ones((2, LENGTH, WIDTH))
    with pytest.raises(
        ValueError, match=r"grouped_matmul='megablox' is not one of \('ragged_dot', 'tokamax'\)"
    ):
        experts.apply(config, weights, x, grouped_matmul="megablox")
    layer = jd.nn.nnx.MoE(WIDTH, EXPERTS, 2, 8, grouped_matmul="megablox", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"grouped_matmul='megablox' is not one of"):
        layer(x)
    monkeypatch.setattr(experts, "_tokamax", None)
    with pytest.raises(ValueError,
                                         match=r"grouped_matmul='tokamax' needs tokamax, which is "
                                               r"not importable here: "
                                         r"pip install 'jaxdist\[tokamax\]'"):
        jd.nn.MoE(num_experts=EXPERTS, top_k=2, hidden_dim=8,
                  grouped_matmul="tokamax").init(jax.random.key(0), x)


def test_a_grouped_matmul_for_a_call_without_the_ragged_path_is_an_error():
    from jaxdist.nn import experts

    weights_of = lambda config: experts.init_weights(jax.random.key(0), config, WIDTH, 2 * WIDTH)  # noqa: E731
    x = jnp.ones((2, LENGTH, WIDTH))
    dropping = experts.Routing(num_experts=EXPERTS, top_k=2, capacity_factor=1.25)
    with pytest.raises(ValueError,
                       match=r"grouped_matmul=.ragged_dot. chooses .*\(capacity_factor is set"):
        experts.apply(dropping, weights_of(dropping), x, grouped_matmul="ragged_dot")
    dropless = experts.Routing(num_experts=EXPERTS, top_k=2)
    with pytest.raises(ValueError,
                       match=r"ragged=False\); pass ragged=True or leave grouped_matmul=None"):
        experts.apply(dropless, weights_of(dropless), x, ragged=False, grouped_matmul="ragged_dot")
    # CPU, ragged left to choose
    with pytest.raises(ValueError, match=r"these devices have no ragged exchange"):
        experts.apply(dropless, weights_of(dropless), x, grouped_matmul="ragged_dot")
