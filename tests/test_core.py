"""Topology, scopes, contexts and device validation."""

import subprocess
import sys

import jax
import numpy as np
import pytest
from registry import all_strategies, make

import jaxdist as jd
from jaxdist.strategies.layout import _devices as devices_mod


@all_strategies
def test_topology(strategy_name):
    strategy = make(strategy_name)
    n = strategy.num_replicas_in_sync
    per_replica = strategy.mesh.size // n  # devices per replica (model parallelism)
    assert len(strategy.devices) == n * per_replica == strategy.mesh.size
    assert len(strategy.replica_devices) == n
    assert strategy.worker_devices == strategy.devices
    assert strategy.mesh.axis_names[0] == jd.REPLICA_AXIS == "replica"
    assert strategy.mesh.axis_names == (("replica",) if per_replica == 1 else ("replica", "model"))
    assert tuple(strategy.mesh.devices.flat) == strategy.devices
    assert strategy.num_hosts == 1
    assert strategy.num_replicas_per_host == n


def test_mirrored_defaults_to_all_local_devices():
    assert jd.MirroredStrategy().devices == tuple(jax.local_devices())
    assert len(jax.local_devices()) == 8


def test_devices_by_id_and_name():
    strategy = jd.MirroredStrategy([0, "cpu:1", "/device:CPU:2", jax.devices()[3]])
    assert strategy.devices == tuple(jax.devices()[:4])
    assert jd.OneDeviceStrategy("cpu:5").device == jax.devices()[5]


def test_default_strategy_and_scopes():
    default = jd.get_strategy()
    assert isinstance(default, jd.OneDeviceStrategy)
    assert jd.get_strategy() is default  # created once, lazily
    assert not jd.has_strategy()
    strategy = jd.MirroredStrategy()
    with strategy.scope() as s:
        assert s is strategy
        assert jd.get_strategy() is strategy
        assert jd.has_strategy() and jd.in_cross_replica_context()
        assert jd.get_replica_context() is None  # cross-replica context
        with strategy.scope():  # re-entering the same strategy is fine
            assert jd.get_strategy() is strategy
    assert jd.get_strategy() is default


def test_mixing_scopes_is_an_error():
    a, b = jd.MirroredStrategy(), jd.OneDeviceStrategy()
    with a.scope():
        with pytest.raises(RuntimeError, match="Mixing different Strategy objects"):
            with b.scope():
                pass
        assert jd.get_strategy() is a  # the failed entry left the stack intact


def test_default_replica_context_outside_any_scope():
    ctx = jd.get_replica_context()
    assert ctx is not None
    assert ctx.num_replicas_in_sync == 1 and ctx.replica_id_in_sync_group == 0
    assert ctx.all_reduce("sum", 3.0) == 3.0


def test_replica_context_inside_run():
    strategy = jd.MirroredStrategy()
    seen = {}

    def fn():
        ctx = jd.get_replica_context()
        seen["ctx"] = ctx
        seen["strategy"] = jd.get_strategy()
        with pytest.raises(RuntimeError, match="inside a replica function"):
            strategy.scope().__enter__()
        return ctx.replica_id_in_sync_group

    ids = strategy.run(fn)
    assert seen["ctx"].num_replicas_in_sync == 8 and seen["strategy"] is strategy
    assert [int(i) for i in strategy.experimental_local_results(ids)] == list(range(8))
    assert len({int(i) for i in ids.values}) == 8  # per-replica ids distinct


def test_duplicate_devices_is_an_error():
    d = jax.devices()
    with pytest.raises(ValueError,
                       match=r"devices lists .* twice \(positions 0 and 2\).*remove the duplicate"):
        jd.MirroredStrategy([d[0], d[1], d[0]])


def test_devices_from_two_backends_is_an_error(monkeypatch):
    class FakeDevice:
        def __init__(self, platform):
            self.platform = platform

    fake = [FakeDevice("cpu"), FakeDevice("gpu")]
    monkeypatch.setattr(devices_mod, "resolve_device", lambda spec, argument: spec)
    with pytest.raises(ValueError, match=r"mixes backends \['cpu', 'gpu'\].*one platform"):
        devices_mod.resolve_devices(fake)


@pytest.mark.parametrize(
    ("devices", "error", "message"),
    [
        ([], ValueError, r"devices=\[\] is empty"),
        (["tpu:0"], ValueError, r"devices\[0\]='tpu:0': no 'tpu' backend"),
        (["cpu:99"], ValueError, r"only 8 cpu devices"),
        ([1234], ValueError, r"devices\[0\]=1234 is not a device id"),
        (["banana"], ValueError, r"is not a device name"),
        ([1.5], TypeError, r"devices\[0\]=1.5 \(type float\) is not a device"),
        ("cpu:0", TypeError, r"must be a list of devices"),
    ],
)
def test_bad_device_lists(devices, error, message):
    with pytest.raises(error, match=message):
        jd.MirroredStrategy(devices)


def test_import_starts_no_backend():
    code = (
        "import jaxdist, jaxdist.strategies, jaxdist.replicate\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge.backends_are_initialized(), 'importing jaxdist started a backend'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@all_strategies
def test_create_variables_and_mirror(strategy_name):
    strategy = make(strategy_name)
    params = strategy.create_variables(lambda key, n: {"w": jax.random.normal(key, (8, n))},
                                       jax.random.key(0), 4)
    want = jax.random.normal(jax.random.key(0), (8, 4))
    assert params["w"].sharding.device_set == set(strategy.devices)
    assert float(abs(params["w"] - want).max()) == 0.0
    # keyword arguments are passed through as constants
    ones = strategy.create_variables(lambda shape: {"b": jax.numpy.ones(shape)}, shape=(8,))
    assert ones["b"].shape == (8,)
    mirrored = strategy.mirror({"b": np.array([1.0, 2.0]), "s": np.int32(3), "step": 3, "on": True,
                                "act": abs})
    assert (mirrored["b"].sharding.device_set == mirrored["s"].sharding.device_set
            == set(strategy.devices))
    # arrays and Python numbers are placed, as jax.device_put places them (a TrainState's step=0 is
    # a counter); what is not a value (a function) stays as it is
    assert int(mirrored["step"]) == 3 and mirrored["step"].sharding.device_set == set(
        strategy.devices
    )
    assert bool(mirrored["on"]) and mirrored["act"] is abs


@pytest.mark.parametrize("strategy_name", ["one_device", "mirrored_8", "sharded_8"])
def test_mirror_and_create_variables_copy_the_callers_arrays(strategy_name):
    """A mirror is a copy (as tf.distribute's): donating it to a step leaves the caller's arrays
    valid, whether they sit on device 0 (where the mirror's first copy goes) or already in the
    strategy's layout."""
    strategy = make(strategy_name)
    step = strategy.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)
    on_device_0 = {"w": jax.device_put(np.arange(8.0, dtype=np.float32), jax.devices()[0])}
    in_layout = strategy.mirror({"w": np.arange(8.0, dtype=np.float32)})
    for params in (on_device_0, in_layout):
        for placed in (strategy.mirror(params), strategy.create_variables(lambda p: p, params)):
            step(placed)
            assert not params["w"].is_deleted()
            np.testing.assert_array_equal(params["w"], np.arange(8.0))


def test_create_variables_with_a_non_callable_is_an_error():
    strategy = jd.MirroredStrategy()
    with pytest.raises(TypeError,
                       match=r"init_fn=\{'w': 1\} \(type dict\) is not callable.*strategy\.mirror"):
        strategy.create_variables({"w": 1})
    with pytest.raises(TypeError, match=r"fn=3 is not callable"):
        strategy.jit(3)
