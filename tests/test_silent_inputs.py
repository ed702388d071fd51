"""Bad calls that used to run silently (or crash without a word about the cause) are named errors.

``strategy.jit`` argnums past a step's arguments, 0-row batches, ``(x, None)`` batches, an optimizer
state of another optimizer with the same leaves (Adam into AdaBelief, Adam into AdamW), a resume
with another global batch size, a first step that is not finite, an evaluation whose labels fall
outside the classes.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist as jd


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _trainer(optimizer=None):
    return jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(2), optimizer or optax.adam(1e-2),
                               ce)


def _batches(rows=16, n=4, classes=2):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows * n, 4)).astype(np.float32)
    y = (np.abs(x[:, 0]) * classes).astype(np.int32) % classes
    return [(x[i : i + rows], y[i : i + rows]) for i in range(0, rows * n, rows)]


def test_jit_argnums_past_the_steps_arguments_are_errors_like_jax_jit():
    strategy = jd.MirroredStrategy()

    def step(state, batch):
        return state + batch.sum()

    with pytest.raises(ValueError,
                                         match=r"batch_argnums=5 names position\(s\) \[5\], but "
                                               r".*step takes 2 positional "
                                         r"argument\(s\) \('state', 'batch'\): pass positions "
                                         r"below 2"):
        strategy.jit(step, batch_argnums=5)
    with pytest.raises(ValueError, match=r"donate_argnums=7 names position\(s\) \[7\]"):
        strategy.jit(step, donate_argnums=7)
    strategy.jit(lambda *args: args[0], batch_argnums=5)  # *args: any position may come, as jax.jit


def test_an_empty_batch_is_named_in_fit_and_in_strategy_jit():
    x = np.zeros((0, 4), np.float32)
    with pytest.raises(ValueError,
                       match=r"train_data batch 0 of epoch 0 has 0 rows \(an empty batch\)"):
        _trainer().fit([(x, np.zeros(0, np.int32))], steps=1, verbose=0)
    step = jd.MirroredStrategy().jit(lambda w, b: w * b.mean(), batch_argnums=1)
    with pytest.raises(ValueError,
                       match=r"argument 1 \(in batch_argnums\) has 0 rows \(an empty batch"):
        step(jnp.ones(()), x)


def test_a_batch_without_targets_names_the_fix():
    x = np.ones((8, 4), np.float32)
    with pytest.raises(ValueError,
                                         match=r"train_data batch 0 of epoch 0 has targets None "
                                               r"\(no array\).*Fix: yield "
                                         r"\(x, y\)"):
        _trainer().fit([(x, None)], steps=1, verbose=0)


@pytest.mark.parametrize("other, said", [
    (optax.adabelief,
     r"\.opt_state\[0\]: ScaleByAdamState in the checkpoint, ScaleByBeliefState here"),
    (optax.adamw, r"\.opt_state\[2\]: absent in the checkpoint, EmptyState here"),
])
def test_another_optimizer_with_the_same_leaves_is_named(tmp_path, other, said):
    _trainer().fit(_batches(), steps=2, checkpoint_dir=tmp_path, verbose=0)
    with pytest.raises(
        ValueError,
        match=r"holds the state of another optimizer \(its state types differ\): " + said,
    ):
        _trainer(other(1e-2)).fit(_batches(), steps=3, checkpoint_dir=tmp_path, verbose=0)
    # the same optimizer resumes
    _trainer().fit(_batches(), steps=3, checkpoint_dir=tmp_path, verbose=0)


def test_a_resume_with_another_global_batch_size_says_what_the_data_position_does(tmp_path):
    _trainer().fit(_batches(16), steps=2, checkpoint_dir=tmp_path, verbose=0)
    with pytest.warns(UserWarning,
                                         match=r"written with global batches of 16 rows; "
                                               r"train_data now yields 32\. The "
                                         r"data position counts batches: it resumes at batch 2 of "
                                         r"epoch 0, skipping "
                                         r"64 examples of that epoch where the run that wrote it "
                                         r"had read 32"):
        _trainer().fit(_batches(32), steps=3, checkpoint_dir=tmp_path, verbose=0)


def test_labels_outside_the_classes_are_named_in_training_and_evaluation():
    bad = [(x, y + 5) for x, y in _batches()]  # labels 5 and 6 for 2 classes
    trainer = _trainer()
    with pytest.raises(jd.training.NonFiniteError,
                                                         match=r"The first step of this fit was "
                                                               r"not finite, which points "
                                                         r"at the inputs first: integer labels "
                                                         r"outside the logits' "
                                                         r"classes .*then at the learning rate"):
        trainer.fit(bad, steps=3, verbose=0)
    trainer = _trainer()
    trainer.fit(_batches(), steps=2, verbose=0)
    with pytest.raises(ValueError,
                                         match=r"eval_data's integer labels run from 5 to 6, but "
                                               r"the model's outputs have 2 "
                                         r"classes .*labels outside \[0, 2\) make the loss NaN"):
        trainer.evaluate(bad)
    assert np.isfinite(trainer.evaluate(_batches())["loss"])
