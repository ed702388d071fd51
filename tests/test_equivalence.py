"""The central promise: every strategy computes what single-device training computes.

50 Adam steps of a Flax MLP on the same global batches, three ways: plain `jax.jit` on one device
(the reference), the global view (`strategy.jit` of the unmodified step) and the per-replica view
(`strategy.run` with an explicit all-reduce). Then a conv net with BatchNorm in a flax `TrainState`
loop (params and batch statistics; trained on distributed and on host batches, evaluated on
distributed, declared host and undeclared host batches: conv nets with a replicated batch are where
XLA's Shardy partitioner has miscomputed), and an nnx step in the `nnx.jit` style (graph objects
updated in place). fp32, rtol 1e-5.
"""

import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from registry import adam, all_strategies, assert_variable_layout, full_mesh_strategies, make

import jaxdist as jd

STEPS = 10  # each step checks the losses and the layout: more add compute, not cases
GLOBAL_BATCH = 32


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(4)(x)


MODEL = MLP()
OPT = adam(1e-2)


def loss_fn(params, x, y):
    logits = MODEL.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train_step(state, batch):
    """An ordinary single-device step: nothing distributed in it."""
    params, opt_state = state
    x, y = batch
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def batches():
    rng = np.random.default_rng(42)
    out = []
    for _ in range(STEPS):
        x = rng.normal(size=(GLOBAL_BATCH, 8)).astype(np.float32)
        y = (x[:, :4].argmax(1) + (x[:, 4] > 0)).astype(np.int32) % 4
        out.append((x, y))
    return out


def init_state(key):
    params = MODEL.init(key, jnp.zeros((1, 8), jnp.float32))
    return params, OPT.init(params)


@pytest.fixture(scope="session")
def reference():
    state = init_state(jax.random.key(0))
    step = jax.jit(train_step)
    losses = []
    for batch in batches():
        state, loss = step(state, batch)
        losses.append(float(loss))
    return state, losses


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def _assert_layout(strategy, tree, like=None):
    """Every leaf on all the strategy's devices; replicated, or (``like``) laid out exactly as
    ``like``."""
    leaves = jax.tree.leaves(tree)
    for i, leaf in enumerate(leaves):
        assert leaf.sharding.device_set == set(strategy.devices)
        if like is None:
            assert leaf.sharding.is_fully_replicated
        else:
            assert leaf.sharding.is_equivalent_to(jax.tree.leaves(like)[i].sharding, leaf.ndim)


@all_strategies
def test_global_view_equals_single_device(strategy_name, reference):
    strategy = make(strategy_name)
    want_state, want_losses = reference
    with strategy.scope():
        state = strategy.create_variables(init_state, jax.random.key(0))
    initial = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                           state)
    if not isinstance(strategy, jd.ShardedStrategy):
        _assert_layout(strategy, state)
    step = strategy.jit(train_step, donate_argnums=(0,))
    losses = []
    for batch in strategy.experimental_distribute_dataset(batches()):
        assert batch[0].sharding.spec == jax.sharding.PartitionSpec("replica")
        state, loss = step(state, batch)
        _assert_layout(strategy, state, like=initial)  # state keeps its layout across steps
        losses.append(float(loss))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _assert_close(state, want_state)


@all_strategies
def test_per_replica_view_equals_single_device(strategy_name, reference):
    strategy = make(strategy_name)
    want_state, want_losses = reference

    def replica_grads(params, x, y):
        ctx = jd.get_replica_context()
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)  # local gradients
        return ctx.all_reduce(jd.ReduceOp.MEAN, grads), loss

    @strategy.jit
    def apply(state, grads):
        params, opt_state = state
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = strategy.create_variables(init_state, jax.random.key(0))
    layout = jax.tree.map(lambda x: x.sharding, state)
    losses = []
    for x, y in strategy.experimental_distribute_dataset(batches()):
        grads, per_replica_loss = strategy.run(replica_grads, args=(state[0], x, y),
                                               batch_argnums=(1, 2))
        _assert_layout(strategy, grads)  # all-reduced gradients come back mirrored
        state = apply(state, grads)
        assert all(jax.tree.leaves(jax.tree.map(  # the state keeps its layout
            lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), state, layout)))
        losses.append(float(strategy.reduce(jd.ReduceOp.MEAN, per_replica_loss)))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _assert_close(state, want_state)


def test_whole_step_inside_run_with_aggregate(reference):
    """tf.distribute style: optimizer update inside the replica function, mirrored by an
    aggregation."""
    strategy = jd.MirroredStrategy()
    want_state, _ = reference

    def replica_step(state, x, y):
        ctx = jd.get_replica_context()
        params, opt_state = state
        grads = ctx.all_reduce("mean", jax.grad(loss_fn)(params, x, y))
        updates, opt_state = OPT.update(grads, opt_state, params)
        new_state = optax.apply_updates(params, updates), opt_state
        return ctx.aggregate(new_state, jd.VariableAggregation.ONLY_FIRST_REPLICA)

    state = strategy.create_variables(init_state, jax.random.key(0))
    for x, y in strategy.experimental_distribute_dataset(batches()):
        state = strategy.run(replica_step, args=(state, x, y))
    _assert_layout(strategy, state)
    _assert_close(state, want_state)


