"""jaxdist.training with real processes: SIGKILL during a save, SIGTERM then resume (bitwise
identical).

Each test runs small training scripts with ``sys.executable`` (8 simulated CPU devices,
MirroredStrategy, or for a pipelined model ``ShardedStrategy(pipeline_parallelism=2)``); every
subprocess call has a timeout so nothing can hang. Checkpoints are asynchronous (the default) unless
a test asks for "sync". Several processes: tests/test_multihost_preemption.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import jaxdist as jd

pytestmark = pytest.mark.slow  # every test runs training scripts in processes of their own

TIMEOUT = 90

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
    import flax.linen as nn
    import numpy as np
    import optax
    from flax import nnx
    import jaxdist as jd

    kind, mode, ckpt_dir, out, steps = sys.argv[1:6]
    steps = int(steps)
    asynchronous = "sync" not in sys.argv[6:]
    # "straight=PATH": after this run, an uninterrupted one from the start in a trainer of its own (its
    # checkpoints in ckpt_dir + "-straight"), its final parameters dumped to PATH.
    straight = [a.split("=", 1)[1] for a in sys.argv[6:] if a.startswith("straight=")]
    width = 1024 if mode == "big" else 16  # "big": a state that takes a while to write

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            x = nn.Dropout(0.3, deterministic=not train)(nn.relu(nn.Dense(width)(x)))
            return nn.Dense(4)(x)

    class NnxMLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(8, width, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)
            self.out = nnx.Linear(width, 4, rngs=rngs)

        def __call__(self, x):
            return self.out(self.drop(nnx.relu(self.hidden(x))))

    def data_fn(epoch):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(128, 8)).astype(np.float32)
        y = x[:, :4].argmax(1).astype(np.int32)
        order = np.random.default_rng((1, epoch)).permutation(128)
        return [(x[order[i : i + 32]], y[order[i : i + 32]]) for i in range(0, 128, 32)]

    def ce(logits, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    strategy = jd.MirroredStrategy()
    if kind == "pipeline":  # a tiny LM whose layers run as a GPipe pipeline over 2 stages x 4 replicas
        sys.path.insert(0, TESTS)
        from pipeline_model import PipelineLM, batches

        tokens = [(b["inputs"], b["targets"]) for b in batches(4, batch=8)]

        def data_fn(epoch):
            return [tokens[i] for i in np.random.default_rng((1, epoch)).permutation(len(tokens))]

        strategy = jd.ShardedStrategy(pipeline_parallelism=2, min_shard_size=1)

    def make_trainer():  # a fresh model each time: an nnx trainer updates its module in place
        if kind == "linen":
            return jd.training.Trainer(strategy, MLP(), optax.adam(1e-2), ce, train_kwargs={"train": True})
        if kind == "pipeline":
            return jd.training.Trainer(strategy, PipelineLM(4, 2, dropout=0.1), optax.adam(1e-2), ce,
                                       train_kwargs={"train": True}, flops_per_step=1e6)
        return jd.training.Trainer(strategy, NnxMLP(nnx.Rngs(0)), optax.adam(1e-2), ce)

    def dump(path, trainer):
        leaves = jax.tree.leaves(jax.device_get(trainer.params))
        np.savez(path, *[np.asarray(a) for a in leaves])

    every = 1 if mode == "big" else 3

    class Tell(jd.training.Callback):
        def on_train_begin(self, trainer):  # what fit starts from (after any restore)
            dump(os.path.join(os.path.dirname(out), f"begin_{trainer.step}.npz"), trainer)

        def on_step_end(self, trainer, step, metrics):
            print(f"step {step}", flush=True)
            if step % every == 0 and mode != "big":  # the state a checkpoint of this step holds
                dump(os.path.join(os.path.dirname(out), f"at_{step}.npz"), trainer)
            if mode == "slow":
                time.sleep(0.15)  # leaves the parent time to send SIGTERM mid-run

        def on_checkpoint(self, trainer, step, path):  # once complete (an async one: a step or more later)
            print(f"saved {step}", flush=True)

    if mode == "kill-in-save":  # SIGKILL this process while the 2nd checkpoint is written, before its rename
        from orbax.checkpoint._src.path import atomicity
        finalize = atomicity.AtomicRenameTemporaryPath.finalize

        async def killing_finalize(self, *args, **kwargs):
            if os.path.basename(str(self.get_final())) == "6":  # everything written, not yet renamed into place
                os.kill(os.getpid(), signal.SIGKILL)
            return await finalize(self, *args, **kwargs)

        atomicity.AtomicRenameTemporaryPath.finalize = killing_finalize

    for directory, path in [(ckpt_dir, out)] + [(ckpt_dir + "-straight", p) for p in straight]:
        trainer = make_trainer()
        trainer.fit(data_fn, steps=steps, checkpoint_dir=directory, checkpoint_every=every, verbose=0,
                    callbacks=[Tell()], async_checkpoints=asynchronous)
        if kind == "pipeline":  # the layers stayed split over the stages (a restore too puts them there)
            kernel = nn.unbox(trainer.params)["layers"]["block"]["Dense_0"]["kernel"]
            assert kernel.sharding.spec[0] == "stage", kernel.sharding
        dump(path, trainer)
        print(f"done {trainer.step}", flush=True)
    """
).replace("TESTS", repr(os.path.dirname(os.path.abspath(__file__))))  # where pipeline_model.py is


