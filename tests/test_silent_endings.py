"""Nothing ends silently: data that runs out before ``steps`` (one process too), a profile window
the fit never reaches, a progress record that is not the directory's, and an in-place update that
would change a value's type each say what happened and what to do (a one-time warning where the run
can go on, an error where it cannot).
"""

from __future__ import annotations

import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist as jd
from jaxdist.training.checkpoints import read_progress
from jaxdist.training.checkpoints._directory import PROGRESS_FILE


def batches(n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * n, 4)).astype(np.float32)
    return [(x[i : i + 8], (x[i : i + 8, 0] > 0).astype(np.int32)) for i in range(0, 8 * n, 8)]


def trainer():
    return jd.training.Trainer(
        jd.MirroredStrategy(),
        nn.Dense(2),
        optax.sgd(0.1),
        lambda o, y: optax.softmax_cross_entropy_with_integer_labels(o, y).mean(),
    )


def test_a_read_once_iterator_that_ends_before_steps_is_said_on_one_process():
    t = trainer()
    with pytest.warns(UserWarning,
                                         match=r"train_data ended at step 5 of steps=10: the run "
                                               r"stopped there "
                                         r"\(history.data_ended == 5\)\. An iterator is read once: "
                                         r"pass a list"):
        history = t.fit(iter(batches(5)), steps=10, verbose=0)
    assert t.step == 5 and history.data_ended == 5
    t = trainer()
    history = t.fit(iter(batches(3)), steps=3, verbose=0)  # exactly enough: nothing to say
    assert t.step == 3 and history.data_ended is None


def test_a_profile_window_after_the_last_step_is_said_and_one_before_a_resumed_run_is_not(
    tmp_path, monkeypatch
):
    started = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: started.append(a))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
    t = trainer()
    with pytest.warns(UserWarning,
                                         match=r"profile_steps=\(100, 200\): no trace taken: this "
                                               r"fit ended at step 8, "
                                         r"before the window's first step 100\. Pass a window "
                                         r"within the steps"):
        t.fit(batches(8), steps=8, log_dir=tmp_path, profile_steps=(100, 200), verbose=0)
    assert started == [] and not (tmp_path / "profile").exists()
    # resumed past it: no word
    t.fit(batches(8), steps=12, log_dir=tmp_path, profile_steps=(2, 4), verbose=0)

    class Stop(jd.training.Callback):
        def on_step_end(self, trainer, step, metrics):
            trainer.stop_training = True

    t.fit(batches(8), steps=20, log_dir=tmp_path, profile_steps=(18, 19), callbacks=[Stop()],
          verbose=0)
    assert t.step == 13 and started == []  # stopped on request before the window: no word either


def test_a_progress_record_that_is_not_the_directorys_is_said_and_ignored(tmp_path):
    ck = tmp_path / "ck"
    options = {"checkpoint_dir": ck, "checkpoint_every": 5, "log_every": 5, "verbose": 0}
    trainer().fit(batches(10), steps=5, **options)
    # Copied in from a run that reached step 50 after checkpoint 45, which this directory does not
    # have.
    (ck / PROGRESS_FILE).write_text(json.dumps({"step": 50, "checkpoint": 45, "time": time.time()}))
    with pytest.warns(UserWarning,
                                         match=r"its progress record \(\.jaxdist-progress\.json\) "
                                               r"says a run reached "
                                         r"step 50 after checkpoint 45, which this directory does "
                                         r"not have \(its "
                                         r"newest is 5\).*It is ignored"):
        history = trainer().fit(batches(10), steps=10, **options)
    assert history.time["lost"] == 0  # before: every resumed step counted as taken again
    # ended with a checkpoint of its last step: no record now
    assert not os.path.exists(ck / PROGRESS_FILE)
    # A record of this directory's own run (a crash after its checkpoint 10, at step 13) is
    # believed.
    (ck / PROGRESS_FILE).write_text(json.dumps({"step": 13, "checkpoint": 10, "time": time.time()}))
    assert read_progress(str(ck)) == 13


def test_an_update_that_would_truncate_a_sync_on_read_value_is_an_error():
    strategy = jd.MirroredStrategy()
    seen = strategy.sync_on_read(jnp.zeros((), jnp.int32), jd.VariableAggregation.SUM)
    with pytest.raises(TypeError,
                       match=r"^assign_add\(0\.5\): the sync-on-read value is int32, which cannot "
                             r"hold a float32 value \(it would be truncated without a word\)\. "
                             r"Pass a value of dtype int32 .* "
                             r"strategy\.sync_on_read\(jnp\.zeros\(shape, jnp\.float32\)"):
        seen.assign_add(0.5)
    with pytest.raises(TypeError, match=r"^assign_sub\(0\.5\): "):
        seen.assign_sub(0.5)
    with pytest.raises(TypeError, match=r"^assign\(a float32 value\): "):
        seen.assign(jnp.float32(2.0))

    def count(s):
        s.assign_add(0.5)  # in replica context too: each replica's component would gain 0

    with pytest.raises(TypeError, match=r"^assign_add\(0\.5\): the sync-on-read value is int32"):
        strategy.run(count, args=(seen,))
    assert int(seen.read()) == 0
    seen.assign_add(3)  # what the dtype holds still goes in
    strategy.run(lambda s: s.assign_add(jnp.int32(1)), args=(seen,))
    assert int(seen.read()) == 3 + strategy.num_replicas_in_sync
    real = strategy.sync_on_read(jnp.zeros((), jnp.float32), "mean")
    with pytest.raises(TypeError,
                       match=r"^assign_add\(1j\): the sync-on-read value is float32, which cannot "
                             r"hold a complex64 value"):
        real.assign_add(1j)
    real.assign_add(2)  # an int into a float: exact
    assert float(real.read()) == 2.0
