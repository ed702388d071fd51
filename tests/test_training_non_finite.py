"""A run that diverges loses nothing: ``fit(on_non_finite=...)`` stops, skips or rolls back; no NaN
state is saved.

The scenario of the issue: a small regression trained with ``checkpoint_every=10`` and the default
``keep_checkpoints=3``, whose learning rate jumps at step 30 (a stand-in for a loss spike): its loss
is first non-finite at step 35. A second scenario has finite training but three bad batches (steps
35-37, inputs scaled by 1e30: infinite loss, NaN gradients), a spike that skipping or rolling back
gets past.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from registry import LAUNCH, launch_env

import jaxdist as jd
from jaxdist.training.loop import FitOptions
from jaxdist.training.loop._logs import Logs
from jaxdist.training.step import (
    NonFiniteGuard,
    NonFinitePolicy,
    TrainState,
    Window,
    non_finite_leaves,
)

STEPS = 60
BAD = (35, 36, 37)  # the steps whose batches are bad in the second scenario
STRATEGIES = {
    "mirrored": lambda: jd.MirroredStrategy(),
    "fsdp": lambda: jd.ShardedStrategy(min_shard_size=1),
}


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.Dense(16)(x))


def data(epoch, bad=()):
    """40 batches per epoch; the batches of the steps in ``bad`` (first epoch) have inputs scaled by
    1e30."""
    xs = np.random.default_rng(epoch).normal(size=(40, 16, 8)).astype(np.float32)
    out = [(x, x @ np.linspace(-1, 1, 8).astype(np.float32)) for x in xs]
    for step in bad:
        if (step - 1) // 40 == epoch:
            i = (step - 1) % 40
            out[i] = (out[i][0] * 1e30, out[i][1])
    return out


def mse(out, y):
    return ((out[:, 0] - y) ** 2).mean()


def trainer(strategy="mirrored", spike=True, **kwargs):
    # 0.02 -> 3.0 at step 30
    lr = optax.piecewise_constant_schedule(0.02, {30: 150.0}) if spike else 0.02
    return jd.training.Trainer(STRATEGIES[strategy](), Net(), optax.sgd(lr), mse, **kwargs)


def finite(tree):
    return all(bool(np.isfinite(np.asarray(a)).all()) for a in jax.tree.leaves(tree))


def params(t):
    return [np.asarray(a) for a in jax.tree.leaves(t.params)]


def absolute(position):
    return position.epoch * 40 + position.index


def restored_everywhere(directory, **kwargs):
    """Every checkpoint in ``directory``, restored into ``trainer(**kwargs)``: ``{step:
    finite?}``."""
    out = {}
    for step in jd.training.Checkpointer(directory).all_steps():
        fresh = trainer(**kwargs)
        fresh.restore(directory, step=step, batch=data(0)[0])
        out[step] = finite(fresh.state.params) and finite(fresh.state.opt_state)
    return out


# ------------------------------------------------------------------------------------- the scenario
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_loss_spike_stops_the_run_and_the_step_30_checkpoint_survives(strategy, tmp_path):
    t = trainer(strategy)
    with pytest.raises(FloatingPointError) as caught:
        t.fit(data, steps=STEPS, checkpoint_dir=tmp_path, checkpoint_every=10, verbose=0)
    error = caught.value
    assert isinstance(error, jd.training.NonFiniteError)
    assert 31 <= error.step <= 40 and error.checkpoint == 30 and error.directory == str(tmp_path)
    message = str(error)
    assert f"step {error.step} were not finite" in message
    assert "last finite checkpoint is step 30" in message and "restore_step=30" in message
    # None was deleted for a NaN one, and each restores finite.
    assert restored_everywhere(tmp_path, strategy=strategy) == {10: True, 20: True, 30: True}
    again = trainer(strategy)
    assert again.restore(tmp_path, batch=data(0)[0]) == 30 and finite(again.params)


@pytest.mark.timeout(300)
def test_continue_trains_on_with_one_warning_and_saves_no_non_finite_state(tmp_path):
    t = trainer()
    with pytest.warns(RuntimeWarning) as warned:
        history = t.fit(data, steps=STEPS, checkpoint_dir=tmp_path, checkpoint_every=10, verbose=0,
                        on_non_finite="continue")
    messages = [str(w.message) for w in warned]
    assert sum("on_non_finite='continue' trains on" in m for m in messages) == 1  # said once
    assert all("not saving step" in m for m in messages if "trains on" not in m)
    assert t.step == STEPS and not finite(t.params)  # the old behaviour
    assert history.non_finite_steps > 0 and any(row.get("non_finite_steps")
                                                for row in history.train)
    assert set(restored_everywhere(tmp_path).values()) == {True}
    assert max(jd.training.Checkpointer(tmp_path).all_steps()) <= 40


# -------------------------------------------------------------------------------- skip and rollback
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("steps_per_run", "grad_accum_steps"), [(1, 1), (5, 1), (1, 2)])
def test_skip_changes_nothing_on_bad_steps_and_finishes_finite(
    steps_per_run, grad_accum_steps, tmp_path
):
    """apply_if_finite semantics: the run over 40 batches with 3 bad ones ends exactly where a run
    over the 37 good ones ends (the step counter moves on; the optimizer's own count does not)."""
    kwargs = {"steps_per_run": steps_per_run, "grad_accum_steps": grad_accum_steps, "spike": False}
    t = trainer(**kwargs)
    history = t.fit(lambda e: data(e, BAD), steps=40, checkpoint_dir=tmp_path, checkpoint_every=10,
                    verbose=0, on_non_finite="skip")
    assert t.step == 40 and finite(t.params)
    assert history.non_finite_steps == 3
    assert [(row["step"], row.get("non_finite_steps")) for row in history.train][2:4] == [
        (30, None),
        (40, 3),
    ]
    good = [b for i, b in enumerate(data(0, BAD), 1) if i not in BAD]
    reference = trainer(**kwargs)
    reference.fit(good, steps=37, verbose=0)
    for a, b in zip(params(t), params(reference), strict=True):
        np.testing.assert_array_equal(a, b)
    assert set(restored_everywhere(tmp_path, **kwargs).values()) == {True}


@pytest.mark.timeout(300)
def test_skip_stops_after_max_consecutive_skips_in_a_row_across_windows(tmp_path):
    t = trainer(spike=False)
    policy = jd.training.NonFinitePolicy("skip", max_consecutive_skips=3)
    with pytest.raises(jd.training.NonFiniteError,
                       match=r"step 39 .*3 steps in a row .*max_consecutive_skips=3"):
        t.fit(lambda e: data(e, (39, 40, 41)), steps=STEPS, checkpoint_dir=tmp_path,
              checkpoint_every=10, verbose=0, on_non_finite=policy)
    assert finite(t.params)  # every bad step was skipped
    # Two bad steps in a row (39, 40; then 41 alone is not a run of 3 with them, 42 is good):
    # trained through.
    t = trainer(spike=False)
    history = t.fit(lambda e: data(e, (39, 40, 42)), steps=STEPS, verbose=0, on_non_finite=policy)
    assert t.step == STEPS and history.non_finite_steps == 3 and finite(t.params)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("strategy", "steps_per_run"), [("mirrored", 1), ("fsdp", 1),
                                                         ("mirrored", 5)])
