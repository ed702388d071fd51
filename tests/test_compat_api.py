"""The 2018 DistributionStrategy / TPUStrategy API surface, its lower-level cross-replica layer,
merge_call, and the AutoDist parameter-server behaviours mapped to their synchronous JAX
equivalents.

Small strategies (4 replicas, tiny arrays): each test is about semantics, not scale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxdist as jd

# The names of the 2018 TPUStrategy reference (its properties and methods, DistributionStrategy's
# included), and the later 2018 names a ported program may call; the TPU-only ones are on
# TPUStrategy.
NAMES_2018 = """
between_graph is_single_tower num_hosts num_towers num_towers_per_host parameter_devices should_checkpoint
should_init should_save_summary worker_device_index worker_devices batch_reduce broadcast call_for_each_tower
colocate_vars_with configure distribute_dataset group map non_slot_devices read_var reduce run_steps_on_dataset
scope unwrap update update_non_slot value_container update_config_proto fetch make_input_fn_iterator
""".split()
TPU_ONLY = ["finalize", "get_host_cpu_device", "initialize", "steps_per_run", "num_cores"]


def four():
    return jd.MirroredStrategy(jax.devices()[:4])


def test_every_2018_name_exists_on_every_strategy():
    for strategy in (
        jd.TPUStrategy(devices=jax.devices()[:4]),
        four(),
        jd.OneDeviceStrategy(),
        jd.ShardedStrategy(jax.devices()[:4]),
    ):
        names = NAMES_2018 + (TPU_ONLY if isinstance(strategy, jd.TPUStrategy) else [])
        missing = [n for n in names if not hasattr(strategy, n)]
        assert not missing, f"{type(strategy).__name__} lacks {missing}"


def test_tower_names_are_the_modern_ones():
    s = jd.TPUStrategy(devices=jax.devices()[:4])
    assert (s.num_towers, s.num_towers_per_host, s.is_single_tower, s.between_graph) == (4, 4, False, False)
    assert jd.OneDeviceStrategy().is_single_tower
    assert s.parameter_devices == s.devices == s.worker_devices
    # worker_device_index passed to call_for_each_tower: each replica sees its own index (2018 doc
    # example)
    out = s.call_for_each_tower(lambda i, scale: i * scale, s.worker_device_index, 10,
                                run_concurrently=True)
    assert [int(v) for v in s.unwrap(out)] == [0, 10, 20, 30]
    assert (jd.compat.get_distribution_strategy() is jd.get_strategy()
            and not jd.compat.has_distribution_strategy())
    with s.scope():
        assert jd.compat.get_distribution_strategy() is s and jd.compat.get_tower_context() is None


def test_merge_call_2018_doc_example():
    """The call_for_each_tower / merge_call example of the 2018 reference, unchanged but for the
    names."""

    def merge_fn(distribution, three_plus_tower_id):
        return sum(distribution.unwrap(three_plus_tower_id))

    def fn(three):
        tower_ctx = jd.compat.get_tower_context()
        v = three + tower_ctx.tower_id
        s = tower_ctx.merge_call(merge_fn, v)
        return s + v

    distribution = four()
    with distribution.scope():
        merged_results = distribution.call_for_each_tower(fn, 3)
    assert [int(v) for v in distribution.unwrap(merged_results)] == [18 + 3 + i for i in range(4)]


def test_merge_call_sees_per_replica_values_and_returns_to_every_replica():
    s = four()

    def merge_fn(strategy, v, count, scale=1.0):
        assert isinstance(v, jd.PerReplica) and jd.get_replica_context().in_merge_call
        total = strategy.reduce("sum", v) * scale  # 0 + 1 + 2 + 3
        # a PerReplica result: each replica gets its own component back
        return total, v, count.read()

    def replica_fn(count):
        ctx = jd.get_replica_context()
        v = ctx.replica_id_in_sync_group.astype(jnp.float32)
        total, own, seen = ctx.merge_call(merge_fn, args=(v, count.assign_add(v)),
                                          kwargs={"scale": 2.0})
        assert not ctx.in_merge_call
        return total, own, seen

    total, own, seen = s.run(replica_fn, args=(s.sync_on_read(0.0, "sum"),))
    # a SyncOnRead reaches merge_fn aggregating on read
    assert float(total) == 12.0 and float(seen) == 6.0
    assert [float(x) for x in s.unwrap(own)] == [0.0, 1.0, 2.0, 3.0]
    # outside any strategy: the default single-replica context calls merge_fn on the values as they
    # are
    assert jd.get_replica_context().merge_call(lambda strategy, x: x + 1, args=(1,)) == 2
    ctx = jd.get_replica_context()
    with pytest.raises(TypeError, match=r"merge_fn=3 is not callable"):
        ctx.merge_call(3)
    with pytest.raises(TypeError,
                       match=r"args=1.0 must be a tuple .*get_tower_context\(\)\.merge_call"):
        ctx.merge_call(lambda strategy, x: x, 1.0)
    with pytest.raises(TypeError, match=r"kwargs=\[1\] must be a dict"):
        ctx.merge_call(lambda strategy: 0, kwargs=[1])


def test_update_applies_fn_to_every_copy_and_keeps_the_layout():
    s = jd.ShardedStrategy(jax.devices()[:4], min_shard_size=1)
    var = s.mirror({"w": np.arange(8.0, dtype=np.float32).reshape(4, 2),
                    "b": np.zeros(3, np.float32)})
    layouts = jax.tree.map(lambda x: x.sharding, var)
    assert layouts["w"].spec == P("replica")
    new = s.update(var, lambda v, g, lr=1.0: jax.tree.map(lambda a: a - lr * g, v), 1.0,
                   lr=np.float32(0.5))
    assert jax.tree.map(lambda x: x.sharding, new) == layouts
    np.testing.assert_allclose(new["w"], np.arange(8.0).reshape(4, 2) - 0.5)
    # TF's grouped=False: one entry per replica
    copies = s.update(var["b"], lambda v: v + 1, grouped=False)
    assert len(copies) == 4 and all(np.array_equal(c, np.ones(3)) for c in copies)

    # inside a compiled step and inside merge_call, fn is applied there (the enclosing program keeps
    # the layout)
    step = s.jit(lambda v: s.update(v, lambda a: jax.tree.map(lambda t: t * 2, a)),
                 batch_argnums=())
    np.testing.assert_allclose(step(var)["w"], np.arange(8.0).reshape(4, 2) * 2)
    out = s.run(
        lambda: jd.get_replica_context().merge_call(
            lambda st: st.update(jnp.ones(2), lambda a: a + 1)
        )
    )
    np.testing.assert_allclose(out, [2.0, 2.0])

    ids = s.run(lambda: jd.get_replica_context().replica_id_in_sync_group)
    with pytest.raises(ValueError,
                       match=r"args / kwargs of strategy.update hold a PerReplica .* "
                             r"strategy.reduce"):
        s.update(var, lambda v, g: v, ids)
    with pytest.raises(ValueError, match=r"got a PerReplica / SyncOnRead as var"):
        s.update(ids, lambda v: v)
    with pytest.raises(TypeError, match=r"fn=None is not callable"):
        s.update(var, None)
    with pytest.raises(
        TypeError, match=r"var holding ndarray .* strategy.create_variables or strategy.mirror"
    ):
        s.update(np.zeros(2), lambda v: v)
    with pytest.raises(
        ValueError,
        match=r"fn=.*<lambda> returned \[float32\[\]\] for a variable of "
        r"\[float32\[3\]\]: .* same structure",
    ):
        s.update(var["b"], lambda v: v.sum())
    with pytest.raises(RuntimeError,
                       match=r"inside a replica function.*ctx.aggregate.*ctx.merge_call"):
        s.run(lambda v: s.update(v, lambda a: a + 1), args=(var["b"],))


def test_colocate_vars_with_non_slot_devices_and_update_non_slot():
    s = jd.ShardedStrategy(jax.devices()[:4], min_shard_size=1)
    w = s.mirror(np.zeros((4, 8), np.float32))  # FSDP splits its largest axis (8)
    assert w.sharding.spec == P(None, "replica")
    with s.scope():
        # a slot takes its variable's layout, a scalar a whole copy on its devices
        with s.colocate_vars_with(w):
            slot, scalar = s.create_variables(lambda: (jnp.zeros((4, 8)), jnp.zeros(())))
            placed = s.mirror(np.ones((8, 8), np.float32))
        assert (
            slot.sharding == w.sharding and scalar.sharding.spec == P()
            and placed.sharding.spec == P(None, "replica")
        )
        # the block is over
        assert s.mirror(np.ones((8, 8), np.float32)).sharding.spec == P("replica")
        where = s.non_slot_devices({"w": w})
        with s.colocate_vars_with(where):
            step = s.create_variables(lambda: jnp.zeros((), jnp.int32))
        with s.colocate_vars_with(jax.devices()[5]):
            assert s.mirror(np.ones(2)).sharding.device_set == {jax.devices()[5]}
    assert where.device_set == set(s.devices) and step.sharding.is_fully_replicated
    step = s.update_non_slot(where, lambda t, k: t + k, step, 2)
    assert int(step) == 2 and step.sharding == where
    assert len(s.update_non_slot(w, lambda t: t * 3, step, grouped=False)) == 4

    with pytest.raises(RuntimeError, match=r"inside this strategy's scope\(\)"):
        with s.colocate_vars_with(w):
            pass
    with s.scope(), pytest.raises(TypeError,
                                  match=r"colocate_with_variable='w' .* is not a variable"):
        with s.colocate_vars_with("w"):
            pass
    with pytest.raises(TypeError, match=r"var_list holds str 'w': pass the variables"):
        s.non_slot_devices(["w"])
    with pytest.raises(TypeError, match=r"colocate_with=3 is not a layout"):
        s.update_non_slot(3, lambda: 0)
    with pytest.raises(TypeError, match=r"fn=1 is not callable"):
        s.update_non_slot(where, 1)


def test_batch_reduce_is_one_program_with_destinations():
    s = jd.ShardedStrategy(jax.devices()[:4], min_shard_size=1)
    ids = s.run(lambda: jd.get_replica_context().replica_id_in_sync_group.astype(jnp.float32) + 1.0)
    rows = s.run(lambda: jnp.full((4, 2), jd.get_replica_context().replica_id_in_sync_group,
                                  jnp.float32))
    fsdp = s.mirror(np.zeros((4, 2), np.float32))  # split over the replicas
    before = len(s.programs)
    total, mean_rows, on_cpu, on_two = s.batch_reduce(
        jd.ReduceOp.SUM, [(ids, None), ({"r": rows}, fsdp), (ids, "cpu:0"),
                          (ids, jax.devices()[:2])]
    )
    assert len(s.programs) == before + 1  # one compiled program for all of them
    assert float(total) == 10.0 and total.sharding.is_fully_replicated
    np.testing.assert_allclose(mean_rows["r"], np.full((4, 2), 6.0))
    assert mean_rows["r"].sharding == fsdp.sharding  # reduced straight into the variable's layout
    assert (on_cpu.sharding.device_set == {jax.devices("cpu")[0]}
            and len(on_two.sharding.device_set) == 2)
    assert [float(v) for v in s.batch_reduce("mean", [(ids, None)])] == [2.5]
    assert [float(v) for v in s.batch_reduce("only_first_replica", [(ids, None)])] == [1.0]
    # the same value on every replica
    assert float(s.batch_reduce("sum", [(jnp.float32(2.0), None)])[0]) == 8.0

    with pytest.raises(ValueError,
                       match=r"reduce_op=VariableAggregation.NONE: specify how to combine"):
        s.batch_reduce(jd.VariableAggregation.NONE, [(ids, None)])
    with pytest.raises(
        ValueError, match=r"value_destination_pairs=.* must be a list of \(value, destination\)"
    ):
        s.batch_reduce("sum", [ids])
    with pytest.raises(
        TypeError, match=r"value_destination_pairs\[0\] destination=2.5 .* is not a destination"
    ):
        s.batch_reduce("sum", [(ids, 2.5)])
    with pytest.raises(
        ValueError, match=r"value_destination_pairs\[0\] holds a PerReplica of .* reduce it with"
    ):
        s.batch_reduce("sum",
                       [(four().run(lambda: jd.get_replica_context().replica_id_in_sync_group),
                         None)])
    ints = s.run(lambda: jd.get_replica_context().replica_id_in_sync_group)
    with pytest.raises(TypeError,
                       match=r"value_destination_pairs\[0\] has dtype int32: MEAN of an integer"):
        s.batch_reduce("mean", [(ints, None)])


def test_broadcast_read_var_and_process_roles(monkeypatch):
    s = four()
    b = s.broadcast({"x": np.arange(3.0)})
    assert b["x"].sharding.is_fully_replicated and len(b["x"].sharding.device_set) == 4
    assert s.broadcast(np.ones(2), destinations="cpu:1").sharding.device_set == {jax.devices()[1]}
    ids = s.run(lambda: jd.get_replica_context().replica_id_in_sync_group)
    with pytest.raises(ValueError,
                       match=r"the tensor given to strategy.broadcast hold a PerReplica"):
        s.broadcast(ids)
    with pytest.raises(RuntimeError,
                       match=r"broadcast was called inside a replica function.*only_first_replica"):
        s.run(lambda x: s.broadcast(x), args=(jnp.ones(2),))
    assert s.jit(lambda x: s.broadcast(x) + 1, batch_argnums=())(jnp.ones(2)).tolist() == [2.0, 2.0]

    count = s.run(lambda c: c.assign_add(1.0), args=(s.sync_on_read(0.0, "sum"),))
    read = s.read_var({"count": count, "w": b["x"]})
    assert float(read["count"]) == 4.0 and read["w"] is b["x"]
    with pytest.raises(ValueError, match=r"read_var got a PerReplica: .* strategy.reduce"):
        s.read_var(ids)

    assert (s.should_checkpoint, s.should_save_summary, s.should_init) == (True, True, True)
    monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)  # a worker that is not the chief
    assert (s.should_checkpoint, s.should_save_summary, s.should_init) == (False, False, True)


def test_unwrap_and_value_container():
    s = four()
    ids = s.run(lambda: jd.get_replica_context().replica_id_in_sync_group)
    parts = s.unwrap(ids)
    assert [int(p) for p in parts] == [0, 1, 2, 3]
    again = s.unwrap(ids)
    # the same component objects every time
    assert all(a is b for a, b in zip(parts, again, strict=True))
    container = s.value_container(parts[2])
    assert isinstance(container, jd.PerReplica) and container.stacked is ids.stacked
    # TF: value in unwrap(value_container(value))
    assert any(c is parts[2] for c in s.unwrap(container))
    mirrored = s.mirror(np.ones(2, np.float32))
    copies = s.unwrap(mirrored)
    assert len(copies) == 4 and s.value_container(copies[3]) is mirrored
    count = s.sync_on_read(1.0, "mean")
    assert float(s.value_container(s.unwrap(count)[1]).read()) == 1.0
    assert s.unwrap(3) == [3] and s.value_container(7) == 7
    tree = s.unwrap({"a": ids, "b": mirrored})
    assert len(tree) == 4 and int(tree[3]["a"]) == 3


def test_distribute_dataset_feeds_one_element_per_replica():
    s = four()
    # 2018: each element is one tower's batch
    elements = [np.full((2, 3), i, np.float32) for i in range(8)]
    batches = list(s.distribute_dataset(lambda: elements))
    assert [b.shape for b in batches] == [(8, 3), (8, 3)]
    per_replica = s.run(lambda x: x[0, 0], args=(batches[1],))
    assert [float(v) for v in s.unwrap(per_replica)] == [4.0, 5.0, 6.0, 7.0]
    with pytest.raises(ValueError,
                       match=r"ended after 2 of the 4 per-replica batches .* multiple of 4"):
        list(s.distribute_dataset(lambda: elements[:6]))
    with pytest.raises(TypeError, match=r"dataset_fn=\[\] is not callable"):
        s.distribute_dataset([])
    it = s.make_input_fn_iterator(lambda ctx: [np.zeros((4 * ctx.num_input_pipelines, 1),
                                                        np.float32)] * 2)
    assert [b.shape for b in it] == [(4, 1), (4, 1)]
    with pytest.raises(ValueError, match=r"replication_mode='per_replica': only PER_WORKER exists"):
        s.make_input_fn_iterator(lambda ctx: [], replication_mode="per_replica")


def test_map_spreads_elements_over_the_replicas():
    s = four()

    def fn(m, scale):
        return {"y": m["x"] * scale}

    # 6 elements on 4 replicas: padded to 8
    out = s.map([{"x": np.float32(i)} for i in range(6)], fn, 2.0)
    assert [float(o["y"]) for o in out] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    with pytest.raises(ValueError, match=r"map_over is empty"):
        s.map([], fn)
    with pytest.raises(TypeError, match=r"fn='f' is not callable"):
        s.map([1.0], "f")


def test_graph_and_session_names():
    s = four()
    assert s.configure(session_config=object()) is None  # no session: nothing to configure
    with pytest.raises(
        ValueError,
        match=r"configure\(cluster_spec=\{'worker': \['a:1'\]\}\): jaxdist joins the "
        r"cluster when the strategy is created",
    ):
        s.configure(cluster_spec={"worker": ["a:1"]})
    config = object()
    assert s.update_config_proto(config) is config
    assert s.group({"a": s.mirror(np.ones(2)), "b": 3}) is None
    fetched = s.fetch(s.mirror(np.arange(3.0, dtype=np.float32)), fn=lambda x: x * 2)
    assert fetched.sharding.device_set == {jax.devices("cpu")[0]} and fetched.tolist() == [
        0.0,
        2.0,
        4.0,
    ]
    assert s.fetch(np.ones(2), destination="cpu:2").sharding.device_set == {jax.devices()[2]}
    with pytest.raises(ValueError, match=r"fetch got a PerReplica / SyncOnRead"):
        s.fetch(s.sync_on_read(0.0))


def test_autodist_ps_accumulator_is_all_reduce_plus_gradient_accumulation():
    """AutoDist's synchronous PS: a ConditionalAccumulator applies the mean of num_accum_required
    gradients once they arrived. With N replicas and k steps, num_accum_required = N * k is an
    all-reduce MEAN per step plus optax.MultiSteps(every_k_schedule=k): one update, equal to one
    single-device step on all N * k batches."""
    s, k = four(), 2
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(8, 3)).astype(np.float32) for _ in range(k)]
    w0 = np.ones(3, np.float32)
    loss = lambda w, x: jnp.mean((x @ w - 1.0) ** 2)  # noqa: E731
    opt = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=k)
    state = opt.init(w0)
    w = s.mirror(w0)

    # each replica's gradients, averaged over the replicas: the accumulator's take_grad(N)
    def replica_fn(w, x):
        return jd.get_replica_context().all_reduce("mean", jax.grad(loss)(w, x))

    apply = jax.jit(opt.update)
    for x in batches:
        g = s.run(replica_fn, args=(w, s.experimental_distribute_values(x)))
        updates, state = apply(g, state, w)
        w = optax.apply_updates(w, updates)
    want = w0 - 0.1 * jax.grad(loss)(w0, np.concatenate(batches))
    np.testing.assert_allclose(w, want, rtol=1e-5)


def test_autodist_shared_variable_is_only_first_replica():
    """AutoDist's _share_variable: every replica reads the master replica's copy. In SPMD: a
    mirrored value updated with ONLY_FIRST_REPLICA, so each replica ends with replica 0's update."""
    s = four()

    def replica_fn(v):
        ctx = jd.get_replica_context()
        local = v + ctx.replica_id_in_sync_group.astype(jnp.float32)  # replicas disagree
        return ctx.aggregate(local, jd.VariableAggregation.ONLY_FIRST_REPLICA)

    shared = s.run(replica_fn, args=(s.mirror(np.float32(5.0)),))
    assert shared.sharding.is_fully_replicated and [float(c) for c in s.unwrap(shared)] == [5.0] * 4


def test_2018_reduce_with_destinations_names_batch_reduce():
    s = four()
    ids = s.run(lambda: jd.get_replica_context().replica_id_in_sync_group.astype(jnp.float32))
    with pytest.raises(TypeError,
                       match=r"axis='/device:CPU:0' must be an int or None.*strategy.batch_reduce"):
        s.reduce(jd.VariableAggregation.SUM, ids, "/device:CPU:0")
    assert float(s.batch_reduce(jd.VariableAggregation.SUM, [(ids, "/device:CPU:0")])[0]) == 6.0
