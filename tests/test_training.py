"""jaxdist.training: fit on any strategy equals the same training written by hand on one device.

Linen and nnx each, over the strategy registry; gradient accumulation, mixed precision, clipping,
schedules, steps_per_run, evaluate / predict, callbacks and metric files. fp32 comparisons at rtol
1e-5.
"""

from __future__ import annotations

import csv
import os
import struct

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from registry import adam, all_strategies, make

import jaxdist as jd

STEPS = 12
BATCH = 32
FEATURES = 8
CLASSES = 4


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(CLASSES)(nn.relu(nn.Dense(16)(x)))


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, 16, rngs=rngs)
        self.out = nnx.Linear(16, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_batches(n=STEPS, batch=BATCH, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(batch, FEATURES)).astype(np.float32)
        out.append((x, (x[:, :CLASSES].argmax(1)).astype(np.int32)))
    return out


def linen_reference(batches, opt, variables):
    """The same training, by hand, with plain jax.jit on one device."""
    params = variables["params"]
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: ce(MLP().apply({"params": p}, x), y))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for x, y in batches:
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
    return params, losses


def assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


@pytest.fixture(scope="session")
def linen_variables():
    return MLP().init(jax.random.key(0), jnp.zeros((1, FEATURES)))


@pytest.fixture(scope="session")
def linen_want(linen_variables):
    """`linen_reference` on `make_batches()` with ``adam(1e-2)`` (computed once)."""
    return linen_reference(make_batches(), adam(1e-2), linen_variables)


@all_strategies
def test_linen_fit_equals_hand_written_single_device(strategy_name, linen_variables, linen_want):
    strategy = make(strategy_name)
    batches = make_batches()
    opt = adam(1e-2)
    want_params, want_losses = linen_want
    trainer = jd.training.Trainer(strategy, MLP(), opt, ce, variables=linen_variables)
    history = trainer.fit(batches, steps=STEPS, log_every=1, verbose=0)
    np.testing.assert_allclose(history.metric("loss"), want_losses, rtol=1e-5)
    assert_trees_close(trainer.params, want_params)
    for leaf in jax.tree.leaves(trainer.state):  # the state stays in the strategy's mirrored layout
        assert leaf.sharding.device_set == set(strategy.devices)


def nnx_reference(model, batches, opt):
    """The canonical nnx loop: nnx.Optimizer + nnx.jit, on one device."""
    optimizer = nnx.Optimizer(model, opt, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: ce(m(x), y))(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer, x, y)) for x, y in batches]


@pytest.fixture(scope="session")
def nnx_want():
    """`nnx_reference` on `make_batches()` with ``adam(1e-2)`` (computed once): the trained
    module and its losses."""
    reference = NnxMLP(nnx.Rngs(0))
    return reference, nnx_reference(reference, make_batches(), adam(1e-2))


@all_strategies
def test_nnx_fit_equals_hand_written_single_device(strategy_name, nnx_want):
    strategy = make(strategy_name)
    batches = make_batches()
    opt = adam(1e-2)
    reference, want_losses = nnx_want
    model = NnxMLP(nnx.Rngs(0))
    trainer = jd.training.Trainer(strategy, model, opt, ce)
    history = trainer.fit(batches, steps=STEPS, log_every=1, verbose=0)
    np.testing.assert_allclose(history.metric("loss"), want_losses, rtol=1e-5)
    # fit writes the trained values back into the user's module, as nnx code expects
    assert_trees_close(nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param))


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_grad_accumulation_equals_one_step_on_the_whole_batch(kind, linen_variables):
    strategy = make("mirrored_8")
    batches = make_batches(n=6, batch=64)  # 8 replicas x 4 micro-batches of 2 rows each
    opt = optax.sgd(0.3, momentum=0.9)
    if kind == "linen":
        want_params, want_losses = linen_reference(batches, opt, linen_variables)
        model = MLP()
        trainer = jd.training.Trainer(strategy, model, opt, ce, variables=linen_variables,
                                      grad_accum_steps=4)
    else:
        reference = NnxMLP(nnx.Rngs(0))
        want_losses = nnx_reference(reference, batches, opt)
        want_params = nnx.to_pure_dict(nnx.state(reference, nnx.Param))
        trainer = jd.training.Trainer(strategy, NnxMLP(nnx.Rngs(0)), opt, ce, grad_accum_steps=4)
    history = trainer.fit(batches, steps=6, log_every=1, verbose=0)
    np.testing.assert_allclose(history.metric("loss"), want_losses, rtol=1e-5)
    assert_trees_close(trainer.params, want_params)


