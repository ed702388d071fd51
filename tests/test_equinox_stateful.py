"""Equinox's stateful pattern (`eqx.nn.make_with_state`, an `eqx.nn.BatchNorm` whose running
statistics live in an `eqx.nn.State`) and diffrax's neural ODE through `strategy.mirror` and
`strategy.jit`, equal to `eqx.filter_jit` on one device.

Two things other libraries' code needs from jaxdist: `strategy.mirror` places arrays only (a
module's Python settings, BatchNorm's ``inference`` flag first, stay what its ``if`` branches on),
and on `jax.make_mesh`'s Explicit axes a step that a library refuses with an error of its own
(Equinox's ``State.set`` compares the old and new values' types, layouts included; diffrax's solver
checks its state) runs with the axes Auto, as a step JAX refuses by types does. A bug fails under
both and is raised as itself.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from registry import make

import jaxdist as jd

eqx = pytest.importorskip("equinox")  # an optional extra; the test extra installs it

pytestmark = pytest.mark.timeout(300)

# (not Adam: its first step blows float noise in the bias that BatchNorm
OPTIM = optax.sgd(0.1, momentum=0.9)
# subtracts, a gradient of zero, up to a full step of either sign)
STEPS = 3


class Model(eqx.Module):
    """The shape of Equinox's stateful example: Linear -> BatchNorm -> Linear."""

    first: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    last: eqx.nn.Linear
    # a Python int field, not marked static: a setting all the same (eqx.filter_jit keeps it static)
    width: int

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(3, 16, key=k1)
        # Equinox's default mode, said aloud
        self.norm = eqx.nn.BatchNorm(16, axis_name="batch", mode="ema")
        self.last = eqx.nn.Linear(16, 1, key=k2)
        self.width = 16

    def __call__(self, x, state):
        h, state = self.norm(self.first(x), state)
        return self.last(jax.nn.relu(h[: self.width])), state


def loss_fn(model, state, x, y):
    pred, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        x, state
    )
    return jnp.mean((pred[:, 0] - y) ** 2), state


def train_step(model, state, opt_state, x, y):
    (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, state, x, y)
    updates, opt_state = OPTIM.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), state, opt_state, loss


def evaluate(model, state, x):
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)[0]


def init():
    model, state = eqx.nn.make_with_state(Model)(jax.random.key(0))
    return model, state, OPTIM.init(eqx.filter(model, eqx.is_array))


def data():
    x = np.random.default_rng(0).normal(size=(STEPS, 16, 3)).astype(np.float32)
    return x, np.sin(x).sum(-1)


def train(step, evaluate_step, model, state, opt_state):
    losses = []
    for x, y in zip(*data(), strict=True):
        model, state, opt_state, loss = step(model, state, opt_state, x, y)
        losses.append(float(loss))
    predictions = evaluate_step(eqx.nn.inference_mode(model), state, data()[0][0])
    return model, state, np.array(losses), np.asarray(predictions)


def _explicit_mirrored():
    return jd.MirroredStrategy(mesh=jax.make_mesh((8,), ("data",)))


def _explicit_sharded():
    return jd.ShardedStrategy(mesh=jax.make_mesh((8,), ("data",)), batch_axes="data",
                              min_shard_size=1)


STRATEGIES = {"mirrored_8": lambda: make("mirrored_8"), "sharded_8": lambda: make("sharded_8"),
              "mirrored_explicit": _explicit_mirrored, "sharded_explicit": _explicit_sharded}


