"""Variables on the host: ``host_offload`` keeps variables and/or optimizer state in
``"pinned_host"`` memory.

CPU devices have pinned_host memory, so the whole path runs here: layouts report the host memory
kind, training equals one device, and the compiled step's device-memory arguments shrink by the
offloaded state. XLA:CPU's memory analysis counts every argument in ``argument_size_in_bytes`` (its
``host_*`` fields stay 0), so the split by memory space is read from the compiled program's input
layouts; the test checks that the two parts add up to XLA's total.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from registry import adam

import jaxdist as jd

model = nn.Dense(4)
optimizer = adam(1e-2)
DEVICES = 4  # small meshes: these tests are about placement and equality, not scale


def init(key):
    params = model.init(key, jnp.zeros((1, 8)))
    return params, optimizer.init(params)


def step(state, x, y):  # an unmodified single-device step
    params, opt_state = state
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def data(n=3):
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32))
        for _ in range(n)
    ]


def kinds(tree):
    return [getattr(x, "sharding", x).memory_kind for x in jax.tree.leaves(tree)]


def split_kinds(state):
    """Memory kinds of (params leaves, optimizer-state leaves)."""
    return set(kinds(state[0])), set(kinds(state[1]))


@pytest.fixture(scope="session")
def reference():
    state, losses = init(jax.random.key(0)), []
    single = jax.jit(step)
    for x, y in data():
        state, loss = single(state, x, y)
        losses.append(float(loss))
    return state, losses


def assert_close(state, want):
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make, mode",
    [
        (lambda m: jd.MirroredStrategy(jax.devices()[:DEVICES], host_offload=m), "opt_state"),
        (lambda m: jd.ShardedStrategy(jax.devices()[:DEVICES], min_shard_size=1, host_offload=m),
         "all"),
    ],
    ids=["mirrored-opt_state", "sharded-all"],
)
def test_training_with_offloaded_state_equals_one_device(make, mode, reference):
    strategy = make(mode)
    state = strategy.create_variables(init, jax.random.key(0))  # created straight into host memory
    assert (
        split_kinds(state)
        == {"all": ({"pinned_host"}, {"pinned_host"}), "opt_state": ({"device"}, {"pinned_host"})}[
            mode
        ]
    )
    layouts = jax.tree.map(lambda x: x.sharding, state)
    train = strategy.jit(step, donate_argnums=(0,), batch_argnums=(1, 2))
    for (x, y), want in zip(data(), reference[1], strict=True):
        state, loss = train(state, x, y)
        np.testing.assert_allclose(float(loss), want, rtol=1e-5)
        assert loss.sharding.memory_kind == "device"  # metrics stay on the device
        # the state stays offloaded, same layout
        assert jax.tree.map(lambda x: x.sharding, state) == layouts
    assert_close(state, reference[0])


def test_tpu_on_device_loop_streams_offloaded_state(reference):
    strategy = jd.TPUStrategy(steps_per_run=3, devices=jax.devices()[:DEVICES],
                              host_offload="params")
    state = strategy.create_variables(init, jax.random.key(0))

    def step_fn(ctx, state, x, y):
        state, loss = step(state, x, y)
        ctx.set_last_step_output("loss", loss)
        return state

    ctx = strategy.run_steps_on_dataset(step_fn, iter(data()), initial_loop_values=state,
                                        donate=True)
    assert split_kinds(ctx.loop_values) == ({"pinned_host"}, {"device"})
    np.testing.assert_allclose(float(ctx.last_step_outputs["loss"]), reference[1][-1], rtol=1e-5)
    assert_close(ctx.loop_values, reference[0])


def _device_and_host_argument_bytes(compiled):
    """Per-device bytes of a compiled program's arguments in device memory and in host memory."""
    formats = jax.tree.leaves(compiled.input_formats, is_leaf=lambda f: hasattr(f, "layout"))
    by_kind = {"device": 0, "pinned_host": 0}
    for fmt, aval in zip(formats, jax.tree.leaves(compiled.in_avals), strict=True):
        shard = fmt.sharding.shard_shape(aval.shape)
        by_kind[fmt.sharding.memory_kind] += int(np.prod(shard)) * aval.dtype.itemsize
    return by_kind["device"], by_kind["pinned_host"]


def test_memory_analysis_device_bytes_drop_by_the_offloaded_state():
    x, y = data(1)[0]
    batch_bytes = (x.nbytes + y.nbytes) // DEVICES
    state = jax.eval_shape(init, jax.random.key(0))
    nbytes = lambda tree: sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(tree))  # noqa: E731
    params_bytes, opt_bytes = nbytes(state[0]), nbytes(state[1])
    device = {}
    for mode in (None, "opt_state", "all"):
        strategy = jd.MirroredStrategy(jax.devices()[:DEVICES], host_offload=mode)
        shardings = strategy.variable_shardings(state)
        abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                state, shardings)
        compiled = (strategy.jit(step, donate_argnums=(0,), batch_argnums=(1, 2))
                    .lower(abstract, x, y).compile())
        on_device, on_host = _device_and_host_argument_bytes(compiled)
        # XLA's total
        assert on_device + on_host == compiled.memory_analysis().argument_size_in_bytes
        device[mode] = on_device
    # a whole copy of the state per device
    assert device[None] == params_bytes + opt_bytes + batch_bytes
    # Adam's mu, nu and count left the device
    assert device["opt_state"] == params_bytes + batch_bytes
    assert device["all"] == batch_bytes  # only the batch rows stay in device memory between steps
    params_only = jd.MirroredStrategy(jax.devices()[:DEVICES],
                                      host_offload="params").variable_shardings(state)
    assert split_kinds(params_only) == ({"pinned_host"}, {"device"})


