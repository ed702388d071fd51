"""Sync-on-read values (tf.keras.metrics' role) where TF's tutorial uses them: inside
``strategy.run``, inside a compiled step (``strategy.jit``, TF's ``tf.function``) around it, and
inside the JAX control flow of a replica function (``lax.scan``, ``lax.cond``, a nested ``jax.jit``:
TF's ``tf.while_loop`` / ``tf.cond``).

The names are those of TensorFlow's "Custom training with tf.distribute.Strategy" tutorial
(``test_step``, ``distributed_test_step``, ``test_accuracy``, ...); every count is checked against
the same count on one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist as jd

BATCH_SIZE_PER_REPLICA = 8
N_EXAMPLES = 256


def _strategy():
    strategy = jd.MirroredStrategy()
    return strategy, BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync


def _data():
    rng = np.random.default_rng(3)
    images = rng.normal(size=(N_EXAMPLES, 6)).astype(np.float32)
    labels = (images[:, 0] + 0.5 * images[:, 1] > 0).astype(np.int32) + (images[:, 2] > 1).astype(
        np.int32
    )
    params = {"w": rng.normal(size=(6, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}
    return images, labels, params


def model(params, images):
    return images @ params["w"] + params["b"]


# SparseCategoricalCrossentropy(from_logits=True, reduction=NONE)
def loss_object(labels, predictions):
    return optax.softmax_cross_entropy_with_integer_labels(predictions, labels)


def _one_device(params, images, labels):
    """The tutorial's test metrics on one device: summed loss, correct predictions, examples."""
    predictions = model(params, images)
    return (float(np.sum(loss_object(labels, predictions))),
            int(np.sum(np.argmax(predictions, -1) == labels)), len(labels))


def _dataset(strategy, global_batch_size, images, labels):
    batches = [(images[i:i + global_batch_size], labels[i:i + global_batch_size])
               for i in range(0, len(images), global_batch_size)]
    return strategy.experimental_distribute_dataset(batches)


def test_metrics_returned_by_run_in_a_compiled_test_step():
    """TF's ``distributed_test_step``, a tf.function around ``strategy.run(test_step)``: the metrics
    are passed in, ``test_step`` returns ``metric.assign_add(...)``, the step returns run's output
    (a compiled step's updates leave through its outputs)."""
    strategy, global_batch_size = _strategy()
    images, labels, host = _data()
    params = strategy.mirror(host)
    test_loss, test_correct, test_seen = (strategy.sync_on_read(0.0, "sum") for _ in range(3))

    def test_step(params, test_loss, test_correct, test_seen, inputs):
        images, labels = inputs
        predictions = model(params, images)
        t_loss = loss_object(labels, predictions)
        return (test_loss.assign_add(jnp.sum(t_loss)),
                test_correct.assign_add(jnp.sum(jnp.argmax(predictions, -1) == labels)),
                test_seen.assign_add(labels.shape[0]))

    @strategy.jit
    def distributed_test_step(params, test_loss, test_correct, test_seen, dataset_inputs):
        return strategy.run(test_step, args=(params, test_loss, test_correct, test_seen,
                                             dataset_inputs))

    for inputs in _dataset(strategy, global_batch_size, images, labels):
        test_loss, test_correct, test_seen = distributed_test_step(
            params, test_loss, test_correct, test_seen, inputs
        )
    assert all(isinstance(m, jd.SyncOnRead) for m in (test_loss, test_correct, test_seen))
    want_loss, want_correct, want_seen = _one_device(host, images, labels)
    assert float(test_seen.read()) == want_seen and float(test_correct.read()) == want_correct
    np.testing.assert_allclose(float(test_loss.read()), want_loss, rtol=1e-5)
    # Eagerly, the object passed in is what comes back (updated in place), as TF's assign_add
    # returns it.
    again = strategy.run(test_step, args=(params, test_loss, test_correct, test_seen, inputs))
    assert again[2] is test_seen and float(test_seen.read()) == want_seen + global_batch_size


def test_metrics_updated_in_the_global_view_of_a_compiled_step():
    """No ``strategy.run``: the step sees the whole batch and updates the metrics in cross-replica
    context."""
    strategy, global_batch_size = _strategy()
    images, labels, host = _data()
    params = strategy.mirror(host)
    test_correct = strategy.sync_on_read(jnp.zeros((), jnp.int32), "sum")
    test_seen = strategy.sync_on_read(0.0, "sum")

    @strategy.jit
    def test_step(params, test_correct, test_seen, images, labels):
        predictions = model(params, images)
        test_correct.assign_add(jnp.sum(jnp.argmax(predictions, -1) == labels).astype(jnp.int32))
        test_seen.assign_add(labels.shape[0])
        return test_correct, test_seen

    for images_b, labels_b in _dataset(strategy, global_batch_size, images, labels):
        test_correct, test_seen = test_step(params, test_correct, test_seen, images_b, labels_b)
    _, want_correct, want_seen = _one_device(host, images, labels)
    assert int(test_correct.read()) == want_correct and float(test_seen.read()) == want_seen


def test_a_captured_metric_reads_its_replica_component_inside_run():
    """In replica context ``.value`` (and ``.read()``) is this replica's component, whether the
    metric was passed to the replica function or captured by it (TF's sync-on-read variables read
    locally there)."""
    strategy, global_batch_size = _strategy()
    images, _, _ = _data()
    test_seen = strategy.sync_on_read(0.0, "sum")

    def test_step(images):
        test_seen.assign_add(images.shape[0])

    def progress():  # reads only
        return test_seen.value, test_seen.read()

    batch = strategy.experimental_distribute_values(images[:global_batch_size])
    for _ in range(2):
        strategy.run(test_step, args=(batch,))
    by_value, by_read = strategy.run(progress)
    for out in (by_value, by_read):
        assert [float(v) for v in out.values] == [
            2.0 * BATCH_SIZE_PER_REPLICA
        ] * strategy.num_replicas_in_sync
    assert float(test_seen.read()) == 2 * global_batch_size


