"""Equinox steps through `strategy.jit`: the shape of Equinox's parallelism example (an
`eqx.nn.MLP`, whose pytree holds activation functions, trained with `eqx.filter_value_and_grad` and
optax) equals `eqx.filter_jit` on one device, on Mirrored and FSDP, given the plain step or the
`eqx.filter_jit`-wrapped one. Array leaves are laid out like any pytree's; every other leaf is
static, as `eqx.filter_jit` makes it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from registry import make

import jaxdist as jd

eqx = pytest.importorskip("equinox")  # an optional extra; the test extra installs it

OPTIM = optax.sgd(0.1, momentum=0.9)
STEPS = 4


def loss_fn(model, x, y):
    pred = jax.vmap(model)(x)
    return jnp.mean((pred - y) ** 2)


def train_step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = OPTIM.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def init():
    model = eqx.nn.MLP(8, 2, width_size=32, depth=2, activation=jax.nn.relu, key=jax.random.key(0))
    return model, OPTIM.init(eqx.filter(model, eqx.is_array))


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, 16, 8)).astype(np.float32)
    return x, np.stack([np.sin(x[..., :2]).sum(-1), x[..., 2]], -1).astype(np.float32)


def train(step, model, opt_state):
    losses = []
    for x, y in zip(*data(), strict=True):
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))
    return model, np.array(losses)


@pytest.mark.parametrize("wrapped", [False, True], ids=["step", "filter_jit_step"])
@pytest.mark.parametrize("strategy_name", ["one_device", "mirrored_8", "sharded_8"])
def test_equinox_step_equals_filter_jit_on_one_device(strategy_name, wrapped):
    want_model, want_losses = train(eqx.filter_jit(train_step), *init())
    strategy = make(strategy_name)
    model, opt_state = init()
    step = strategy.jit(eqx.filter_jit(train_step) if wrapped else train_step,
                        donate_argnums=(0, 1), batch_argnums=(2, 3))
    got_model, losses = train(step, model, opt_state)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert (got_model.activation is jax.nn.relu
            and got_model.final_activation is want_model.final_activation)
    for got, want in zip(jax.tree.leaves(eqx.filter(got_model, eqx.is_array)),
                         jax.tree.leaves(eqx.filter(want_model, eqx.is_array)), strict=True):
        assert got.sharding.device_set == set(strategy.devices)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    if strategy_name == "sharded_8":  # FSDP: the big kernel is split, as any pytree's would be
        assert not got_model.layers[1].weight.sharding.is_fully_replicated


def test_equinox_plan_and_lower_see_the_same_program():
    strategy = jd.MirroredStrategy()
    model, opt_state = init()
    x, y = (a[0] for a in data())
    step = strategy.jit(train_step, batch_argnums=(2, 3))
    assert "all-reduce" in step.lower(model, opt_state, x, y).compile().as_text()
    assert step.plan(model, opt_state, x, y).collectives["all-reduce"].count >= 1


def test_an_unhashable_non_array_leaf_is_an_error_naming_the_fix():
    class Holder(eqx.Module):
        weight: jax.Array
        # a list leaf inside a field is a pytree; a dict subclass instance is not hashable
        config: list

    class Config(dict):
        pass

    holder = Holder(jnp.ones(2), [Config(a=1)])
    with pytest.raises(TypeError, match=r"not hashable.*eqx\.filter_jit.*make it hashable"):
        jd.OneDeviceStrategy().jit(lambda h: h.weight * 2)(holder)


def test_errors_and_warnings_name_the_users_positions_with_a_module_among_the_arguments():
    """With an Equinox module among the arguments the step runs over their arrays, its non-array
    leaves one static argument after them: what jaxdist says names each argument where the user
    put it (x is argument 2 here, as without the module), so the fix it suggests is the right
    one."""
    strategy = jd.MirroredStrategy()
    model, opt_state = init()
    x, y = (a[0] for a in data())
    step = strategy.jit(train_step, batch_argnums=(2, 3))
    with pytest.raises(ValueError, match=r"rows of argument 2 \(in batch_argnums\) 10"):
        step(model, opt_state, x[:10], y[:10])
    undeclared = strategy.jit(lambda model, x: jax.vmap(model)(x).sum())
    with pytest.warns(jd.UndeclaredBatchWarning,
                      match=r"argument 0 holds unplaced arrays \(e\.g\. argument 0\.layers\[0\]"):
        undeclared(model, x)


def replica_step(model, opt_state, x, y):
    """The per-replica port of `train_step` (tf.distribute's shape): local gradients,
    all-reduced."""
    ctx = jd.get_replica_context()
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    grads = ctx.all_reduce(jd.ReduceOp.MEAN, grads)
    updates, opt_state = OPTIM.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, ctx.all_reduce(jd.ReduceOp.MEAN, loss)


def test_an_equinox_module_comes_back_from_strategy_run_mirrored_and_equals_filter_jit():
    """A module in and out of `strategy.run`: its functions come back as they went in (statics, as
    `eqx.filter_jit` keeps them) and its arrays mirrored, equal to one device."""
    want_model, want_losses = train(eqx.filter_jit(train_step), *init())
    strategy = jd.MirroredStrategy()
    model, opt_state = strategy.mirror(init())

    def step(model, opt_state, x, y):
        return strategy.run(replica_step, args=(model, opt_state, x, y), batch_argnums=(2, 3))

    got_model, losses = train(step, model, opt_state)
    assert isinstance(got_model, eqx.nn.MLP) and got_model.activation is want_model.activation
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    arrays = (jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (got_model, want_model))
    for got, want in zip(*arrays, strict=True):
        assert got.sharding.is_fully_replicated
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_equinox_module_updated_with_local_gradients_is_refused_by_name():
    strategy = jd.MirroredStrategy()
    model, opt_state = strategy.mirror(init())
    x, y = (a[0] for a in data())

    def local_step(model, opt_state, x, y):  # no all-reduce: every replica's copy drifts
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        updates, opt_state = OPTIM.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state

    with pytest.raises(ValueError, match=r"takes the place of the mirrored argument .*all_reduce"):
        strategy.run(local_step, args=(model, opt_state, x, y), batch_argnums=(2, 3))