def run_script(tmp_path, *args, timeout=TIMEOUT):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def load(path):
    with np.load(path) as data:
        return [data[k] for k in sorted(data.files, key=lambda k: int(k.split("_")[1]))]


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def test_sigterm_saves_exits_cleanly_and_resume_is_bitwise_identical(tmp_path):
    """Slow because it runs 2 processes (~5 s each: imports, 8 CPU devices, compiles). A linen
    model: an nnx model takes the same exit and the same restore in a fresh process; its own part,
    the dropout key in its module (nnx.Rngs) saved and resumed bitwise, is
    test_training_checkpoint::test_resume_is_bitwise_identical[nnx], and its restore in a process of
    its own is test_sigkill_during_save_leaves_the_previous_checkpoint_restorable[nnx-async]."""
    sigterm_then_resume("linen", tmp_path)


@pytest.mark.timeout(480)
def test_sigterm_with_a_pipelined_model_resumes_bitwise_identical(tmp_path):
    """The same with `jd.nn.Pipeline` layers on ShardedStrategy(pipeline_parallelism=2): the
    stage-split layers, the optimizer state and the dropout rng are saved and restored exactly."""
    sigterm_then_resume("pipeline", tmp_path, timeout=150)


def sigterm_then_resume(kind, tmp_path, timeout=TIMEOUT):
    """A run sent SIGTERM after step 4 that saves and exits cleanly; its resumption to the same
    step, whose final parameters must equal bitwise those of an uninterrupted run (from the start,
    in a trainer and checkpoint directory of its own, made after the resumed run in the same
    process: one process start fewer than a process of its own; nothing of the resumed run reaches
    it but the compiled programs)."""
    steps = 10  # 2.5 epochs of 4 batches, dropout on: data order and RNG both matter
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), kind, "slow", str(tmp_path / "ckpt"),
         str(tmp_path / "first.npz"), str(steps)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        lines = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.strip() == "step 4":
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    lines += out.split()
    assert proc.returncode == 0, err[-3000:]  # a clean exit, not a kill
    stopped = jd.training.Checkpointer(tmp_path / "ckpt").all_steps()[-1]
    # finished the step it was in, saved
    assert 4 <= stopped < steps and f"saved {stopped}" in " ".join(lines)
    assert "done" not in out

    resumed = run_script(tmp_path, kind, "plain", tmp_path / "ckpt", tmp_path / "resumed.npz",
                         steps, f"straight={tmp_path / 'straight.npz'}", timeout=timeout)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step {stopped + 1}" in resumed.stdout.split("\n")[0]  # resumed where it stopped
    assert resumed.stdout.split().count("done") == 2  # the resumed run, then the uninterrupted one
    with jd.training.Checkpointer(tmp_path / "ckpt-straight") as straight:
        assert straight.all_steps()[-1] == steps
    assert_bitwise(load(tmp_path / "resumed.npz"), load(tmp_path / "straight.npz"))


@pytest.mark.parametrize(("kind", "saving"), [("linen", "sync"), ("nnx", "async")])
def test_sigkill_during_save_leaves_the_previous_checkpoint_restorable(kind, saving, tmp_path):
    # async: the kill comes from the background thread while the steps after 6 run
    killed = run_script(tmp_path, kind, "kill-in-save", tmp_path / "ckpt", tmp_path / "never.npz",
                        9, saving)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "saved 3" in killed.stdout and "saved 6" not in killed.stdout
    leftovers = [p for p in os.listdir(tmp_path / "ckpt") if "tmp" in p]
    assert leftovers  # the half-written step 6 is there, under a temporary name
    ckpt = jd.training.Checkpointer(tmp_path / "ckpt")
    assert ckpt.all_steps() == [3]  # never listed as a checkpoint
    ckpt.close()

    resumed = run_script(tmp_path, kind, "plain", tmp_path / "ckpt", tmp_path / "resumed.npz", 9)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.split("\n")[0] == "step 4" and "done 9" in resumed.stdout
    assert not [p for p in os.listdir(tmp_path / "ckpt") if "tmp" in p]  # removed by the next run
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["3", "6", "9"]
    # the resumed run started from exactly the step-3 state saved before the kill
    assert_bitwise(load(tmp_path / "begin_3.npz"), load(tmp_path / "at_3.npz"))


def test_sigkill_at_a_random_moment_of_a_large_save(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(script), "linen", "big", str(ckpt), str(tmp_path / "never.npz"), "40"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        # kill as soon as a write is in progress
        while time.monotonic() < deadline and proc.poll() is None:
            names = os.listdir(ckpt) if ckpt.exists() else []
            if any(n.isdigit() for n in names) and any("tmp" in n for n in names):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-3000:]
    proc.stderr.close()
    steps = jd.training.Checkpointer(ckpt).all_steps()
    assert steps, "no complete checkpoint survived"
    resumed = run_script(tmp_path, "linen", "big", ckpt, tmp_path / "resumed.npz", steps[-1] + 1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.split("\n")[0] == f"step {steps[-1] + 1}"
