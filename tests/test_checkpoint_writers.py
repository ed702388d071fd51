"""One writer per checkpoint directory, and storage checked at the start and said well.

A live run's claim refuses a second run (a live process on this host, or a claim touched recently on
another host); a stale claim is taken over with a line; two fits started together: one trains, the
other is refused by name. Saving a step that exists: the same contents a no-op, other contents an
error. ``checkpoint_dir`` that is ``""``, a file or not writable is an error before the first step;
a full disk (simulated where orbax writes an array's bytes) is one error, without orbax's
tracebacks. The 2-process claim check is in test_job_failures.py.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from orbax.checkpoint._src.serialization import serialization
from registry import launch_env

import jaxdist as jd
from jaxdist.training.checkpoints import _claim as checkpoint_claim
from jaxdist.training.checkpoints import _storage as checkpoint_storage

CLAIM = checkpoint_claim.CLAIM_FILE


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    return [(x[i : i + 16], (x[i : i + 16, 0] > 0).astype(np.int32)) for i in range(0, 64, 16)]


def _trainer():
    return jd.training.Trainer(
        jd.MirroredStrategy(),
        nn.Dense(2),
        optax.adam(1e-2),
        lambda o, y: optax.softmax_cross_entropy_with_integer_labels(o, y).mean(),
    )


def _claim(directory, **fields):
    directory.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
              "run": "other", **fields}
    (directory / CLAIM).write_text(json.dumps(record))
    return directory / CLAIM


def test_a_live_writer_is_refused_at_the_start_and_a_stale_claim_is_taken_over(tmp_path, capfd):
    ck = tmp_path / "ck"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _claim(ck, pid=sleeper.pid)  # another live process on this host
        trainer = _trainer()
        with pytest.raises(
            jd.training.CheckpointConflictError,
            match=r"checkpoint_dir='.*ck' is being written by another run: run "
            rf"other \(pid {sleeper.pid} on host .*\)\. .*Fix: wait for that "
            r"run to end, pass another "
            r"checkpoint_dir, or, if that run is gone, remove its claim: rm .*",
        ):
            trainer.fit(_data(), steps=2, checkpoint_dir=ck, verbose=0)
        # nothing trained or saved
        assert trainer.step == 0 and not any(p.name.isdigit() for p in ck.iterdir())
        # the own-loop path: refused at the first save
        with pytest.raises(jd.training.CheckpointConflictError):
            jd.training.Checkpointer(ck).save(1, {"w": jnp.zeros(2)})
    finally:
        sleeper.kill()
        sleeper.wait()
    capfd.readouterr()
    trainer.fit(_data(), steps=2, checkpoint_dir=ck, verbose=0)  # its process is gone: taken over
    assert "taking over the claim of run other (pid" in capfd.readouterr().err
    assert not (ck / CLAIM).exists()  # released when fit ended

    _claim(ck, host="elsewhere", pid=1)  # another host: live while its heartbeat is recent
    with pytest.raises(jd.training.CheckpointConflictError, match=r"pid 1 on host elsewhere"):
        _trainer().fit(_data(), steps=2, checkpoint_dir=ck, verbose=0)
    old = time.time() - 2 * checkpoint_claim.STALE_SECONDS
    os.utime(ck / CLAIM, (old, old))
    _trainer().fit(_data(), steps=4, checkpoint_dir=ck, verbose=0)
    assert jd.training.Checkpointer(ck).all_steps() == [2, 4]


def test_checkpointers_of_one_process_share_its_claim_until_the_last_closes(tmp_path):
    a, b = jd.training.Checkpointer(tmp_path), jd.training.Checkpointer(tmp_path)
    a.save(1, {"w": jnp.zeros(2)})
    b.save(2, {"w": jnp.ones(2)})
    claim = json.loads((tmp_path / CLAIM).read_text())
    assert claim["pid"] == os.getpid() and claim["host"] == socket.gethostname() and claim["run"]
    a.close()
    assert (tmp_path / CLAIM).exists()
    b.close()
    assert not (tmp_path / CLAIM).exists()
    # a claim taken over while held: the next save says so
    with jd.training.Checkpointer(tmp_path) as c:
        c.save(3, {"w": jnp.ones(2)})
        _claim(tmp_path, run="thief")
        with pytest.raises(jd.training.CheckpointConflictError,
                           match=r"no longer claimed by this run: run thief"):
            c.save(4, {"w": jnp.ones(2)})


def test_saving_an_existing_step_again_is_a_no_op_for_the_same_contents_and_an_error_for_others(
    tmp_path,
):
    with jd.training.Checkpointer(tmp_path) as ckpt:
        state = {"w": jnp.arange(3.0)}
        path = ckpt.save(5, state)
        assert ckpt.save(5, {"w": jnp.arange(3.0)}) == path  # the same contents: nothing to do
        with pytest.raises(jd.training.CheckpointConflictError,
                           match=r"checkpoint step 5 in .* already exists with other contents "
                                 r"\(\['w'\] differ\)"):
            ckpt.save(5, {"w": jnp.arange(3.0) + 1})
        with pytest.raises(jd.training.CheckpointConflictError, match=r"\['v'\], \['w'\] differ"):
            ckpt.save(5, {"v": jnp.arange(3.0)})
        restored, _ = ckpt.restore(state)
        assert restored["w"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_fits_started_together_one_trains_and_the_other_is_refused_by_name(tmp_path):
    """Slow because it starts two Pythons (each imports jax and jaxdist) and the winner trains ~4 s
    (0.5 s a step) so that the loser's claim surely comes while the winner's run is live, even on a
    loaded machine."""
    script = textwrap.dedent(f"""
        import os, sys, time
        import flax.linen as nn, numpy as np, optax, jaxdist as jd
        class Slow(jd.training.Callback):
            def on_step_end(self, trainer, step, metrics):
                time.sleep(0.5)
        x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
        trainer = jd.training.Trainer(jd.OneDeviceStrategy(), nn.Dense(2), optax.sgd(0.1),
                                      lambda o, y: optax.softmax_cross_entropy_with_integer_labels(o, y).mean())
        trainer.init((x, np.zeros(16, np.int32)))
        ready, deadline = sys.argv[1], time.monotonic() + 90
        open(f"{{ready}}-{{sys.argv[2]}}", "w").close()  # imported and ready: both start fit once both are
        while not all(os.path.exists(f"{{ready}}-{{i}}") for i in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            trainer.fit([(x, np.zeros(16, np.int32))], steps=8, checkpoint_dir={str(tmp_path / "ck")!r},
                        checkpoint_every=2, verbose=0, callbacks=[Slow()])
        except jd.training.CheckpointConflictError as error:
            print("REFUSED", error)
        else:
            print("TRAINED", trainer.step)
    """)
    # each process writes ready-<i> once imported; both wait for both (no fixed wait)
    ready = str(tmp_path / "ready")
    procs = [subprocess.Popen([sys.executable, "-c", script, ready, str(i)], env=launch_env(),
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(o.strip().splitlines()[-1].split()[0] for o in outs) == ["REFUSED", "TRAINED"], (
        outs
    )
    assert "being written by another run" in "".join(
        outs
    ) and "Configuration mismatch" not in "".join(outs)
    assert "TRAINED 8" in "".join(outs)


@pytest.mark.parametrize("bad, said", [
    ("",
     r"checkpoint_dir='' names no directory \(it would put the checkpoints into the current "
     r"directory\)"),
    ("file", r"checkpoint_dir='.*file' is a file, not a directory: pass a directory"),
    ("file/sub", r"checkpoint_dir='.*file/sub' cannot be created \(a part of its path is a file"),
])
def test_a_checkpoint_dir_that_cannot_hold_checkpoints_is_named_before_the_first_step(
    tmp_path, bad, said
):
    (tmp_path / "file").write_text("x")
    trainer = _trainer()
    value = str(tmp_path / bad) if bad else bad
    with pytest.raises(ValueError, match=said):
        trainer.fit(_data(), steps=2, checkpoint_dir=value, verbose=0)
    assert trainer.step == 0
    if bad != "file/sub":
        with pytest.raises(ValueError, match=said.replace("checkpoint_dir=", "directory=")):
            jd.training.Checkpointer(value)


def test_a_read_only_checkpoint_dir_is_named_before_the_first_step(tmp_path, monkeypatch):
    def read_only(path, *args, **kwargs):  # root ignores permission bits: refuse the write itself
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(checkpoint_storage, "open", read_only, raising=False)
    trainer = _trainer()
    with pytest.raises(ValueError,
                                         match=r"checkpoint_dir='.*' cannot hold checkpoints \(it "
                                               r"is not writable; OSError: "
                                         r"Read-only file system\): make it writable.*Nothing has "
                                         r"run"):
        trainer.fit(_data(), steps=2, checkpoint_dir=tmp_path, verbose=0)
    assert trainer.step == 0


@pytest.fixture
def full_disk(monkeypatch):
    """Writing an array's bytes fails as a full disk does (orbax's narrowest write: one array, from
    host)."""

    async def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    def install():
        monkeypatch.setattr(serialization, "async_serialize_from_host", full)

    return install


class _FullAfter(jd.training.Callback):
    """The disk fills once checkpoint ``step`` is complete (not at a step end: an asynchronous save
    of it may still be writing then, and would be the one that fails)."""

    def __init__(self, step, install):
        self.step, self.install = step, install

    def on_checkpoint(self, trainer, step, path):
        if step == self.step:
            self.install()


@pytest.mark.parametrize("async_checkpoints", [False, True])
def test_a_full_disk_is_one_named_error_without_orbax_tracebacks(
    tmp_path, full_disk, capfd, async_checkpoints
):
    trainer = _trainer()
    with pytest.raises(jd.training.CheckpointSaveError) as info:
        trainer.fit(_data(), steps=8, checkpoint_dir=tmp_path, checkpoint_every=2, verbose=0,
                    async_checkpoints=async_checkpoints, callbacks=[_FullAfter(2, full_disk)])
    message = str(info.value)
    assert ("saving checkpoint step 4 in" in message
            and "the disk is full (OSError: [Errno 28]" in message)
    assert "the last complete checkpoint is step 2. Fix: free space there" in message
    assert "run again to resume from step 2" in message
    assert isinstance(info.value.__context__,
                      OSError) or isinstance(info.value.__context__.__context__, OSError)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "absl" not in err, err[-2000:]
    assert jd.training.Checkpointer(tmp_path).all_steps() == [2]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_full_disk_ends_the_program_with_one_short_traceback(tmp_path):
    script = textwrap.dedent(f"""
        import errno
        import flax.linen as nn, numpy as np, optax, jaxdist as jd
        from orbax.checkpoint._src.serialization import serialization
        async def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        class FullAfter2(jd.training.Callback):  # once checkpoint 2 is complete (an async save may still write)
            def on_checkpoint(self, trainer, step, path):
                if step == 2:
                    serialization.async_serialize_from_host = full
        x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
        trainer = jd.training.Trainer(jd.OneDeviceStrategy(), nn.Dense(2), optax.sgd(0.1),
                                      lambda o, y: optax.softmax_cross_entropy_with_integer_labels(o, y).mean())
        trainer.fit([(x, np.zeros(16, np.int32))], steps=8, checkpoint_dir={str(tmp_path)!r}, checkpoint_every=2,
                    verbose=0, callbacks=[FullAfter2()])
    """)
    out = subprocess.run([sys.executable, "-c", script], env=launch_env(), capture_output=True,
                         text=True, timeout=120)  # bounded: no minutes-long wait at exit
    assert out.returncode == 1
    assert out.stderr.count("Traceback") == 1 and "absl" not in out.stderr, out.stderr[-3000:]
    assert ("CheckpointSaveError: saving checkpoint step 4" in out.stderr
            and "the disk is full" in out.stderr)
    assert len(out.stderr.splitlines()) < 40, out.stderr
