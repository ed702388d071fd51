"""jaxdist.training checkpoints (in-process): restore onto any strategy, keep N, exact resume, bad
checkpoints.

The subprocess tests (SIGKILL during a save, SIGTERM then resume) are in
test_training_preemption.py.
"""

from __future__ import annotations

import os
import signal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from registry import (
    CLASSES,
    FEATURES,
    QUICK_TIER_LEAVES_OUT,
    REGISTRY,
    host_leaves,
    make,
    shuffled_batches,
)

import jaxdist as jd

STRATEGIES = sorted(REGISTRY)


class DropoutMLP(nn.Module):
    width: int = 16

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(self.width)(x))
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(CLASSES)(x)


class NnxDropoutMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(16, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.hidden(x))))


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


data_fn = shuffled_batches  # 4 fixed batches, shuffled per epoch (deterministic)

SAMPLE = data_fn(0)[0]


def linen_trainer(strategy, optimizer=None, width=16):
    return jd.training.Trainer(strategy, DropoutMLP(width), optimizer or optax.adam(1e-2), ce,
                               train_kwargs={"train": True}, seed=3)


def nnx_trainer(strategy):
    return jd.training.Trainer(strategy, NnxDropoutMLP(nnx.Rngs(5)), optax.adam(1e-2), ce)


