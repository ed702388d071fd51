"""Client code on Explicit meshes (`jax.make_mesh`'s default axis types) and Auto ones: Flax nnx
scan over layers with per-layer dropout keys, JAX's training cookbook's `jax.Ref` state and
`out_sharding=` initialisers, and a batch from a distributed dataset. Each equals what `jax.jit`
computes on one device."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxdist as jd

pytestmark = pytest.mark.timeout(300)


class Block(nnx.Module):
    def __init__(self, dim, *, rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.linear(x))


class ScanMLP(nnx.Module):
    """Flax's scan-over-layers example (nnx_toy_examples/06): one dropout key per layer, stacked."""

    def __init__(self, dim, *, n_layers, rngs):
        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(axis_size=n_layers)
        def create_block(rngs):
            return Block(dim, rngs=rngs)

        self.layers = create_block(rngs)

    def __call__(self, x):
        @nnx.scan
        def scan_fn(x, block):
            return block(x), None

        return scan_fn(x, self.layers)[0]


def _scan_loss(model, x):
    return model(x).sum()


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_per_layer_dropout_keys_of_a_scanned_nnx_model_stay_whole_and_equal_one_device(axis_type):
    x = np.random.default_rng(0).normal(size=(32, 16)).astype(np.float32)
    reference = ScanMLP(16, n_layers=4, rngs=nnx.Rngs(0))
    # the keys advance in place
    expected = [float(nnx.jit(_scan_loss)(reference, x)) for _ in range(2)]

    mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(axis_type,) * 2)
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes=("data", "fsdp"), fsdp_axes="fsdp",
                                  min_shard_size=1)
    with strategy.scope():
        model = ScanMLP(16, n_layers=4, rngs=nnx.Rngs(0))
    step = strategy.jit(_scan_loss, batch_argnums=1)
    got = [float(step(model, x)) for _ in range(2)]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    rngs = model.layers.dropout.rngs
    # the FSDP rule leaves key arrays whole
    assert rngs.key.get_value().sharding.spec in (P(), P(None))
    # a counter of the same shape is split by it
    assert rngs.count.get_value().sharding.spec == P("fsdp")
    np.testing.assert_array_equal(
        jax.random.key_data(rngs.key.get_value()),
        jax.random.key_data(reference.layers.dropout.rngs.key.get_value()),
    )
    np.testing.assert_array_equal(rngs.count.get_value(),
                                  reference.layers.dropout.rngs.count.get_value())


def test_the_fsdp_rule_leaves_key_arrays_whole_and_a_layout_rule_still_splits_them():
    keys = jax.ShapeDtypeStruct((8,), jax.random.key(0).dtype)
    fsdp = jd.ShardedStrategy(min_shard_size=1)
    assert fsdp.policy.variable_layout("rngs/key", keys).spec == P()
    assert fsdp.policy.variable_layout(
        "rngs/count", jax.ShapeDtypeStruct((8,), jnp.uint32)
    ).spec == P("replica")
    ruled = jd.ShardedStrategy(min_shard_size=1, layout_rules=[("key", P("replica"))])
    assert ruled.policy.variable_layout("rngs/key", keys).spec == P("replica")


