"""Asynchronous checkpoints (in-process): training goes on while a save is written, the checkpoint
holds the state of its step even though the steps donate it, a failed background save raises,
preemption and the end of ``fit`` wait for the save in flight. The write is slowed, held or failed
where orbax renames the finished temporary directory into place (the commit), which runs in orbax's
background thread.

SIGKILL during an asynchronous save (a real subprocess): tests/test_training_preemption.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from orbax.checkpoint._src.path import atomicity

import jaxdist as jd
from jaxdist.training.loop._job_time import JOB_FILE

BATCH = 32


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dropout(0.3, deterministic=not train)(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(4)(x)


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def data_fn(epoch):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * BATCH, 8)).astype(np.float32)
    y = x[:, :4].argmax(1).astype(np.int32)
    order = np.random.default_rng((1, epoch)).permutation(len(x))
    return [(x[order[i : i + BATCH]], y[order[i : i + BATCH]]) for i in range(0, len(x), BATCH)]


def trainer(strategy=None):
    return jd.training.Trainer(
        strategy or jd.MirroredStrategy(), DropoutMLP(), optax.adam(1e-2), ce,
        train_kwargs={"train": True}, seed=3
    )


def host(tree):
    return [np.asarray(jax.device_get(a)) for a in jax.tree.leaves(tree)]


@pytest.fixture
def at_commit(monkeypatch):
    """``at_commit({step: action})``: run ``action()`` in orbax's background thread just before
    checkpoint ``step`` is renamed into place (raising from it fails that save)."""
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    def install(actions):
        async def patched(self, *args, **kwargs):
            action = actions.get(os.path.basename(str(self.get_final())))
            if action is not None:
                action()
            return await finalize(self, *args, **kwargs)

        monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", patched)

    return install


def test_training_goes_on_while_a_save_is_written_and_it_holds_its_steps_state(tmp_path, at_commit):
    released, held = threading.Event(), []
    at_commit({"3": lambda: held.append(released.wait(30))})  # step 3's save waits for step 5
    seen, snapshots = [], {}

    class Watch(jd.training.Callback):
        def on_step_end(self, trainer, step, metrics):
            if step == 3:
                snapshots[3] = host(trainer.params)
            if step == 5:
                # steps 4 and 5 ran (and donated the state) while checkpoint 3 was pending
                released.set()

        def on_checkpoint(self, trainer, step, path):
            seen.append((step, trainer.step))

    t = trainer()
    history = t.fit(data_fn, steps=6, checkpoint_dir=tmp_path, checkpoint_every=3, verbose=0,
                    callbacks=[Watch()])
    assert held == [True]  # released by the training loop, not by the timeout
    assert seen[0][0] == 3 and seen[0][1] >= 5 and seen[1] == (6, 6)  # reported once complete
    assert [os.path.basename(p) for p in history.checkpoints] == ["3", "6"]
    restored = trainer()
    assert restored.restore(tmp_path, step=3, batch=data_fn(0)[0]) == 3
    for a, b in zip(host(restored.params), snapshots[3], strict=True):
        assert np.array_equal(a, b)


def test_preemption_and_the_end_of_fit_wait_for_the_save_in_flight(tmp_path, at_commit):
    at_commit({"3": lambda: time.sleep(0.5)})  # a slow write, still in flight when SIGTERM comes

    class Preempt(jd.training.Callback):
        def on_step_end(self, trainer, step, metrics):
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    history = trainer().fit(
        data_fn,
        steps=10,
        checkpoint_dir=tmp_path,
        checkpoint_every=3,
        verbose=0,
        callbacks=[Preempt()],
        on_preemption="return",
    )
    assert history.preempted
    assert [os.path.basename(p) for p in history.checkpoints] == ["3", "4"]
    # Both complete when fit returned: no temporary left; the job's record of its time stays for the
    # restart.
    assert sorted(os.listdir(tmp_path)) == [JOB_FILE, "3", "4"]


def test_a_failed_background_save_raises_at_a_later_step_or_at_the_end(tmp_path, at_commit):
    def fail():
        raise OSError("No space left on device (injected)")

    at_commit({"2": fail})
    t = trainer()
    with pytest.raises(
        jd.training.CheckpointSaveError,  # a RuntimeError
        match=r"saving checkpoint step 2 in .* failed in the background: OSError: No "
        r"space left on device \(injected\); there is no complete checkpoint",
    ) as info:
        t.fit(data_fn, steps=10, checkpoint_dir=tmp_path / "a", checkpoint_every=2, verbose=0)
    # kept, not printed
    assert isinstance(info.value.__context__, OSError) and info.value.__suppress_context__
    assert 2 < t.step <= 4  # at a step after the save, at the latest at the next save
    assert jd.training.Checkpointer(tmp_path / "a").all_steps() == []

    at_commit({"3": fail})  # the last save of fit: raised before fit returns
    t = trainer()
    with pytest.raises(RuntimeError,
                       match=r"saving checkpoint step 3 in .* the last complete checkpoint is step "
                             r"2"):
        t.fit(data_fn, steps=3, checkpoint_dir=tmp_path / "b", checkpoint_every=2, verbose=0)


def test_checkpointer_async_own_loop(tmp_path, at_commit):
    strategy = jd.MirroredStrategy()
    state = strategy.mirror({"w": np.arange(4 << 20, dtype=np.float32).reshape(8, -1),
                             "n": np.int32(1)})
    want = host(state)
    double = strategy.jit(lambda s: jax.tree.map(lambda a: a * 2 + 1, s), donate_argnums=(0,))
    ckpt = jd.training.Checkpointer(tmp_path)
    path = ckpt.save(1, state)
    for _ in range(3):  # change (and donate) the state while it is being written
        state = double(state)
    with pytest.raises(jd.training.CheckpointConflictError,
                       match=r"step 1 .* already exists with other contents"):
        # the step is being written (or is complete) with the state before the changes
        ckpt.save(1, state)
    assert ckpt.poll(wait=True) == [(1, path)] and ckpt.poll() == []
    restored, meta = ckpt.restore(state, step=1)
    assert meta["step"] == 1 and all(
        np.array_equal(a, b) for a, b in zip(host(restored), want, strict=True)
    )

    def fail():
        raise OSError("disk gone (injected)")

    at_commit({"2": fail, "4": fail})
    ckpt.save(2, state)
    with pytest.raises(
        RuntimeError, match=r"step 2 .*OSError: disk gone.*the last complete checkpoint is step 1"
    ):
        ckpt.wait_until_finished()
    ckpt.save(3, state)  # raised once; the next save works
    assert [s for s, _ in ckpt.poll(wait=True)] == [3] and ckpt.all_steps() == [1, 3]
    with pytest.raises(TypeError, match=r"meta=\{'bad': <object.*is not JSON-serializable"):
        ckpt.save(5, state, {"bad": object()})
    ckpt.save(4, state)
    with pytest.raises(RuntimeError, match=r"saving checkpoint step 4 .* failed in the background"):
        ckpt.close()  # nothing reported it yet: close does
    assert jd.training.Checkpointer(tmp_path).all_steps() == [1, 3]

    sync = jd.training.Checkpointer(tmp_path / "sync", async_save=False)
    sync.save(7, state)
    assert [s for s, _ in sync.poll()] == [7] and os.path.isdir(tmp_path / "sync" / "7")
    sync.close()
    with pytest.raises(ValueError, match=r"async_save='yes' must be True or False"):
        jd.training.Checkpointer(tmp_path, async_save="yes")


def test_checkpoint_benchmark_row_runs(tmp_path):
    from benchmarks.checkpointing import markdown, measure
    from benchmarks.report import machine_info

    result = measure(pairs=1, saves=1, every=0.0, width=8, directory=tmp_path)
    assert len(result.blocked_async[0]) == len(result.blocked_sync[0]) == 1 and result.ratios[0] > 0
    table = markdown(result, {**machine_info(jax.devices()), "orbax": "test"})
    assert "| ckpt | 784-8-8-10 + adam, 0 MB | Checkpointer(async_save=True).save |" in table
    assert not os.listdir(tmp_path)  # every run's directory removed
