"""jaxdist.training for language models: token-weighted losses, tokens/s, MFU and memory.

A loss returning ``(sum, weight)`` must make, under gradient accumulation and on many replicas, the
update and the logged loss that ONE step on the whole batch on one device makes, however padding is
spread over the micro-batches and replicas (fp32, rtol 1e-5). MFU is "n/a" on CPU unless a peak is
given, and then equals XLA's FLOPs of the compiled step x steps/s / peak.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from registry import make

import jaxdist as jd
from jaxdist.costs.step import CostOptions, measure_step_cost

VOCAB, SEQ, BATCH, ACCUM = 11, 6, 64, 4


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(VOCAB)(nn.relu(nn.Dense(16)(nn.Embed(VOCAB, 8)(tokens))))


def token_loss(logits, y):
    labels, mask = y
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return (losses * mask).sum(), mask.sum()


def token_accuracy(logits, y):
    labels, mask = y
    return ((logits.argmax(-1) == labels) * mask).sum(), mask.sum()


def lm_batches(n, seed=0):
    """Sequences of random lengths (0 to SEQ real tokens, the rest padding): every micro-batch and
    every replica holds a different number of real tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
        lengths = rng.integers(0, SEQ + 1, BATCH)
        mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.float32)
        out.append((tokens[:, :-1], (tokens[:, 1:], mask)))
    return out


@pytest.fixture(scope="session")
def variables():
    return TinyLM().init(jax.random.key(0), np.zeros((1, SEQ), np.int32))


