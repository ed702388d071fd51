"""A `Checkpointer` left open: every save that returned is on disk when the program ends (normally or with an
uncaught exception), restores bitwise, and orbax's shutdown noise never reaches the terminal. Real
subprocesses (the end of an interpreter cannot be tested in-process); every run has a timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import jaxdist as jd

ROOT = Path(__file__).parent.parent

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import jaxdist as jd

    directory, how = sys.argv[1], sys.argv[2]
    strategy = jd.MirroredStrategy()
    ckpt = jd.training.Checkpointer(directory, max_to_keep=2)
    for epoch in range(3):  # large enough that the last write is still in flight when the script ends
        state = strategy.mirror({"w": np.random.default_rng(epoch).normal(size=(512, 512)).astype(np.float32)})
        ckpt.save(epoch, state)
    if how == "crash":
        raise RuntimeError("the user's own error after a save")
    if how == "with":
        with jd.training.Checkpointer(directory + "-with") as again:
            again.save(5, state)
    """
)


def run(tmp_path, how):
    script = tmp_path / "own_loop.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), how], capture_output=True,
                          text=True, timeout=120, env=env)


def orbax_lines(text):
    words = ("orbax", "absl", "asyncio", "Event loop", "futures", "Traceback")
    return [line for line in text.splitlines() if any(w in line for w in words)]


def restored_w(directory, step):
    like = jd.OneDeviceStrategy().mirror({"w": np.zeros((512, 512), np.float32)})
    with jd.training.Checkpointer(directory) as ckpt:
        assert ckpt.all_steps()[-1] == step
        return np.asarray(ckpt.restore(like, step)[0]["w"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["exit", "crash", "with"])
def test_a_checkpointer_left_open_finishes_its_last_save_at_exit_without_orbax_noise(tmp_path, how):
    out = run(tmp_path, how)
    text = out.stdout + out.stderr
    if how == "crash":
        assert out.returncode == 1
        assert "RuntimeError: the user's own error after a save" in text
        noise = [line for line in orbax_lines(text) if "Traceback" not in line]
        assert len(noise) < 5, text[-3000:]
        assert text.count("Traceback") == 1, text[-3000:]  # the user's own, nothing after it
    else:
        assert out.returncode == 0, text[-3000:]
        assert len(orbax_lines(text)) < 5, text[-3000:]
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == ["1", "2"], names  # no "*.orbax-checkpoint-tmp" left
    expected = np.random.default_rng(2).normal(size=(512, 512)).astype(np.float32)
    np.testing.assert_array_equal(restored_w(tmp_path / "ckpt", 2), expected)  # bitwise
    if how == "with":
        assert os.listdir(tmp_path / "ckpt-with") == ["5"]


def test_checkpointer_is_a_context_manager_and_close_is_idempotent(tmp_path):
    state = {"w": np.arange(4.0, dtype=np.float32)}
    with jd.training.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    ckpt.close()  # again: nothing to do
    assert os.listdir(tmp_path) == ["1"]
    with pytest.raises(ValueError, match="inside"), jd.training.Checkpointer(tmp_path / "b") as ckpt:
        ckpt.save(2, state)
        raise ValueError("inside")  # the block's own error comes out, the save is still complete
    assert os.listdir(tmp_path / "b") == ["2"]
