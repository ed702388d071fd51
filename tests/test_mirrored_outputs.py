"""Mirrored stays mirrored, or says why not: what ``strategy.run`` returns in a mirrored argument's
place.

A tf.distribute custom loop ported as written (the update inside ``run``): with the gradients
all-reduced the parameters come back mirrored and train as one device does; without it each
replica's copy would drift, which ``run`` refuses before the first update, naming ``all_reduce``.
Values kept apart on purpose are declared.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist as jd
from jaxdist.replicate.collectives import keep_per_replica
from jaxdist.strategies.compile._identical import (
    DECLARED,
    DIFFERENT,
    IDENTICAL,
    output_values,
    program_values,
)

GLOBAL_BATCH = 64


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH, 6)).astype(np.float32)
    y = (x[:, :3].sum(axis=1) > 0).astype(np.int32)
    params = {"w": rng.normal(size=(6, 2)).astype(np.float32) * 0.1, "b": np.zeros(2, np.float32)}
    return x, y, params


def _loss(params, x, y):
    logits = jnp.tanh(x @ params["w"]) + params["b"]
    return jd.compute_average_loss(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _tutorial_step(tx, reduce_grads):
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        if reduce_grads:
            grads = jd.get_replica_context().all_reduce(jd.ReduceOp.SUM, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


@pytest.mark.parametrize("make", [jd.MirroredStrategy,
                                  lambda: jd.ShardedStrategy(model_parallelism=2)],
                         ids=["mirrored", "sharded_4x2"])
def test_the_tutorial_port_equals_one_device_and_stays_mirrored(make):
    strategy = make()
    x, y, host = _data()
    tx = optax.adam(0.05)
    params, opt_state = strategy.mirror(host), strategy.mirror(tx.init(host))
    step = _tutorial_step(tx, reduce_grads=True)
    for _ in range(3):
        params, opt_state, loss = strategy.run(step, args=(params, opt_state, x, y),
                                               batch_argnums=(2, 3))
        assert isinstance(loss, jd.PerReplica)  # each replica's scaled loss
    # The update used all-reduced gradients: the same on every replica, so it comes back mirrored.
    for leaf in jax.tree.leaves((params, opt_state)):
        assert isinstance(leaf, jax.Array) and leaf.sharding.is_fully_replicated

    want, want_opt = host, tx.init(host)
    for _ in range(3):
        grads = jax.grad(_loss)(want, x, y)
        updates, want_opt = tx.update(grads, want_opt, want)
        want = optax.apply_updates(want, updates)
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_the_port_without_the_all_reduce_is_refused_before_any_update():
    strategy = jd.MirroredStrategy()
    x, y, host = _data()
    tx = optax.sgd(0.1)
    params, opt_state = strategy.mirror(host), strategy.mirror(tx.init(host))
    place = r"output\[0\]\['b'\] takes the place of the mirrored argument args\[0\]\['b'\]"
    with pytest.raises(ValueError, match=place) as e:
        strategy.run(_tutorial_step(tx, reduce_grads=False), args=(params, opt_state, x, y),
                     batch_argnums=(2, 3))
    assert "all_reduce" in str(e.value) and "per_replica" in str(e.value)
    assert "output[0]['b']" in str(e.value) and "output[0]['w']" in str(e.value)


def test_a_train_state_returned_whole_is_checked_too():
    strategy = jd.MirroredStrategy()
    x, y, host = _data()

    def step(state, x, y):  # state -> new_state, as flax's TrainState steps are written
        grads = jax.grad(_loss)(state["params"], x, y)
        return {"params": jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads),
                "step": state["step"] + 1}

    state = strategy.mirror({"params": host, "step": jnp.zeros((), jnp.int32)})
    place = r"output\['params'\]\['b'\] takes the place of the mirrored argument args\[0\]\['params'\]\['b'\]"
    with pytest.raises(ValueError, match=place):
        strategy.run(step, args=(state, x, y), batch_argnums=(1, 2))


def test_kept_apart_on_purpose_local_sgd():
    """Local SGD: each replica trains its own copy, declared with ReplicaContext.per_replica;
    averaged later."""
    strategy = jd.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    x, y, host = _data()

    def local_step(params, x, y):
        grads = jax.grad(_loss)(params, x, y)
        new = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
        return jd.get_replica_context().per_replica(new)

    params = strategy.run(local_step, args=(strategy.mirror(host), x, y), batch_argnums=(1, 2))
    assert all(isinstance(leaf, jd.PerReplica) for leaf in params.values())
    # Passed back, each replica continues from its own copy (a PerReplica argument is never taken
    # for mirrored).
    params = strategy.run(local_step, args=(params, x, y), batch_argnums=(1, 2))
    averaged = strategy.reduce(jd.ReduceOp.MEAN, params)
    # Reference: replica i trains on rows of its own, twice, then the copies are averaged.
    rows = GLOBAL_BATCH // n
    copies = []
    for i in range(n):
        p = host
        xi, yi = x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]
        for _ in range(2):
            # compute_average_loss inside run divides by the global batch: rows * n.
            grads = jax.grad(lambda q, xi=xi, yi=yi: _loss(q, xi, yi) * rows / GLOBAL_BATCH)(p)
            p = jax.tree.map(lambda a, g: a - 0.5 * g, p, grads)
        copies.append(p)
    want = jax.tree.map(lambda *c: np.mean(c, axis=0), *copies)
    for got, ref in zip(jax.tree.leaves(averaged), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)


def test_values_read_from_the_jaxpr():
    """The dataflow reading: collectives make values identical, batches and axis_index different,
    loops and branches join their paths, the declaration marker survives reshaping."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("replica",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(w, x):
        w = jax.lax.pcast(w, "replica", to="varying")
        summed = jax.lax.psum(x, "replica")
        nested = jax.jit(lambda a, b: a * b)(w, summed)  # identical inside a nested jit
        carry, _ = jax.lax.scan(lambda c, xi: (c + xi, None), w, x)  # a batch flows into the carry
        const, _ = jax.lax.scan(lambda c, _: (c * 2.0, None), w, None, length=3)
        branch = jax.lax.cond(w[0] > 0, lambda: w, lambda: w * 2)
        by_index = w * jax.lax.axis_index("replica")
        kept = keep_per_replica(w, "replica")
        return tuple(v[None] for v in (w, summed[0], nested[0], carry, const, branch, by_index,
                                       kept))

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("replica")), out_specs=P("replica"))
    traced = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones((16, 3)))
    inner = traced.jaxpr.eqns[0].params["jaxpr"]
    got = output_values(inner, [False, True], ["replica"])
    assert got == [IDENTICAL, IDENTICAL, IDENTICAL, DIFFERENT, IDENTICAL, IDENTICAL, DIFFERENT,
                   DECLARED]
    assert program_values(traced, {"replica": 8}) == got
    # A collective over only part of the replica axes does not make a value identical.
    assert output_values(inner, [False, True], ["replica", "other"])[1] == DIFFERENT


