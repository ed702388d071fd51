"""Porting pmap-era code: a step written for ``jax.pmap(step, axis_name="batch")`` runs unmodified
under ``strategy.run(step, ..., axis_name="batch")`` and computes what pmap computes on the same
per-device batches.

The step is shaped like Flax's ImageNet example: a small ResNet-style conv net whose BatchNorm
averages its batch statistics across replicas (``axis_name="batch"``), ``mutable=["batch_stats"]``,
gradients and batch statistics averaged with ``lax.pmean``, a flax ``TrainState``. fp32, rtol 1e-5.
"""

import contextlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax import lax

import jaxdist as jd

DEVICES = 8
PER_DEVICE = 4
STEPS = 2


class ResidualBlock(nn.Module):
    features: int
    train: bool

    @nn.compact
    def __call__(self, x):
        norm = lambda: nn.BatchNorm(use_running_average=not self.train, momentum=0.9, axis_name="batch")  # noqa: E731
        y = nn.relu(norm()(nn.Conv(self.features, (3, 3), use_bias=False)(x)))
        y = norm()(nn.Conv(self.features, (3, 3), use_bias=False)(y))
        if x.shape[-1] != self.features:
            x = norm()(nn.Conv(self.features, (1, 1), use_bias=False)(x))
        return nn.relu(x + y)


class TinyResNet(nn.Module):
    num_classes: int = 4
    train: bool = True

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not self.train, momentum=0.9,
                                 axis_name="batch")(x))
        x = ResidualBlock(4, self.train)(x)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = ResidualBlock(8, self.train)(x)
        return nn.Dense(self.num_classes)(x.mean(axis=(1, 2)))


class TrainState(train_state.TrainState):
    batch_stats: Any


def create_state(rng):
    model = TinyResNet()
    # flax turns axis_name off while initializing
    variables = model.init(rng, jnp.ones((1, 8, 8, 3)))
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=optax.sgd(0.1, momentum=0.9),
    )


def train_step(state, batch):
    """A pmap-era step: it names the device axis "batch" and all-reduces explicitly (untouched by
    the port)."""

    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, batch["image"],
            mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, new_model_state

    (loss, new_model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grads = lax.pmean(grads, axis_name="batch")
    new_state = state.apply_gradients(
        grads=grads, batch_stats=lax.pmean(new_model_state["batch_stats"], axis_name="batch")
    )
    metrics = {"loss": lax.pmean(loss, axis_name="batch"), "replica": lax.axis_index("batch")}
    return new_state, metrics


def per_device_batches():
    """STEPS batches of shape (DEVICES, PER_DEVICE, ...): what a pmap input pipeline feeds."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        image = rng.normal(size=(DEVICES, PER_DEVICE, 8, 8, 3)).astype(np.float32)
        label = rng.integers(0, 4, size=(DEVICES, PER_DEVICE)).astype(np.int32)
        out.append({"image": image, "label": label})
    return out


def global_batch(batch):
    """The same examples as one global batch: the per-device batches concatenated, in device
    order."""
    return jax.tree.map(lambda x: x.reshape((-1, *x.shape[2:])), batch)


def _first(strategy, tree):
    """Replica 0's copy of every leaf: mirrored arrays and `PerReplica` values alike."""
    return jax.tree.map(
        lambda x: np.asarray(strategy.experimental_local_results(x)[0]),
        tree,
        is_leaf=lambda x: isinstance(x, jd.PerReplica),
    )


def _assert_close(got, want):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                            strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="session")
def pmap_reference():
    """jax.pmap over the 8 devices: the state replicated with a leading device axis."""
    if len(jax.devices()) < DEVICES:
        pytest.skip(f"needs {DEVICES} devices")
    state = create_state(jax.random.key(0))
    replicated = jax.tree.map(lambda x: jnp.stack([x] * DEVICES), state)
    step = jax.pmap(train_step, axis_name="batch")
    losses = []
    for batch in per_device_batches():
        replicated, metrics = step(replicated, batch)
        np.testing.assert_array_equal(metrics["replica"], np.arange(DEVICES))
        losses.append(float(metrics["loss"][0]))
    # pmean'd gradients and statistics keep the replicas identical: any device's copy is the result
    for leaf in jax.tree.leaves((replicated.params, replicated.batch_stats)):
        np.testing.assert_allclose(leaf, jnp.broadcast_to(leaf[0], leaf.shape), rtol=1e-6)
    return jax.tree.map(lambda x: x[0], replicated), losses


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pmap_reference_trains(pmap_reference):
    """The reference itself: the loss is finite and the batch statistics moved off their initial
    values."""
    state, losses = pmap_reference
    assert np.all(np.isfinite(losses)) and len(losses) == STEPS
    initial = create_state(jax.random.key(0))
    pairs = zip(jax.tree.leaves(state.batch_stats), jax.tree.leaves(initial.batch_stats),
                strict=True)
    assert not any(np.allclose(a, b) for a, b in pairs)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("make_strategy", [jd.MirroredStrategy, jd.TPUStrategy],
                         ids=["mirrored", "tpu"])
