"""`strategy.run` runs what `jax.pmap` runs: the varying-type check relaxed where only it refuses a
function.

The pmap-era shape: a whole training run is one function (a ``lax.scan`` over updates whose carry
starts as constants: parameters, counters), vmapped over seeds, the seeds split over the replicas.
Inside ``shard_map`` JAX's varying-type check refuses the scan (its carry comes out varying);
``jax.pmap`` runs it. ``run`` runs it as ``pmap`` does, with a one-time note; ``check_vma=True``
keeps the check, ``check_vma=False`` asks for it off.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxdist as jd

pytestmark = pytest.mark.timeout(300)

SEEDS, UPDATES = 16, 6


def make_train(updates):
    """A whole run: parameters and counters start as constants inside it, the scan carries them."""

    def train(rng):
        def update(carry, _):
            params, visits, rng = carry
            rng, key = jax.random.split(rng)
            obs = jax.random.normal(key, (8, 4))
            loss, grad = jax.value_and_grad(lambda p: jnp.mean((obs @ p - 1.0) ** 2))(params)
            visits = visits + (obs[:4, 0] > 0).astype(jnp.int32)
            return (params - 0.1 * grad, visits, rng), loss

        carry = (jnp.zeros(4), jnp.zeros(4, jnp.int32), rng)
        (params, visits, _), losses = lax.scan(update, carry, None, updates)
        return {"params": params, "visits": visits, "losses": losses}

    return train


def _stacked(tree):
    assert all(isinstance(v, jd.PerReplica)
               for v in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, jd.PerReplica)))
    return jax.tree.map(
        lambda v: np.asarray(v.stacked), tree, is_leaf=lambda v: isinstance(v, jd.PerReplica)
    )


@pytest.fixture(scope="module")
def strategy():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    return jd.MirroredStrategy(devices=jax.devices()[:8])


def test_whole_run_vmapped_over_seeds_equals_pmap(strategy, caplog):
    train = jax.vmap(make_train(UPDATES))
    rngs = jax.random.split(jax.random.PRNGKey(0), SEEDS)
    want = jax.pmap(train)(rngs.reshape(8, SEEDS // 8, -1))
    with caplog.at_level(logging.WARNING, logger="jaxdist"):
        got = strategy.run(train, args=(rngs,), batch_argnums=(0,))
        again = strategy.run(train, args=(rngs,), batch_argnums=(0,))
    notes = [r.getMessage() for r in caplog.records if "check_vma" in r.getMessage()]
    assert len(notes) == 1 and "PerReplica" in notes[0]  # one note, naming what was relaxed
    for out in (got, again):
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7),
                     _stacked(out), want)
    assert np.std(_stacked(got)["params"].reshape(SEEDS, -1), axis=0).max() > 0  # the seeds differ


def test_strict_check_keeps_jax_error(strategy):
    rngs = jax.random.split(jax.random.PRNGKey(1), 8)
    with pytest.raises(TypeError):  # JAX's own refusal, as it raises it
        strategy.run(jax.vmap(make_train(2)), args=(rngs,), batch_argnums=(0,), check_vma=True)


def test_check_off_by_request_reads_outputs_by_value_without_note(strategy, caplog):
    def replica_fn(x):
        total = jax.lax.psum(jnp.sum(x), jd.REPLICA_AXIS)  # identical on every replica
        return total, x * 2.0

    x = np.arange(16.0).reshape(8, 2)
    strict_total, _ = strategy.run(replica_fn, args=(x,), batch_argnums=(0,))
    assert not isinstance(strict_total, jd.PerReplica)  # the type proves it mirrored
    with caplog.at_level(logging.WARNING, logger="jaxdist"):
        total, doubled = strategy.run(replica_fn, args=(x,), batch_argnums=(0,), check_vma=False)
    assert not caplog.records
    # No type proves anything with the check off; the values do: a psum's result is the same on
    # every replica.
    assert not isinstance(total, jd.PerReplica) and isinstance(doubled, jd.PerReplica)
    np.testing.assert_array_equal(np.asarray(total), x.sum())
    np.testing.assert_array_equal(np.asarray(doubled.stacked).reshape(8, 2), x * 2.0)


def test_relaxed_check_keeps_local_gradients_and_explicit_all_reduce(strategy):
    """Gradients in a relaxed program are each replica's own (pmap's), and ctx.all_reduce averages
    them."""
    w = np.array([0.5, -1.0, 2.0], np.float32)
    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)

    def loss(w, x):
        # a counter that starts constant and comes out varying: only pmap runs it
        def body(count, row):
            return count + (row[0] > 0).astype(jnp.float32), jnp.sum(row * w) ** 2

        count, squares = lax.scan(body, jnp.zeros(()), x)
        return jnp.mean(squares) + 0.0 * count

    def replica_fn(w, x, reduce):
        grad = jax.grad(loss)(w, x)
        return jd.get_replica_context().all_reduce(jd.ReduceOp.MEAN, grad) if reduce else grad

    local = strategy.run(replica_fn, args=(w, x, False), batch_argnums=(1,))
    want_local = jax.pmap(jax.grad(loss), in_axes=(None, 0))(w, x.reshape(8, 2, 3))
    np.testing.assert_allclose(np.asarray(local.stacked), np.asarray(want_local), rtol=1e-6)
    mean = strategy.run(replica_fn, args=(w, x, True), batch_argnums=(1,))
    # the all-reduced gradient is the same everywhere: mirrored
    assert not isinstance(mean, jd.PerReplica)
    np.testing.assert_allclose(np.asarray(mean), jax.grad(loss)(w, x), rtol=1e-5)


def test_function_own_error_is_raised_as_it_is(strategy):
    def replica_fn(x):
        raise ValueError("the replica function's own error")

    with pytest.raises(ValueError, match="own error"):
        strategy.run(replica_fn, args=(np.ones((8, 2)),), batch_argnums=(0,))


def test_check_vma_must_be_none_or_bool(strategy):
    with pytest.raises(TypeError, match=r"check_vma='off' must be None.*True.*False"):
        strategy.run(lambda x: x, args=(np.ones((8, 2)),), batch_argnums=(0,), check_vma="off")