def test_a_sync_on_read_metric_updated_in_place_counts_what_it_saw():
    """tf.distribute's sync-on-read variables are updated in place inside the replica function."""
    strategy = jd.MirroredStrategy()
    x, y, _ = _data()
    seen = strategy.sync_on_read(0.0, "sum")
    correct = strategy.sync_on_read(jnp.zeros((), jnp.int32), "sum")

    def count(x, y):  # nothing returned: the updates stay in the objects, as in TF
        seen.assign_add(x.shape[0])
        correct.assign_add(jnp.sum((x[:, 0] > 0) == (y == 1)).astype(jnp.int32))

    for _ in range(2):
        assert strategy.run(count, args=(x, y), batch_argnums=(0, 1)) is None
    assert float(seen.read()) == 2 * GLOBAL_BATCH
    assert int(correct.read()) == 2 * int(np.sum((x[:, 0] > 0) == (y == 1)))

    # Passed as arguments, then subtracted in place: the objects passed in keep the update too.
    def undo(seen, x):
        seen.assign_sub(x.shape[0])

    strategy.run(undo, args=(seen, x), batch_argnums=(1,))
    assert float(seen.read()) == GLOBAL_BATCH


def test_a_sync_on_read_value_updated_in_a_compiled_step_is_returned_or_refused():
    strategy = jd.MirroredStrategy()
    x, _, _ = _data()

    def count(seen, x):
        seen.assign_add(x.shape[0])

    def step_returning(seen, x):
        strategy.run(count, args=(seen, x), batch_argnums=(1,))
        return seen

    seen = strategy.sync_on_read(0.0, "sum")
    step = strategy.jit(step_returning, batch_argnums=(1,))
    seen = step(seen, x)
    seen = step(seen, x)
    assert float(seen.read()) == 2 * GLOBAL_BATCH

    def step_dropping(seen, x):
        strategy.run(count, args=(seen, x), batch_argnums=(1,))
        return jnp.zeros(())

    with pytest.raises(ValueError,
                       match=r"updated the sync-on-read value args\[0\] in place.*Return it"):
        strategy.jit(step_dropping, batch_argnums=(1,))(seen, x)


