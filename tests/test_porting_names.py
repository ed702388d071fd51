"""tf.distribute's porting names: compute_average_loss, scale_regularization_loss and per-replica
values from a function (ValueContext), in the per-replica view (`run`) and the global view
(`jit`)."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from registry import make

import jaxdist as jd

FEATURES, BATCH, L2 = 3, 32, 1e-2


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    y = rng.normal(size=(BATCH,)).astype(np.float32)
    weight = rng.uniform(0.0, 2.0, size=(BATCH,)).astype(np.float32)
    params = {"w": rng.normal(size=(FEATURES,)).astype(np.float32), "b": np.float32(0.1)}
    return params, x, y, weight


def _per_example(params, x, y):
    return (jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2


def _l2(params):
    return L2 * jnp.sum(params["w"] ** 2)


def _one_device(params, x, y, weight=None):
    """The reference: one device, the whole batch, plain means (no jaxdist)."""

    def loss(p):
        per_example = _per_example(p, x, y)
        data = jnp.mean(per_example) if weight is None else jnp.sum(per_example * weight) / len(x)
        return data + _l2(p)

    return jax.value_and_grad(loss)(params)


def _tf_style_replica_step(params, x, y, weight=None):
    """The tf.distribute custom-training-loop step: per-replica average loss, all-reduce SUM."""
    ctx = jd.get_replica_context()

    def loss(p):
        data = jd.compute_average_loss(_per_example(p, x, y), sample_weight=weight)
        return data + jd.scale_regularization_loss(_l2(p))

    value, grads = jax.value_and_grad(loss)(params)
    return ctx.all_reduce(jd.ReduceOp.SUM, value), ctx.all_reduce(jd.ReduceOp.SUM, grads)


def _assert_close(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                                         atol=1e-6),
                 got, want)


# ----------------------------------------------------------------------------- the per-replica view
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy_name", ["mirrored_8", "sharded_4x2"])
@pytest.mark.parametrize("weighted", [False, True])
def test_tf_style_step_in_run_equals_one_device(strategy_name, weighted):
    strategy = make(strategy_name)
    params, x, y, weight = _data()
    args = (x, y, weight) if weighted else (x, y)
    with strategy.scope():
        batches = tuple(range(1, 1 + len(args)))
        got = strategy.run(_tf_style_replica_step, args=(strategy.mirror(params), *args),
                           batch_argnums=batches)
    _assert_close(got, _one_device(params, x, y, weight if weighted else None))


@pytest.mark.timeout(120)
def test_default_global_batch_in_run_is_rows_times_replicas():
    strategy = make("mirrored_8")
    x = np.arange(BATCH, dtype=np.float32)

    def fn(x):
        ctx = jd.get_replica_context()
        default = jd.compute_average_loss(x)
        explicit = jd.compute_average_loss(x, global_batch_size=BATCH)
        halved = jd.compute_average_loss(x, global_batch_size=2 * BATCH)
        return [ctx.all_reduce("sum", v) for v in (default, explicit,
                                                   halved)], jd.scale_regularization_loss(8.0)

    (default, explicit, halved), scaled = strategy.run(fn, args=(x,), batch_argnums=0)
    assert float(default) == float(explicit) == pytest.approx(x.mean())
    assert float(halved) == pytest.approx(x.mean() / 2)
    assert float(scaled) == 1.0  # 8.0 / 8 replicas


# ---------------------------------------------------------------------------------- the global view
@pytest.mark.timeout(120)
@pytest.mark.parametrize("in_scope", [False, True])
def test_global_view_step_equals_one_device(in_scope):
    strategy = make("mirrored_8")
    params, x, y, weight = _data()

    # a global-view step: it sees the whole batch, nothing is divided by 8
    def step(params, x, y, weight):
        def loss(p):
            data = jd.compute_average_loss(_per_example(p, x, y), sample_weight=weight)
            return data + jd.scale_regularization_loss(_l2(p))

        return jax.value_and_grad(loss)(params)

    compiled = strategy.jit(step, batch_argnums=(1, 2, 3))
    if in_scope:
        with strategy.scope():
            got = compiled(strategy.mirror(params), x, y, weight)
    else:
        got = compiled(strategy.mirror(params), x, y, weight)
    _assert_close(got, _one_device(params, x, y, weight))


def test_outside_any_strategy_and_in_cross_replica_context_it_is_the_plain_mean():
    loss = jnp.array([1.0, 2.0, 3.0, 6.0])
    assert float(jd.compute_average_loss(loss)) == 3.0
    assert float(jd.scale_regularization_loss(jnp.float32(5.0))) == 5.0
    with make("mirrored_8").scope():  # cross-replica code sees global values: nothing to rescale
        assert float(jd.compute_average_loss(loss)) == 3.0
        assert float(jd.scale_regularization_loss(jnp.float32(5.0))) == 5.0


def test_sample_weight_shapes_follow_tf():
    loss = jnp.arange(8.0).reshape(4, 2)  # (batch, time): summed over time, averaged over the batch
    per_example = jnp.array([1.0, 0.0, 2.0, 1.0])
    want = float(jnp.sum(loss * per_example[:, None]) / 4)
    # (batch,) -> (batch, 1)
    assert float(jd.compute_average_loss(loss, sample_weight=per_example)) == want
    assert float(jd.compute_average_loss(loss, sample_weight=per_example[:, None])) == want
    column = jnp.array([1.0, 2.0, 3.0])
    assert float(jd.compute_average_loss(column, sample_weight=column[:, None])) == float(
        jnp.sum(column**2) / 3
    )
    assert float(jd.compute_average_loss(column,
                                         sample_weight=2.0)) == float(2 * jnp.sum(column) / 3)


def test_dtype_is_the_losses():
    loss = jnp.ones((4,), jnp.bfloat16)
    assert (jd.compute_average_loss(loss, sample_weight=jnp.ones((4,), jnp.float32)).dtype
            == jnp.bfloat16)
    assert jd.compute_average_loss(loss).dtype == jnp.bfloat16


def test_regularization_loss_pytree_is_summed():
    terms = {"a": jnp.float32(1.0), "b": [jnp.array([2.0, 3.0])]}
    assert float(jd.scale_regularization_loss(terms)) == 6.0


# -------------------------------------------------------------------------------------- loss errors
def test_scalar_per_example_loss_is_an_error():
    with pytest.raises(ValueError, match=r"per_example_loss has shape \(\) .*without \.mean\(\)"):
        jd.compute_average_loss(jnp.float32(1.0))


@pytest.mark.parametrize(("bad", "message"), [
    (0, "global_batch_size=0 must be positive"),
    (-4, "global_batch_size=-4 must be positive"),
    (2.5, r"global_batch_size=2.5 \(type float\) must be a positive Python int"),
    (True, r"global_batch_size=True \(type bool\) must be a positive Python int"),
    ("32", r"global_batch_size='32' \(type str\) must be a positive Python int"),
])
def test_bad_global_batch_size_is_an_error(bad, message):
    with pytest.raises(ValueError, match=message):
        jd.compute_average_loss(jnp.ones(4), global_batch_size=bad)


def test_sample_weights_passed_as_global_batch_size_say_so():
    # tf.nn's positional order is (loss, sample_weight, global_batch_size): a port passing weights
    # second
    with pytest.raises(ValueError,
                       match=r"global_batch_size=.*must be a positive Python "
                             r"int.*sample_weight=\.\.\."):
        jd.compute_average_loss(jnp.ones(4), jnp.ones(4))


def test_traced_global_batch_size_is_an_error():
    with pytest.raises(ValueError, match=r"global_batch_size=.*must be a positive Python int"):
        jax.jit(lambda n: jd.compute_average_loss(jnp.ones(4), global_batch_size=n))(4)


def test_sample_weight_that_does_not_broadcast_is_an_error():
    with pytest.raises(
        ValueError, match=r"sample_weight has shape \(3,\).*shape \(4,\).*one weight per example"
    ):
        jd.compute_average_loss(jnp.ones(4), sample_weight=jnp.ones(3))
    # would grow the loss
    with pytest.raises(ValueError, match=r"sample_weight has shape \(4, 5\).*\(4, 2\)"):
        jd.compute_average_loss(jnp.ones((4, 2)), sample_weight=jnp.ones((4, 5)))


def test_empty_regularization_loss_is_an_error():
    with pytest.raises(ValueError, match=r"regularization_loss=\[\] holds no array"):
        jd.scale_regularization_loss([])


# ------------------------------------------------------------- values from a function, ValueContext
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy_name", ["one_device", "mirrored_8", "sharded_4x2"])
def test_each_replica_gets_its_own_value(strategy_name):
    strategy = make(strategy_name)
    n = strategy.num_replicas_in_sync
    seen = []

    def value_fn(ctx):
        seen.append(ctx)
        return {"scaled": jnp.float32(10 * ctx.replica_id_in_sync_group),
                "n": ctx.num_replicas_in_sync}

    values = strategy.experimental_distribute_values_from_function(value_fn)
    assert seen == [jd.ValueContext(i, n) for i in range(n)]  # once per (local) replica, in order
    assert isinstance(values["scaled"], jd.PerReplica) and isinstance(values["n"], jd.PerReplica)
    got, ids = strategy.run(lambda v: (v, jd.get_replica_context().replica_id_in_sync_group),
                            args=(values,))
    ids = [int(i) for i in strategy.experimental_local_results(ids)]
    assert ids == list(range(n))
    assert [float(v["scaled"]) for v in strategy.experimental_local_results(got)] == [
        10.0 * i for i in ids
    ]
    assert [int(v["n"]) for v in strategy.experimental_local_results(values)] == [n] * n


@pytest.mark.timeout(120)
def test_per_replica_dropout_keys():
    strategy = make("mirrored_8")
    key = jax.random.key(42)
    keys = strategy.experimental_distribute_values_from_function(
        lambda ctx: jax.random.fold_in(key, ctx.replica_id_in_sync_group)
    )
    x = np.ones((16, 4), np.float32)

    def dropout(key, x):  # each replica drops with its own key
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.where(keep, x / 0.5, 0.0)

    out = strategy.run(dropout, args=(keys, x), batch_argnums=(1,))
    want = np.concatenate([dropout(jax.random.fold_in(key, i), x[2 * i : 2 * i + 2])
                           for i in range(8)])
    np.testing.assert_array_equal(np.asarray(out.stacked).reshape(16, 4), want)
    masks = [np.asarray(v) for v in strategy.experimental_local_results(out)]
    assert any(not np.array_equal(masks[0], m) for m in masks[1:])  # the replicas' keys differ


@pytest.mark.timeout(120)
def test_per_replica_values_into_run_inside_jit():
    strategy = make("mirrored_8")
    offsets = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group)
    )

    def step(offsets, x):
        def replica_fn(offset, x):
            return jd.get_replica_context().all_reduce("sum", jnp.sum(x) + offset)

        return strategy.run(replica_fn, args=(offsets, x))

    x = np.ones((16,), np.float32)
    assert float(strategy.jit(step, batch_argnums=1)(offsets, x)) == 16.0 + sum(range(8))


def test_value_context_fields_and_validation():
    ctx = jd.ValueContext(replica_id_in_sync_group=2, num_replicas_in_sync=4)
    assert (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync) == (2, 4)
    assert jd.ValueContext() == jd.ValueContext(0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.replica_id_in_sync_group = 3
    with pytest.raises(ValueError, match=r"num_replicas_in_sync=0 must be >= 1"):
        jd.ValueContext(0, 0)
    with pytest.raises(ValueError, match=r"replica_id_in_sync_group=4 must be in \[0, 4\)"):
        jd.ValueContext(4, 4)
    with pytest.raises(ValueError, match=r"replica_id_in_sync_group=-1 must be in \[0, 2\)"):
        jd.ValueContext(-1, 2)


# ------------------------------------------------------------------- values from a function: errors
def test_value_fn_not_callable_is_an_error():
    with pytest.raises(TypeError,
                       match=r"value_fn=3 is not callable: pass a function of a jd.ValueContext"):
        make("mirrored_8").experimental_distribute_values_from_function(3)


def test_values_from_function_inside_run_is_an_error():
    strategy = make("mirrored_8")

    def fn():
        return strategy.experimental_distribute_values_from_function(lambda ctx: 1.0)

    with pytest.raises(RuntimeError,
                       match=r"called inside a replica function.*call it before strategy.run"):
        strategy.run(fn)


def test_traced_value_is_an_error():
    strategy = make("mirrored_8")
    with pytest.raises(ValueError,
                       match=r"traced value for replica 0 at the root.*outside jax.jit"):
        jax.jit(lambda k: strategy.experimental_distribute_values_from_function(lambda ctx: k + 1))(
            1.0
        )


def test_replicas_that_disagree_are_an_error():
    strategy = make("mirrored_8")
    with pytest.raises(
        ValueError, match=r"for replica 1 but .* for replica 0: every replica's value must have"
    ):
        strategy.experimental_distribute_values_from_function(
            lambda ctx: [0.0] * (ctx.replica_id_in_sync_group + 1)
        )
    with pytest.raises(
        ValueError, match=r"float32\[2\] for replica 3 at \['a'\] but float32\[1\] for replica 0"
    ):
        strategy.experimental_distribute_values_from_function(
            lambda ctx: {"a": np.zeros(1 + (ctx.replica_id_in_sync_group == 3), np.float32)}
        )
    with pytest.raises(ValueError,
                       match=r"int32\[\] for replica 1 at the root but float32\[\] for replica 0"):
        strategy.experimental_distribute_values_from_function(
            lambda ctx: np.int32(1) if ctx.replica_id_in_sync_group else np.float32(0)
        )


def test_non_numeric_value_is_an_error():
    with pytest.raises(
        TypeError, match=r"value_fn returned 'a' \(type str\) for replica 0 at \[0\]: each leaf"
    ):
        make("mirrored_8").experimental_distribute_values_from_function(lambda ctx: ["a"])


def test_process_without_replicas_is_an_error():
    from jaxdist.strategies.replica_context import distribute_values_from_function

    # A policy over other processes' devices only (possible in a multi-process job): its local
    # replicas are none.
    policy = types.SimpleNamespace(num_replicas=4, local_replicas=(),
                                   mesh=types.SimpleNamespace(shape={"replica": 4}))
    with pytest.raises(ValueError, match=r"holds none of the 4 replicas .*include this process's"):
        distribute_values_from_function(policy, None, lambda ctx: 1.0)