def test_sync_on_read_run_update_and_colocation_with_offloaded_variables():
    strategy = jd.MirroredStrategy(jax.devices()[:4], host_offload="all")
    w = strategy.mirror({"w": np.ones((4, 2), np.float32)})
    assert kinds(w) == ["pinned_host"]
    # replicas update it every step: it stays on the devices
    count = strategy.sync_on_read(0.0, "sum")
    assert count.stacked.sharding.memory_kind == "device"
    x = strategy.experimental_distribute_values(np.arange(16.0, dtype=np.float32).reshape(4, 4))

    # eager run: offloaded arguments are copied to device memory for the program
    def replica_fn(w, x, count):
        ctx = jd.get_replica_context()
        return ctx.all_reduce("sum", jnp.sum(x @ w["w"])), count.assign_add(1.0)

    total, count = strategy.run(replica_fn, args=(w, x, count))
    assert float(total) == float(np.sum(np.arange(16.0).reshape(4, 4) @ np.ones((4, 2))))
    assert float(count.read()) == 4.0 and count.stacked.sharding.memory_kind == "device"
    # the layout includes the memory kind
    new = strategy.update(w, lambda v, g: {"w": v["w"] - g}, np.float32(0.5))
    assert kinds(new) == ["pinned_host"] and np.asarray(new["w"]).tolist() == [[0.5, 0.5]] * 4
    with strategy.scope(), strategy.colocate_vars_with(new["w"]):
        slot = strategy.create_variables(lambda: jnp.zeros((4, 2)))
    assert slot.sharding == new["w"].sharding
    assert strategy.non_slot_devices(w).memory_kind == "pinned_host"
    rows = strategy.run(lambda: jnp.ones((4,
                                          2)) * jd.get_replica_context().replica_id_in_sync_group)
    # reduced straight into the host-memory layout
    (reduced,) = strategy.batch_reduce("sum", [(rows, new["w"])])
    assert (
        reduced.sharding == new["w"].sharding and np.asarray(reduced).tolist() == [[6.0, 6.0]] * 4
    )


def test_nnx_model_and_optimizer_offloaded_equal_nnx_jit():
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    def make():
        model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, adam(1e-2), wrt=nnx.Param)

    ref_model, ref_opt = make()
    model, opt = make()
    strategy = jd.MirroredStrategy(jax.devices()[:DEVICES], host_offload="opt_state")
    train = strategy.jit(train_step, batch_argnums=(2, 3))
    for x, y in data():
        np.testing.assert_allclose(
            float(train(model, opt, x, y)), float(nnx.jit(train_step)(ref_model, ref_opt, x, y)),
            rtol=1e-5
        )
    # nnx.OptState is optimizer state
    assert set(kinds(nnx.state(opt, nnx.OptState))) == {"pinned_host"}
    assert set(kinds(nnx.state(model))) == {"device"}
    np.testing.assert_allclose(np.asarray(model.kernel[...]), np.asarray(ref_model.kernel[...]),
                               rtol=1e-5, atol=1e-6)


class _FakeMemory:
    kind = "device"


class _FakeDevice:
    def addressable_memories(self):
        return [_FakeMemory()]

    def __str__(self):
        return "FakeDevice(id=0)"


def test_bad_host_offload_options_name_the_fix():
    with pytest.raises(
        ValueError,
        match=r"host_offload='cpu' is not a host offloading mode: use None .* 'opt_state' "
        r".* 'params' .* or 'all'",
    ):
        jd.MirroredStrategy(host_offload="cpu")
    with pytest.raises(ValueError, match=r"host_offload=True is not a host offloading mode"):
        jd.TPUStrategy(host_offload=True)
    from jaxdist.strategies.layout import parse_host_offload

    with pytest.raises(
        ValueError,
        match=r"host_offload='all' needs 'pinned_host' memory on every device, but "
        r"FakeDevice\(id=0\) has only \['device'\]: .* use host_offload=None",
    ):
        parse_host_offload("all", [_FakeDevice()])


def test_offloaded_state_with_a_python_number_stays_in_host_memory():
    """Outputs follow their argument's memory kind leaf by leaf: a Python step counter in the state
    does not pull the offloaded arrays back into device memory."""
    strategy = jd.MirroredStrategy(jax.devices()[:4], host_offload="all")
    state = (strategy.mirror({"w": np.ones((4, 2), np.float32)}), 0)
    step = strategy.jit(lambda st, x: ((jax.tree.map(lambda a: a - x.mean(), st[0]), st[1] + 1),
                                       x.sum()),
                        batch_argnums=1)
    for _ in range(2):
        state, _ = step(state, np.ones((8, 2), np.float32))
        assert state[0]["w"].sharding.memory_kind == "pinned_host"
    np.testing.assert_allclose(state[0]["w"], np.full((4, 2), -1.0))