def test_mixed_precision_keeps_fp32_params_and_optimizer_state(linen_variables):
    strategy = make("mirrored_2")
    batches = make_batches()
    full = jd.training.Trainer(strategy, MLP(), adam(1e-2), ce, variables=linen_variables)
    mixed = jd.training.Trainer(strategy, MLP(), adam(1e-2), ce, variables=linen_variables,
                                compute_dtype=jnp.bfloat16)
    h_full = full.fit(batches, steps=STEPS, log_every=1, verbose=0)
    h_mixed = mixed.fit(batches, steps=STEPS, log_every=1, verbose=0)
    for leaf in jax.tree.leaves((mixed.state.params, mixed.state.opt_state)):
        assert leaf.dtype in (jnp.float32, jnp.int32), leaf.dtype
    hlo = mixed._live.steps.fit_step.lower(mixed.state, make_batches(1)[0],
                                           mixed.peek_running_sums().vector).as_text()
    assert "bf16" in hlo and "dot" in hlo  # the matmuls run in bf16
    np.testing.assert_allclose(h_mixed.metric("loss"), h_full.metric("loss"), rtol=0.05)
    assert h_mixed.metric("loss")[-1] < h_mixed.metric("loss")[0]


def test_gradient_clipping_and_logged_schedule(linen_variables):
    strategy = make("mirrored_8")
    schedule = optax.linear_schedule(1.0, 0.5, transition_steps=4)
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    trainer = jd.training.Trainer(strategy, MLP(), opt, ce, variables=linen_variables,
                                  clip_grad_norm=1e-3)
    before = jax.device_get(trainer.init(make_batches(1)[0]).params)
    history = trainer.fit(make_batches(n=1), steps=1, verbose=0)
    moved = optax.tree.norm(jax.tree.map(lambda a, b: a - b, jax.device_get(trainer.params),
                                         before))
    assert float(moved) <= 1e-3 * 1.0 + 1e-7  # lr 1.0 x clipped norm 1e-3
    history = trainer.fit(make_batches(n=1), steps=4, log_every=1, verbose=0)
    np.testing.assert_allclose(history.metric("learning_rate"), [schedule(s) for s in (1, 2, 3)],
                               rtol=1e-6)


def test_steps_per_run_uses_on_device_loops(linen_variables):
    strategy = jd.TPUStrategy(steps_per_run=4)
    if not hasattr(strategy, "run_steps_on_dataset"):
        pytest.skip("the strategy core has no run_steps_on_dataset yet")
    batches = make_batches(n=10)
    opt = adam(1e-2)
    want_params, want_losses = linen_reference(batches, opt, linen_variables)
    trainer = jd.training.Trainer(strategy, MLP(), opt, ce, variables=linen_variables)
    assert trainer.steps_per_run == 4
    seen = []

    class Steps(jd.training.Callback):
        def on_step_end(self, trainer, step, metrics):
            seen.append(step)

    history = trainer.fit(batches, steps=10, log_every=8, eval_every=6, eval_data=batches[:1],
                          verbose=0, callbacks=[Steps()])
    # loops of at most 4 steps that end at the evaluation (6) and the log (8)
    assert seen == [4, 6, 8, 10]
    assert_trees_close(trainer.params, want_params)
    assert [row["step"] for row in history.eval] == [6, 10]
    # every log is the mean over its steps
    assert [row["step"] for row in history.train] == [8, 10]
    np.testing.assert_allclose(history.metric("loss"), [np.mean(want_losses[:8]),
                                                        np.mean(want_losses[8:])],
                               rtol=1e-5)


def test_evaluate_and_predict_cover_every_example_with_padding(linen_variables):
    strategy = make("mirrored_8")
    trainer = jd.training.Trainer(strategy, MLP(), adam(1e-2), ce, variables=linen_variables,
                                  metrics={"accuracy": jd.training.accuracy})
    rng = np.random.default_rng(1)
    x = rng.normal(size=(37, FEATURES)).astype(np.float32)  # 37 rows: the last batch is ragged
    y = x[:, :CLASSES].argmax(1).astype(np.int32)
    data = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 37, 16)]
    logits = np.asarray(MLP().apply(linen_variables, x))
    got = trainer.evaluate(data)
    np.testing.assert_allclose(got["loss"], float(ce(logits, y)), rtol=1e-5)
    np.testing.assert_allclose(got["accuracy"], float(np.mean(logits.argmax(1) == y)), rtol=1e-6)
    np.testing.assert_allclose(trainer.predict([b[0] for b in data]), logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trainer.predict(lambda: iter(data)), logits, rtol=1e-5, atol=1e-6)