def assert_bitwise(a, b):
    for x, y in zip(host_leaves(a), host_leaves(b), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.fixture(scope="session")
def written(tmp_path_factory):
    """``written(name)``: the checkpoint (step 3) fit writes with registry strategy ``name``, and
    the state it saved; written the first time a test asks for it (the quick tier's matrix needs
    only its strategies')."""
    out = {}

    def checkpoint(name):
        if name not in out:
            strategy = make(name)  # skips where the devices are short
            directory = tmp_path_factory.mktemp(f"ckpt_{name}")
            trainer = linen_trainer(strategy)
            trainer.fit(data_fn, steps=3, checkpoint_dir=directory, verbose=0)
            out[name] = (directory, trainer.state)
        return out[name]

    return checkpoint


# Every writer and reader of the registry; the quick tier runs the pairs of its strategies
# (QUICK_TIER_LEAVES_OUT).
@pytest.mark.parametrize(("writer", "reader"), [
    pytest.param(w, r, marks=[pytest.mark.slow] if {w, r} & set(QUICK_TIER_LEAVES_OUT) else [])
    for r in STRATEGIES for w in STRATEGIES
])
def test_restore_matrix_linen(writer, reader, written):
    directory, want = written(writer)
    strategy = make(reader)
    trainer = linen_trainer(strategy)
    assert trainer.restore(directory, batch=SAMPLE) == 3
    assert_bitwise(trainer.state, want)
    assert trainer.data_position == jd.training.DataPosition(0, 3)
    for leaf in jax.tree.leaves(trainer.state):  # restored straight into the reader's layout
        assert leaf.sharding.device_set == set(strategy.devices)


@pytest.mark.parametrize(("writer", "reader"), [("mirrored_8", "one_device"),
                                                ("one_device", "mirrored_8")])
def test_restore_nnx_across_strategies_and_continue(writer, reader, tmp_path):
    first = nnx_trainer(make(writer))
    first.fit(data_fn, steps=3, checkpoint_dir=tmp_path, verbose=0)
    resumed = nnx_trainer(make(reader))
    # restores step 3, trains to 6
    resumed.fit(data_fn, steps=6, checkpoint_dir=tmp_path, verbose=0)
    straight = nnx_trainer(make(reader))
    straight.fit(data_fn, steps=6, verbose=0)
    assert resumed.step == 6
    for a, b in zip(host_leaves(resumed.state), host_leaves(straight.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # the user's nnx module holds the trained values
    np.testing.assert_array_equal(np.asarray(resumed.model.out.kernel[...]),
                                  np.asarray(resumed.state.params["out"]["kernel"]))


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_resume_is_bitwise_identical(kind, tmp_path):
    build = linen_trainer if kind == "linen" else nnx_trainer
    strategy = make("mirrored_8")
    straight = build(strategy)
    straight.fit(data_fn, steps=10, verbose=0)  # 2.5 epochs, dropout on
    build(strategy).fit(data_fn, steps=6, checkpoint_dir=tmp_path, verbose=0)  # stops mid-epoch
    resumed = build(strategy)
    resumed.fit(data_fn, steps=10, checkpoint_dir=tmp_path, verbose=0)
    assert resumed.step == 10 and resumed.data_position == jd.training.DataPosition(2, 2)
    assert_bitwise(resumed.state, straight.state)


def test_keep_last_n_and_restore_latest_or_chosen(tmp_path):
    strategy = make("mirrored_2")
    trainer = linen_trainer(strategy)
    history = trainer.fit(data_fn, steps=10, checkpoint_dir=tmp_path, checkpoint_every=2,
                          keep_checkpoints=2, verbose=0)
    assert len(history.checkpoints) == 5
    assert jd.training.Checkpointer(tmp_path).all_steps() == [8, 10]
    other = linen_trainer(strategy)
    assert other.restore(tmp_path, batch=SAMPLE) == 10
    assert other.restore(tmp_path, step=8) == 8
    with pytest.raises(FileNotFoundError,
                       match=r"no checkpoint for step=4 .* it has steps \[8, 10\]"):
        other.restore(tmp_path, step=4)


def test_sigterm_finishes_the_step_saves_and_returns_or_exits(tmp_path):
    strategy = make("mirrored_2")

    class Preempt(jd.training.Callback):
        def on_step_end(self, trainer, step, metrics):
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = linen_trainer(strategy)
    history = trainer.fit(data_fn, steps=10, checkpoint_dir=tmp_path / "a", verbose=0,
                          callbacks=[Preempt()], on_preemption="return")
    assert history.preempted and trainer.step == 3
    assert jd.training.Checkpointer(tmp_path / "a").all_steps() == [3]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the previous handler is back
    with pytest.raises(SystemExit) as exit_info:
        linen_trainer(strategy).fit(data_fn, steps=10, checkpoint_dir=tmp_path / "b", verbose=0,
                                    callbacks=[Preempt()])
    assert exit_info.value.code == 0
    assert jd.training.Checkpointer(tmp_path / "b").all_steps() == [3]


# ---------------------------------------------------------------------------------- bad checkpoints
def test_another_models_checkpoint_is_a_clear_error(tmp_path):
    strategy = make("mirrored_2")
    linen_trainer(strategy, width=16).fit(data_fn, steps=1, checkpoint_dir=tmp_path, verbose=0)
    other = linen_trainer(strategy, width=32)
    with pytest.raises(ValueError,
                                         match=r"another model's checkpoint "
                                               r".*\.params\['Dense_0'\]\['kernel'\]: "
                                         r"\(8, 16\) float32 in the checkpoint, \(8, 32\) float32 "
                                         r"here"):
        other.fit(data_fn, steps=2, checkpoint_dir=tmp_path, verbose=0)


def test_optimizer_state_that_does_not_fit_is_a_clear_error(tmp_path):
    strategy = make("mirrored_2")
    linen_trainer(strategy, optax.adam(1e-2)).fit(data_fn, steps=1, checkpoint_dir=tmp_path,
                                                  verbose=0)
    with pytest.raises(ValueError, match=r"optimizer state that does not fit .*\.opt_state"):
        linen_trainer(strategy, optax.sgd(0.1, momentum=0.9)).restore(tmp_path, batch=SAMPLE)


def test_nnx_checkpoint_into_linen_trainer_and_back(tmp_path):
    strategy = make("one_device")
    nnx_trainer(strategy).fit(data_fn, steps=1, checkpoint_dir=tmp_path / "nnx", verbose=0)
    linen_trainer(strategy).fit(data_fn, steps=1, checkpoint_dir=tmp_path / "linen", verbose=0)
    with pytest.raises(
        ValueError, match="checkpoint of a nnx model, but this Trainer's model is a linen module"
    ):
        linen_trainer(strategy).restore(tmp_path / "nnx", batch=SAMPLE)
    with pytest.raises(
        ValueError, match="checkpoint of a linen model, but this Trainer's model is a nnx module"
    ):
        nnx_trainer(strategy).fit(data_fn, steps=2, checkpoint_dir=tmp_path / "linen", verbose=0)


def test_foreign_or_missing_checkpoint(tmp_path):
    manager = ocp.CheckpointManager(tmp_path / "foreign")
    manager.save(5, args=ocp.args.Composite(other=ocp.args.StandardSave({"w": jnp.ones(2)})))
    manager.wait_until_finished()
    manager.close()
    trainer = linen_trainer(make("one_device"))
    with pytest.raises(ValueError, match=r"that jaxdist\.training did not write"):
        trainer.restore(tmp_path / "foreign", batch=SAMPLE)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        trainer.restore(tmp_path / "empty", batch=SAMPLE)


def test_checkpointer_own_loop_round_trip_across_strategies(tmp_path):
    eight, one = make("mirrored_8"), make("one_device")
    state = eight.mirror({"w": np.arange(6.0, dtype=np.float32), "step": np.int32(4)})
    ckpt = jd.training.Checkpointer(tmp_path, max_to_keep=1)
    ckpt.save(4, state, {"epoch": 1})
    ckpt.save(5, state)
    assert ckpt.all_steps() == [5]
    like = one.mirror(jax.tree.map(np.zeros_like, jax.device_get(state)))
    restored, meta = ckpt.restore(like)
    ckpt.close()
    assert meta["step"] == 5 and restored["w"].sharding.device_set == {one.devices[0]}
    assert_bitwise(restored, state)
    with pytest.raises(ValueError, match="max_to_keep=0 must be an int >= 1"):
        jd.training.Checkpointer(tmp_path, max_to_keep=0)
