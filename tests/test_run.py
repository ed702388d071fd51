"""The per-replica view: `run`, its gradient semantics, and reading its outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from registry import all_strategies, make

import jaxdist as jd


def _loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def _data(n, rows=4):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows * n, 3)).astype(np.float32), rng.normal(size=(3, 2)).astype(
        np.float32
    )


@all_strategies
def test_gradients_are_local_and_all_reduce_is_explicit(strategy_name):
    strategy = make(strategy_name)
    n = strategy.num_replicas_in_sync
    x_host, w_host = _data(n)
    x = strategy.experimental_distribute_values(x_host)
    w = strategy.mirror(w_host)

    def fn(w, x):
        g = jax.grad(_loss)(w, x)
        return g, jd.get_replica_context().all_reduce(jd.ReduceOp.MEAN, g)

    local, mean = strategy.run(fn, args=(w, x))
    shards = x_host.reshape(n, -1, 3)
    expected_local = np.stack([jax.grad(_loss)(w_host, s) for s in shards])
    got_local = np.stack([np.asarray(v) for v in strategy.experimental_local_results(local)])
    # Each replica's gradient is its own shard's gradient, NOT the sum over replicas.
    np.testing.assert_allclose(got_local, expected_local, rtol=1e-5, atol=1e-7)
    # pmean of the local gradients = the single-device gradient of the global batch.
    np.testing.assert_allclose(mean, jax.grad(_loss)(w_host, x_host), rtol=1e-5, atol=1e-7)
    assert mean.sharding.is_fully_replicated
    assert (n == 1) or isinstance(local, jd.PerReplica)


@all_strategies
def test_outputs_mirrored_or_per_replica(strategy_name):
    strategy = make(strategy_name)
    n = strategy.num_replicas_in_sync
    x = strategy.experimental_distribute_values(np.arange(2 * n, dtype=np.float32).reshape(n, 2))

    def fn(x, scale):
        ctx = jd.get_replica_context()
        return {
            "const": jnp.float32(3.0) * scale,  # same everywhere -> mirrored
            "sum": ctx.all_reduce("sum", x.sum()),  # all-reduced -> mirrored
            "rows": x * 2,  # varies -> PerReplica
            "id": ctx.replica_id_in_sync_group,  # varies -> PerReplica
            "gathered": ctx.all_gather(x, axis=0),  # same everywhere -> mirrored
            "none": None,
        }

    out = strategy.run(fn, args=(x,), kwargs={"scale": 2.0})
    assert out["none"] is None
    assert isinstance(out["const"], jax.Array) and float(out["const"]) == 6.0
    assert float(out["sum"]) == float(np.arange(2 * n).sum())
    np.testing.assert_allclose(out["gathered"], np.arange(2 * n).reshape(n, 2))
    assert isinstance(out["rows"], jd.PerReplica) and isinstance(out["id"], jd.PerReplica)
    assert out["rows"].stacked.shape == (n, 1, 2)
    np.testing.assert_allclose(
        strategy.gather(out["rows"], axis=0), np.arange(2 * n).reshape(n, 2) * 2
    )
    assert [int(i) for i in out["id"].values] == list(range(n))


@all_strategies
def test_reduce_gather_local_results(strategy_name):
    strategy = make(strategy_name)
    n = strategy.num_replicas_in_sync
    batch = np.arange(6 * n, dtype=np.float32).reshape(3 * n, 2)
    rows = strategy.run(lambda x: x + 1.0, args=(strategy.experimental_distribute_values(batch),))
    expected = batch + 1.0
    np.testing.assert_allclose(strategy.reduce("sum", rows), expected.reshape(n, 3, 2).sum(0))
    np.testing.assert_allclose(strategy.reduce(jd.ReduceOp.MEAN, rows, axis=0), expected.mean(0),
                               rtol=1e-6)
    np.testing.assert_allclose(
        strategy.reduce("sum", rows, axis=-1), expected.reshape(n, 3, 2).sum((0, 2))
    )
    np.testing.assert_allclose(strategy.gather(rows, axis=0), expected)
    np.testing.assert_allclose(strategy.gather(rows, axis=1),
                               np.concatenate(expected.reshape(n, 3, 2), axis=1))
    locals_ = strategy.experimental_local_results(rows)
    assert len(locals_) == n
    np.testing.assert_allclose(np.concatenate([np.asarray(v) for v in locals_]), expected)
    # A plain (mirrored) value is the same on every replica.
    w = strategy.mirror(np.ones(2, np.float32))
    np.testing.assert_allclose(strategy.reduce("sum", w), np.full(2, n))
    np.testing.assert_allclose(strategy.reduce("mean", w), np.ones(2))
    assert strategy.gather(w).shape == (2 * n,)
    copies = strategy.experimental_local_results(w)
    assert [c.devices() for c in copies] == [{d} for d in strategy.replica_devices]
    assert strategy.reduce("sum", rows).sharding.is_fully_replicated


def test_reduce_and_gather_errors():
    strategy = jd.MirroredStrategy()
    ids = strategy.run(lambda: jd.get_replica_context().replica_id_in_sync_group * 1.0)
    with pytest.raises(ValueError, match="scalar per-replica values"):
        strategy.gather(ids)
    with pytest.raises(ValueError,
                       match=r"axis=1 is out of range for per-replica values of rank 0"):
        strategy.reduce("sum", ids, axis=1)
    rows = strategy.run(lambda x: x,
                        args=(strategy.experimental_distribute_values(np.zeros((8, 2))),))
    with pytest.raises(ValueError, match=r"axis=2 is out of range"):
        strategy.gather(rows, axis=2)


def test_per_replica_of_another_strategy_is_an_error():
    a, b = jd.MirroredStrategy(), jd.MirroredStrategy()
    ids = a.run(lambda: jd.get_replica_context().replica_id_in_sync_group)
    with pytest.raises(ValueError,
                       match=r"strategy.run got a PerReplica of another strategy .*reduce or "
                             r"gather it"):
        b.run(lambda i: i + 1, args=(ids,))
    with pytest.raises(ValueError, match="of another strategy"):
        b.reduce("sum", ids)
    total = a.sync_on_read(0.0, "sum")
    with pytest.raises(ValueError, match="got a SyncOnRead of another strategy"):
        b.run(lambda t: t.assign_add(1.0), args=(total,))


def test_per_replica_round_trip():
    strategy = jd.MirroredStrategy()
    ids = strategy.run(lambda: jd.get_replica_context().replica_id_in_sync_group)
    doubled = strategy.run(lambda i: i * 2, args=(ids,))
    assert [int(v) for v in doubled.values] == [2 * i for i in range(8)]
    assert "PerReplica({0: 0, 1: 2" in repr(doubled)


def test_nested_run_and_bad_arguments():
    strategy = jd.MirroredStrategy()
    with pytest.raises(RuntimeError, match="replica functions do not nest"):
        strategy.run(lambda: strategy.run(lambda: 1.0))
    with pytest.raises(TypeError, match=r"args=.* must be a tuple"):
        strategy.run(lambda x: x, args=jnp.ones(2))
    with pytest.raises(TypeError, match=r"kwargs=.* must be a dict"):
        strategy.run(lambda x: x, args=(1.0,), kwargs=[1])


def test_static_arguments_and_caching():
    strategy = jd.MirroredStrategy()
    calls = []

    def fn(x, mode):
        calls.append(mode)
        return x * (2.0 if mode == "double" else 3.0)

    x = jnp.ones(2)
    first = strategy.run(fn, args=(x, "double"))
    # Computed from a mirrored argument alone: varying by type (each replica owns a copy) but the
    # same on every replica, so it comes back mirrored: one replicated array.
    assert isinstance(first, jax.Array) and first.sharding.is_fully_replicated
    assert all(np.array_equal(v, [2.0, 2.0]) for v in strategy.experimental_local_results(first))
    traced = len(calls)
    strategy.run(fn, args=(x, "double"))
    assert len(calls) == traced  # cached: no retrace
    np.testing.assert_allclose(strategy.reduce("mean", strategy.run(fn, args=(x, "triple"))),
                               [3.0, 3.0])
    np.testing.assert_allclose(
        strategy.run(lambda x: jd.get_replica_context().aggregate(x * 2, "only_first_replica"),
                     args=(x,)),
        [2.0, 2.0],
    )


def test_run_inside_strategy_jit():
    """A global-view step may call run: its batch arguments keep their per-replica split."""
    strategy = jd.MirroredStrategy()
    x_host, w_host = _data(8)

    def step(w, x):
        def replica_fn(w, x):
            return jd.get_replica_context().all_reduce("mean", jax.grad(_loss)(w, x))

        return w - 0.1 * strategy.run(replica_fn, args=(w, x))

    new_w = strategy.jit(step)(strategy.mirror(w_host),
                               strategy.experimental_distribute_values(x_host))
    np.testing.assert_allclose(new_w, w_host - 0.1 * jax.grad(_loss)(w_host, x_host), rtol=1e-5,
                               atol=1e-7)


def test_run_inside_plain_jit_is_a_clear_error():
    strategy = jd.MirroredStrategy()
    x = strategy.experimental_distribute_values(jnp.arange(8.0))
    with pytest.raises(ValueError,
                       match=r"outside this strategy's compiled computations.*strategy\.jit"):
        jax.jit(lambda x: strategy.run(lambda v: v * 2, args=(x,)))(x)
    # Inside strategy.jit the batch keeps its per-replica split.
    rows = strategy.jit(lambda x: strategy.run(lambda v: jnp.float32(v.shape[0]), args=(x,)))(x)
    assert [float(v) for v in strategy.experimental_local_results(rows)] == [1.0] * 8


def test_an_undeclared_batch_split_over_another_mesh_warns_and_names_the_declaration():
    """A batch laid out over a mesh of the same devices and names but other axis types (the user's,
    say) is not on the strategy's mesh: its layout cannot give it a role, so jaxdist says which
    declaration decides."""
    strategy = jd.MirroredStrategy(jax.devices()[:4])
    explicit = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("replica",),
                                 axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(
        np.arange(8.0, dtype=np.float32), jax.sharding.NamedSharding(explicit, jax.P("replica"))
    )
    with pytest.warns(jd.UndeclaredBatchWarning,
                      match=r"not this strategy's.*batch_argnums=\(i, \.\.\.\)"):
        whole = strategy.run(lambda v: v.sum(), args=(x,))
    # a variable: all of it
    assert [float(v) for v in strategy.experimental_local_results(whole)] == [28.0] * 4
    # declared: each replica its rows
    split = strategy.run(lambda v: v.sum(), args=(x,), batch_argnums=(0,))
    assert [float(v) for v in strategy.experimental_local_results(split)] == [1.0, 5.0, 9.0, 13.0]