# ==================================================================================================
# A conv net with BatchNorm, trained with a flax TrainState loop that carries batch statistics
# ==================================================================================================
class ConvBN(nn.Module):
    # No conv bias before BatchNorm (as in ResNet): its gradient is zero up to rounding noise, which
    # Adam scales up to full-size steps, so two correct programs would disagree on it.
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
        x = nn.Conv(16, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
        return nn.Dense(4)(x.reshape((x.shape[0], -1)))


class BNTrainState(train_state.TrainState):
    """Flax's documented pattern for models with batch statistics."""

    batch_stats: Any


def create_bn_state(rng):
    model = ConvBN()
    variables = model.init(rng, jnp.ones((1, 8, 8, 1)), train=False)
    return BNTrainState.create(
        apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"],
        tx=adam(1e-2)
    )


def bn_train_step(state, batch):
    images, labels = batch

    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, images, train=True,
            mutable=["batch_stats"]
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])
    return state, loss


def bn_eval_step(state, batch):
    images, labels = batch
    logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats}, images,
                            train=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels), "logits": logits}


# the first half on distributed batches, the second on host batches declared as batches
BN_STEPS = 6


def image_batches(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.uniform(size=(GLOBAL_BATCH, 8, 8, 1)).astype(np.float32)
        y = ((x[:, :4].mean((1, 2, 3)) > 0.5) * 2 + (x[:,
                                                       4:].mean((1, 2, 3)) > 0.5)).astype(np.int32)
        out.append((x, y))
    return out


@pytest.fixture(scope="session")
def bn_reference():
    state = create_bn_state(jax.random.key(0))
    step = jax.jit(bn_train_step)
    losses = []
    for batch in image_batches(BN_STEPS, seed=1):
        state, loss = step(state, batch)
        losses.append(float(loss))
    evaluation = jax.jit(bn_eval_step)(state, image_batches(1, seed=2)[0])
    return state, losses, evaluation


@full_mesh_strategies
def test_conv_batchnorm_train_state_equals_single_device(strategy_name, bn_reference):
    """Losses, params, batch statistics and Adam state after training on distributed then host
    batches; the state keeps its layout; evaluation with running averages equals one device on a
    distributed batch, on a host batch declared as one, and on a host batch left undeclared
    (mirrored, with the one-time warning)."""
    strategy = make(strategy_name)
    want_state, want_losses, want_eval = bn_reference
    with strategy.scope():
        state = strategy.create_variables(create_bn_state, jax.random.key(0))
    initial = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                           state)
    step = strategy.jit(bn_train_step, donate_argnums=(0,), batch_argnums=(1,))
    data = image_batches(BN_STEPS, seed=1)
    half = BN_STEPS // 2
    losses = []
    for batch in [*strategy.experimental_distribute_dataset(data[:half]), *data[half:]]:
        state, loss = step(state, batch)
        _assert_layout(strategy, state, like=initial)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _assert_close(state, want_state)

    test_batch = image_batches(1, seed=2)[0]
    declared = strategy.jit(bn_eval_step, batch_argnums=(1,))
    results = {
        "distributed": declared(state,
                                next(iter(strategy.experimental_distribute_dataset([test_batch])))),
        "host declared": declared(state, test_batch),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results["host undeclared"] = strategy.jit(bn_eval_step)(
            jax.tree.map(np.asarray, state), test_batch
        )
    # a (replica, model) mesh's idle axis
    caught = [w for w in caught if w.category is not jd.IdleAxisWarning]
    if strategy.num_replicas_in_sync > 1:
        assert [w.category for w in caught] == [jd.UndeclaredBatchWarning], [
            str(w.message) for w in caught
        ]
    for placement, got in results.items():
        for key in want_eval:
            np.testing.assert_allclose(
                np.asarray(got[key]), np.asarray(want_eval[key]), rtol=1e-5, atol=1e-6,
                err_msg=placement
            )


# ==================================================================================================
# nnx: a step in the nnx.jit style (graph objects updated in place, the loss returned)
# ==================================================================================================
class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        # no bias before BatchNorm (see ConvBN)
        self.hidden = nnx.Linear(8, 32, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


def nnx_train_step(model, optimizer, x, y):
    def loss_of(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_of)(model)
    optimizer.update(model, grads)
    return loss


NNX_STEPS = 10


@pytest.fixture(scope="session")
def nnx_reference():
    model = NnxNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, OPT, wrt=nnx.Param)
    step = nnx.jit(nnx_train_step)
    losses = [float(step(model, optimizer, x, y)) for x, y in batches()[:NNX_STEPS]]
    return model, optimizer, losses


@all_strategies
def test_nnx_step_equals_nnx_jit_single_device(strategy_name, nnx_reference):
    """strategy.jit of an nnx.jit-style step: same losses, the module (params and batch statistics)
    and the optimizer updated in place to the same values, their state written back in the
    strategy's variable layout after every step."""
    strategy = make(strategy_name)
    want_model, want_optimizer, want_losses = nnx_reference
    with strategy.scope():
        model = NnxNet(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, OPT, wrt=nnx.Param)
    step = strategy.jit(nnx_train_step, batch_argnums=(2, 3))
    losses = []
    for x, y in strategy.experimental_distribute_dataset(batches()[:NNX_STEPS]):
        losses.append(float(step(model, optimizer, x, y)))
        # written back in the layout, every step
        assert_variable_layout(strategy, nnx.state((model, optimizer)))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _assert_close(nnx.state(model), nnx.state(want_model))
    _assert_close(nnx.state(optimizer), nnx.state(want_optimizer))