def test_fit_with_epochs_and_shuffling_function_and_dict_batches():
    strategy = make("mirrored_2")

    def data_fn(epoch):
        order = np.random.default_rng((7, epoch)).permutation(4)
        batches = make_batches(n=4, seed=3)
        return [{"x": batches[i][0], "y": batches[i][1]} for i in order]

    trainer = jd.training.Trainer(strategy, NnxMLP(nnx.Rngs(1)), adam(1e-2), ce)
    history = trainer.fit(data_fn, epochs=3, eval_data=data_fn(0), eval_every=5, log_every=4,
                          verbose=0)
    assert trainer.step == 12 and trainer.data_position == jd.training.DataPosition(3, 0)
    assert [row["step"] for row in history.eval] == [5, 10, 12]
    assert history.eval[-1]["loss"] < history.eval[0]["loss"]


def test_callbacks_progress_lines_and_metric_files(tmp_path, capsys, linen_variables):
    strategy = make("mirrored_2")
    events = []

    class Record(jd.training.Callback):
        def on_train_begin(self, trainer):
            events.append("begin")

        def on_step_end(self, trainer, step, metrics):
            events.append(("step", step, sorted(metrics)))
            if step == 6:
                trainer.stop_training = True

        def on_eval_end(self, trainer, step, metrics):
            events.append(("eval", step))

        def on_checkpoint(self, trainer, step, path):
            events.append(("checkpoint", step, os.path.isdir(path)))

        def on_train_end(self, trainer, history):
            events.append("end")

    trainer = jd.training.Trainer(strategy, MLP(), adam(1e-2), ce, variables=linen_variables,
                                  metrics={"accuracy": jd.training.accuracy})
    batches = make_batches()
    history = trainer.fit(batches, steps=STEPS, eval_data=batches[:2], eval_every=4,
                          checkpoint_dir=tmp_path / "ck",
                          checkpoint_every=4, log_every=2, log_dir=tmp_path / "logs",
                          verbose="lines", callbacks=[Record()])
    assert trainer.step == 6  # stop_training from a callback
    assert events[0] == "begin" and events[-1] == "end"
    assert ("step", 1, ["accuracy", "loss"]) in events
    assert ("eval", 4) in events and ("eval", 6) in events
    assert ("checkpoint", 4, True) in events and ("checkpoint", 6, True) in events
    out = capsys.readouterr().out
    assert "step 2/12 loss" in out and " steps/s" in out and "eval at step 4:" in out
    with open(tmp_path / "logs" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows if r["split"] == "train"] == ["2", "4", "6"]
    assert float(rows[0]["loss"]) == pytest.approx(history.train[0]["loss"], rel=1e-6)
    (event_file,) = (tmp_path / "logs").glob("events.out.tfevents.*")
    scalars = read_tfevents(event_file.read_bytes())
    assert scalars[("train/loss", 2)] == pytest.approx(history.train[0]["loss"], rel=1e-6)
    assert ("eval/accuracy", 4) in scalars


def read_tfevents(data: bytes) -> dict:
    """A minimal TFRecord + Event protobuf reader (checks the framing and CRCs TensorBoard
    checks)."""
    from tfevents import masked_crc as _masked_crc

    def fields(buf):
        i = 0
        while i < len(buf):
            key, i = varint(buf, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, i = varint(buf, i)
            elif wire == 1:
                value, i = buf[i : i + 8], i + 8
            elif wire == 5:
                value, i = buf[i : i + 4], i + 4
            else:
                n, i = varint(buf, i)
                value, i = buf[i : i + n], i + n
            yield number, value

    def varint(buf, i):
        shift = result = 0
        while True:
            b = buf[i]
            result |= (b & 0x7F) << shift
            i, shift = i + 1, shift + 7
            if not b & 0x80:
                return result, i

    out, i = {}, 0
    while i < len(data):
        (length,) = struct.unpack("<Q", data[i : i + 8])
        assert struct.unpack("<I", data[i + 8 : i + 12])[0] == _masked_crc(data[i : i + 8])
        record = data[i + 12 : i + 12 + length]
        assert struct.unpack("<I",
                             data[i + 12 + length : i + 16 + length])[0] == _masked_crc(record)
        i += 16 + length
        event = dict(fields(record))
        for number, summary in fields(event.get(5, b"")):
            assert number == 1
            value = dict(fields(summary))
            out[(value[1].decode(), event[2])] = struct.unpack("<f", value[2])[0]
    return out


def test_prepare_own_loop_equals_hand_written(linen_variables):
    strategy = make("mirrored_8")
    batches = make_batches()
    opt = adam(1e-2)
    want_params, want_losses = linen_reference(batches, opt, linen_variables)

    def train_step(state, batch):
        params, opt_state = state
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: ce(MLP().apply({"params": p}, x), y))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    params = linen_variables["params"]
    step, state, data = jd.training.prepare(strategy, train_step, (params, opt.init(params)),
                                            batches)
    losses = []
    for batch in data:
        state, loss = step(state, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(state[0], want_params)
