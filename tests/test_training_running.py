"""The running sums (`jaxdist.training.RunningSums`): a pytree of named parts added on the devices
each step, read in one transfer at a log point; the deprecated ``(names, vector)`` methods still
return what they did."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from registry import make

import jaxdist as jd
from jaxdist.training.step import NonFiniteRecord

ROWS = 8
MASKS = [np.array([1, 1, 1, 0, 0, 0, 0, 0], np.float32), np.ones(ROWS, np.float32),
         np.array([1, 0, 0, 0, 0, 0, 0, 0], np.float32)]


def token_loss(out, batch_y):
    """A token-weighted loss: the masked sum of the targets (the model's output counts for nothing,
    so its gradient is 0 and an infinite target makes the loss, not the parameters, non-finite)."""
    y, mask = batch_y[:, 0], batch_y[:, 1]
    return ((out[:, 0] * 0.0 + y) * mask).sum(), mask.sum()


def ones_metric(out, batch_y):
    """A scalar metric: the batch mean of the targets."""
    return (out[:, 0] * 0.0 + batch_y[:, 0]).mean()


def batch(value, mask):
    y = np.full(ROWS, value, np.float32)
    return np.ones((ROWS, 2), np.float32), np.stack([y, mask], axis=1)


def make_trainer(strategy):
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0)
    return jd.training.Trainer(strategy, nn.Dense(1), opt, token_loss,
                               metrics={"mean_y": ones_metric})


def train(trainer, batches, looped):
    if looped:
        trainer.train_on_batches(batches)
    else:
        for b in batches:
            trainer.train_on_batch(b)


def reference_record(flags):
    """The non-finite record of a window, computed step by step in Python."""
    count = sum(flags)
    first = flags.index(1) if count else 0
    lead = next((i for i, f in enumerate(flags) if not f), len(flags))
    run = next((i for i, f in enumerate(reversed(flags)) if not f), len(flags))
    longest = current = 0
    for f in flags:
        current = current + 1 if f else 0
        longest = max(longest, current)
    return [count, first, lead, run, longest]


@pytest.mark.parametrize("looped", [False, True], ids=["step-by-step", "on-device-loop"])
def test_sums_equal_a_hand_computation_with_tokens_and_non_finite_steps(looped):
    trainer = make_trainer(make("mirrored_8"))
    # Window 1: finite steps of 3, 8 and 1 real tokens.
    values = [2.0, 3.0, 5.0]
    train(trainer, [batch(v, m) for v, m in zip(values, MASKS, strict=True)], looped)
    sums = trainer.pop_running_sums().to_host()
    assert sums.names == ("loss", "mean_y") and sums.token_weighted == ("loss",)
    tokens = [m.sum() for m in MASKS]
    assert float(sums.averages["loss"].total) == pytest.approx(
        sum(v * t for v, t in zip(values, tokens, strict=True))
    )
    assert float(sums.averages["loss"].weight) == sum(tokens) == float(sums.loss_weight)
    # not the mean of step means
    assert sums.mean("loss") == pytest.approx((2 * 3 + 3 * 8 + 5 * 1) / 12)
    assert float(sums.averages["mean_y"].weight) == 3 and sums.mean("mean_y") == pytest.approx(
        10 / 3
    )
    assert int(sums.steps) == 3 and [int(v) for v in sums.non_finite] == [0, 0, 0, 0, 0]
    assert float(sums.learning_rate) == 0.0
    # Window 2: steps 2, 4 and 5 of five are not finite (an infinite loss).
    flags = [0, 1, 0, 1, 1]
    train(trainer, [batch(np.inf if f else 1.0, MASKS[1]) for f in flags], looped)
    sums = trainer.pop_running_sums().to_host()
    assert int(sums.steps) == 5 and float(sums.averages["loss"].weight) == 5 * ROWS
    assert np.isinf(float(sums.averages["loss"].total))
    assert [int(v) for v in sums.non_finite] == reference_record(flags) == [3, 1, 0, 2, 2]
    assert int(trainer.pop_running_sums().to_host().steps) == 0  # restarted


def test_records_compose_as_one_window():
    rng = np.random.default_rng(0)
    for _ in range(20):
        flags = rng.integers(0, 2, size=int(rng.integers(1, 9))).tolist()
        record, steps = NonFiniteRecord.zeros(), 0
        for f in flags:
            record, steps = record.then(NonFiniteRecord.of_step(jnp.float32(f)), steps,
                                        1), steps + 1
        assert [int(v) for v in record] == reference_record(flags), flags
        # two windows, composed afterwards: the same record
        cut = int(rng.integers(0, len(flags) + 1))
        parts = []
        for part in (flags[:cut], flags[cut:]):
            r = NonFiniteRecord.zeros()
            for i, f in enumerate(part):
                r = r.then(NonFiniteRecord.of_step(jnp.float32(f)), i, 1)
            parts.append(r)
        joined = parts[0].then(parts[1], cut, len(flags) - cut)
        assert [int(v) for v in joined] == reference_record(flags), (flags, cut)


def test_a_log_point_reads_the_sums_in_one_transfer(monkeypatch):
    trainer = make_trainer(make("mirrored_8"))
    reads, inside = [], []
    device_get, to_host = jax.device_get, jd.training.PackedSums.to_host

    def counting(tree):
        if inside:
            inside[-1].append(jax.tree.leaves(tree))
        return device_get(tree)

    def read(self):
        inside.append([])
        try:
            return to_host(self)
        finally:
            reads.append(inside.pop())

    monkeypatch.setattr(jax, "device_get", counting)
    monkeypatch.setattr(jd.training.PackedSums, "to_host", read)
    batches = [batch(float(i), MASKS[i % 3]) for i in range(6)]
    # No implicit read (float(leaf), np.asarray(leaf)) of any device value: only explicit device_get
    # calls.
    with jax.transfer_guard_device_to_host("disallow"):
        history = trainer.fit(batches, steps=6, log_every=2, verbose=0)
    assert [row["step"] for row in history.train] == [2, 4, 6]
    # one read per window (the three log points, and the empty window closed as fit ends), each one
    # jax.device_get of one array: the loss's total and weight, the metric's total, the learning
    # rate, the non-finite record (5) and the step count
    assert len(reads) == 4, reads
    for calls in reads:
        assert len(calls) == 1 and len(calls[0]) == 1 and calls[0][0].shape == (10,), calls
    assert history.train[0]["loss"] == pytest.approx((0 * 3 + 1 * 8) / 11)


def test_bad_sums_name_the_fix():
    sums = jd.training.RunningSums.zeros(["loss", "acc"], token_weighted=["loss"])
    with pytest.raises(KeyError,
                       match=r"no running sums of 'accuracy': the sums hold \['loss', 'acc'\]"):
        sums.mean("accuracy")
    with pytest.raises(ValueError,
                                         match=r"token_weighted=\['tokens'\] names no metric: pass "
                                               r"some of "
                                         r"names=\('loss',\)"):
        jd.training.RunningSums.zeros(["loss"], token_weighted=["tokens"])
    step = jd.training.RunningSums.of_step({"loss": (1.0, None), "acc": (0.5, None)})
    with pytest.raises(ValueError,
                                         match=r"running sums of metrics \['loss', 'acc'\] "
                                               r"\(token-weighted: \['loss'\]\) "
                                         r"cannot add sums of metrics \['loss', 'acc'\] "
                                         r"\(token-weighted: \[\]\)"):
        sums.then(step)
    assert jd.training.RunningSums.zeros(()).pack().fields == (
        "non_finite_steps", "non_finite_first", "non_finite_lead", "non_finite_run",
        "non_finite_longest", "steps")


def test_packing_keeps_every_part():
    step = jd.training.RunningSums.of_step({"loss": (jnp.float32(6.0), jnp.float32(3.0)),
                                            "acc": (0.5, None)},
                                           flag=jnp.float32(1.0), learning_rate=jnp.float32(0.1))
    sums = jd.training.RunningSums.zeros(["loss", "acc"], ["loss"],
                                         learning_rate=True).then(step).then(step)
    packed = sums.pack()
    assert jax.tree.leaves(packed) == [packed.vector] and packed.vector.shape == (10,)
    host = packed.to_host()
    assert host.names == ("loss", "acc") and host.token_weighted == ("loss",)
    assert host.means() == {"loss": 2.0, "acc": 0.5} and float(host.loss_weight) == 6.0
    assert [int(v) for v in host.non_finite] == [2, 0, 2, 2, 2] and int(host.steps) == 2
    assert float(host.learning_rate) == pytest.approx(0.1)
    assert jax.tree.map(lambda a, b: bool(np.asarray(a) == np.asarray(b)), host,
                        sums) == jax.tree.map(
        lambda _: True, host)


@pytest.mark.parametrize("looped", [False, True], ids=["step-by-step", "on-device-loop"])
def test_each_window_starts_from_zeros_placed_once(looped, monkeypatch):
    """A window's sums start from zeros placed on the devices once and passed to the step that
    starts each window (the step does not consume them); an on-device loop consumes its starting
    sums, so each window after one gets zeros placed again. Sums peeked between steps stay
    readable after the next step."""
    from jaxdist.training.step import _compiled

    trainer = make_trainer(make("mirrored_8"))
    train(trainer, [batch(1.0, MASKS[1])], looped)
    trainer.pop_running_sums()  # the zeros are placed here, laid out as the sums were
    placed, put = [], _compiled.put
    monkeypatch.setattr(_compiled, "put", lambda *a: placed.append(a) or put(*a))
    for _ in range(3):
        train(trainer, [batch(2.0, MASKS[1])] * 2, looped)
        if not looped:
            peeked = trainer.peek_running_sums()
        train(trainer, [batch(5.0, MASKS[1])], looped)
        if not looped:
            assert int(peeked.to_host().steps) == 2 and peeked.to_host().mean("mean_y") == 2.0
        sums = trainer.pop_running_sums().to_host()
        assert int(sums.steps) == 3 and sums.mean("mean_y") == pytest.approx(3.0)
    assert len(placed) == (2 if looped else 0)
