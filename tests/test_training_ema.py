"""Averaged weights: ``Trainer(ema_decay=...)`` keeps the EMA of the parameter trajectory on the
devices.

The reference is computed by hand, in float32 numpy, from the parameters read after every step; the
average must match it (rtol 1e-6) on replicated and FSDP layouts, keep the parameters' shardings,
skip what the non-finite policy skips, survive a checkpoint bit for bit, and be what
``evaluate(ema=True)`` evaluates.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist as jd

DECAY = 0.9
STRATEGIES = {
    "mirrored": lambda: jd.MirroredStrategy(),
    "fsdp": lambda: jd.ShardedStrategy(min_shard_size=1),
}


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(16)(x)))


def batches(n, seed=0, bad=()):
    """``n`` regression batches of 16 rows; those at the indices in ``bad`` have NaN targets."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        x = rng.normal(size=(16, 8)).astype(np.float32)
        y = (x @ np.linspace(-1, 1, 8).astype(np.float32)).astype(np.float32)
        out.append((x, np.full_like(y, np.nan) if i in bad else y))
    return out


def mse(out, y):
    return ((out[:, 0] - y) ** 2).mean()


def trainer(strategy="mirrored", model=None, **kwargs):
    kwargs.setdefault("ema_decay", DECAY)
    return jd.training.Trainer(STRATEGIES[strategy](), Net() if model is None else model,
                               optax.adam(0.05), mse, **kwargs)


def hand_ema(trajectory, decay=DECAY):
    """The EMA of a list of host parameter trees, as the Trainer defines it, in float32."""
    ema = trajectory[0]
    for params in trajectory[1:]:
        ema = jax.tree.map(lambda e, p: np.float32(decay) * e + np.float32(1 - decay) * p, ema,
                           params)
    return ema


def trajectory(t, data):
    """The parameters before the first step and after each step of ``train_on_batch`` over
    ``data``."""
    t.init(data[0])
    out = [jax.device_get(t.params)]
    for batch in data:
        t.train_on_batch(batch)
        out.append(jax.device_get(t.params))
    return out


def assert_close(got, want, rtol=1e-6):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=rtol, atol=0), got,
                 want)


def assert_equal(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got,
                 want)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_ema_params_is_the_ema_of_the_trajectory_in_the_params_layout(strategy):
    t = trainer(strategy)
    path = trajectory(t, batches(6))
    assert_close(t.ema_params, hand_ema(path))
    assert not np.allclose(jax.device_get(t.ema_params)["Dense_1"]["kernel"],
                           path[-1]["Dense_1"]["kernel"])
    same = jax.tree.map(lambda e, p: e.sharding == p.sharding, t.ema_params, t.params)
    assert all(jax.tree.leaves(same)), same
    if strategy == "fsdp":  # really split: the average lives where the parameters do
        assert any(len(a.sharding.spec) and a.sharding.spec[-1]
                   for a in jax.tree.leaves(t.ema_params))


def test_ema_in_on_device_loops_matches_the_step_by_step_trajectory():
    data = batches(6)
    path = trajectory(trainer(), data)
    looped = trainer(steps_per_run=3)
    looped.train_on_batches(data[:3])
    looped.train_on_batches(data[3:])
    assert looped.step == 6
    assert_close(looped.ema_params, hand_ema(path))
    fitted = trainer(steps_per_run=3)  # fit's on-device loops
    fitted.fit(data, steps=6, verbose=0, log_every=3)
    assert_close(fitted.ema_params, hand_ema(path))


def test_ema_of_an_nnx_model():
    model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.relu,
                           nnx.Linear(16, 1, rngs=nnx.Rngs(1)))
    t = trainer(model=model)
    path = trajectory(t, batches(5))
    assert_close(t.ema_params, hand_ema(path))


def test_a_skipped_step_does_not_move_the_ema():
    data = batches(6, bad=(2,))
    t = trainer()
    t.fit(data, steps=6, verbose=0, on_non_finite="skip", log_every=2)
    assert t.step == 6
    # the skipped step changes nothing, so: the run without it
    good = [b for i, b in enumerate(data) if i != 2]
    assert_close(t.ema_params, hand_ema(trajectory(trainer(), good)))


def test_ema_resumes_bitwise_from_a_checkpoint(tmp_path):
    data = batches(8)
    first = trainer()
    first.fit(data, steps=4, checkpoint_dir=tmp_path, checkpoint_every=2, verbose=0)
    resumed = trainer()
    resumed.fit(data, steps=8, checkpoint_dir=tmp_path, checkpoint_every=2, verbose=0)
    whole = trainer()
    whole.fit(data, steps=8, verbose=0)
    assert resumed.step == whole.step == 8
    assert_equal(resumed.ema_params, whole.ema_params)
    assert_equal(resumed.params, whole.params)
    restored = trainer()  # restore() reads the average too
    restored.restore(tmp_path, batch=data[0])
    assert_equal(restored.ema_params, whole.ema_params)


