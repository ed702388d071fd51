"""ReduceOp / VariableAggregation parsing, sync-on-read values, replica-context aggregation,
naming."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from registry import all_strategies, make

import jaxdist as jd
from jaxdist.replicate import component_name


def test_parse_names_and_members():
    assert jd.ReduceOp.parse("sum") is jd.ReduceOp.SUM
    assert jd.ReduceOp.parse(jd.ReduceOp.MEAN) is jd.ReduceOp.MEAN
    assert (jd.VariableAggregation.parse("Only_First_Replica")
            is jd.VariableAggregation.ONLY_FIRST_REPLICA)
    assert jd.VariableAggregation.parse(jd.ReduceOp.SUM) is jd.VariableAggregation.SUM


def test_unknown_reduce_op_lists_valid_ones():
    strategy = jd.OneDeviceStrategy()
    with pytest.raises(ValueError,
                                          match=r"reduce_op='max' is not a valid ReduceOp: use one "
                                                r"of ReduceOp.SUM, "
                                          r"ReduceOp.MEAN"):
        strategy.reduce("max", jnp.ones(2))
    with pytest.raises(ValueError, match=r"reduce_op=3 is not a valid ReduceOp"):
        strategy.run(lambda: jd.get_replica_context().all_reduce(3, 1.0))


def test_unknown_aggregation_lists_valid_ones():
    strategy = jd.OneDeviceStrategy()
    with pytest.raises(ValueError,
                                          match=r"aggregation='median'.*VariableAggregation.NONE, "
                                                r"VariableAggregation.SUM, "
                                          r"VariableAggregation.MEAN, "
                                          r"VariableAggregation.ONLY_FIRST_REPLICA"):
        strategy.sync_on_read(0.0, "median")


def test_component_names():
    assert [component_name("w", i) for i in range(3)] == ["w", "w/replica_1", "w/replica_2"]
    with pytest.raises(ValueError, match="replica_id=-1"):
        component_name("w", -1)


@all_strategies
def test_aggregate_modes_in_replica_context(strategy_name):
    strategy = make(strategy_name)
    n = strategy.num_replicas_in_sync

    def fn(w):
        ctx = jd.get_replica_context()
        local = w + ctx.replica_id_in_sync_group.astype(jnp.float32)  # differs per replica
        return (
            ctx.aggregate(local, jd.VariableAggregation.SUM),
            ctx.aggregate(local, "mean"),
            ctx.aggregate(local, jd.VariableAggregation.ONLY_FIRST_REPLICA),
            ctx.per_replica(local),  # w updated on each replica its own way: declared, or refused
        )

    total, mean, first, local = strategy.run(fn, args=(jnp.zeros(3),))
    ids = np.arange(n, dtype=np.float32)
    np.testing.assert_allclose(total, np.full(3, ids.sum()))
    np.testing.assert_allclose(mean, np.full(3, ids.mean()))
    np.testing.assert_allclose(first, np.zeros(3))
    for out in (total, mean, first):  # aggregated updates come back mirrored
        assert isinstance(out, jax.Array) and out.sharding.is_fully_replicated
    assert isinstance(local, jd.PerReplica)


def test_aggregate_none_is_an_error():
    strategy = jd.MirroredStrategy()
    with pytest.raises(ValueError, match="specify an aggregation"):
        strategy.run(
            lambda w: jd.get_replica_context().aggregate(w + 1, jd.VariableAggregation.NONE),
            args=(jnp.zeros(2),),
        )


def test_mean_of_integers_is_an_error():
    strategy = jd.MirroredStrategy()
    with pytest.raises(TypeError, match=r"dtype int32: MEAN of an integer value.*use SUM"):
        strategy.run(lambda c: jd.get_replica_context().aggregate(c + 1, "mean"),
                     args=(jnp.zeros(2, jnp.int32),))
    with pytest.raises(TypeError, match="MEAN of an integer value"):
        strategy.sync_on_read(jnp.zeros((), jnp.int32), "mean")


def test_sync_on_read_none_is_an_error():
    with pytest.raises(ValueError, match="specify an aggregation"):
        jd.MirroredStrategy().sync_on_read(0.0, "none")


@all_strategies
def test_sync_on_read_updates_locally_and_aggregates_on_read(strategy_name):
    strategy = make(strategy_name)
    n = strategy.num_replicas_in_sync
    batch = np.arange(4 * n, dtype=np.float32).reshape(2 * n, 2)
    x = strategy.experimental_distribute_values(batch)
    total = strategy.sync_on_read(jnp.zeros(2), jd.VariableAggregation.SUM)
    mean = strategy.sync_on_read(jnp.zeros(2), "mean")
    first = strategy.sync_on_read(jnp.zeros(2), "only_first_replica")

    def fn(total, mean, first, x):
        s = x.sum(0)
        assert total.value.shape == (2,)
        return total.assign_add(s), mean.assign_add(s), first.assign(s)

    total, mean, first = strategy.run(fn, args=(total, mean, first, x))
    per_replica = batch.reshape(n, 2, 2).sum(1)
    assert isinstance(total, jd.SyncOnRead) and total.aggregation is jd.VariableAggregation.SUM
    np.testing.assert_allclose(total.read(), batch.sum(0))
    np.testing.assert_allclose(mean.read(), per_replica.mean(0))
    np.testing.assert_allclose(first.read(), per_replica[0])
    np.testing.assert_allclose(np.stack([np.asarray(v) for v in total.values]), per_replica)


@all_strategies
def test_sync_on_read_cross_replica_assign(strategy_name):
    strategy = make(strategy_name)
    n = strategy.num_replicas_in_sync
    total = strategy.sync_on_read(jnp.zeros(3), "sum").assign(jnp.array([8.0, 16.0, 4.0]))
    np.testing.assert_allclose(total.read(), [8.0, 16.0, 4.0])
    # x / N each
    np.testing.assert_allclose(np.asarray(total.values[-1]), np.array([8.0, 16.0, 4.0]) / n)
    count = strategy.sync_on_read(jnp.zeros((), jnp.int32), "sum").assign(7)
    assert int(count.read()) == 7  # integers stay exact: replica 0 holds 7, the rest 0
    mean = strategy.sync_on_read(0.0, "mean").assign(2.5)
    assert float(mean.read()) == 2.5
    with pytest.raises(ValueError,
                       match=r"value has shape \(2,\) but the sync-on-read value has shape \(3,\)"):
        total.assign(jnp.zeros(2))
    with pytest.raises(RuntimeError, match=r"exists only inside strategy\.run"):
        _ = total.value


def test_sync_on_read_is_a_pytree():
    strategy = jd.MirroredStrategy()
    total = strategy.sync_on_read(jnp.ones(2), "sum")
    doubled = jax.jit(lambda t: jax.tree.map(lambda v: v * 2, t))(total)
    assert isinstance(doubled, jd.SyncOnRead)
    np.testing.assert_allclose(doubled.read(), np.full(2, 16.0))


def test_replica_context_errors():
    strategy = jd.MirroredStrategy()
    with pytest.raises(ValueError, match=r"all_gather got a scalar.*gather x\[None\]"):
        strategy.run(lambda x: jd.get_replica_context().all_gather(x.sum()), args=(jnp.ones(2),))
    total = strategy.sync_on_read(jnp.zeros(2), "sum")
    with pytest.raises(
        ValueError, match=r"value has shape \(3,\) but this replica's component has shape \(2,\)"
    ):
        strategy.run(lambda t: t.assign(jnp.zeros(3)), args=(total,))
