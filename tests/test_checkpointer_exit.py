"""A `Checkpointer` left open: every save that returned is on disk when the program ends (normally,
by ``sys.exit``, with an uncaught exception, or after SIGTERM stopped a ``fit``), restores bitwise,
and orbax's shutdown noise never reaches the terminal. Real subprocesses (the end of an interpreter
cannot be tested in-process), under this Python and under the oldest one accepted (3.12:
`interpreters.pythons`), whose releases 3.12.0-3.12.2 refuse new threads at shutdown; every run has
a timeout.
"""

from __future__ import annotations

import _thread
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from interpreters import pythons

import jaxdist as jd
from jaxdist.training.checkpoints import _at_exit

ROOT = Path(__file__).parent.parent

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import jaxdist as jd

    directory, how = sys.argv[1], sys.argv[2]
    strategy = jd.MirroredStrategy()
    if how == "sigterm":  # fit stops after the step the signal came in, saves it, and exits (SystemExit(0))
        import flax.linen as nn, optax

        class Term(jd.training.Callback):
            def on_step_end(self, trainer, step, metrics):
                if step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)

        x = np.random.default_rng(0).normal(size=(32, 512)).astype(np.float32)
        trainer = jd.training.Trainer(strategy, nn.Dense(512), optax.adam(1e-3), lambda o, y: ((o - y) ** 2).mean())
        try:
            trainer.fit([(x, x)] * 4, steps=50, checkpoint_dir=directory, checkpoint_every=2, verbose=0,
                        callbacks=[Term()])
        finally:
            print("stopped at", trainer.step)
    ckpt = jd.training.Checkpointer(directory, max_to_keep=2)
    for epoch in range(3):  # large enough that the last write is still in flight when the script ends
        state = strategy.mirror({"w": np.random.default_rng(epoch).normal(size=(512, 512)).astype(np.float32)})
        ckpt.save(epoch, state)
        if how == "with" and epoch == 1:  # another checkpointer, opened and closed while save 1 is in flight
            with jd.training.Checkpointer(directory + "-with") as again:
                again.save(5, state)
    if how == "crash":
        raise RuntimeError("the user's own error after a save")
    if how == "sys.exit":
        sys.exit(0)
    """
)


def run(tmp_path, how, python=sys.executable):
    script = tmp_path / "own_loop.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([python, str(script), str(tmp_path / "ckpt"), how], capture_output=True,
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
@pytest.mark.parametrize("python", pythons())
@pytest.mark.parametrize("how", ["sys.exit", "crash", "with"])
def test_a_checkpointer_left_open_finishes_its_last_save_at_exit_without_orbax_noise(
    tmp_path, how, python
):
    """Slow because each case is a Python of its own (imports jax, jaxdist, orbax). "with" ends the
    program normally with the last save in flight, after a with-block checkpointer opened and closed
    while save 1 was in flight: what the case "exit" (a plain normal end, a process of its own)
    checked is part of it."""
    out = run(tmp_path, how, python)
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
    assert "can't create new thread" not in text, text[-3000:]
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == ["1", "2"], names  # no "*.orbax-checkpoint-tmp" left
    expected = np.random.default_rng(2).normal(size=(512, 512)).astype(np.float32)
    np.testing.assert_array_equal(restored_w(tmp_path / "ckpt", 2), expected)  # bitwise
    if how == "with":
        assert os.listdir(tmp_path / "ckpt-with") == ["5"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("python", pythons())
def test_sigterm_stops_fit_with_its_last_checkpoint_complete(tmp_path, python):
    out = run(tmp_path, "sigterm", python)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "stopped at 3" in out.stdout and len(orbax_lines(text)) < 5, text[-3000:]
    names = sorted(os.listdir(tmp_path / "ckpt"), key=lambda n: (not n.isdigit(), n))
    # the step it stopped after, saved
    assert [n for n in names if not n.startswith(".")] == ["2", "3"], names


def test_checkpointer_is_a_context_manager_and_close_is_idempotent(tmp_path):
    state = {"w": np.arange(4.0, dtype=np.float32)}
    with jd.training.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    ckpt.close()  # again: nothing to do
    assert os.listdir(tmp_path) == ["1"]
    with pytest.raises(ValueError,
                       match="inside"), jd.training.Checkpointer(tmp_path / "b") as ckpt:
        ckpt.save(2, state)
        raise ValueError("inside")  # the block's own error comes out, the save is still complete
    assert os.listdir(tmp_path / "b") == ["2"]


def test_a_refused_thread_start_runs_its_body_in_a_parked_thread():
    """`_at_exit.Reserve` (what finishes a save at exit on CPython 3.12.0-3.12.2): a start the
    interpreter refuses runs in a thread parked earlier; none parked (or one forked away): the
    refusal stands."""

    def refused(function, args, *rest):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    reserve = _at_exit.Reserve(_thread.start_new_thread)
    reserve.top_up(2)
    assert reserve.parked == 2
    reserve._start = refused  # what the interpreter does once it shuts down
    ran = [threading.Event(), threading.Event()]
    assert reserve.start(ran[0].set, ()) == 0 and reserve.start(ran[1].set, ()) == 0
    assert all(event.wait(10) for event in ran) and reserve.parked == 0
    with pytest.raises(RuntimeError, match="interpreter shutdown"):
        reserve.start(ran[0].set, ())
    reserve.top_up(1)  # refused too: nothing parked, no error
    assert reserve.parked == 0

    reserve = _at_exit.Reserve(_thread.start_new_thread)
    reserve.top_up(1)
    # as in a forked child: the parked thread stayed in the parent
    reserve._start, reserve._pid = refused, -1
    with pytest.raises(RuntimeError, match="interpreter shutdown"):
        reserve.start(ran[0].set, ())
    assert reserve.parked == 0
    reserve._work.put((lambda: None, ()))  # releases the parent's parked thread


def test_threads_are_reserved_only_where_the_interpreter_refuses_them_at_exit(monkeypatch):
    monkeypatch.setattr(_at_exit, "_RESERVE", None)
    monkeypatch.setattr(
        threading, "_start_new_thread", getattr(threading, "_start_new_thread", None), raising=False
    )
    _at_exit.reserve_threads()
    assert (_at_exit._RESERVE is not None) == _at_exit.REFUSES_THREADS_AT_EXIT
    assert _at_exit.REFUSES_THREADS_AT_EXIT == ((3, 12, 0) <= sys.version_info[:3] < (3, 12, 3))
