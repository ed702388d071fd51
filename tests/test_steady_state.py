"""A compiled step's steady state: arguments already on the mesh go to jax.jit as they are (no
binding, splitting or placing), and every other call (a batch held whole, host arrays, a new shape,
another precision, weak types, a tracer) computes what the full path computes: the placing rules,
and jax.jit's own cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd
from jaxdist.strategies.compile import StrategyFunction


def counted(strategy, **options):
    traces = []

    def step(w, x):
        traces.append(x.shape)
        return w - 0.1 * (x @ w).mean(), x

    return strategy.jit(step, batch_argnums=1, **options), traces


@pytest.fixture
def mirrored():
    return jd.MirroredStrategy(jax.devices()[:4])


def test_steady_state_calls_skip_the_placing_path(mirrored, monkeypatch):
    step, traces = counted(mirrored)
    w = mirrored.mirror(jnp.eye(3))
    x = next(iter(mirrored.experimental_distribute_dataset([np.ones((8, 3), np.float32)])))
    w, _ = step(w, x)

    def no_python_path(*args, **kwargs):
        raise AssertionError("a steady-state call went through the placing path")

    monkeypatch.setattr(StrategyFunction, "_prepare", no_python_path)
    for _ in range(3):
        w, out = step(w, x)
    assert traces == [(8, 3)]
    assert out.sharding.spec == P("replica")
    expected = np.eye(3, dtype=np.float32)
    for _ in range(4):
        expected = expected - 0.1 * (np.ones((8, 3), np.float32) @ expected).mean()
    np.testing.assert_allclose(w, expected, rtol=1e-6)


def test_a_batch_held_whole_after_steady_state_is_still_split(mirrored):
    step, _ = counted(mirrored)
    w = mirrored.mirror(jnp.eye(3))
    data = np.arange(24, dtype=np.float32).reshape(8, 3)
    split = next(iter(mirrored.experimental_distribute_dataset([data])))
    w, _ = step(w, split)
    whole = jax.device_put(data, NamedSharding(mirrored.mesh, P()))
    w2, out = step(w, whole)
    assert out.sharding.spec == P("replica")  # placed as a batch, not run on the whole copy
    expected = jax.device_get(w) - 0.1 * (data @ jax.device_get(w)).mean()
    np.testing.assert_allclose(w2, expected, rtol=1e-6)


def test_host_arrays_new_shapes_and_tracers_take_the_full_path(mirrored):
    step, traces = counted(mirrored)
    w = mirrored.mirror(jnp.eye(3))
    data = np.ones((8, 3), np.float32)
    w, _ = step(w, data)
    w, out = step(w, data)  # host batch again: placed as a batch
    assert out.sharding.spec == P("replica")
    w, _ = step(w, np.ones((4, 3), np.float32))  # a new shape: a new program
    assert traces == [(8, 3), (4, 3)]
    w, _ = step(w, data)  # back to the first: its program, not a third trace
    assert traces == [(8, 3), (4, 3)]
    nested = jax.jit(lambda w, x: step(w, x)[0])(w, jnp.asarray(data))  # called with tracers
    np.testing.assert_allclose(nested, jax.device_get(w) - 0.1 * (data @ jax.device_get(w)).mean(),
                               rtol=1e-6)


def test_another_precision_is_another_program():
    """jax.jit keys its programs on JAX's trace context (matmul precision, ...): so does the steady
    state."""
    strategy = jd.OneDeviceStrategy()
    traces = []

    def step(a, b):
        traces.append(jax.config.jax_default_matmul_precision)
        return a @ b

    fn = strategy.jit(step, batch_argnums=())
    a = jax.device_put(np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32),
                       strategy.devices[0])
    fn(a, a)
    fn(a, a)
    with jax.default_matmul_precision("highest"):
        fn(a, a)
    assert traces == [None, "highest"]


def test_donated_state_is_consumed_in_steady_state(mirrored):
    step, _ = counted(mirrored, donate_argnums=0)
    w = mirrored.mirror(jnp.eye(3))
    x = next(iter(mirrored.experimental_distribute_dataset([np.ones((8, 3), np.float32)])))
    w1, _ = step(w, x)
    w2, _ = step(w1, x)
    assert w1.is_deleted() and not w2.is_deleted()


def test_weak_types_python_numbers_and_nan_checks_are_jax_jits(mirrored):
    """What jax.jit keys its programs on beyond shapes and layouts still decides: an int8 array plus
    a Python int stays int8 after a call with an int32 array, a weakly typed learning rate keeps a
    bfloat16 update bfloat16, and the NaN check names the failing operation."""
    add = mirrored.jit(lambda x, n: x + n, batch_argnums=())
    x = mirrored.mirror(jnp.full(3, 100, jnp.int8))
    assert add(x, mirrored.mirror(jnp.int32(1))).dtype == jnp.int32
    assert add(x, 100).dtype == jnp.int8
    update = mirrored.jit(lambda w, lr: w - lr * w, batch_argnums=())
    w = mirrored.mirror(jnp.ones(3, jnp.bfloat16))
    assert update(w, mirrored.mirror(jnp.float32(0.5))).dtype == jnp.float32
    assert update(w, mirrored.mirror(0.5)).dtype == jnp.bfloat16
    log = mirrored.jit(lambda w: jnp.log(w).sum(), batch_argnums=())
    log(mirrored.mirror(jnp.ones(3)))
    with jax.debug_nans(True), pytest.raises(FloatingPointError, match="log"):
        log(mirrored.mirror(-jnp.ones(3)))


def test_an_undeclared_host_batch_after_steady_state_still_warns(mirrored):
    step = mirrored.jit(lambda w, x: (x @ w).sum())
    w = mirrored.mirror(jnp.ones(3))
    split = jax.device_put(jnp.ones((8, 3)), NamedSharding(mirrored.mesh, P("replica")))
    step(w, split)
    step(w, split)
    with pytest.warns(jd.UndeclaredBatchWarning, match="batch_argnums"):
        assert float(step(w, np.ones((8, 3), np.float32))) == 24.0


def test_the_program_carries_the_step_functions_name(mirrored):
    # Compile logs and profiles name the program after the user's step, as jax.jit does (not
    # jaxdist's wrapper).
    def train_step(w, x):
        return w - 0.1 * (x @ w).mean()

    lowered = mirrored.jit(train_step, batch_argnums=1).lower(
        np.ones(3, np.float32), np.ones((8, 3), np.float32)
    )
    assert lowered.as_text().startswith("module @jit_train_step "), lowered.as_text()[:80]


# --------------------------------------------------------------------------------- the express path
def _fsdp_explicit():
    return jd.ShardedStrategy(mesh=jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4]),
                              batch_axes="fsdp", fsdp_axes="fsdp", min_shard_size=1)


@pytest.mark.parametrize("make", [
    lambda: jd.OneDeviceStrategy(),
    lambda: jd.MirroredStrategy(jax.devices()[:4]),
    lambda: jd.ShardedStrategy(jax.devices()[:4], min_shard_size=1),
    _fsdp_explicit,
], ids=["one_device", "mirrored", "fsdp", "fsdp_explicit_mesh"])
def test_steady_calls_are_served_by_jaxs_compiled_dispatch(make):
    """Once a signature has been seen, a call never enters JAX's Python path (jax.no_tracing raises
    there), including after the state changed its weak types (a new trace whose first express
    attempt JAX refused)."""
    strategy = make()

    def step(state, batch):
        return jax.tree.map(lambda w: w * 0.5 + batch.mean(), state), batch.sum()

    # weakly typed: the outputs are not
    state = {f"w{i}": jnp.full((8, 4), float(i)) for i in range(3)}
    batch = strategy.experimental_distribute_values(jnp.ones((8, 4)))
    compiled = strategy.jit(step, donate_argnums=0, batch_argnums=1)
    state, _ = compiled(strategy.create_variables(lambda: state), batch)
    for _ in range(2):
        state, _ = compiled(state, batch)
    with jax.no_tracing():
        for _ in range(3):
            state, loss = compiled(state, batch)
    expected = jax.tree.map(lambda i: np.full((8, 4), float(i)), {f"w{i}": i for i in range(3)})
    for _ in range(6):
        expected = jax.tree.map(lambda w: w * 0.5 + 1.0, expected)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), state, expected)
    assert float(loss) == 32.0


def test_host_rows_nested_in_a_batch_after_steady_state_are_split(mirrored):
    """A host array inside a batch argument (not the argument itself) has the argument types of a
    placed batch: it is laid out as the full path places a batch (split), never whole on every
    replica."""

    seen = []

    def step(w, batch):
        x, y = batch
        # at each compile
        jax.debug.inspect_array_sharding(x, callback=lambda s: seen.append(s.spec))
        return w - 0.1 * ((x @ w) * y[:, None]).mean()

    compiled = mirrored.jit(step, batch_argnums=1)
    w = mirrored.mirror(jnp.eye(3))
    x, y = np.arange(24, dtype=np.float32).reshape(8, 3), np.ones(8, np.float32)
    placed = next(iter(mirrored.experimental_distribute_dataset([(x, y)])))
    w = compiled(compiled(w, placed), placed)
    expected = jax.device_get(w) - 0.1 * ((x @ jax.device_get(w)) * y[:, None]).mean()
    w2 = compiled(w, (x, y))  # a tuple of host arrays: the same argument types as the placed batch
    # every program: the rows split
    assert seen and all(spec == P("replica") for spec in seen), seen
    np.testing.assert_allclose(w2, expected, rtol=1e-6)


def test_alternating_signatures_still_compute_and_compile_once_each(mirrored):
    step, traces = counted(mirrored)
    w = mirrored.mirror(jnp.eye(3))
    big, small = np.ones((8, 3), np.float32), np.ones((4, 3), np.float32)
    big, small = (next(iter(mirrored.experimental_distribute_dataset([b]))) for b in (big, small))
    expected = np.eye(3, dtype=np.float32)
    for i in range(40):  # past the refusals after which such calls take the full path only
        w, _ = step(w, big if i % 2 else small)
        expected = expected - 0.1 * ((np.ones((8 if i % 2 else 4, 3)) @ expected).mean())
    assert traces == [(4, 3), (8, 3)]
    np.testing.assert_allclose(w, expected, rtol=1e-5)


# ------------------------------------------------------------------------- strategy.run's fast path
def _replica_step(w, x):
    g = jd.get_replica_context().all_reduce(jd.ReduceOp.MEAN, x.mean())
    return w * 0.5 + g, x.sum()


def test_steady_run_calls_skip_the_classifying_path(mirrored, monkeypatch):
    from jaxdist.strategies.compile import _run
    from jaxdist.strategies.compile._mirror_check import raise_on_disagreement

    w = mirrored.mirror(jnp.ones(3))
    x = mirrored.experimental_distribute_values(jnp.arange(8.0))
    first = mirrored.run(_replica_step, args=(w, x))
    checks = []
    monkeypatch.setattr(_run, "classify",
                        lambda *a, **k: pytest.fail("a steady call classified its arguments"))
    monkeypatch.setattr(_run, "raise_on_disagreement", lambda *a: checks.append(a)
                        or raise_on_disagreement(*a))
    for _ in range(3):
        out, total = mirrored.run(_replica_step, args=(w, x))
    assert not checks  # the on-device check of the mirrored outputs: the first call only
    np.testing.assert_allclose(out, first[0])
    assert out.sharding.is_fully_replicated and isinstance(total, jd.PerReplica)
    np.testing.assert_allclose(total.stacked, [1, 5, 9, 13])  # each replica's rows summed
    mirrored.run(_replica_step, args=(w, x), check_mirrored="every")
    assert len(checks) == 1  # on request, also in steady state


def test_run_calls_after_steady_state_keep_their_checks(mirrored):
    w = mirrored.mirror(jnp.ones(3))
    x = mirrored.experimental_distribute_values(jnp.arange(8.0))
    for _ in range(2):
        mirrored.run(_replica_step, args=(w, x))
    other = jd.MirroredStrategy(jax.devices()[:4])
    per_replica = other.run(lambda v: v * 2,
                            args=(other.experimental_distribute_values(jnp.arange(8.0)),))
    with pytest.raises(ValueError, match="another strategy"):
        mirrored.run(_replica_step, args=(w, per_replica))
    with pytest.raises(ValueError, match="traced arguments"):
        jax.jit(lambda w, x: mirrored.run(_replica_step, args=(w, x)))(w, x)
    # a declared batch the replicas do not divide
    with pytest.raises(ValueError, match="batch_argnums"):
        mirrored.run(_replica_step, args=(w, jnp.arange(6.0)), batch_argnums=1)
    # A host batch and another precision: placed, another program; the same results as placed
    # arrays.
    _, total = mirrored.run(_replica_step, args=(np.ones(3, np.float32),
                                                 np.arange(8.0, dtype=np.float32)),
                              batch_argnums=1)
    np.testing.assert_allclose(total.stacked, [1, 5, 9, 13])
    out16, _ = mirrored.run(_replica_step, args=(w.astype(jnp.bfloat16), x.astype(jnp.bfloat16)))
    assert out16.dtype == jnp.bfloat16


def test_steady_run_calls_with_per_replica_values(mirrored, monkeypatch):
    from jaxdist.strategies.compile import _run

    def plus_one(v):
        return v + 1

    values = mirrored.experimental_distribute_values(jnp.arange(8.0))
    per_replica = mirrored.run(lambda v: v * 2, args=(values,))
    mirrored.run(plus_one, args=(per_replica,))
    monkeypatch.setattr(_run, "classify",
                        lambda *a, **k: pytest.fail("a steady call classified its arguments"))
    for _ in range(3):
        again = mirrored.run(plus_one, args=(per_replica,))
    assert isinstance(again, jd.PerReplica) and again.owner is mirrored
    np.testing.assert_allclose(again.stacked, (np.arange(8.0) * 2 + 1).reshape(4, 2))
