"""What a first run prints: the progress of ``Trainer.fit`` (the metrics and one rate on each line,
a short cost line, no column that is "n/a" on CPU, one line when a fit resumes), the demo's output
width, and the launcher's output without gloo's connection lines."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import numpy as np
import optax
import pytest
from registry import launch_env

import jaxdist as jd
from jaxdist.launch import launch

ROOT = Path(__file__).resolve().parent.parent


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batches(n=8):
    x = np.random.default_rng(0).normal(size=(n * 16, 8)).astype(np.float32)
    y = x[:, :4].argmax(1).astype(np.int32)
    return [(x[i : i + 16], y[i : i + 16]) for i in range(0, len(x), 16)]


def test_a_progress_line_has_the_metrics_and_one_rate():
    out = io.StringIO()
    progress = jd.training.Progress(total=20, mode="lines", stream=out)
    progress.on_log(None, 10, {"loss": 0.5, "accuracy": 0.75, "steps_per_sec": 412.3,
                               "tokens_per_sec": 1.3e5})
    assert out.getvalue() == "step 10/20 loss 0.5 accuracy 0.75 412 steps/s 130,000 tokens/s\n"


def test_the_bar_shows_the_metrics_and_only_the_trainers_rate():
    out = io.StringIO()
    progress = jd.training.Progress(total=20, mode="bar", stream=out)
    progress.on_train_begin(None)
    progress.on_step_end(None, 10, {})
    progress.on_log(None, 10, {"loss": 0.5, "accuracy": 0.75, "steps_per_sec": 412.3})
    progress.on_train_end(None, jd.training.History())
    last = out.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert "loss 0.5 accuracy 0.75 412 steps/s" in last and "10/20" in last
    assert last.count("/s") == 1, f"two rates on the bar: {last!r}"  # tqdm's own "it/s" is left out


def test_a_bad_progress_mode_names_the_choices():
    with pytest.raises(ValueError, match=r"mode='bars' must be 'auto', 'bar' or 'lines'"):
        jd.training.Progress(mode="bars")


def test_fit_prints_a_short_cost_line_no_na_column_and_says_when_it_resumes(tmp_path, capsys):
    data = batches()
    trainer = jd.training.Trainer(jd.MirroredStrategy(), MLP(), optax.adam(1e-2), ce,
                                  metrics={"accuracy": jd.training.accuracy})
    trainer.fit(data, steps=4, log_every=2, checkpoint_dir=tmp_path, verbose="lines")
    first = capsys.readouterr().out.splitlines()
    # how often it backs up
    assert first[0] == "checkpoints every 10 min (the default checkpoint_every)"
    assert first[1].startswith("per device: ") and "temp " in first[1] and len(first[1]) <= 100
    # The first window's wall time is mostly the step's compile: its rate says so.
    assert re.fullmatch(r"step 2/4 loss \S+ accuracy \S+ \S+ steps/s \(incl\. compile \d+%\)",
                        first[2]), first[2]
    assert not any("n/a" in line or "mfu" in line or "resumed" in line for line in first)

    again = jd.training.Trainer(jd.MirroredStrategy(), MLP(), optax.adam(1e-2), ce)
    again.fit(data, steps=6, log_every=2, checkpoint_dir=tmp_path, verbose="lines")
    assert capsys.readouterr().out.splitlines()[1] == f"resumed from step 4 ({tmp_path})"

    done = jd.training.Trainer(jd.MirroredStrategy(), MLP(), optax.adam(1e-2), ce)
    # 2: the cost in every detail (nothing to train)
    done.fit(data, steps=6, checkpoint_dir=tmp_path, verbose=2)
    assert capsys.readouterr().out.splitlines() == [
        f"resumed from step 6 ({tmp_path}): already at steps=6, nothing to train"
    ]


def test_verbose_2_shows_the_whole_cost_line(capsys):
    trainer = jd.training.Trainer(jd.OneDeviceStrategy(), MLP(), optax.adam(1e-2), ce)
    trainer.fit(batches(), steps=2, verbose=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("train step per device (1 devices): ") and "peak n/a" in lines[0]


def test_the_launcher_leaves_out_gloos_connection_lines_unless_verbose(tmp_path):
    script = tmp_path / "chatty.py"
    script.write_text(
        "import os\n"
        "i = os.environ['JAXDIST_PROCESS_ID']\n"
        "print(f'[Gloo] Rank {i} is connected to 1 peer ranks. Expected number of connected peer "
        "ranks is : 1')\nprint(f'process {i} [Gloo] in the middle stays')\n"
    )
    quiet, loud = io.StringIO(), io.StringIO()
    assert launch([str(script)], 2, out=quiet) == 0
    assert sorted(quiet.getvalue().splitlines()) == ["[0] process 0 [Gloo] in the middle stays",
                                                     "[1] process 1 [Gloo] in the middle stays"]
    assert launch([str(script)], 2, out=loud, verbose=True) == 0
    assert sum("] [Gloo] Rank" in line for line in loud.getvalue().splitlines()) == 2


def test_a_printed_line_inside_one_of_gloos_pieces_is_still_passed_on(tmp_path):
    """Gloo writes a connection line to stderr a piece at a time; a line printed to stdout between
    two pieces stays whole and shown (a preemption test once waited for a step line that a shared
    pipe had merged into a gloo line, which was then dropped)."""
    script = tmp_path / "pieces.py"
    script.write_text(
        "import os\n"
        "os.write(2, b'[Gloo] Rank ')\n"
        "os.write(1, b'step 3\\n')\n"
        "os.write(2, b'0 is connected to 1 peer ranks.\\n')\n"
    )
    out = io.StringIO()
    assert launch([str(script)], 1, out=out) == 0
    assert "[0] step 3" in out.getvalue().splitlines(), out.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_demo_fits_an_80_column_terminal(tmp_path):
    """Every line of the demo's output (a run, then a resumed one) fits 80 columns once the
    checkpoint directory, whose length is the machine's, is shortened to DIR; none is over 120 even
    with it."""
    env = dict(launch_env(), COLUMNS="80")
    ckpt = tmp_path / "ckpt"
    lines = []
    for steps in (30, 50):
        cmd = [sys.executable, str(ROOT / "examples" / "digits_mirrored.py"), "--steps", str(steps),
               "--checkpoint-dir", str(ckpt)]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        lines += (run.stdout + run.stderr).splitlines()
    assert any(line.startswith("resumed from step 30") for line in lines)
    assert any(line.startswith("step 50/50 loss") and "accuracy" in line for line in lines)
    too_long = [line for line in lines if len(line) > 120
                or len(line.replace(str(ckpt), "DIR")) > 80]
    assert not too_long, f"lines wider than 80 columns: {too_long}"
    assert not [line for line in lines if "n/a" in line]
    assert os.path.isdir(ckpt / "50")