def test_unmodified_pmap_step_under_run_equals_pmap(make_strategy, pmap_reference):
    """strategy.run(train_step, ..., axis_name="batch"): the pmap step, unmodified, gives pmap's
    losses, params, batch statistics and optimizer state after STEPS steps; each replica sees its
    own rows of the global batch (axis_index("batch") is the replica id), and the pmean'd loss comes
    back mirrored."""
    strategy = make_strategy()
    assert strategy.num_replicas_in_sync == DEVICES
    want_state, want_losses = pmap_reference
    state = strategy.mirror(create_state(jax.random.key(0)))
    losses = []
    for batch in per_device_batches():
        state, metrics = strategy.run(
            train_step, args=(state, global_batch(batch)), batch_argnums=(1,), axis_name="batch"
        )
        # invariant by type (a pmean): mirrored; the replica id varies: PerReplica
        assert isinstance(metrics["loss"],
                          jax.Array) and metrics["loss"].sharding.is_fully_replicated
        assert isinstance(metrics["replica"], jd.PerReplica)
        np.testing.assert_array_equal(
            [int(r) for r in strategy.experimental_local_results(metrics["replica"])],
            np.arange(DEVICES)
        )
        losses.append(float(metrics["loss"]))
        # The new state is computed from each replica's own copy of the mirrored state
        # (tf.distribute semantics), so by type it varies and comes back PerReplica, though the
        # pmeans make the copies equal.
        for leaf in jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, jd.PerReplica)):
            copies = [np.asarray(c) for c in strategy.experimental_local_results(leaf)]
            for c in copies[1:]:
                np.testing.assert_allclose(c, copies[0], rtol=1e-6)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    got = _first(strategy, state)
    _assert_close(got.params, want_state.params)
    _assert_close(got.batch_stats, want_state.batch_stats)
    _assert_close(got.opt_state, want_state.opt_state)
    assert int(got.step) == STEPS


@pytest.mark.timeout(120)
def test_axis_name_also_works_with_replica_context():
    """Inside run(axis_name=...) jaxdist's own collectives still work: the user's name and ctx
    agree."""
    strategy = jd.MirroredStrategy()

    def fn(x):
        ctx = jd.get_replica_context()
        return lax.psum(x, "batch"), ctx.all_reduce(jd.ReduceOp.SUM,
                                                    x), ctx.replica_id_in_sync_group

    x = np.arange(DEVICES, dtype=np.float32)
    by_name, by_ctx, replica_id = strategy.run(fn, args=(x,), batch_argnums=(0,), axis_name="batch")
    np.testing.assert_allclose(np.asarray(by_name), [x.sum()])
    np.testing.assert_allclose(np.asarray(by_ctx), [x.sum()])
    assert [int(r) for r in strategy.experimental_local_results(replica_id)] == list(range(DEVICES))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "collective",
    [
        lambda x: lax.pmean(x, "batch"),  # JAX itself raises a bare AssertionError here (jax 0.12)
        lambda x: lax.psum(x, axis_name="batch"),
        lambda x: x + lax.axis_index("batch"),  # JAX: NameError
        lambda x: lax.all_gather(x, "batch"),
    ],
    ids=["pmean", "psum", "axis_index", "all_gather"],
)
def test_unbound_axis_name_is_a_value_error_naming_the_fix(collective):
    """A pmap-era step run without axis_name=: a ValueError that names the axis and the fix."""
    strategy = jd.MirroredStrategy()
    x = np.ones((DEVICES, 2), np.float32)
    with pytest.raises(ValueError,
                       match=r"not bound here.*mesh axes \('replica',\), the replicas under "
                       r"'replica'.*axis_name=<that name>") as raised:
        strategy.run(collective, args=(x,), batch_argnums=(0,))
    _assert_names_the_axis(raised.value, "batch")
    # a different name than the step uses: the same error, naming the bound one
    with pytest.raises(ValueError,
                       match=r"mesh axes \('devices',\), the replicas under 'devices'") as raised:
        strategy.run(collective, args=(x,), batch_argnums=(0,), axis_name="devices")
    _assert_names_the_axis(raised.value, "batch")


