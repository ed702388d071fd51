"""The central promise: every strategy computes what single-device training computes.

50 Adam steps of a Flax MLP on the same global batches, three ways: plain `jax.jit` on one device (the
reference), the global view (`strategy.jit` of the unmodified step) and the per-replica view (`strategy.run`
with an explicit all-reduce). fp32, rtol 1e-5.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from registry import all_strategies, make

import jaxdist as jd

STEPS = 50
GLOBAL_BATCH = 32


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(4)(x)


MODEL = MLP()
OPT = optax.adam(1e-2)


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


@pytest.fixture(scope="module")
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
    """Every leaf on all the strategy's devices; replicated, or (``like``) laid out exactly as ``like``."""
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
    initial = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
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
        grads, per_replica_loss = strategy.run(replica_grads, args=(state[0], x, y))
        _assert_layout(strategy, grads)  # all-reduced gradients come back mirrored
        state = apply(state, grads)
        assert jax.tree.map(lambda x: x.sharding, state) == layout  # the state keeps its layout
        losses.append(float(strategy.reduce(jd.ReduceOp.MEAN, per_replica_loss)))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _assert_close(state, want_state)


def test_whole_step_inside_run_with_aggregate(reference):
    """tf.distribute style: optimizer update inside the replica function, mirrored by an aggregation."""
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