def test_checkpoints_with_and_without_ema(tmp_path):
    data = batches(4)
    plain = trainer(ema_decay=None)
    plain.fit(data, steps=4, checkpoint_dir=tmp_path / "plain", verbose=0)
    assert plain.ema_params is None
    averaging = trainer()
    with pytest.warns(
        UserWarning, match=r"checkpoint step 4 .* has no averaged weights .* starts again from its"
    ):
        averaging.restore(tmp_path / "plain", batch=data[0])
    assert_equal(averaging.ema_params, plain.params)  # started from the restored parameters
    averaging.train_on_batch(data[0])  # and averaged from there
    assert_close(averaging.ema_params,
                 hand_ema([jax.device_get(plain.params), jax.device_get(averaging.params)]))

    averaging.save(tmp_path / "ema")
    # a checkpoint with an average restores into a trainer without one
    again = trainer(ema_decay=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.restore(tmp_path / "ema", batch=data[0])
    assert again.ema_params is None
    assert_equal(again.params, averaging.params)


def test_load_state_starts_the_ema_from_the_loaded_params():
    data = batches(2)
    source = trainer(ema_decay=None)
    source.train_on_batch(data[0])
    t = trainer()
    t.load_state(params=jax.device_get(source.params), batch=data[0])
    assert_equal(t.ema_params, source.params)


def test_evaluate_and_predict_use_the_averaged_weights():
    data = batches(6)
    t = trainer()
    t.fit(data, steps=6, verbose=0)
    twin = trainer(ema_decay=None)  # a trainer whose parameters are the average
    twin.load_state(params=jax.device_get(t.ema_params), batch=data[0])
    with_ema, plain = t.evaluate(data, ema=True), t.evaluate(data)
    assert with_ema == pytest.approx(twin.evaluate(data), rel=1e-6)
    assert with_ema["loss"] != pytest.approx(plain["loss"], rel=1e-3)
    np.testing.assert_allclose(t.predict(data[0][0], ema=True), twin.predict(data[0][0]), rtol=1e-5)
    assert t.evaluate(data) == plain  # the parameters are untouched


def test_plan_counts_the_averaged_weights():
    batch = batches(1)[0]
    with_ema, without = trainer().plan(batch), trainer(ema_decay=None).plan(batch)
    params = (8 * 16 + 16 + 16 + 1) * 4
    assert with_ema.argument_bytes - without.argument_bytes == params


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, True, "0.9", float("nan")])
def test_bad_ema_decay_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=r"ema_decay=.* must be a number in \[0, 1\)"):
        trainer(ema_decay=bad)


def test_ema_true_without_ema_decay_is_a_value_error_naming_it():
    data = batches(1)
    t = trainer(ema_decay=None)
    with pytest.raises(ValueError,
                                         match=r"evaluate\(ema=True\) needs averaged "
                                               r"weights.*ema_decay=None.*"
                                         r"Trainer\(\.\.\., ema_decay=0\.999\)"):
        t.evaluate(data, ema=True)
    with pytest.raises(ValueError, match=r"predict\(ema=True\) needs averaged weights"):
        t.predict(data[0][0], ema=True)
    assert t.ema_params is None


def test_a_rollback_restores_the_ema_with_the_state(tmp_path):
    data = batches(8, bad=(4,))  # step 5's batch is bad
    t = trainer()
    with pytest.warns(RuntimeWarning, match="rolled back to checkpoint 4"):
        history = t.fit(data, steps=6, checkpoint_dir=tmp_path, checkpoint_every=2, log_every=1,
                        verbose=0, on_non_finite="rollback")
    assert [r["restored"] for r in history.rollbacks] == [4]
    assert (history.rollbacks[0]["data_position"].epoch == 0
            and history.rollbacks[0]["data_position"].index >= 5)
    assert t.step == 6
    used = [0, 1, 2, 3, *range(history.rollbacks[0]["data_position"].index, 8)][:6]
    assert_close(t.ema_params, hand_ema(trajectory(trainer(), [data[i] for i in used])))


def test_a_checkpoint_without_averaged_weights_is_stored_as_before_and_plain_orbax_reads_it(
    tmp_path,
):
    """``TrainState.ema`` is None without ``ema_decay``: nothing of it on disk, so checkpoints
    written before the field existed restore, and plain orbax reads the state with a dict target of
    the five fields it always had."""
    import orbax.checkpoint as ocp

    data = batches(2)
    plain = trainer(ema_decay=None)
    plain.fit(data, steps=2, verbose=0)
    path = plain.save(tmp_path / "run")
    tree = ocp.PyTreeCheckpointer().metadata(f"{path}/state").item_metadata.tree
    assert sorted(tree) == ["model_state", "opt_state", "params", "rng", "step"]
    like = jax.eval_shape(lambda: jax.device_get(plain.state)._asdict())
    del like["ema"]
    state = ocp.PyTreeCheckpointer().restore(f"{path}/state", args=ocp.args.PyTreeRestore(
        like, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), like)))
    assert_equal(state["params"], plain.params)
    again = trainer(ema_decay=None)
    assert again.restore(tmp_path / "run", batch=data[0]) == 2
    assert_equal(again.params, plain.params)