def _assert_names_the_axis(error, axis):
    """jaxdist's error is raised from JAX's, which names the axis the step used (jaxdist never reads
    it)."""
    assert isinstance(error.__cause__, NameError), error.__cause__
    assert axis in str(error.__cause__)


@pytest.mark.timeout(300)
def test_unbound_axis_in_flax_batchnorm_step():
    """The whole pmap step (BatchNorm(axis_name="batch") is the first collective it reaches) without
    axis_name=: the same ValueError."""
    strategy = jd.MirroredStrategy()
    state = strategy.mirror(create_state(jax.random.key(0)))
    batch = global_batch(per_device_batches()[0])
    with pytest.raises(ValueError,
                       match=r"strategy.run\(train_step\).*not bound here.*axis_name=") as raised:
        strategy.run(train_step, args=(state, batch), batch_argnums=(1,))
    _assert_names_the_axis(raised.value, "batch")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["", 3, ("batch", "x")])
def test_axis_name_must_be_a_name(bad):
    strategy = jd.MirroredStrategy()
    with pytest.raises((TypeError, ValueError), match="axis_name"):
        strategy.run(lambda x: x, args=(np.ones(DEVICES),), batch_argnums=(0,), axis_name=bad)


@pytest.mark.timeout(60)
def test_other_assertion_errors_pass_through():
    """Only JAX's unbound-axis errors become the ValueError: the replica function's own assert is
    untouched."""
    strategy = jd.MirroredStrategy()

    def fn(x):
        assert x.shape[0] == 2, "the step's own check"
        return lax.pmean(x, "batch")

    with pytest.raises(AssertionError, match="the step's own check"):
        strategy.run(fn, args=(np.ones(DEVICES),), batch_argnums=(0,), axis_name="batch")


@pytest.mark.timeout(60)
def test_the_step_own_name_and_value_errors_pass_through():
    """A NameError of the step's own (an undefined variable) or its ValueError is not an unbound
    axis."""
    strategy = jd.MirroredStrategy()

    def undefined(x):
        return lax.pmean(x, "batch") + not_defined_anywhere  # noqa: F821

    with pytest.raises(NameError, match="not_defined_anywhere"):
        strategy.run(undefined, args=(np.ones(DEVICES),), batch_argnums=(0,), axis_name="batch")

    def own_value_error(x):
        raise ValueError("the step's own value check")

    with pytest.raises(ValueError) as raised:
        strategy.run(own_value_error, args=(np.ones(DEVICES),), batch_argnums=(0,))
    assert str(raised.value) == "the step's own value check"


@pytest.mark.timeout(60)
def test_an_unbound_name_among_several_is_the_same_error():
    """JAX 0.12 fails pmean over ("replica", "batch") with a ValueError of its value-type check: the
    same jaxdist error."""
    strategy = jd.MirroredStrategy()
    with pytest.raises(ValueError, match=r"not bound here.*axis_name=<that name>") as raised:
        strategy.run(lambda x: lax.pmean(x, ("replica", "batch")), args=(np.ones(DEVICES),),
                     batch_argnums=(0,))
    _assert_names_the_axis(raised.value, "batch")