def test_a_captured_metric_returned_by_the_replica_function_is_that_metric():
    strategy, _ = _strategy()
    steps = strategy.sync_on_read(0.0, "sum")

    def count():
        steps.assign_add(1.0)
        return steps

    assert strategy.run(count) is steps
    assert float(steps.read()) == strategy.num_replicas_in_sync  # one per replica, summed on read


@pytest.mark.parametrize("where", ["scan", "cond", "nested_jit"])
def test_metrics_updated_inside_jax_control_flow_of_a_replica_function(where):
    """``assign_add`` inside ``lax.scan`` / ``lax.cond`` / a nested ``jax.jit`` (TF: inside
    tf.while_loop / tf.cond / a nested tf.function) updates the metric as it would on one device."""
    strategy, global_batch_size = _strategy()
    images, labels, host = _data()
    params = strategy.mirror(host)
    test_correct = strategy.sync_on_read(0.0, "sum")  # captured
    test_seen = strategy.sync_on_read(0.0, "sum")  # passed in

    def test_step(params, test_seen, images, labels):
        if where == "scan":
            def body(carry, example):
                image, label = example
                test_correct.assign_add(jnp.argmax(model(params, image[None]), -1)[0] == label)
                test_seen.assign_add(1.0)
                return carry, None

            jax.lax.scan(body, 0.0, (images, labels))
        elif where == "cond":
            def update(hits):
                test_correct.assign_add(hits)
                test_seen.assign_add(labels.shape[0])
                return hits

            hits = jnp.sum(jnp.argmax(model(params, images), -1) == labels).astype(jnp.float32)
            jax.lax.cond(labels.shape[0] > 0, update, lambda hits: hits, hits)
        else:
            @jax.jit
            def update(images, labels):
                test_correct.assign_add(jnp.sum(jnp.argmax(model(params, images), -1) == labels))
                test_seen.assign_add(labels.shape[0])

            update(images, labels)

    for images_b, labels_b in _dataset(strategy, global_batch_size, images, labels):
        assert strategy.run(test_step, args=(params, test_seen, images_b, labels_b)) is None
    _, want_correct, want_seen = _one_device(host, images, labels)
    assert float(test_correct.read()) == want_correct and float(test_seen.read()) == want_seen


def test_a_metric_updated_in_a_scan_inside_a_compiled_step():
    """The same inside ``strategy.jit``: the metric passed in, updated in the replica function's
    scan, returned."""
    strategy, global_batch_size = _strategy()
    images, labels, host = _data()
    params = strategy.mirror(host)

    def test_step(params, test_correct, images, labels):
        def body(carry, example):
            image, label = example
            test_correct.assign_add(jnp.argmax(model(params, image[None]), -1)[0] == label)
            return carry, None

        jax.lax.scan(body, 0.0, (images, labels))
        return test_correct

    @strategy.jit
    def distributed_test_step(params, test_correct, images, labels):
        return strategy.run(test_step, args=(params, test_correct, images, labels))

    test_correct = strategy.sync_on_read(0.0, "sum")
    for images_b, labels_b in _dataset(strategy, global_batch_size, images, labels):
        test_correct = distributed_test_step(params, test_correct, images_b, labels_b)
    assert float(test_correct.read()) == _one_device(host, images, labels)[1]


@pytest.mark.parametrize("primed", [False, True], ids=["first", "after_an_eager_run"])
def test_a_captured_metric_in_a_compiled_step_is_refused_whatever_ran_before(primed):
    """A compiled step cannot update (or read the current value of) a metric it captures: refused,
    naming the fix. The same answer whether or not the replica function ran eagerly before (the
    eager program, which stores into the captured metric, is not the one a compiled step gets)."""
    strategy, global_batch_size = _strategy()
    images, _, _ = _data()
    test_seen = strategy.sync_on_read(0.0, "sum")

    def test_step(images):
        test_seen.assign_add(images.shape[0])
        return jnp.sum(images)

    batch = strategy.experimental_distribute_values(images[:global_batch_size])
    if primed:
        strategy.run(test_step, args=(batch,))
    distributed_test_step = strategy.jit(lambda inputs: strategy.run(test_step, args=(inputs,)))
    with pytest.raises(ValueError,
                                         match=r"captured from the enclosing code.*Pass the value "
                                               r"to the step and to "
                                         r"run as an argument"):
        distributed_test_step(batch)
    # nothing leaked into it
    assert float(test_seen.read()) == (global_batch_size if primed else 0.0)


def test_a_captured_metric_assigned_in_a_compiled_global_view_step_is_refused():
    strategy, global_batch_size = _strategy()
    images, _, _ = _data()
    test_seen = strategy.sync_on_read(0.0, "sum")

    @strategy.jit
    def test_step(images):
        test_seen.assign_add(images.shape[0])
        return jnp.sum(images)

    with pytest.raises(ValueError,
                                         match=r"assigns a sync-on-read value \(SUM, shape \(\)\) "
                                               r"that it captured.*"
                                         r"Pass it to the step as an argument and return it"):
        test_step(strategy.experimental_distribute_values(images[:global_batch_size]))
    assert float(test_seen.read()) == 0.0
