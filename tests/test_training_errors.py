"""jaxdist.training bad input: every error names what is wrong, the value received and the fix."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd
from jaxdist.training import LinenModel, NnxModel


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batches(n=3, rows=16):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(rows, 4)).astype(np.float32),
             rng.integers(0, 3, rows).astype(np.int32))
            for _ in range(n)]


@pytest.fixture(scope="session")
def strategy():
    return jd.MirroredStrategy()


def trainer(strategy, loss=ce, **kwargs):
    return jd.training.Trainer(strategy, nn.Dense(3), optax.sgd(0.1), loss, **kwargs)


def test_non_scalar_loss_and_metric(strategy):
    per_example = lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out, y)  # noqa: E731
    with pytest.raises(
        ValueError, match=r"loss_fn returned shape \(16,\) float32 .* must return a float scalar"
    ):
        trainer(strategy, per_example).fit(batches(), steps=1, verbose=0)
    with pytest.raises(ValueError, match=r"metrics\['hits'\] returned shape \(16,\)"):
        trainer(strategy, metrics={"hits": lambda out, y: out.argmax(-1) == y}).fit(
            batches(), steps=1, verbose=0
        )


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ([(np.ones((8, 4)), np.ones(8), np.ones(8))],
                                                     r"train_data batch 0 of epoch 0 is a tuple of "
                                                     r"3 items; expected \(x, y\)"),
        ([{"inputs": np.ones((8, 4)), "y": np.ones(8)}],
         r"dict with keys \['inputs', 'y'\] and no 'x' \(input_key='x'\): name the keys .* "
         r"Trainer\(\.\.\., input_key='inputs', target_key='y'\)"),
        ([np.ones((8, 4))], r"is a ndarray; expected \(x, y\)"),
    ],
)
def test_wrong_batch_structure(strategy, data, match):
    with pytest.raises(ValueError, match=match):
        trainer(strategy).fit(data, steps=1, verbose=0)


def test_ragged_and_indivisible_batches(strategy):
    data = [*batches(2), (np.ones((8, 4), np.float32), np.ones(8, np.int32))]
    with pytest.raises(ValueError,
                                         match=r"train_data batch 2 of epoch 0 has "
                                               r"structure/shapes .* first training "
                                         r"batch had .* drop the ragged last batch or pad it"):
        trainer(strategy).fit(data, steps=3, verbose=0)
    with pytest.raises(ValueError,
                                         match=r"has 12 rows, which 8 replicas x "
                                               r"grad_accum_steps=1 do not divide: use a "
                                         r"global batch that is a multiple of 8 \(e.g. 16\)"):
        trainer(strategy).fit(batches(rows=12), steps=1, verbose=0)
    with pytest.raises(ValueError,
                       match=r"8 replicas x grad_accum_steps=4 do not divide: .* multiple of 32"):
        trainer(strategy, grad_accum_steps=4).fit(batches(), steps=1, verbose=0)


def test_nnx_where_linen_is_expected_and_vice_versa(strategy):
    linen, module = nn.Dense(3), nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="is an nnx module where a linen module is expected"):
        LinenModel(module)
    with pytest.raises(TypeError, match="is a linen module where an nnx module is expected"):
        NnxModel(linen)
    with pytest.raises(ValueError, match=r"variables=\.\.\. was given with an nnx module"):
        jd.training.Trainer(strategy, module, optax.sgd(0.1), ce, variables={"params": {}})
    with pytest.raises(TypeError, match="train_kwargs apply to linen modules only"):
        jd.training.Trainer(strategy, module, optax.sgd(0.1), ce, train_kwargs={"train": True})
    with pytest.raises(TypeError,
                                        match=r"model=Linear is an nnx module class, not an "
                                              r"instance: pass "
                                        r"Linear\(..., rngs=nnx.Rngs\(0\)\)"):
        jd.training.Trainer(strategy, nnx.Linear, optax.sgd(0.1), ce)
    with pytest.raises(TypeError, match=r"model=Dense is a linen module class, not an instance"):
        jd.training.Trainer(strategy, nn.Dense, optax.sgd(0.1), ce)
    with pytest.raises(TypeError, match="is not a Flax module"):
        jd.training.Trainer(strategy, lambda x: x, optax.sgd(0.1), ce)
    with pytest.raises(ValueError,
                       match=r"variables has collections \['weights'\] but no 'params'"):
        jd.training.Trainer(strategy, linen, optax.sgd(0.1), ce, variables={"weights": {}})


def test_constructor_arguments(strategy):
    dense, sgd = nn.Dense(3), optax.sgd(0.1)
    cases = [
        (TypeError, "is not a jaxdist strategy", dict(strategy="mirrored")),
        (TypeError, "is not an optax GradientTransformation", dict(optimizer=0.1)),
        (TypeError, r"loss_fn=3 is not callable", dict(loss_fn=3)),
        (ValueError, r"metrics\['loss'\]", dict(metrics={"loss": ce})),
        (ValueError, r"grad_accum_steps=0 must be an int >= 1", dict(grad_accum_steps=0)),
        (ValueError, r"clip_grad_norm=-1 must be a positive number", dict(clip_grad_norm=-1)),
        (ValueError, r"compute_dtype=<class 'jax.numpy.int32'> must be a floating dtype",
         dict(compute_dtype=jnp.int32)),
        (ValueError, r"steps_per_run=0 must be an int >= 1", dict(steps_per_run=0)),
    ]
    for error, match, override in cases:
        args = {"strategy": strategy, "model": dense, "optimizer": sgd, "loss_fn": ce, **override}
        with pytest.raises(error, match=match):
            jd.training.Trainer(args.pop("strategy"), args.pop("model"), args.pop("optimizer"),
                                args.pop("loss_fn"), **args)


def test_fit_arguments(strategy):
    t = trainer(strategy)
    cases = [
        (r"fit needs steps=N .* or epochs=N", dict()),
        (r"steps=-1 must be an int >= 0", dict(steps=-1)),
        (r"eval_every=5 needs eval_data", dict(steps=1, eval_every=5)),
        (r"eval_data is an iterator, which can be read only once",
         dict(steps=1, eval_data=iter(batches()))),
        (r"on_preemption='ignore' must be 'exit' or 'return'",
         dict(steps=1, on_preemption="ignore")),
        (r"log_every=0 must be an int >= 1", dict(steps=1, log_every=0)),
    ]
    for match, kwargs in cases:
        with pytest.raises(ValueError, match=match):
            t.fit(batches(), verbose=0, **kwargs)
    with pytest.raises(TypeError,
                       match=r"train_data=5 \(type int\) is neither iterable nor callable"):
        t.fit(5, steps=1, verbose=0)
    with pytest.raises(ValueError, match=r"train_data yielded no batches \(epoch 0\)"):
        t.fit([], steps=1, verbose=0)
    with pytest.raises(RuntimeError, match=r"save\(\) before the state exists"):
        t.save("/tmp/never")
    with pytest.raises(ValueError, match="evaluate got no examples"):
        t.evaluate([])


def test_data_shorter_than_the_restored_position(strategy, tmp_path):
    t = trainer(strategy)
    t.fit(batches(3), steps=2, checkpoint_dir=tmp_path, verbose=0)
    with pytest.raises(ValueError,
                                         match=r"train_data has 1 batches in epoch 0, but the "
                                               r"restored position is batch "
                                         r"2 of that epoch: the data differs"):
        trainer(strategy).fit(batches(1), steps=4, checkpoint_dir=tmp_path, verbose=0)


def test_one_shot_iterator_is_read_once_and_resumes_by_skipping(strategy, tmp_path):
    data = batches(5)
    t = trainer(strategy)
    t.fit(iter(data[:3]), steps=3, checkpoint_dir=tmp_path, verbose=0)
    assert t.data_position == jd.training.DataPosition(0, 3)
    resumed = trainer(strategy)
    with pytest.warns(UserWarning, match=r"train_data ended at step 5 of steps=10"):
        # skips 3, then 2 left: stops at 5
        resumed.fit(iter(data), steps=10, checkpoint_dir=tmp_path, verbose=0)
    assert resumed.step == 5
    straight = trainer(strategy)
    with pytest.warns(UserWarning, match=r"train_data ended at step 5 of steps=10"):
        straight.fit(iter(data), steps=10, verbose=0)
    np.testing.assert_array_equal(np.asarray(resumed.params["kernel"]),
                                  np.asarray(straight.params["kernel"]))
