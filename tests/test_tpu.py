"""TPUStrategy, on-device step loops (run_steps_on_dataset) and outside_compilation host regions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from registry import all_strategies, make

import jaxdist as jd

oc = jd.tpu.outside_compilation


# -------------------------------------------------------------------------------------- TPUStrategy
def test_tpu_strategy_topology_and_lifecycle():
    strategy = jd.TPUStrategy(steps_per_run=20)
    assert strategy.devices == tuple(jax.devices()) and strategy.num_cores == 8
    assert (strategy.steps_per_run == 20 and strategy.num_hosts == 1
            and strategy.num_replicas_per_host == 8)
    assert jd.TPUStrategy(num_cores=2).devices == tuple(jax.devices()[:2])
    assert strategy.get_host_cpu_device(0).platform == "cpu"
    for _ in range(2):  # safe to call more than once, in any order
        strategy.initialize()
        strategy.finalize()
    strategy.finalize()
    strategy.initialize()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps_per_run": 0}, r"steps_per_run=0 must be an int >= 1"),
        ({"num_cores": 9}, r"num_cores=9 must be an int in \[1, 8\]"),
        ({"num_cores": 0}, r"num_cores=0 must be an int in \[1, 8\]"),
    ],
)
def test_tpu_strategy_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jd.TPUStrategy(**kwargs)


def test_host_cpu_device_bad_host():
    with pytest.raises(ValueError, match=r"host_id=1 must be in \[0, 1\)"):
        jd.TPUStrategy().get_host_cpu_device(1)


# -------------------------------------------------------------------------------------- steps loops
def _regression_data(steps, batch=16, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(batch, 3)).astype(np.float32),
         rng.normal(size=(batch,)).astype(np.float32))
        for _ in range(steps)
    ]


def _loss(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def _strategies():
    return [*sorted(k for k in ("one_device", "mirrored_2", "mirrored_8")), "tpu_8"]


@pytest.mark.parametrize("name", _strategies())
def test_steps_loop_equals_single_steps(name):
    strategy = jd.TPUStrategy(steps_per_run=5) if name == "tpu_8" else make(name)
    data = _regression_data(10)
    w0 = np.full(3, 0.5, np.float32)

    def step_fn(ctx, w, x, y):
        def replica_fn(w, x, y):
            loss, g = jax.value_and_grad(_loss)(w, x, y)
            return jd.get_replica_context().all_reduce("mean", g), loss

        grads, loss = strategy.run(replica_fn, args=(w, x, y))
        ctx.set_last_step_output("loss", loss, aggregation=jd.ReduceOp.MEAN)
        ctx.set_last_step_output("per_replica_loss", loss)
        ctx.set_non_tensor_output("note", "ok")
        return w - 0.1 * grads

    # Reference: one step at a time, on one device.
    w, losses, starts = w0, [], []
    for x, y in data:
        starts.append(w)
        losses.append(float(_loss(w, x, y)))
        w = w - 0.1 * jax.grad(_loss)(w, x, y)

    it = iter(data)
    ctx = strategy.run_steps_on_dataset(step_fn, it, iterations=5, initial_loop_values=w0)
    ctx = strategy.run_steps_on_dataset(step_fn, it, iterations=5,
                                        initial_loop_values=ctx.loop_values)
    np.testing.assert_allclose(ctx.loop_values, w, rtol=1e-5)
    outs = ctx.last_step_outputs
    assert isinstance(outs, dict) and set(outs) == {"loss", "per_replica_loss"}
    np.testing.assert_allclose(outs["loss"], losses[-1], rtol=1e-5)  # aggregated: one value
    n = strategy.num_replicas_in_sync
    per_replica = strategy.experimental_local_results(outs["per_replica_loss"])
    assert len(per_replica) == n  # no aggregation: one value per replica
    x_last, y_last = data[-1]
    expected = [_loss(starts[-1], xs, ys) for xs, ys in zip(np.split(x_last, n),
                                                            np.split(y_last, n), strict=True)]
    np.testing.assert_allclose([float(v) for v in per_replica], expected, rtol=1e-4)
    assert ctx.non_tensor_outputs == {"note": "ok"}


def test_steps_per_run_default_and_global_view_step():
    strategy = jd.TPUStrategy(steps_per_run=4)
    data = _regression_data(8)

    def step_fn(ctx, w, x, y):  # unmodified global-view step
        ctx.set_last_step_output("loss", _loss(w, x, y), aggregation="mean")
        return w - 0.1 * jax.grad(_loss)(w, x, y)

    it = iter(data)
    w = np.zeros(3, np.float32)
    # iterations = steps_per_run
    ctx = strategy.run_steps_on_dataset(step_fn, it, initial_loop_values=w)
    ctx = strategy.run_steps_on_dataset(step_fn, it, initial_loop_values=ctx.loop_values)
    for x, y in data:
        w = w - 0.1 * jax.grad(_loss)(w, x, y)
    np.testing.assert_allclose(ctx.loop_values, w, rtol=1e-5)
    assert ctx.loop_values.sharding.is_fully_replicated
    with pytest.raises(StopIteration):
        strategy.run_steps_on_dataset(step_fn, it, initial_loop_values=w)


def test_steps_loop_without_loop_values_and_single_array_batches():
    strategy = jd.MirroredStrategy()
    batches = [np.full((8, 2), i, np.float32) for i in range(3)]

    def step_fn(ctx, x):  # a single array batch is one input; no loop values: step_fn(ctx, *inputs)
        ctx.set_last_step_output("sum", x.sum(), aggregation=None)

    ctx = strategy.run_steps_on_dataset(step_fn, iter(batches), iterations=3)
    assert ctx.loop_values is None
    assert float(ctx.last_step_outputs["sum"]) == 2 * 16


def test_callback_fires_once_per_replica_per_step_in_order():
    strategy = jd.MirroredStrategy()
    log = []

    def record(step, replica):
        log.append((int(step), int(replica)))

    def step_fn(ctx, step, x):
        def replica_fn(step, x):
            oc(record, step, jd.get_replica_context().replica_id_in_sync_group, result_shape=())
            return jd.get_replica_context().all_reduce("sum", x.sum())

        total = strategy.run(replica_fn, args=(step, x))
        return step + 1 + 0 * total.astype(jnp.int32)

    batches = iter([np.ones((16, 1), np.float32)] * 6)
    strategy.run_steps_on_dataset(step_fn, batches, iterations=6, initial_loop_values=jnp.int32(0))
    jax.effects_barrier()
    assert sorted(log) == [(s, r) for s in range(6) for r in range(8)]  # once per replica per step
    for r in range(8):
        # each replica's calls in step order
        assert [s for s, rr in log if rr == r] == list(range(6))


def test_steps_loop_bad_input():
    strategy = jd.MirroredStrategy()

    def step_fn(ctx, w, x):
        return w + x.sum()

    w = np.float32(0)
    ragged = iter([np.ones((16, 1)), np.ones((16, 1)), np.ones((8, 1))])
    with pytest.raises(ValueError,
                                         match=r"batch 2 has a leaf of shape \(8, 1\) where batch "
                                               r"0 has \(16, 1\).*drop "
                                         r"the remainder .* or pad"):
        strategy.run_steps_on_dataset(step_fn, ragged, iterations=3, initial_loop_values=w)
    with pytest.raises(ValueError,
                                         match=r"num_replicas_in_sync=8 does not divide global "
                                               r"batch 12: drop the "
                                         r"remainder \(batch 8\) or pad to 16"):
        strategy.run_steps_on_dataset(step_fn, iter([np.ones((12, 1))]), iterations=1,
                                      initial_loop_values=w)
    with pytest.raises(ValueError,
                       match=r"iterator ended after 2 of iterations=3 batches.*drop the remainder"):
        strategy.run_steps_on_dataset(step_fn, iter([np.ones((8, 1))] * 2), iterations=3,
                                      initial_loop_values=w)
    with pytest.raises(TypeError, match=r"iterator=list is not an iterator: pass iter\(dataset\)"):
        strategy.run_steps_on_dataset(step_fn, [np.ones((8, 1))], iterations=1,
                                      initial_loop_values=w)
    with pytest.raises(ValueError, match=r"iterations=0 must be an int >= 1"):
        strategy.run_steps_on_dataset(step_fn, iter([np.ones((8, 1))]), iterations=0,
                                      initial_loop_values=w)
    with pytest.raises(ValueError,
                       match=r"step_fn returned a state of structure .* but the loop carries"):
        strategy.run_steps_on_dataset(lambda ctx, w, x: (w, w), iter([np.ones((8, 1))]),
                                      iterations=1, initial_loop_values=w)

    def sets_in_replica(ctx, w, x):
        strategy.run(lambda x: ctx.set_last_step_output("bad", x.sum()), args=(x,))
        return w

    with pytest.raises(RuntimeError, match="inside a replica function"):
        strategy.run_steps_on_dataset(sets_in_replica, iter([np.ones((8, 1))]), iterations=1,
                                      initial_loop_values=w)
    with pytest.raises(RuntimeError, match="called from inside step_fn"):
        jd.MultiStepContext().set_last_step_output("x", 1.0)


# ------------------------------------------------------------------------------ outside_compilation
def _host_fn(w, x):
    return jnp.tanh(x @ w) * 2.0


@all_strategies
def test_outside_compilation_values_and_gradients(strategy_name):
    strategy = make(strategy_name)
    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng(1)
    x_host = rng.normal(size=(4 * n, 3)).astype(np.float32)
    w_host = rng.normal(size=(3, 2)).astype(np.float32)
    x, w = strategy.experimental_distribute_values(x_host), strategy.mirror(w_host)

    def loss(w, x):
        return jnp.mean(oc(_host_fn, w, x) ** 2)

    def ref_loss(w, x):
        return jnp.mean(_host_fn(w, x) ** 2)

    want = jax.jit(jax.grad(ref_loss))(w_host, x_host)
    # Per-replica view.
    got = strategy.run(
        lambda w, x: jd.get_replica_context().all_reduce("mean", jax.grad(loss)(w, x)), args=(w, x)
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The same program as jax.pmap runs it (no varying types: each replica's values are its own).
    got = strategy.run(
        lambda w, x: jd.get_replica_context().all_reduce("mean", jax.grad(loss)(w, x)),
        args=(w, x),
        check_vma=False,
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Global view: the same, and the host fn still sees per-replica rows.
    np.testing.assert_allclose(strategy.jit(jax.grad(loss))(w, x), want, rtol=1e-5, atol=1e-6)
    # atol: an output near 0 is a difference of O(1) products, exact only to their rounding (~1e-7)
    np.testing.assert_allclose(strategy.jit(lambda w, x: oc(_host_fn, w, x))(w, x),
                               _host_fn(w_host, x_host), rtol=1e-5, atol=1e-6)


def test_outside_compilation_sees_per_replica_shapes():
    strategy = jd.MirroredStrategy()
    x = strategy.experimental_distribute_values(np.zeros((32, 5), np.float32))
    seen = []

    def host(x):
        seen.append(x.shape)

    strategy.run(lambda x: oc(host, x, result_shape=()), args=(x,))
    jax.effects_barrier()
    assert seen == [(4, 5)] * 8
    seen.clear()
    # Global view: still once per replica, never gathered to device 0.
    strategy.jit(lambda x: oc(host, x, result_shape=()))(x)
    jax.effects_barrier()
    assert seen == [(4, 5)] * 8
    seen.clear()
    # A jax.numpy host function with a result is traced (for its shapes, and compiled once for the
    # host): its Python side effects happen at trace time, like any JAX code; it computes once per
    # replica.
    out = strategy.run(lambda x: oc(lambda a: (seen.append(type(a)), a + 1)[1], x), args=(x,))
    jax.effects_barrier()
    assert seen and all(issubclass(t, jax.core.Tracer) for t in seen)
    np.testing.assert_allclose(strategy.gather(out), np.ones((32, 5)))
    # In the global view a scalar result comes back as one value per replica.
    x = strategy.experimental_distribute_values(np.arange(32, dtype=np.float32).reshape(32, 1))
    means = strategy.jit(lambda x: oc(jnp.mean, x))(x)
    np.testing.assert_allclose(means, np.arange(32).reshape(8, 4).mean(1))


def test_outside_compilation_once_per_replica_on_a_model_parallel_mesh():
    """On a (replica, model) = (4, 2) mesh the host runs once per replica, not once per device."""
    strategy = make("sharded_4x2")
    n = strategy.num_replicas_in_sync
    assert n == 4
    x_host = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    x = strategy.experimental_distribute_values(x_host)
    seen = []

    def host(x):  # numpy: called at run time, once per call
        seen.append(x.shape)
        return np.cos(x)

    shape = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    logged = []

    def replica_fn(x):
        # a side effect: ordered, no result
        oc(lambda v: logged.append(v.shape), x, result_shape=())
        return oc(host, x, result_shape=shape)

    out = strategy.run(replica_fn, args=(x,))
    jax.effects_barrier()
    np.testing.assert_allclose(strategy.gather(out), np.cos(x_host), rtol=1e-6)
    assert seen == [(2, 3)] * n and logged == [(2, 3)] * n
    seen.clear()
    flags = strategy.jit(lambda x: oc(lambda v: np.asarray(v > 5), x,
                                      result_shape=jax.ShapeDtypeStruct(
        # a boolean result comes back unchanged from the replica's first device
        (2, 3), jnp.bool_)))(x)
    np.testing.assert_array_equal(flags, x_host > 5)
    np.testing.assert_allclose(strategy.jit(lambda x: oc(host, x, result_shape=shape))(x),
                               np.cos(x_host), rtol=1e-6)
    assert seen == [(2, 3)] * n


def test_outside_compilation_numpy_host_fn():
    strategy = jd.MirroredStrategy()
    x_host = np.linspace(-1, 1, 16, dtype=np.float32).reshape(8, 2)
    x = strategy.experimental_distribute_values(x_host)
    shape = jax.ShapeDtypeStruct((1, 2), jnp.float32)
    out = strategy.run(lambda x: oc(np.sin, x, result_shape=shape), args=(x,))
    np.testing.assert_allclose(strategy.gather(out), np.sin(x_host), rtol=1e-6)
    # Differentiable with a host vjp.
    def host_vjp(args, cotangent):
        return (np.cos(args[0]) * cotangent,)

    grad = strategy.run(
        lambda x: jax.grad(lambda x: jnp.sum(oc(np.sin, x, result_shape=shape, vjp=host_vjp)))(x),
        args=(x,)
    )
    np.testing.assert_allclose(strategy.gather(grad), np.cos(x_host), rtol=1e-6)
    # Without a vjp: a clear error, not a crash in XLA.
    with pytest.raises(TypeError,
                                        match=r"region '0' .* is being differentiated, but its "
                                              r"host function is opaque.*"
                                        r"pass vjp="):
        strategy.run(lambda x: jax.grad(lambda x: jnp.sum(oc(np.sin, x, result_shape=shape)))(x),
                     args=(x,))
    # A numpy function without result_shape cannot be traced.
    with pytest.raises(TypeError, match=r"could not trace host_fn='sin'.*pass result_shape="):
        strategy.run(lambda x: oc(np.sin, x), args=(x,))


def test_outside_compilation_eager_nesting_and_bad_arguments():
    assert oc(lambda a, b: a + b, 1.0, 2.0) == 3.0  # outside any trace: just called
    strategy = jd.MirroredStrategy()
    x = strategy.experimental_distribute_values(np.zeros((8, 1), np.float32))
    with pytest.raises(NotImplementedError, match="Cannot nest outside_compilation clusters"):
        strategy.run(lambda x: oc(lambda a: oc(jnp.sin, a), x), args=(x,))
    with pytest.raises(TypeError, match=r"host_fn=3 is not callable"):
        oc(3, x)
    with pytest.raises(TypeError, match=r"vjp=1 is not callable"):
        strategy.run(lambda x: oc(jnp.sin, x, vjp=1), args=(x,))


def test_outside_compilation_under_plain_jit_and_grad():
    f = jax.jit(jax.grad(lambda x: jnp.sum(oc(jnp.sin, x) ** 2)))
    x = np.linspace(0, 1, 4, dtype=np.float32)
    np.testing.assert_allclose(f(x), jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(x), rtol=1e-5)


# ----------------------------------------------------------------------------------------- clusters
def _clustered(x):
    with jd.gradients.cluster("C"):
        y = jnp.sin(x) * 3.0
    return jnp.sum(y**2)


def test_cluster_names_forward_first_and_second_order():
    strategy = jd.OneDeviceStrategy()
    x = jnp.ones(3)
    grad = jd.gradients.grad
    assert set(jd.gradients.clusters(strategy.jit(_clustered).lower(x))) == {"C"}
    assert set(jd.gradients.clusters(strategy.jit(grad(_clustered)).lower(x))) == {"C", "C.uid"}
    two = strategy.jit(lambda x: (grad(_clustered)(x), grad(_clustered)(x)))
    assert set(jd.gradients.clusters(two.lower(x))) == {"C", "C.uid", "C.uid_1"}
    # grad of grad: invocation "uid" (outer) differentiates "uid_1" (inner): the second-order ops of
    # C land in C.uid_1.uid; the outer gradient of the forward ops in C.uid.
    second = strategy.jit(grad(lambda x: jnp.sum(grad(_clustered)(x))))
    assert set(jd.gradients.clusters(second.lower(x))) == {"C", "C.uid", "C.uid_1", "C.uid_1.uid"}
    # Plain jax.grad still works: its gradient ops carry no uid.
    assert set(jd.gradients.clusters(jax.jit(jax.grad(_clustered)).lower(x))) == {"C"}
    np.testing.assert_allclose(strategy.jit(grad(_clustered))(x), jax.grad(_clustered)(x),
                               rtol=1e-6)


def test_cluster_decorator_value_and_grad_and_vjp():
    @jd.gradients.cluster("D")
    def f(x):
        return jnp.sum(jnp.cos(x))

    strategy = jd.OneDeviceStrategy()
    value, g = strategy.jit(jd.gradients.value_and_grad(f))(jnp.ones(2))
    np.testing.assert_allclose(value, 2 * np.cos(1.0), rtol=1e-6)
    np.testing.assert_allclose(g, -np.sin(np.ones(2)), rtol=1e-6)
    assert set(
        jd.gradients.clusters(strategy.jit(jd.gradients.value_and_grad(f)).lower(jnp.ones(2)))
    ) == {"D", "D.uid"}

    def with_vjp(x):
        y, pull = jd.gradients.vjp(f, x)
        return pull(jnp.ones_like(y))[0]

    assert set(jd.gradients.clusters(strategy.jit(with_vjp).lower(jnp.ones(2)))) == {"D", "D.uid"}
    with pytest.raises(ValueError, match=r"name='a/b' is not a valid cluster name"):
        jd.gradients.cluster("a/b")
    with pytest.raises(TypeError, match="neither a lowered computation nor text"):
        jd.gradients.clusters(42)


def test_host_region_clusters_and_host_compute_core():
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    x = strategy.experimental_distribute_values(np.ones((4, 2), np.float32))

    def step(x):
        a = oc(jnp.sin, x)  # cluster "0"
        b = oc(jnp.cos, x)  # cluster "1"
        return jnp.sum(a * b)

    forward = strategy.jit(step).lower(x)
    assert jd.tpu.host_compute_core(forward, 2) == ["0:0", "0:1", "1:0", "1:1"]
    backward = strategy.jit(jd.gradients.grad(step)).lower(x)
    # The backward of each host region is a host region of its own, in cluster C.uid.
    assert set(jd.gradients.clusters(backward)) >= {"0.uid", "1.uid"}
    assert {"0.uid:0", "0.uid:1", "1.uid:0", "1.uid:1"} <= set(
        jd.tpu.host_compute_core(backward, 2)
    )
    # Inside a steps loop the numbering is per compiled loop, and readable after it ran.
    ctx = strategy.run_steps_on_dataset(lambda ctx, s, x: s + step(x),
                                        iter([np.ones((4, 2), np.float32)] * 2),
                                        iterations=2, initial_loop_values=np.float32(0))
    assert jd.tpu.host_compute_core(ctx.lower(), 2) == ["0:0", "0:1", "1:0", "1:1"]


def test_more_steps_loop_errors():
    strategy = jd.MirroredStrategy()
    w = np.float32(0)
    mixed = iter([(np.ones((8, 1)), np.ones((8, 1))), np.ones((8, 1))])
    with pytest.raises(ValueError,
                       match=r"batch 1 has structure .* batch 0 has .*batches must agree"):
        strategy.run_steps_on_dataset(lambda ctx, w, *x: w, mixed, iterations=2,
                                      initial_loop_values=w)
    with pytest.raises(ValueError, match=r"a batch leaf is a scalar"):
        strategy.run_steps_on_dataset(lambda ctx, w, x: w, iter([np.float32(1)]), iterations=1,
                                      initial_loop_values=w)

    def bad_name(ctx, w, x):
        ctx.set_last_step_output(3, x.sum())
        return w

    with pytest.raises(ValueError, match=r"name=3 must be a string"):
        strategy.run_steps_on_dataset(bad_name, iter([np.ones((8, 1))]), iterations=1,
                                      initial_loop_values=w)


def test_outside_compilation_global_view_roles_are_declared_or_carried():
    """In a global-view step a region splits the step's own batch arguments; a value computed in the
    step is split only when declared (batch_argnums), never because of its shape."""
    strategy = jd.MirroredStrategy()
    x_host = np.arange(32, dtype=np.float32).reshape(16, 2)
    x = strategy.experimental_distribute_values(x_host)
    rows = lambda v: jnp.full((v.shape[0], 1), v.shape[0], jnp.float32)  # noqa: E731 - rows each call sees

    with pytest.raises(ValueError,
                                         match=r"args\[0\], an array of shape \(16, 2\) computed "
                                               r"inside the step.*"
                                         r"batch_argnums=\(i, \.\.\.\)"):
        strategy.jit(lambda x: oc(rows, x * 2.0))(x)
    split = strategy.jit(lambda x: oc(rows, x * 2.0, batch_argnums=0))(x)
    np.testing.assert_array_equal(split, np.full((16, 1), 2.0))  # 8 calls on 2 rows each
    whole = strategy.jit(lambda x: oc(rows, x * 2.0, batch_argnums=()))(x)
    # 8 calls on all 16 rows, concatenated
    np.testing.assert_array_equal(whole, np.full((8 * 16, 1), 16.0))
    carried = strategy.jit(lambda x: oc(rows, x))(x)  # the step's own batch argument: split
    np.testing.assert_array_equal(carried, np.full((16, 1), 2.0))
    with pytest.raises(ValueError, match=r"batch_argnums=\(3,\) names positions \[3\]"):
        strategy.jit(lambda x: oc(rows, x, batch_argnums=3))(x)
    with pytest.raises(ValueError,
                       match=r"num_replicas_in_sync=8 does not divide the rows of a batch_argnums"):
        strategy.jit(lambda x: oc(rows, x[:4] * 1.0, batch_argnums=0))(x)


def test_outside_compilation_batch_argnums_naming_a_scalar_is_an_error():
    strategy = jd.MirroredStrategy()
    x = strategy.experimental_distribute_values(np.ones((16, 2), np.float32))
    with pytest.raises(ValueError, match=r"batch_argnums names a scalar: a batch needs an axis 0"):
        strategy.jit(lambda x: oc(lambda a, b: a * b, x, x.sum(), batch_argnums=(0, 1)))(x)