def _ref_sgd_step(params, x):
    """The training cookbook's shape: state in refs, read with [...], updated in place; returns
    metrics only."""
    def loss_fn(p):
        return jnp.mean((jnp.tanh(x @ p["w"]) + p["b"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(jax.tree.map(jax.ref.get, params))
    for k in params:
        params[k][...] -= 0.1 * grads[k]
    return {"loss": loss}


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("placed_by", ["jaxdist", "user"])
def test_state_held_in_refs_is_updated_in_place_as_one_device(axis_type, placed_by):
    rng = np.random.default_rng(0)
    host = {"w": rng.normal(size=(16, 32)).astype(np.float32),
            "b": rng.normal(size=(32,)).astype(np.float32)}
    xs = [rng.normal(size=(16, 16)).astype(np.float32) for _ in range(3)]
    one = jax.tree.map(jax.ref.new_ref, jax.device_put(host, jax.devices()[0]))
    expected = [float(jax.jit(_ref_sgd_step)(one, x)["loss"]) for x in xs]

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(axis_type,))
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes="fsdp", min_shard_size=1)
    if placed_by == "jaxdist":
        params = strategy.create_variables(lambda: host)
    else:
        with jax.set_mesh(mesh):
            params = {"w": jax.device_put(host["w"], P(None, "fsdp")),
                      "b": jax.device_put(host["b"], P())}
    refs = jax.tree.map(jax.ref.new_ref, params)
    layouts = {k: r.sharding.spec for k, r in refs.items()}
    step = strategy.jit(_ref_sgd_step, batch_argnums=1)
    got = [float(step(refs, x)["loss"]) for x in xs]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    for k in host:  # updated in place, each ref keeping its layout
        np.testing.assert_allclose(refs[k][...], one[k][...], rtol=1e-5, atol=1e-6)
        assert refs[k].sharding.spec == layouts[k]


# the training cookbook's way: each parameter created in the layout the user wants
def _cookbook_init():
    return {"pos": jnp.zeros((32, 64), out_sharding=P(None, None)),
            "w": jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128),
            "v": jax.sharding.reshard(jnp.ones((64, 128)), P("fsdp", None))}


def test_an_output_the_steps_code_types_split_keeps_that_layout_and_a_whole_one_is_declared():
    mesh = jax.make_mesh((8,), ("fsdp",))  # Explicit axes
    strategy = jd.ShardedStrategy(mesh=mesh, batch_axes="fsdp")

    def init():
        out = _cookbook_init()
        # not the FSDP rule's P(None, 'fsdp')
        out["w"] = jax.sharding.reshard(out["w"], P("fsdp", None))
        return out

    with jax.set_mesh(mesh):
        plain = jax.jit(init)()
    with strategy.scope():
        mine = strategy.jit(init)()
        declared = strategy.jit(init, out_layouts={"pos": P(), "w": None, "v": None})()
    for k in ("w", "v"):  # stated by the step's code: kept, as jax.jit keeps it
        assert mine[k].sharding.spec == plain[k].sharding.spec == P("fsdp", None)
        np.testing.assert_array_equal(mine[k], plain[k])
    # a whole type is what jaxdist's own split variables have inside a step too: the variable
    # layout, unless declared
    assert mine["pos"].sharding.spec == P(None, "fsdp")
    assert declared["pos"].sharding.is_fully_replicated and declared["w"].sharding.spec == P(
        "fsdp", None
    )

    # the kept layouts are the user's: a step taking them sees them as its types (as under jax.jit)
    seen = []

    def step(params, x):
        seen.append(jax.typeof(params["w"]).sharding.spec)
        return (x @ params["w"]).sum()

    x = np.ones((16, 64), np.float32)
    got = float(strategy.jit(step, batch_argnums=1)(mine, x))
    np.testing.assert_allclose(got, float((x @ np.asarray(plain["w"])).sum()), rtol=1e-6)
    assert seen == [P("fsdp", None)]


@pytest.mark.parametrize("strategy_class", [jd.MirroredStrategy, jd.ShardedStrategy])
def test_a_batch_from_a_distributed_dataset_declares_the_calls_roles_and_a_host_one_does_not(
    strategy_class,
):
    strategy = strategy_class()
    host_batch = np.ones((16, 4), np.float32)

    def step(p, x):
        return (x @ p["w"]).sum()

    # created eagerly, unplaced (Equinox / Flax users' habit)
    params = {"w": np.ones((4, 2), np.float32)}
    with warnings.catch_warnings():
        # no UndeclaredBatchWarning: the batch's layout says it is one
        warnings.simplefilter("error")
        for x in strategy.experimental_distribute_dataset([host_batch]):
            assert float(strategy.jit(step)(params, x)) == 128.0
    with pytest.warns(jd.UndeclaredBatchWarning, match="batch_argnums"):
        assert float(strategy.jit(step)(params, host_batch)) == 128.0