def test_mirror_places_arrays_and_keeps_every_other_leaf():
    strategy = make("mirrored_8")
    model, state, opt_state = strategy.mirror(init())
    assert model.norm.inference is False and model.norm.axis_name == "batch" and model.width == 16
    assert eqx.nn.inference_mode(model).norm.inference is True
    for leaf in jax.tree.leaves(eqx.filter((model, state, opt_state), eqx.is_array)):
        assert (
            leaf.sharding.device_set == set(strategy.devices) and leaf.sharding.is_fully_replicated
        )
    # Outside a module, Python numbers are values, as jax.device_put takes them (a TrainState's
    # step=0 counts); functions, strings and None are not.
    tree = {"flag": True, "n": 3, "lr": 0.5, "name": "relu", "fn": jax.nn.relu, "none": None,
            "np": np.ones(2, np.float32), "np_scalar": np.float32(2), "jax": jnp.zeros(3)}
    placed = strategy.mirror(tree)
    for key in ("name", "fn", "none"):
        assert placed[key] is tree[key], key
    for key in ("flag", "n", "lr", "np", "np_scalar", "jax"):
        assert isinstance(placed[key],
                          jax.Array) and placed[key].sharding.device_set == set(strategy.devices)


def test_a_flax_train_state_step_counter_is_placed():
    """Flax's TrainState.create starts ``step`` at the Python int 0: mirrored, it is an array, so a
    learning-rate schedule of the step is computed on device (Flax's WMT schedule raises
    ZeroDivisionError in Python at 0)."""
    from flax.training import train_state

    strategy = make("mirrored_8")
    state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
                                          tx=optax.sgd(0.1))
    assert type(state.step) is int
    placed = strategy.mirror(state)
    assert isinstance(placed.step, jax.Array) and placed.step.sharding.is_fully_replicated
    schedule = lambda count: 1.0 * count ** -0.5  # noqa: E731  (inf at 0 on device; an error in Python)
    lr = strategy.run(lambda s: schedule(s.step), args=(placed,))
    assert np.isinf(float(lr))


@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
def test_a_batchnorm_model_with_state_trains_and_evaluates_as_on_one_device(strategy_name, caplog):
    want_model, want_state, want_losses, want_pred = train(eqx.filter_jit(train_step),
                                                           eqx.filter_jit(evaluate), *init())
    strategy = STRATEGIES[strategy_name]()
    step = strategy.jit(train_step, donate_argnums=(0, 1, 2), batch_argnums=(3, 4))
    with caplog.at_level(logging.INFO, logger="jaxdist"):
        model, state, losses, pred = train(step, strategy.jit(evaluate, batch_argnums=(2,)),
                                           *strategy.mirror(init()))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(pred, want_pred, rtol=1e-5, atol=1e-6)
    assert model.norm.inference is False and model.width == 16
    for got, want in zip(jax.tree.leaves(eqx.filter((model, state), eqx.is_array)),
                         jax.tree.leaves(eqx.filter((want_model, want_state), eqx.is_array)),
                         strict=True):
        assert got.sharding.device_set == set(strategy.devices)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # Equinox's State.set refuses the Explicit types: the step ran Auto, said so
    if "explicit" in strategy_name:
        said = [r.getMessage() for r in caplog.records if "train_step" in r.getMessage()]
        assert (len(said) == 1 and "Auto" in said[0] and "ValueError" in said[0]
                and "axis_types=" in said[0]), said


def test_forced_explicit_axes_raise_equinox_s_own_error():
    strategy = _explicit_sharded()
    model, state, opt_state = strategy.mirror(init())
    x, y = (a[0] for a in data())
    step = strategy.jit(train_step, batch_argnums=(3, 4), axis_types=AxisType.Explicit)
    with pytest.raises(ValueError, match="different structures/shapes/dtypes"):
        step(model, state, opt_state, x, y)
    plan = strategy.jit(train_step, batch_argnums=(3, 4)).plan(model, state, opt_state, x, y)
    assert plan.axis_types == {"data": AxisType.Auto}


def test_a_bug_under_explicit_axes_is_raised_as_itself_after_the_auto_trace():
    strategy = _explicit_mirrored()
    traces = []

    def broken(model, state, x):  # (inference mode: no State.set) 16 rows do not reshape to 5
        traces.append(jax.sharding.get_abstract_mesh().axis_types)
        return evaluate(model, state, x).reshape(5, -1)

    model, state, _ = strategy.mirror(init())
    with pytest.raises(TypeError, match="reshape") as raised:
        strategy.jit(broken, batch_argnums=(2,))(eqx.nn.inference_mode(model), state, data()[0][0])
    # retried once, then raised as the step raised it
    assert traces == [(AxisType.Explicit,), (AxisType.Auto,)]
    assert raised.value.__cause__ is None
    assert any("Auto and failed there the same way: the axis types are not its cause" in note
               for note in raised.value.__notes__)