def test_rollback_restores_the_last_checkpoint_moves_the_data_past_and_finishes_finite(
    strategy, steps_per_run, tmp_path
):
    t = trainer(strategy, spike=False, steps_per_run=steps_per_run)
    with pytest.warns(RuntimeWarning,
                      match=r"step 35 were not finite: rolled back to checkpoint 30"):
        history = t.fit(lambda e: data(e, BAD), steps=STEPS, checkpoint_dir=tmp_path,
                        checkpoint_every=10, verbose=0, on_non_finite="rollback")
    assert t.step == STEPS and finite(t.params)
    [rollback] = history.rollbacks
    assert rollback["step"] == 35 and rollback["restored"] == 30
    moved_on = absolute(rollback["data_position"])
    assert moved_on >= 37  # past the bad batches: they are never trained on again
    assert absolute(t.data_position) == moved_on + STEPS - 30
    assert history.non_finite_steps >= 6  # 35-37 bad, and the steps after them from a NaN state
    assert jd.training.Checkpointer(tmp_path).all_steps() == [40, 50, 60]
    assert set(restored_everywhere(tmp_path, strategy=strategy, spike=False,
                                   steps_per_run=steps_per_run).values()) \
        == {True}


@pytest.mark.timeout(300)
def test_rollback_stops_after_max_rollbacks_or_without_an_earlier_checkpoint(tmp_path):
    t = trainer()  # the learning rate stays high: every rollback diverges again
    with pytest.warns(RuntimeWarning, match="rolled back"), pytest.raises(
        jd.training.NonFiniteError, match=r"after 1 rollback \(.*max_rollbacks=1"
    ):
        t.fit(data, steps=STEPS, checkpoint_dir=tmp_path / "a", checkpoint_every=10, verbose=0,
              on_non_finite=jd.training.NonFinitePolicy("rollback", max_rollbacks=1))
    assert jd.training.Checkpointer(tmp_path / "a").all_steps() == [10, 20, 30]
    t = trainer(spike=False)
    with pytest.raises(jd.training.NonFiniteError,
                       match="no checkpoint before it to roll back to") as caught:
        t.fit(lambda e: data(e, (5,)), steps=20, checkpoint_dir=tmp_path / "b", checkpoint_every=10,
              verbose=0, on_non_finite="rollback")
    assert caught.value.step == 5 and caught.value.checkpoint is None


