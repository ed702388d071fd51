"""Storage that fails under a running ``fit``: each cause is ONE `CheckpointSaveError` naming the
step, the cause, the last complete checkpoint and the fix, and nothing else reaches the terminal (no
orbax / absl / asyncio tracebacks, no "Event loop is closed", no second error while ``fit`` closes
its checkpointer).

Real processes with real faults, injected once checkpoint 5 is complete: a file-size limit
(``RLIMIT_FSIZE``, errno 27, as a quota on file size gives), the directory removed; in a private
mount namespace where the system allows one (``unshare``): a filesystem that fills up and one
remounted read-only. Synchronous and asynchronous saves; the file-size limit also under the oldest
Python accepted (`interpreters.pythons`). Every run is bounded.
"""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from interpreters import pythons
from registry import launch_env

import jaxdist as jd
from jaxdist.training.checkpoints import _storage

pytestmark = pytest.mark.slow  # each test runs training scripts in processes of their own

SCRIPT = textwrap.dedent(
    """
    import os, resource, shutil, signal, subprocess, sys
    import flax.linen as nn, numpy as np, optax, jaxdist as jd

    directory, fault, saving = sys.argv[1:4]

    class FaultAfter5(jd.training.Callback):  # once checkpoint 5 is complete: the save of step 10 meets it
        def on_checkpoint(self, trainer, step, path):
            if step != 5:
                return
            if fault == "fsize":
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) rather than the process
                resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
            elif fault == "vanish":
                shutil.rmtree(directory)
            elif fault == "full":  # fill the small filesystem the directory is on
                with open(os.path.join(os.path.dirname(directory), "filler"), "wb") as f:
                    try:
                        while True:
                            f.write(b"x" * (1 << 16))
                            f.flush()
                    except OSError:
                        pass
            elif fault == "readonly":
                subprocess.run(["mount", "-o", "remount,ro", os.path.dirname(directory)], check=True, timeout=30)

    x = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
    trainer = jd.training.Trainer(jd.OneDeviceStrategy(), nn.Dense(64), optax.sgd(0.1),
                                  lambda o, y: ((o - y) ** 2).mean())
    trainer.fit([(x, x)] * 100, steps=12, checkpoint_dir=directory, checkpoint_every=5, verbose=0,
                callbacks=[FaultAfter5()], async_checkpoints=saving == "async")
    """
)


def run(tmp_path, fault, saving, python=sys.executable, mount=None):
    """Run SCRIPT (in a private mount namespace on a small tmpfs when ``mount``); its stderr through
    a pipe (a file-size limit would cut a file short)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    directory = tmp_path / "disk" / "ckpt"
    args = [python, str(script), str(directory), fault, saving]
    if mount is not None:
        (tmp_path / "disk").mkdir()
        shell = f"mount -t tmpfs -o size={mount} tmpfs {tmp_path / 'disk'} && exec \"$@\""
        args = ["unshare", "-rm", "sh", "-c", shell, "sh", *args]
    out = subprocess.run(args, capture_output=True, text=True, timeout=150, env=launch_env())
    return out, directory


def assert_one_named_error(out, *phrases):
    err = out.stderr
    assert out.returncode == 1, err[-3000:]
    for noise in ("absl", "orbax", "Event loop is closed", "During handling", "Exception ignored"):
        assert noise not in err, err[-4000:]
    assert err.count("Traceback") == 1 and len(err.splitlines()) < 45, err[-4000:]
    last = err.strip().splitlines()[-1]
    head = "jaxdist.training.checkpoints._storage.CheckpointSaveError: saving checkpoint step 10 in"
    assert last.startswith(head), last
    for phrase in phrases:
        assert phrase in last, last


def _mount_namespaces() -> str | None:
    """Why a private mount namespace with a tmpfs cannot be made here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    try:
        out = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unshare failed: {error}"
    return (None if out.returncode == 0
            else f"no private mount namespace here: {out.stderr.strip()[:200]}")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("python", pythons())
@pytest.mark.parametrize("saving", ["sync", "async"])
def test_a_file_size_limit_is_one_named_error(tmp_path, saving, python):
    out, directory = run(tmp_path, "fsize", saving, python)
    assert_one_named_error(out, "a file reached the largest size this process may write",
                           "RLIMIT_FSIZE",
                           "[Errno 27]", "the last complete checkpoint is step 5", "ulimit -f",
                           "run again to resume from step 5")
    assert jd.training.Checkpointer(directory).all_steps() == [5]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("saving", ["sync", "async"])
def test_a_directory_removed_under_the_run_is_one_named_error(tmp_path, saving):
    out, directory = run(tmp_path, "vanish", saving)
    assert_one_named_error(out, "the directory no longer exists", "there is no complete checkpoint",
                           "recreate it", "run again from the start")
    assert not directory.exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("fault", "said"), [
    ("full", ("the disk is full (OSError: [Errno 28]", "free space there")),
    ("readonly", ("it is not writable (OSError: [Errno 30]", "make it writable")),
])
def test_a_full_or_read_only_filesystem_is_one_named_error(tmp_path, fault, said):
    why = _mount_namespaces()
    if why is not None:
        pytest.skip(why)
    out, _ = run(tmp_path, fault, "async", mount="8m")
    assert_one_named_error(out, *said, "the last complete checkpoint is step 5",
                           "resume from step 5")


def test_the_cause_of_a_failed_save_is_found_without_reading_library_text(tmp_path):
    """`describe_failure`: the OSError in the chain, else the directory itself (gone; a probe
    write), else the error shortened to one line (tensorstore's texts carry a 2 KB spec)."""
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    wrapped = ValueError("OUT_OF_RANGE: write failed")
    wrapped.__cause__ = quota
    what, fix, vanished = _storage.describe_failure(wrapped, str(tmp_path))
    assert (
        what.startswith("the disk quota is used up (OSError: [Errno 122]") and "larger one" in fix
    )
    assert not vanished
    what, _, vanished = _storage.describe_failure(ValueError("x"), str(tmp_path / "gone"))
    assert what.startswith("the directory no longer exists") and vanished
    long = ValueError("NOT_FOUND: " + "y" * 500 + "\nsecond line")
    what, fix, _ = _storage.describe_failure(long, str(tmp_path))
    assert (
        what.startswith("ValueError: NOT_FOUND: yyy") and len(what) < 330 and "second" not in what
    )
    assert fix == "fix the cause (disk space, permissions, ...)"
    error = jd.training.CheckpointSaveError(3, str(tmp_path / "gone"), 2, ValueError("x"))
    # its checkpoints went too
    assert error.latest is None and "there is no complete checkpoint" in str(error)


def test_a_checkpointer_whose_directory_cannot_be_made_or_vanished_says_so(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError,
                       match=r"directory='.*file/sub' cannot be created \(a part of its path is a "
                             r"file"):
        jd.training.Checkpointer(tmp_path / "file" / "sub")
    state = {"w": np.zeros(3, np.float32)}
    ckpt = jd.training.Checkpointer(tmp_path / "c", async_save=False)
    ckpt.save(1, state)
    shutil.rmtree(tmp_path / "c")
    with pytest.raises(jd.training.CheckpointSaveError,
                       match=r"step 2 in .* failed: the directory no longer exists .*there is no "
                             r"complete checkpoint"):
        ckpt.save(2, state)
    ckpt.close()  # nothing more to say
