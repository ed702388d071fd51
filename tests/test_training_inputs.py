"""jaxdist.training with the NNX tutorial's ways: call-time ``rngs``, dict batches with named keys;
logs with ``steps_per_run > 1`` equal to one step at a time; the declared batch arguments of the
compiled steps.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from registry import adam, make

import jaxdist as jd

FEATURES, CLASSES, ROWS = 8, 4, 32


class DropoutNet(nnx.Module):
    """In the NNX MNIST tutorial's style: dropout keys and batch-norm mode given at call time / by
    mode."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(rate=0.3)
        self.out = nnx.Linear(32, CLASSES, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = nnx.relu(self.norm(self.drop(self.hidden(x), rngs=rngs)))
        return self.out(x)


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def dict_batches(n=6, rows=ROWS, seed=0, **extra):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
        out.append({"image": x, "label": x[:, :CLASSES].argmax(1).astype(np.int32), **extra})
    return out


def nnx_trainer(strategy, **kwargs):
    return jd.training.Trainer(strategy, DropoutNet(rngs=nnx.Rngs(0)), adam(1e-2), ce,
                               input_key="image", target_key="label", **kwargs)


# ----------------------------------------------------------------------------------- call-time rngs
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy_name", ["one_device", "mirrored_8"])
def test_nnx_model_with_call_time_rngs_trains_with_the_steps_key(strategy_name):
    strategy = make(strategy_name)
    batches = dict_batches()
    trainer = nnx_trainer(strategy)
    state = trainer.init(batches[0])
    rng = jax.random.wrap_key_data(jax.device_get(state.rng))
    history = trainer.fit(batches, steps=2, log_every=1, verbose=0)

    # The first step by hand: the tutorial's model in training mode, rngs from fold_in(state.rng,
    # 0).
    reference = DropoutNet(rngs=nnx.Rngs(0))
    reference.train()
    x, y = batches[0]["image"], batches[0]["label"]
    want = ce(reference(x, rngs=nnx.Rngs(jax.random.fold_in(rng, 0))), y)
    np.testing.assert_allclose(history.train[0]["loss"], float(want), rtol=1e-5)
    deterministic = DropoutNet(rngs=nnx.Rngs(0))
    deterministic.eval()
    # batch statistics, as in training, but no dropout
    deterministic.norm.use_running_average = False
    assert abs(float(want) - float(ce(deterministic(x), y))) > 1e-3  # the dropout really dropped

    # Evaluation runs the module in eval mode without keys: the user's module after fit gives the
    # same.
    model = trainer.model
    model.eval()
    np.testing.assert_allclose(trainer.evaluate(batches[:2])["loss"],
                               np.mean([float(ce(model(b["image"]), b["label"]))
                                        for b in batches[:2]]), rtol=1e-5)


@pytest.mark.timeout(300)
def test_nnx_call_time_rngs_resume_bitwise(tmp_path):
    strategy = make("mirrored_2")
    batches = dict_batches(n=6)
    straight = nnx_trainer(strategy)
    straight.fit(batches, steps=6, verbose=0)
    first = nnx_trainer(strategy)
    first.fit(batches, steps=3, checkpoint_dir=tmp_path, verbose=0)
    resumed = nnx_trainer(strategy)
    resumed.fit(batches, steps=6, checkpoint_dir=tmp_path, verbose=0)
    for got, want in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(straight.params),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_nnx_required_rngs_parameter_gets_none_in_evaluation():
    class Required(nnx.Module):
        def __init__(self, rngs):
            self.linear, self.drop = nnx.Linear(FEATURES, CLASSES, rngs=rngs), nnx.Dropout(0.5)

        # no default: evaluation passes rngs=None, as the tutorial's eval step
        def __call__(self, x, rngs):
            return self.drop(self.linear(x), rngs=rngs)

    adapter = jd.training.NnxModel(Required(nnx.Rngs(0)))
    params, state = adapter.init(None, None, adapter.initial_variables)
    x = jnp.ones((4, FEATURES))
    out, _ = adapter.apply(params, state, x, None, train=False)
    np.testing.assert_allclose(out, Required(nnx.Rngs(0)).linear(x), rtol=1e-6)
    assert not jd.training.NnxModel(nnx.Linear(2, 2, rngs=nnx.Rngs(0))).takes_rngs


# ---------------------------------------------------------------------------------- dict batch keys
@pytest.mark.timeout(300)
def test_dict_batches_with_named_keys_equal_pairs():
    strategy = make("mirrored_8")
    batches = dict_batches()
    pairs = [(b["image"], b["label"]) for b in batches]
    by_key = nnx_trainer(strategy)
    by_pair = nnx_trainer(strategy)
    h_key = by_key.fit(batches, steps=6, log_every=2, eval_data=batches[:2], verbose=0)
    h_pair = by_pair.fit(pairs, steps=6, log_every=2, eval_data=pairs[:2], verbose=0)
    np.testing.assert_allclose(h_key.metric("loss"), h_pair.metric("loss"), rtol=1e-6)
    np.testing.assert_allclose(h_key.metric("loss", "eval"), h_pair.metric("loss", "eval"),
                               rtol=1e-6)
    ragged = [{"image": batches[0]["image"][:13]}]  # predict: inputs only, any size
    np.testing.assert_allclose(by_key.predict(ragged), by_pair.predict([batches[0]["image"][:13]]),
                               rtol=1e-6)


def test_several_input_keys_reach_the_model_as_a_dict():
    class TwoInputs(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(3, 2, rngs=rngs), nnx.Linear(5, 2, rngs=rngs)

        def __call__(self, inputs):
            return self.a(inputs["left"]) + self.b(inputs["right"])

    rng = np.random.default_rng(0)
    data = [{"left": rng.normal(size=(8, 3)).astype(np.float32),
             "right": rng.normal(size=(8, 5)).astype(np.float32),
             "target": rng.integers(0, 2, 8).astype(np.int32)}]
    trainer = jd.training.Trainer(make("mirrored_2"), TwoInputs(nnx.Rngs(0)), optax.sgd(0.1), ce,
                                  input_key=("left", "right"), target_key="target")
    trainer.fit(data, steps=2, verbose=0)
    assert trainer.predict([{"left": data[0]["left"], "right": data[0]["right"]}]).shape == (8, 2)


def test_extra_dict_keys_are_dropped_with_one_warning():
    trainer = nnx_trainer(make("mirrored_2"))
    batches = dict_batches(n=3, id=np.arange(ROWS))
    with pytest.warns(UserWarning,
                                         match=r"train_data batch 0 of epoch 0 has keys \['id'\] "
                                               r"that neither "
                                         r"input_key='image' nor target_key='label' names: they "
                                         r"are dropped on the "
                                         r"host \(not sent to the devices\)") as caught:
        trainer.fit(batches, steps=3, verbose=0)
    assert len([w for w in caught if "dropped on the host" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.evaluate(batches)  # warned once per trainer


def test_missing_and_malformed_keys_name_the_keys_present_and_the_options():
    strategy = make("mirrored_2")
    images = [{"img": np.ones((8, FEATURES), np.float32), "label": np.zeros(8, np.int32)}]
    with pytest.raises(ValueError,
                                         match=r"train_data batch 0 of epoch 0 is a dict with keys "
                                               r"\['img', 'label'\] and "
                                         r"no 'image' \(input_key='image'\): name the keys that "
                                         r"hold the inputs and "
                                         r"the targets, e.g. Trainer\(\.\.\., input_key='img', "
                                         r"target_key='label'\)"):
        nnx_trainer(strategy).fit(images, steps=1, verbose=0)
    trainer = nnx_trainer(strategy)
    trainer.fit(dict_batches(n=1), steps=1, verbose=0)
    with pytest.raises(ValueError,
                                         match=r"eval_data batch 0 is a dict with keys \['image'\] "
                                               r"and no 'label' "
                                         r"\(target_key='label'\)"):
        trainer.evaluate([{"image": np.ones((8, FEATURES), np.float32)}])
    with pytest.raises(ValueError,
                                         match=r"data batch 0 is a dict with keys \['pixels'\] and "
                                               r"no 'image' "
                                         r"\(input_key='image'\)"):
        trainer.predict([{"pixels": np.ones((8, FEATURES), np.float32)}])
    with pytest.raises(ValueError,
                                         match=r"is a dict with keys \['a', 'b'\] and no 'x' "
                                               r"\(input_key='x'\) and no 'y' "
                                         r"\(target_key='y'\): .* e.g. Trainer\(\.\.\., "
                                         r"input_key='a', "
                                         r"target_key='b'\)"):
        jd.training.Trainer(strategy, nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1),
                            ce).train_on_batch(
            {"a": np.ones((8, 2), np.float32), "b": np.zeros(8, np.int32)})
    for option, value in (("input_key", 3), ("target_key", ["a", "a"])):
        with pytest.raises(TypeError,
                                            match=rf"{option}={re.escape(repr(value))} must be a "
                                                  r"dict key \(a string such "
                                            r"as 'image'\) or a sequence of distinct strings"):
            jd.training.Trainer(strategy, nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), ce,
                                **{option: value})


# ---------------------------------------------------------------------- logs with steps_per_run > 1
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("log_every", [5, 3])
def test_steps_per_run_logs_equal_one_step_at_a_time(log_every):
    strategy = jd.TPUStrategy(steps_per_run=5, devices=jax.devices()[:8])
    batches = dict_batches(n=12)
    schedule = optax.linear_schedule(1e-2, 1e-3, transition_steps=12)
    histories = {}
    for steps_per_run in (1, 5):
        trainer = jd.training.Trainer(
            strategy, DropoutNet(rngs=nnx.Rngs(0)),
            optax.inject_hyperparams(optax.adam)(learning_rate=schedule), ce,
            metrics={"accuracy": jd.training.accuracy}, input_key="image", target_key="label",
            steps_per_run=steps_per_run)
        histories[steps_per_run] = trainer.fit(batches, steps=12, log_every=log_every, verbose=0)
    one, five = histories[1].train, histories[5].train
    assert ([r["step"] for r in one] == [r["step"] for r in five]
            == [*range(log_every, 12, log_every), 12])
    for name in ("loss", "accuracy", "learning_rate"):
        np.testing.assert_allclose([r[name] for r in five], [r[name] for r in one], rtol=1e-5,
                                   err_msg=name)
    # the learning rate is the current one at each log point, not a mean over the window
    np.testing.assert_allclose([r["learning_rate"] for r in five],
                               [schedule(r["step"] - 1) for r in five], rtol=1e-6)


def test_train_on_batch_and_train_on_batches():
    strategy = jd.TPUStrategy(steps_per_run=4, devices=jax.devices()[:8])
    batches = [(b["image"], b["label"]) for b in dict_batches(n=4)]
    looped = jd.training.Trainer(strategy, DropoutNet(rngs=nnx.Rngs(0)), adam(1e-2), ce)
    stepped = jd.training.Trainer(strategy, DropoutNet(rngs=nnx.Rngs(0)), adam(1e-2), ce)
    stacked = looped.train_on_batches(batches)
    # host numpy: declared, split
    losses = [float(stepped.train_on_batch(b)["loss"]) for b in batches]
    assert looped.step == stepped.step == 4
    np.testing.assert_allclose(np.asarray(stacked["loss"]), losses, rtol=1e-5)
    with pytest.raises(ValueError, match="train_on_batches got no batches"):
        looped.train_on_batches([])
    # both ways add to the same running sums, read (and restarted) at log points
    # (with the record of non-finite steps: none here)
    sums = looped.pop_running_sums().to_host()
    assert sums.names == ("loss",) and int(sums.steps) == 4 and int(sums.non_finite.count) == 0
    np.testing.assert_allclose(float(sums.averages["loss"].total), np.sum(losses), rtol=1e-5)
    np.testing.assert_allclose(sums.mean("loss"), np.mean(losses), rtol=1e-5)
    assert int(looped.pop_running_sums().to_host().steps) == 0  # restarted
    with pytest.raises(RuntimeError,
                                           match=r"pop_running_sums\(\) before the state exists: "
                                                 r"call fit\(\.\.\.\) or "
                                           r"init\(batch\) first"):
        jd.training.Trainer(strategy, DropoutNet(rngs=nnx.Rngs(0)), adam(1e-2),
                            ce).pop_running_sums()
    # any strategy runs on-device loops (here: a MirroredStrategy given steps_per_run)
    mirrored = jd.training.Trainer(make("mirrored_2"), DropoutNet(rngs=nnx.Rngs(0)), adam(1e-2), ce,
                                   steps_per_run=2)
    history = mirrored.fit(batches, steps=4, log_every=1, verbose=0)
    np.testing.assert_allclose(history.metric("loss"), losses, rtol=1e-5)


# ------------------------------------------------------------------------------ declared batch args
def test_prepare_declares_the_batch_argument():
    strategy = make("mirrored_8")

    def train_step(w, batch):
        x, y = batch
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
        return w - 0.1 * g, loss

    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    y = x.sum(1)
    step, w = jd.training.prepare(strategy, train_step, np.zeros(3, np.float32))
    assert step.batch_argnums == (1,)
    w, loss = step(w, (x, y))  # a host batch passed directly: split over the replicas, no warning
    want_w, want_loss = jax.jit(train_step)(jnp.zeros(3), (x, y))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(w, want_w, rtol=1e-6)
    step, _ = jd.training.prepare(strategy, train_step, np.zeros(3, np.float32), batch_argnums=())
    assert step.batch_argnums == ()