def test_a_bug_past_equinox_s_type_check_is_chained_and_axis_types_named():
    """Under Explicit axes Equinox's State.set refuses first; with them Auto the step fails later,
    at its own bug: both are shown, and ``axis_types=Auto`` raises the bug alone."""
    strategy = _explicit_mirrored()

    def broken(model, state, x):
        return evaluate(model, state, x).reshape(5, -1)

    model, state, _ = strategy.mirror(init())
    with pytest.raises(ValueError, match="different structures/shapes/dtypes") as raised:
        strategy.jit(broken, batch_argnums=(2,))(model, state, data()[0][0])
    assert isinstance(raised.value.__cause__, TypeError)
    assert any("axis_types=jax.sharding.AxisType.Auto) raises it alone" in note
               for note in raised.value.__notes__)
    with pytest.raises(TypeError, match="reshape"):
        strategy.jit(broken, batch_argnums=(2,), axis_types=AxisType.Auto)(
            model, state, data()[0][0]
        )


# ~40 s on 2 cores: diffrax's adaptive solver and its gradient compile under both axis types
@pytest.mark.slow
def test_a_diffrax_neural_ode_on_explicit_axes_equals_one_device():
    diffrax = pytest.importorskip("diffrax")

    class Func(eqx.Module):
        mlp: eqx.nn.MLP

        def __call__(self, t, y, args):
            return self.mlp(y)

    class NeuralODE(eqx.Module):  # diffrax's neural ODE example, smaller
        func: Func

        def __call__(self, ts, y0):
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(self.func), diffrax.Tsit5(), t0=ts[0], t1=ts[-1], dt0=ts[1] - ts[0],
                y0=y0,
                stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-6),
                saveat=diffrax.SaveAt(ts=ts))
            return sol.ys

    optim = optax.adabelief(3e-3)

    def step(model, opt_state, ts, ys):
        def loss(model):
            return jnp.mean((ys - jax.vmap(model, in_axes=(None, 0))(ts, ys[:, 0])) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    model = NeuralODE(Func(eqx.nn.MLP(2, 2, 16, 2, activation=jax.nn.softplus,
                                      key=jax.random.key(0))))
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    ts = jnp.linspace(0.0, 1.0, 8)
    ys = np.random.default_rng(0).normal(size=(2, 16, 8, 2)).astype(np.float32) * 0.1

    def run(step, model, opt_state):
        losses = []
        for batch in ys:
            model, opt_state, value = step(model, opt_state, ts, batch)
            losses.append(float(value))
        return model, losses

    want_model, want = run(eqx.filter_jit(step), model, opt_state)
    strategy = _explicit_sharded()
    got_model, got = run(strategy.jit(step, batch_argnums=(3,)),
                         *strategy.mirror((model, opt_state)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(eqx.filter(got_model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(want_model, eqx.is_array)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_module_returned_from_run_keeps_its_python_settings():
    """strategy.run returns a module as eqx.filter_jit and strategy.jit do: its bool and int fields
    stay Python values (an array there would fail the next ``if inference:`` or slice), its arrays
    mirrored when the same on every replica."""
    strategy = jd.MirroredStrategy()
    model = strategy.mirror(eqx.nn.inference_mode(Model(jax.random.key(0))))

    def replica_fn(model):
        return eqx.tree_at(lambda m: m.last.bias, model, model.last.bias + 1.0)

    out = strategy.run(replica_fn, args=(model,))
    assert out.norm.inference is True and type(out.width) is int and out.width == 16
    assert isinstance(out.last.bias, jax.Array) and out.last.bias.sharding.is_fully_replicated
    np.testing.assert_allclose(out.last.bias, np.asarray(model.last.bias) + 1.0)