@pytest.mark.timeout(120)
def test_strategy_axis_name_binds_every_run_and_synchronizers_follow_it():
    strategy = jd.MirroredStrategy(axis_name="batch")
    assert strategy.axis_name == "batch"
    x = strategy.experimental_distribute_values(np.arange(16.0, dtype=np.float32))
    sync = jd.gradients.AllReduceSynchronizer(jd.gradients.CastCompressor(jnp.bfloat16))

    def replica_fn(x):
        ctx = jd.get_replica_context()
        reduced, _ = sync.all_reduce(x, sync.init(x))  # no axis named: the run's binding
        return lax.psum(x.sum(),
                        "batch"), reduced, ctx.axis_name == "batch", jd.gradients.replica_count()

    total, reduced, named, count = strategy.run(replica_fn, args=(x,))
    assert float(total) == float(np.arange(16.0).sum()) and bool(named) and int(count) == 8
    np.testing.assert_allclose(reduced, np.arange(16.0).reshape(8, 2).mean(0), rtol=1e-2)
    # A per-call axis_name overrides the strategy's; another mesh axis's name is refused.
    ids = strategy.run(lambda: lax.axis_index("data"), axis_name="data")
    assert [int(i) for i in strategy.experimental_local_results(ids)] == list(range(8))
    with pytest.raises(ValueError, match=r"axis_name='model' is already the name of another axis"):
        jd.ShardedStrategy(model_parallelism=2, axis_name="model")


@pytest.mark.timeout(120)
def test_renamed_axis_on_a_model_parallel_mesh_inside_scope_and_host_regions():
    strategy = jd.ShardedStrategy(model_parallelism=2, axis_name="batch")
    rid = lambda: jd.get_replica_context().replica_id_in_sync_group  # noqa: E731
    for ctx in (contextlib.nullcontext(), strategy.scope()):
        with ctx:
            ids = strategy.run(rid)
        assert [int(i) for i in strategy.experimental_local_results(ids)] == [0, 1, 2, 3]
    x = strategy.experimental_distribute_values(np.ones((8, 2), np.float32))
    unsupported = r"outside_compilation inside strategy.run\(\.\.\., axis_name='batch'\)"
    with pytest.raises(NotImplementedError, match=unsupported):
        strategy.run(lambda x: jd.tpu.outside_compilation(jnp.sin, x), args=(x,))


@pytest.mark.timeout(120)
def test_renamed_axis_index_in_a_compiled_step_on_a_model_parallel_mesh():
    strategy = jd.ShardedStrategy(model_parallelism=2, axis_name="batch")
    x = strategy.experimental_distribute_values(np.ones((8, 2), np.float32))
    step = strategy.jit(lambda x: strategy.run(lambda v: lax.axis_index("batch") + v.sum(),
                                               args=(x,)))
    ids = step(x)
    # id + its 2x2 ones
    assert [int(i) for i in strategy.experimental_local_results(ids)] == [4, 5, 6, 7]


class _DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dropout(0.3, deterministic=not train)(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(3)(x)


def _dropout_step(state, batch, dropout_rng):
    """Shaped like Flax's WMT pmap step: a per-device dropout key folded with the step, pmean'd
    gradients."""
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"], rngs={"dropout": dropout_rng})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = lax.pmean(grads, "batch")
    return state.apply_gradients(grads=grads), {"loss": lax.pmean(loss, "batch")}


@pytest.mark.timeout(120)
def test_a_pmap_step_with_per_device_dropout_keys_equals_pmap_bit_for_bit():
    """Closed-over constants in the step (Flax's module code holds some), a per-device key as a
    batch argument: run(..., axis_name="batch") runs pmap's program, so the parameters equal pmap's
    exactly, and come back mirrored (proven: updated with pmean'd gradients)."""
    strategy = jd.MirroredStrategy()
    rng = np.random.default_rng(0)
    model = _DropoutMLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 5)), train=False)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    keys = jax.random.split(jax.random.key(1), DEVICES)
    pmapped = jax.pmap(_dropout_step, axis_name="batch")
    theirs = jax.tree.map(lambda x: jnp.stack([x] * DEVICES), state)
    ours = strategy.mirror(state)
    per_device = strategy.experimental_distribute_values_from_function(
        lambda ctx: keys[ctx.replica_id_in_sync_group]
    )
    for _ in range(STEPS):
        batch = {"x": rng.normal(size=(DEVICES, PER_DEVICE, 5)).astype(np.float32),
                 "y": rng.integers(0, 3, size=(DEVICES, PER_DEVICE)).astype(np.int32)}
        theirs, want = pmapped(theirs, batch, keys)
        flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batch)
        ours, got = strategy.run(_dropout_step, args=(ours, flat, per_device), batch_argnums=(1,),
                                 axis_name="batch")
        assert float(got["loss"]) == float(want["loss"][0])
    for mine, pm in zip(jax.tree.leaves(ours.params), jax.tree.leaves(theirs.params), strict=True):
        assert isinstance(mine, jax.Array) and mine.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(pm[0]))