def test_strategy_jit_as_a_decorator_factory():
    """@strategy.jit, strategy.jit(fn, ...) and @strategy.jit(batch_argnums=...) (nnx.jit's usage)
    agree."""
    strategy = jd.MirroredStrategy()
    x, _, host = _data()

    def step(params, x):
        return jax.tree.map(lambda p: p - 0.1 * jnp.mean(x), params)

    plain = strategy.jit(step, batch_argnums=1)(host, x)

    @strategy.jit(batch_argnums=1)
    def decorated(params, x):
        return step(params, x)

    @strategy.jit
    def bare(params, x):
        return step(params, x)

    for got in (decorated(host, x), bare(strategy.mirror(host),
                                         strategy.experimental_distribute_values(x))):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    with pytest.raises(TypeError, match="fn=3 is not callable"):
        strategy.jit(batch_argnums=1)(3)


def test_identical_outputs_cost_no_communication():
    """An updated parameter comes back mirrored without a byte sent: the step's only collective is
    the gradients' all-reduce (taking replica 0's copy would broadcast it)."""
    strategy = jd.MirroredStrategy()

    def replica_fn(w, x):
        g = jax.grad(lambda w: ((x @ w) ** 2).mean())(w)
        return w - 0.1 * jd.get_replica_context().all_reduce("mean", g)

    step = strategy.jit(lambda w, x: strategy.run(replica_fn, args=(w, x), batch_argnums=(1,)),
                        batch_argnums=1)
    plan = step.plan(
        jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((64, 64), jnp.float32)
    )
    assert set(plan.collectives) == {"all-reduce"} and plan.collectives["all-reduce"].count == 1
    w = strategy.run(replica_fn, args=(jnp.ones((64, 32)), jnp.ones((64, 64))), batch_argnums=(1,))
    assert isinstance(w, jax.Array) and w.sharding.is_fully_replicated


def test_per_replica_gradients_returned_for_a_cross_replica_reduce_are_not_an_update():
    """Gradients have the parameters' structure but carry none of them element-wise: returned per
    replica and reduced outside (a cross-replica reduce), they are not a drifting copy."""
    strategy = jd.MirroredStrategy()
    x, y, host = _data()
    params = strategy.mirror(host)
    grads = strategy.run(lambda p, x, y: jax.grad(_loss)(p, x, y), args=(params, x, y),
                         batch_argnums=(1, 2))
    assert all(isinstance(g, jd.PerReplica) for g in grads.values())
    summed = strategy.reduce(jd.ReduceOp.SUM, grads)
    # compute_average_loss over the global batch: the sum of the replicas'
    want = jax.grad(_loss)(host, x, y)
    for got, ref in zip(jax.tree.leaves(summed), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_a_typed_prng_key_in_a_mirrored_state_runs_and_comes_back_mirrored():
    """optax's DP-SGD keeps a ``jax.random.key`` in its state: a per-replica step that splits it the
    same way on every replica returns it (and the noise drawn from it) mirrored, equal to one
    device."""
    strategy = jd.MirroredStrategy()
    host = {"key": jax.random.key(0), "w": jnp.ones(3)}

    def step(state):
        key, sub = jax.random.split(state["key"])
        return {"key": key, "w": state["w"] + jax.random.normal(sub, (3,))}

    got = strategy.run(step, args=(strategy.mirror(host),))
    want = step(host)
    assert got["key"].sharding.is_fully_replicated and got["w"].sharding.is_fully_replicated
    np.testing.assert_array_equal(jax.random.key_data(got["key"]), jax.random.key_data(want["key"]))
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)