# ------------------------------------------------------------------------------------- a finite run
@pytest.mark.timeout(300)
def test_a_finite_run_is_the_same_under_every_policy(tmp_path):
    """Same numbers, same logs (no non_finite_steps), same checkpoints, whichever policy (and step
    variant)."""
    results = []
    for policy in ("stop", "skip", "rollback", "continue"):
        t = trainer(spike=False)
        history = t.fit(data, steps=30, checkpoint_dir=tmp_path / policy, checkpoint_every=10,
                        verbose=0, on_non_finite=policy)
        rows = [{k: v for k, v in row.items() if k != "steps_per_sec" and not k.startswith("time/")}
                for row in history.train]
        restored = trainer(spike=False)
        restored.restore(tmp_path / policy, step=20, batch=data(0)[0])
        results.append((params(t), rows, jd.training.Checkpointer(tmp_path / policy).all_steps(),
                        params(restored), history.non_finite_steps, history.rollbacks))
    for other in results[1:]:
        for a, b in zip(results[0][0] + results[0][3], other[0] + other[3], strict=True):
            np.testing.assert_array_equal(a, b)
        assert other[1:3] == results[0][1:3] and other[4:] == (0, [])
    assert all("non_finite_steps" not in row for row in results[0][1])


# ---------------------------------------------------------------------------- saving and preemption
def test_save_refuses_a_non_finite_state_and_writes_nothing(tmp_path):
    t = trainer(spike=False)
    batch = data(0)[0]
    t.init(batch)
    t.save(tmp_path, max_to_keep=None)  # step 0: finite
    t.train_on_batch((batch[0], np.full_like(batch[1], np.nan)))
    with pytest.raises(jd.training.NonFiniteError,
                                                         match=r"not saving step 1 "
                                                               r".*\.params\[.*newest checkpoint "
                                                               r"there "
                                                         r"is step 0") as caught:
        t.save(tmp_path)
    assert caught.value.checkpoint == 0 and jd.training.Checkpointer(tmp_path).all_steps() == [0]
    with pytest.raises(jd.training.NonFiniteError, match="there is no checkpoint there"):
        t.save(tmp_path / "empty")


def test_non_finite_leaves_reads_nan_everywhere_and_inf_outside_the_optimizer_state():
    state = TrainState(jnp.int32(0), {"w": jnp.ones(2), "b": jnp.array([jnp.inf])},
                       (jnp.array(jnp.inf), {"mu": jnp.array([0.0, jnp.nan])}),
                       {"stats": jnp.zeros(2)}, jax.random.key_data(jax.random.key(0)))
    assert non_finite_leaves(state) == [".params['b']", ".opt_state[1]['mu']"]
    plateau = optax.contrib.reduce_on_plateau()  # its best value starts at inf: a finite state
    params = {"w": jnp.ones(2)}
    assert non_finite_leaves(state._replace(params=params, opt_state=plateau.init(params))) == []


@pytest.mark.timeout(300)
def test_a_preemption_during_a_stop_leaves_the_last_good_checkpoint(tmp_path):
    class Preempt(jd.training.Callback):
        def on_step_end(self, trainer, step, metrics):
            if step == 38:
                os.kill(os.getpid(), signal.SIGTERM)

    t = trainer()
    with pytest.raises(jd.training.NonFiniteError):
        t.fit(data, steps=STEPS, checkpoint_dir=tmp_path, checkpoint_every=10, verbose=0,
              callbacks=[Preempt()])
    # no preemption save of a NaN state
    assert jd.training.Checkpointer(tmp_path).all_steps() == [10, 20, 30]