def reference(batches, opt, params):
    """One big batch per step on one device (plain jax.jit): per-step gradients, final params, and
    every step's (loss sum, accuracy sum, tokens) for the window means."""

    def mean_loss(p, x, y):
        total, tokens = token_loss(TinyLM().apply({"params": p}, x), y)
        return total / tokens, total

    @jax.jit
    def step(p, s, x, y):
        (_, total), g = jax.value_and_grad(mean_loss, has_aux=True)(p, x, y)
        hits, tokens = token_accuracy(TinyLM().apply({"params": p}, x), y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g, (total, hits, tokens)

    state, grads, sums = opt.init(params), [], []
    for x, y in batches:
        params, state, g, s = step(params, state, x, y)
        grads.append(g)
        sums.append(np.asarray(s, np.float64))
    return params, grads, np.asarray(sums)


def close(got, want, rtol=1e-5, atol=1e-7):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


OPT = optax.sgd(0.5, momentum=0.9)  # after step 1 the momentum trace IS the step's gradient


@pytest.fixture(scope="session")
def accumulation_case(variables):
    """Three batches and their one-big-batch reference (shared by the strategies)."""
    batches = lm_batches(3)
    return batches, reference(batches, OPT, variables["params"])


def test_mean_of_micro_batch_means_would_fail_the_comparison(variables, accumulation_case):
    # The bug the next test guards against: the mean of the micro-batches' means (micro-batch j:
    # rows j, j+4, ...) has another gradient than the token-weighted mean, far beyond the
    # comparison's tolerance.
    batches, (_, want_grads, _) = accumulation_case
    x, y = batches[0]

    def mean_of_means(p):
        logits = TinyLM().apply({"params": p}, x)
        return (
            sum(jax.numpy.divide(*token_loss(logits[j::ACCUM], (y[0][j::ACCUM], y[1][j::ACCUM])))
                for j in range(ACCUM))
            / ACCUM
        )

    wrong = jax.jit(jax.grad(mean_of_means))(variables["params"])
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        close(wrong, want_grads[0])


@pytest.mark.slow
@pytest.mark.parametrize("strategy_name", ["mirrored_8", "sharded_8"])
def test_token_weighted_accumulation_equals_one_big_batch(strategy_name, variables,
                                                          accumulation_case, capsys):
    strategy = make(strategy_name)
    batches, (want_params, want_grads, sums) = accumulation_case
    trainer = jd.training.Trainer(
        strategy,
        TinyLM(),
        OPT,
        token_loss,
        variables=variables,
        metrics={"accuracy": token_accuracy},
        grad_accum_steps=ACCUM,
    )
    trainer.fit(batches, steps=1, verbose=0)
    # the gradient of the whole batch's token mean
    close(trainer.state.opt_state[0].trace, want_grads[0])
    history = trainer.fit(batches, steps=3, log_every=3, verbose="lines")
    close(trainer.params, want_params)
    (row,) = history.train  # one window, steps 2 and 3: sums over sums, never a mean of means
    np.testing.assert_allclose(row["loss"], sums[1:, 0].sum() / sums[1:, 2].sum(), rtol=1e-5)
    np.testing.assert_allclose(row["accuracy"], sums[1:, 1].sum() / sums[1:, 2].sum(), rtol=1e-5)
    np.testing.assert_allclose(row["tokens_per_sec"], sums[1:, 2].sum() * row["steps_per_sec"] / 2,
                               rtol=1e-5)
    assert "mfu" not in row and "hfu" not in row  # CPU: no datasheet peak, no made-up number
    out = capsys.readouterr().out
    assert "per device: " in out and "optimizer " in out and "temp " in out
    # no "n/a" column on CPU
    assert "step 3/3 loss" in out and " tokens/s" in out and "mfu" not in out
    details = history.step_cost.describe()  # fit(verbose=2) shows it
    assert "train step per device (8 devices):" in details and "optimizer state" in details
    assert "peak n/a (no datasheet peak for cpu" in details and "live memory n/a" in details
    total, per_device = sum(a.nbytes
                            for a in jax.tree.leaves(variables)), history.step_cost.param_bytes
    if strategy_name == "mirrored_8":  # whole copies on every device
        assert per_device == total
    else:  # FSDP: about an eighth each (arrays that 8 does not divide stay whole)
        assert total / 8 <= per_device < total / 2
    # evaluation is token-weighted too (a ragged batch's padding rows masked)
    if strategy_name == "mirrored_8":
        x = np.concatenate([b[0] for b in batches])[:100]
        y = tuple(np.concatenate([b[1][i] for b in batches])[:100] for i in range(2))
        got = trainer.evaluate([(x[:64], (y[0][:64], y[1][:64])), (x[64:], (y[0][64:], y[1][64:]))])
        logits = TinyLM().apply({"params": want_params}, x)
        np.testing.assert_allclose(got["loss"], float(np.divide(*token_loss(logits, y))), rtol=1e-5)


def test_window_loss_is_token_weighted_with_steps_per_run(variables, accumulation_case):
    strategy = make("mirrored_8")
    batches, (want_params, _, sums) = accumulation_case
    trainer = jd.training.Trainer(
        strategy, TinyLM(), OPT, token_loss, variables=variables, steps_per_run=3,
        tokens_per_example=SEQ
    )
    history = trainer.fit(batches, steps=3, log_every=3, verbose=0)
    close(trainer.params, want_params)
    (row,) = history.train  # one on-device loop of 3 steps, one window: its sums over its sums
    np.testing.assert_allclose(row["loss"], sums[:, 0].sum() / sums[:, 2].sum(), rtol=1e-5)
    # tokens_per_example counts every position (padding too): rows x sequence length per step
    np.testing.assert_allclose(row["tokens_per_sec"], BATCH * SEQ * row["steps_per_sec"], rtol=1e-9)


def test_hfu_and_mfu_from_program_cost_and_a_given_peak(variables):
    strategy = jd.OneDeviceStrategy()
    batches = lm_batches(4, seed=2)
    peak = 5e9  # a "measured" CPU peak, FLOP/s per device
    trainer = jd.training.Trainer(strategy, TinyLM(), optax.sgd(0.1), token_loss,
                                  variables=variables, peak_flops=peak)
    history = trainer.fit(batches, steps=4, log_every=2, verbose=0)
    cost = history.step_cost
    assert (cost is trainer.step_cost() and cost.peak_flops == peak
            and cost.peak_source == "peak_flops=")
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        trainer.state)
    compiled = trainer._live.steps.fit_step.lower(like, batches[0],
                                                  trainer.peek_running_sums().vector).compile()
    # the one counter, of the step that ran
    assert cost.flops == jd.program_cost(compiled).flops > 0
    # no loop: as XLA counts
    assert cost.flops == pytest.approx(compiled.cost_analysis()["flops"], rel=0.01)
    assert cost.flops == trainer.plan(batches[0]).flops  # the Trainer and Plan read the same count
    # no remat: the model's work is the program's
    assert cost.model_flops == cost.flops and cost.uncosted == ()
    assert cost.temp_bytes == compiled.memory_analysis().temp_size_in_bytes
    assert (cost.param_bytes == sum(a.nbytes for a in jax.tree.leaves(variables))
            and cost.optimizer_bytes == 0)
    for row in history.train:
        assert row["hfu"] == pytest.approx(cost.flops * row["steps_per_sec"] / peak, rel=1e-9)
        assert row["mfu"] == pytest.approx(cost.model_flops * row["steps_per_sec"] / peak, rel=1e-9)
        assert 0 < row["mfu"]

    # Gradient accumulation: XLA counts a loop body once; program_cost counts every micro-batch, so
    # the same global batch costs about the same with 4 micro-batches as in one piece.
    accum = jd.training.Trainer(
        strategy, TinyLM(), optax.sgd(0.1), token_loss, variables=variables, grad_accum_steps=ACCUM
    )
    accum.train_on_batch(batches[0])
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        accum.state)
    counted_once = accum._live.steps.fit_step.lower(like, batches[0],
                                                    accum.pop_running_sums().vector).compile()
    flops = accum.step_cost().flops
    assert flops > 2 * counted_once.cost_analysis()["flops"]
    np.testing.assert_allclose(flops, cost.flops, rtol=0.2)


