"""The Trainer's entry points as ported code meets them: loss_fn's call shape named on the first
batch, and load_state of a run trained elsewhere without a sample batch (linen and nnx alike)."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd


def _batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    return x, (x.sum(1) > 0).astype(np.int32)


def _ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_an_nnx_tutorial_loss_fn_is_named_with_the_fix():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    def loss_fn(model, batch):  # the nnx tutorials' form
        logits = model(batch["image"])
        return _ce(logits, batch["label"])

    trainer = jd.training.Trainer(jd.MirroredStrategy(), model, optax.sgd(0.1), loss_fn)
    with pytest.raises(TypeError,
                       match=r"loss_fn has the parameters \(model, batch\).*loss_fn\(outputs, "
                             r"targets\)"):
        trainer.train_on_batch(_batch())


def test_a_loss_fn_that_fails_on_outputs_and_targets_says_what_it_was_given():
    def loss_fn(outputs, targets):
        return _ce(outputs["logits"], targets)  # indexes the logits array like a dict

    trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(2), optax.sgd(0.1), loss_fn)
    with pytest.raises(Exception,
                       match=r"loss_fn\(outputs, targets\) failed on the first batch") as e:
        trainer.train_on_batch(_batch())
    assert e.value.__cause__ is not None  # the user's own error stays attached


def _trained_elsewhere(model, optimizer, x, y, steps=5):
    params = model.init(jax.random.key(1), x)["params"]
    opt_state = optimizer.init(params)
    for _ in range(steps):
        grads = jax.grad(lambda p: _ce(model.apply({"params": p}, x), y))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, opt_state


def test_linen_load_state_needs_no_batch_and_continues_exactly():
    x, y = _batch()
    model, optimizer = nn.Dense(2), optax.adam(1e-2)
    params, opt_state = _trained_elsewhere(model, optimizer, x, y, steps=5)
    trainer = jd.training.Trainer(jd.MirroredStrategy(), model, optimizer, _ce)
    # no batch= (the contract of own runs)
    trainer.load_state(params=params, opt_state=opt_state, step=5)
    trainer.train_on_batch((x, y))
    want, _ = _trained_elsewhere(model, optimizer, x, y, steps=6)
    for got, ref in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_linen_load_state_that_does_not_fit_the_model_fails_at_the_first_batch_before_any_update():
    x, y = _batch()
    params, opt_state = _trained_elsewhere(nn.Dense(2), optax.adam(1e-2), x, y, steps=1)
    trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(4), optax.adam(1e-2), _ce)
    trainer.load_state(params=params, opt_state=opt_state, step=1)
    with pytest.raises(ValueError, match="do not fit this model on its first batch"):
        trainer.train_on_batch((x, y))
    assert trainer.step == 1  # nothing trained
    # The optimizer state is checked against optimizer.init(params) at once, no batch needed.
    with pytest.raises(ValueError, match="opt_state"):
        jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(2), optax.sgd(0.1, momentum=0.9),
                            _ce).load_state(
            params=params, opt_state=opt_state, step=1)


def test_nnx_load_state_needs_no_batch():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    params = jax.tree.map(lambda a: np.asarray(a) * 0 + 0.5,
                          nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    trainer = jd.training.Trainer(jd.MirroredStrategy(), model, optax.sgd(0.1), _ce)
    trainer.load_state(params=params, step=3)
    assert trainer.step == 3
    np.testing.assert_allclose(np.asarray(trainer.state.params["kernel"]), 0.5)


def test_per_replica_values_are_refused_in_a_state_s_place():
    x, y = _batch()
    strategy = jd.MirroredStrategy()
    params, _ = _trained_elsewhere(nn.Dense(2), optax.sgd(0.1), x, y, steps=1)
    # one copy per replica
    apart = strategy.experimental_distribute_values_from_function(lambda ctx: params)
    trainer = jd.training.Trainer(strategy, nn.Dense(2), optax.sgd(0.1), _ce)
    with pytest.raises(ValueError,
                       match=r"params holds per-replica values \(dict\['bias'\] and 1 more\)"):
        trainer.load_state(params=apart)