# ---------------------------------------------------------------------------------------- mechanism
def test_a_window_is_read_at_the_same_check_on_every_process_with_a_lag():
    seen = []
    logs = Logs(0, lambda step, row: None, watch=lambda step, window: seen.append(step), lag=2)
    sums = jd.training.RunningSums.zeros(["loss"]).then(
        jd.training.RunningSums.of_step({"loss": (1.0, None)})
    )
    logs.close_window(1, sums.pack(), check=1)
    logs.emit_ready(2)
    assert seen == []  # ready, but not due: every process reads it at check 3
    logs.emit_ready(3)
    assert seen == [1]
    logs.close()


def test_the_guard_counts_runs_across_windows():
    guard = NonFiniteGuard(NonFinitePolicy("skip", max_consecutive_skips=4), step=0)
    guard.observe(10, Window(steps=10, count=2, first=8, lead=0, run=2, longest=2))
    guard.observe(20, Window(steps=10, count=10, first=0, lead=10, run=10, longest=10))
    assert (guard.first, guard.total, guard.longest_run) == (9, 12, 12)
    guard.restart(20)
    assert guard.first is None and not guard.pending and guard.total == 12


# ------------------------------------------------------------------------------------ bad arguments
def test_bad_on_non_finite_arguments_are_value_errors_naming_the_fix(tmp_path):
    t = trainer(spike=False)
    with pytest.raises(ValueError,
                                         match=r"on_non_finite='retry' is not a policy: pass one "
                                               r"of 'stop', 'skip', "
                                         r"'rollback', 'continue'"):
        t.fit(data, steps=1, on_non_finite="retry")
    with pytest.raises(ValueError, match=r"on_non_finite=None is not a policy"):
        t.fit(data, steps=1, on_non_finite=None)
    with pytest.raises(ValueError, match=r"on_non_finite='rollback' needs checkpoint_dir=\.\.\."):
        t.fit(data, steps=1, on_non_finite="rollback")
    with pytest.raises(ValueError,
                       match=r"NonFinitePolicy\(max_rollbacks=0\): it must be an int >= 1"):
        jd.training.NonFinitePolicy("rollback", max_rollbacks=0)
    with pytest.raises(ValueError, match=r"NonFinitePolicy\(max_consecutive_skips=True\)"):
        jd.training.NonFinitePolicy("skip", max_consecutive_skips=True)
    assert FitOptions(steps=1,
                      on_non_finite="skip").on_non_finite == jd.training.NonFinitePolicy("skip")
    assert t.step == 0 and t.state is None  # nothing ran
    with pytest.raises(RuntimeError, match=r"peek_running_sums\(\) before the state exists"):
        t.peek_running_sums()


# ------------------------------------------------------------------------------------ two processes
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_processes_take_the_same_decision_at_the_same_step(tmp_path):
    """2 processes x 4 devices: "rollback" rolls back once, at the same step, and ends with the same
    finite parameters on both; "stop" raises on both, naming the same step and checkpoint, and the
    job catches it and resumes from that checkpoint (the error is not told to the peers as one
    process's failure, which would end them). Slow because of its 2-process job (imports, gloo,
    compiles, three runs with checkpoints)."""
    worker = Path(__file__).parent / "multiprocess" / "non_finite_worker.py"
    command = [*LAUNCH, "-n", "2", "--cpu-devices", "4", "--timeout", "300",
               str(worker), str(tmp_path)]
    proc = subprocess.run(command, env=launch_env(), capture_output=True, text=True, timeout=360)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-5000:]
    rollback = dict(re.findall(r"^\[(\d)\] (rollback .*)$", proc.stdout, re.M))
    stop = dict(re.findall(r"^\[(\d)\] (stop .*)$", proc.stdout, re.M))
    resume = dict(re.findall(r"^\[(\d)\] (resume .*)$", proc.stdout, re.M))
    assert set(rollback) == set(stop) == set(resume) == {"0", "1"}, text[-5000:]
    # the same decisions, at the same steps
    assert rollback["0"] == rollback["1"] and stop["0"] == stop["1"]
    assert "step=25 finite=True " in rollback["0"] and "rollbacks=[(15, 10, " in rollback["0"]
    assert resume["0"] == resume["1"], text[-5000:]
    assert re.fullmatch(r"resume step=25 finite=True params=\w+ skipped=3", resume["0"]), resume
    step = int(re.search(r"error\.step=(\d+) checkpoint=10", stop["0"]).group(1))
    assert 15 <= step <= 20