def test_loops_count_per_iteration_and_flops_per_step_sets_the_model_flops():
    # a loop of 3 matmuls (as nn.scan over layers): XLA counts its body once, program_cost 3x
    def scanned(w, x):
        return jax.lax.scan(lambda c, _: (jax.numpy.tanh(c @ w), None), x, None, length=3)[0]

    compiled = jax.jit(scanned).lower(np.ones((16, 16), np.float32),
                                      np.ones((4, 16), np.float32)).compile()
    state = jd.training.TrainState(0, {"w": np.ones((16, 16), np.float32)}, (), {}, None)
    measure = functools.partial(
        measure_step_cost, compiled, state, devices=jax.devices()[:1],
        local_devices=jax.devices()[:1], rows_per_step=4
    )
    cost = measure(options=CostOptions())
    assert (cost.unknown_loops == 0 and cost.flops >= 3 * 2 * 4 * 16 * 16
            and cost.param_bytes == 16 * 16 * 4)
    assert cost.flops > 2 * compiled.cost_analysis()["flops"]
    assert cost.model_flops_source == "program_cost without recomputation"
    # the given count is the model's
    cost = measure(options=CostOptions(flops_per_step=3e6, peak_flops=1e9))
    assert cost.model_flops == 3e6 and cost.model_flops_source == "flops_per_step= / devices"
    assert cost.flops == jd.program_cost(compiled).flops  # what the program executes stays counted
    assert cost.mfu(10.0) == pytest.approx(3e6 * 10 / 1e9)
    assert cost.hfu(10.0) == pytest.approx(cost.flops * 10 / 1e9)
    trainer = jd.training.Trainer(jd.OneDeviceStrategy(), TinyLM(), OPT, token_loss,
                                  flops_per_step=3e6)
    assert trainer.cost_options == CostOptions(flops_per_step=3e6)


@pytest.mark.parametrize(
    ("kind", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756.5e12),
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5", 459e12),
        ("TPU v5p", 459e12),
        ("TPU v6 lite", 918e12),
        ("TPU v4 lite", None),  # v4i: not in the table, so no number
        ("NVIDIA GeForce RTX 4090", None),
        ("cpu", None),
    ],
)
def test_peak_table(kind, peak):
    got = jd.costs.known_peak_flops(kind)
    assert (got[0] if got else None) == peak


def test_bad_weights_and_options_name_the_fix():
    strategy = jd.OneDeviceStrategy()
    batch = lm_batches(1)[0]

    def fit(loss, **kwargs):
        jd.training.Trainer(strategy, TinyLM(), optax.sgd(0.1), loss, **kwargs).fit(
            [batch], steps=1, verbose=0
        )

    per_token_weight = lambda out, y: (token_loss(out, y)[0], y[1])  # noqa: E731
    with pytest.raises(
        ValueError,
        match=r"loss_fn returned \(sum, weight\) with weight of shape \(64, 6\) float32 "
        r"for a batch of 64 rows; the weight must be a real number .* mask\.sum\(\)",
    ):
        fit(per_token_weight)
    with pytest.raises(
        ValueError, match=r"weight of shape \(\) bool .* \(not the mask itself, nor a boolean\)"
    ):
        fit(lambda out, y: (token_loss(out, y)[0], y[1].sum() > 0))
    with pytest.raises(ValueError,
                       match=r"with sum of shape \(64, 6\) float32 .* the SUM over tokens"):
        fit(lambda out, y: (optax.softmax_cross_entropy_with_integer_labels(out, y[0]) * y[1],
                            y[1].sum()))
    with pytest.raises(ValueError,
                       match=r"loss_fn returned a tuple of 3 values .* or a pair \(sum, weight\)"):
        fit(lambda out, y: (*token_loss(out, y), 1.0))
    with pytest.raises(ValueError,
                       match=r"metrics\['acc'\] returned \(sum, weight\) with weight of shape "
                             r"\(64, 6\)"):
        fit(token_loss, metrics={"acc": lambda out, y: (token_accuracy(out, y)[0], y[1])})
    for option, value, fix in [
        ("peak_flops", -1.0, r"the peak FLOP/s of ONE device"),
        ("peak_flops", "989e12", r"the peak FLOP/s of ONE device"),
        ("flops_per_step", 0, r"FLOPs per optimizer step over the global batch"),
        ("tokens_per_example", 0, r"the tokens in one example, e\.g\. the sequence length"),
        ("tokens_per_example", 6.0, r"an int >= 1 \(the tokens in one example"),
    ]:
        with pytest.raises(ValueError, match=rf"{option}={value!r} must be .*{fix}"):
            jd.training.Trainer(strategy, TinyLM(), optax.sgd(0.1), token_loss, **{option: value})
    with pytest.raises(RuntimeError,
                       match=r"step_cost\(\) before the first training step: call fit"):
        jd.training.Trainer(strategy, TinyLM(), optax.sgd(0.1), token_loss).step_cost()
