"""A dataset's smaller last batch: refused early by name, dropped, or padded and left out of the
means."""

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist as jd

# 7 full batches and one of 52 rows, as tf.data's batch(64) gives
N_EXAMPLES, GLOBAL_BATCH = 500, 64


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N_EXAMPLES, 5)).astype(np.float32)
    y = (x[:, 0] + 0.3 * x[:, 1] > 0).astype(np.int32)
    w = {"w": rng.normal(size=(5, 2)).astype(np.float32), "b": np.zeros(2, np.float32)}
    batches = [
        (x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH])
        for i in range(0, N_EXAMPLES, GLOBAL_BATCH)
    ]
    return x, y, w, batches


def _per_example(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"] + params["b"], y)


STRATEGIES = [jd.MirroredStrategy, lambda: jd.ShardedStrategy()]


@pytest.mark.parametrize("make", STRATEGIES, ids=["mirrored", "fsdp"])
def test_padded_epoch_means_equal_one_device(make):
    """The tutorial's evaluation loop: mean loss by compute_average_loss + reduce(SUM), accuracy by
    sync-on-read counters weighted by the batch's row weights: over the 500 real examples."""
    strategy = make()
    x, y, host, batches = _data()
    params = strategy.mirror(host)
    correct = strategy.sync_on_read(0.0, "sum")
    seen = strategy.sync_on_read(0.0, "sum")

    def test_step(params, x, y):
        ctx = jd.get_replica_context()
        per_example = _per_example(params, x, y)
        weights = ctx.batch_weights if ctx.batch_weights is not None else jnp.ones(x.shape[0])
        hits = (jnp.argmax(x @ params["w"] + params["b"], axis=1) == y).astype(jnp.float32)
        correct.assign_add(jnp.sum(hits * weights))
        seen.assign_add(jnp.sum(weights))
        return jd.compute_average_loss(per_example)

    total, steps = 0.0, 0
    dataset = strategy.experimental_distribute_dataset(batches, remainder="pad")
    for xb, yb in dataset:
        assert xb.shape[0] == GLOBAL_BATCH  # the last batch padded to the first one's rows
        total += float(
            strategy.reduce(jd.ReduceOp.SUM, strategy.run(test_step, args=(params, xb, yb)))
        )
        steps += 1
    assert steps == 8 and float(seen.read()) == N_EXAMPLES
    per_example = np.asarray(_per_example(host, x, y))
    # Each step's loss is the mean over that batch's real rows; the epoch's mean of step means, as
    # in TF:
    want = np.mean(
        [per_example[i : i + GLOBAL_BATCH].mean() for i in range(0, N_EXAMPLES, GLOBAL_BATCH)]
    )
    np.testing.assert_allclose(total / steps, want, rtol=1e-5)
    want_acc = np.mean(np.argmax(x @ host["w"] + host["b"], axis=1) == y)
    np.testing.assert_allclose(float(correct.read()) / float(seen.read()), want_acc, rtol=1e-6)


@pytest.mark.parametrize("make", STRATEGIES, ids=["mirrored", "fsdp"])
def test_dropped_remainder_equals_one_device_over_the_full_batches(make):
    strategy = make()
    x, y, host, batches = _data()
    params = strategy.mirror(host)
    step = strategy.jit(lambda p, x, y: jnp.mean(_per_example(p, x, y)), batch_argnums=(1, 2))
    losses = [float(step(params, xb, yb)) for xb, yb in
              strategy.experimental_distribute_dataset(batches, remainder="drop")]
    per_example = np.asarray(_per_example(host, x, y))
    want = [
        per_example[i : i + GLOBAL_BATCH].mean() for i in range(0, 7 * GLOBAL_BATCH, GLOBAL_BATCH)
    ]
    np.testing.assert_allclose(losses, want, rtol=1e-5)


def test_a_smaller_batch_is_refused_by_name_before_anything_runs():
    strategy = jd.MirroredStrategy()
    *_, batches = _data()
    with pytest.raises(ValueError,
                       match=r"batch 7 has 52 rows, which the 8 replicas do not "
                             r"divide.*remainder='drop'"):
        # a list: checked when the dataset is made
        strategy.experimental_distribute_dataset(batches)
    # a generator: at that batch
    dataset = strategy.experimental_distribute_dataset(b for b in batches)
    with pytest.raises(ValueError, match=r"remainder='pad'"):
        list(dataset)
    with pytest.raises(ValueError, match=r"remainder='every' is not one of"):
        strategy.experimental_distribute_dataset(batches, remainder="every")
    with pytest.raises(ValueError, match=r"remainder='every' is not one of"):
        strategy.distribute_datasets_from_function(lambda ctx: batches, remainder="every")


def test_a_smaller_batch_the_replicas_divide_still_runs_under_error():
    strategy = jd.MirroredStrategy()
    shapes = [
        b.shape[0]
        for b in strategy.experimental_distribute_dataset([np.ones((16, 2)), np.ones((8, 2))])
    ]
    assert shapes == [16, 8]


def test_per_process_input_pads_too():
    strategy = jd.MirroredStrategy()
    *_, batches = _data()
    dataset = strategy.distribute_datasets_from_function(lambda ctx: batches, remainder="pad")
    shapes = [xb.shape[0] for xb, _ in dataset]
    assert shapes == [GLOBAL_BATCH] * 8


def test_a_padded_batch_in_a_global_view_step_is_refused():
    strategy = jd.MirroredStrategy()
    *_, host, batches = _data()
    step = strategy.jit(lambda p, x, y: jnp.mean(_per_example(p, x, y)), batch_argnums=(1, 2))
    *_, (xb, yb) = strategy.experimental_distribute_dataset(batches, remainder="pad")
    with pytest.raises(ValueError, match=r"padded.*strategy.run.*remainder='drop'"):
        step(strategy.mirror(host), xb, yb)
    assert jax.tree.leaves(xb)  # (kept alive to the end: the weights are registered while it lives)


def _compiled_test_step(strategy):
    """The tutorial's ``test_step`` and ``distributed_test_step`` (a tf.function around
    ``strategy.run``), the metrics passed in and returned (a compiled step's updates leave through
    its outputs)."""

    def test_step(params, test_correct, test_seen, x, y):
        ctx = jd.get_replica_context()
        weights = ctx.batch_weights if ctx.batch_weights is not None else jnp.ones(x.shape[0])
        hits = (jnp.argmax(x @ params["w"] + params["b"], axis=1) == y).astype(jnp.float32)
        return (jd.compute_average_loss(_per_example(params, x, y)),
                test_correct.assign_add(jnp.sum(hits * weights)),
                test_seen.assign_add(jnp.sum(weights)))

    @strategy.jit
    def distributed_test_step(params, test_correct, test_seen, x, y):
        per_replica_loss, test_correct, test_seen = strategy.run(
            test_step, args=(params, test_correct, test_seen, x, y))
        return strategy.reduce(jd.ReduceOp.SUM, per_replica_loss,
                               axis=None), test_correct, test_seen

    return test_step, distributed_test_step


@pytest.mark.parametrize("primed", [None, "eager_run", "global_view_step"])
@pytest.mark.parametrize("make", STRATEGIES, ids=["mirrored", "fsdp"])
def test_padded_last_batch_through_a_compiled_test_step(make, primed):
    """The padded last batch through ``strategy.jit`` around ``strategy.run``: the run inside leaves
    the padding out, so each epoch's mean loss and accuracy are the one-device ones over the 500
    real examples. The same numbers whatever ran before (the replica function eagerly on the padded
    batch; a compiled step over the full batches and a global-view step refused the padded one) and
    in each epoch (full batches after a padded one, the padded one again: no program of one kind
    serves the other)."""
    strategy = make()
    x, y, host, batches = _data()
    params = strategy.mirror(host)
    test_step, distributed_test_step = _compiled_test_step(strategy)
    dataset = strategy.experimental_distribute_dataset(batches, remainder="pad")
    *_, (x_last, y_last) = dataset
    if primed == "eager_run":
        strategy.run(test_step, args=(params, strategy.sync_on_read(0.0, "sum"),
                                      strategy.sync_on_read(0.0, "sum"), x_last, y_last))
    elif primed == "global_view_step":
        global_view = strategy.jit(lambda p, x, y: jnp.mean(_per_example(p, x, y)))
        global_view(params, *next(iter(dataset)))
        with pytest.raises(ValueError,
                           match=r"padded.*hands it to no strategy.run.*remainder='drop'"):
            global_view(params, x_last, y_last)
    per_example = np.asarray(_per_example(host, x, y))
    want_loss = np.mean(
        [per_example[i : i + GLOBAL_BATCH].mean() for i in range(0, N_EXAMPLES, GLOBAL_BATCH)]
    )
    want_accuracy = np.mean(np.argmax(x @ host["w"] + host["b"], axis=1) == y)
    for _ in range(2):  # epochs
        test_correct, test_seen = (strategy.sync_on_read(0.0, "sum"),
                                   strategy.sync_on_read(0.0, "sum"))
        losses = []
        for xb, yb in dataset:
            loss, test_correct, test_seen = distributed_test_step(
                params, test_correct, test_seen, xb, yb
            )
            losses.append(float(loss))
        assert len(losses) == 8 and float(test_seen.read()) == N_EXAMPLES
        np.testing.assert_allclose(np.mean(losses), want_loss, rtol=1e-5)
        np.testing.assert_allclose(float(test_correct.read()) / N_EXAMPLES, want_accuracy,
                                   rtol=1e-6)


def test_a_padded_batch_freed_while_another_is_registered_does_not_hang(monkeypatch):
    """The garbage collector may free an old padded batch (one held in a reference cycle) in the
    middle of the next batch's registration, on the same thread (the read-ahead thread's): the freed
    batch's entry is dropped without the registry's lock, so the registration never waits on itself.
    (Whether a test hung depended on what garbage the tests before it left.)"""
    from jaxdist.strategies.input import _remainder

    strategy = jd.MirroredStrategy()
    *_, batches = _data()

    class Cycle:
        pass

    old = Cycle()
    old.me = old
    *_, old.batch = strategy.experimental_distribute_dataset(batches, remainder="pad", prefetch=0)
    del old
    lock = _remainder._lock

    # the collector runs inside the registration (as an allocation there can make it run)
    class CollectingLock:
        def __enter__(self):
            lock.acquire()
            gc.collect()

        def __exit__(self, *exc):
            lock.release()

    monkeypatch.setattr(_remainder, "_lock", CollectingLock())
    done = threading.Event()

    def epoch():
        list(strategy.experimental_distribute_dataset(batches, remainder="pad", prefetch=0))
        done.set()

    threading.Thread(target=epoch, daemon=True).start()
    assert done.wait(120), "registering a padded batch waited on the lock it holds"
