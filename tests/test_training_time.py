"""Where a fit's time went (``History.time``, ``History.goodput``, the log rows' ``time/<part>``)
and a profile of chosen steps (``fit(profile_steps=(start, stop))``)."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import threading
import time
import warnings
from contextlib import redirect_stdout
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from registry import LAUNCH, launch_env
from tfevents import read_events, scalars

import jaxdist as jd
from jaxdist.training.callbacks import TIME_PARTS
from jaxdist.training.checkpoints import read_progress, write_progress
from jaxdist.training.checkpoints._directory import PROGRESS_FILE
from jaxdist.training.loop import _start as start_module
from jaxdist.training.loop import _time as time_module
from jaxdist.training.loop._profile import StepProfile


class Net(nn.Module):
    features: int = 16

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(self.features)(x)))


def mse(out, y):
    return ((out[:, 0] - y) ** 2).mean()


def batches(n, bad=()):
    """``n`` batches; those of the steps in ``bad`` (1-based) have inputs scaled by 1e30 (a
    non-finite step)."""
    xs = np.random.default_rng(0).normal(size=(n, 16, 4)).astype(np.float32)
    out = [(x, x.sum(1)) for x in xs]
    for step in bad:
        out[step - 1] = (out[step - 1][0] * 1e30, out[step - 1][1])
    return out


def trainer(features=16, **kwargs):
    # A width no other test uses: the steps compile afresh in this process.
    return jd.training.Trainer(jd.MirroredStrategy(), Net(features), optax.sgd(0.01), mse, **kwargs)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def assert_adds_up(history, wall):
    assert list(history.time) == list(TIME_PARTS)
    assert all(v >= 0 for v in history.time.values()), history.time
    # 5 ms for what a short fit does outside its clock (a 16 ms fit missed 2.5 ms on a loaded machine)
    assert sum(history.time.values()) == pytest.approx(wall, rel=0.05, abs=0.005), (history.time,
                                                                                    wall)
    assert history.goodput == pytest.approx(history.time["steps"] / sum(history.time.values()))


# ------------------------------------------------------------------------------------- History.time
@pytest.mark.timeout(120)
def test_the_parts_add_up_to_the_wall_time_and_a_fresh_program_compiles(tmp_path):
    data = batches(12)
    t = trainer(features=13)
    out = io.StringIO()
    with redirect_stdout(out):
        history, wall = timed(lambda: t.fit(data, steps=12, log_every=4, eval_data=data[:2],
                                            eval_every=6,
                                            checkpoint_dir=tmp_path / "ck", checkpoint_every=6,
                                            log_dir=tmp_path / "logs", verbose="lines"))
    assert_adds_up(history, wall)
    seconds = history.time
    assert seconds["compile"] > 0 and seconds["steps"] > 0 and seconds["input"] > 0
    assert seconds["checkpoint"] > 0 and seconds["evaluation"] > 0 and seconds["lost"] == 0
    assert 0 < history.goodput < 1
    # The whole fit's breakdown is the last line shown; each log row has its window's.
    assert any(line.startswith("time ") and "goodput" in line
               for line in out.getvalue().splitlines()[-2:])
    assert "goodput" in out.getvalue() and "time/steps" not in out.getvalue()
    assert all(len(line) <= 80 for line in out.getvalue().splitlines())
    for row in history.train:
        assert all(row[f"time/{part}"] >= 0 for part in TIME_PARTS), row
    # Over the windows the parts are the fit's (but for the time after the last log point).
    assert sum(row["time/compile"] for row in history.train) <= seconds["compile"] + 1e-9
    assert 0 < sum(row["time/steps"] for row in history.train) <= seconds["steps"] + 1e-9
    # The writers: CSV columns and TensorBoard scalars named time/<part>.
    with open(tmp_path / "logs" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["split"] == "train"]
    assert [float(r["time/steps"]) for r in rows] == pytest.approx(
        [r["time/steps"] for r in history.train]
    )
    jd.training.TensorBoardLogger(tmp_path / "logs").close()
    (events,) = (tmp_path / "logs").glob("events.out.tfevents.*")
    got = scalars(read_events(events))
    for row in history.train:
        assert got[("time/input", row["step"])] == pytest.approx(row["time/input"], rel=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_on_two_processes_the_steps_are_steps_and_each_process_keeps_its_own_profile(tmp_path):
    """Slow because of its 2-process job and the profiler's trace in each process."""
    # Each step sleeps 20 ms on the devices' side and each batch 4 ms to read. The preemption
    # agreement's read (one per step, two steps behind) is where a 2-process host waits for the
    # devices: it was counted as "other" (steps 0.3 s, other 2.4 s of a 4.2 s fit of 80 such steps),
    # now as steps.
    command = [*LAUNCH, "-n", "2", "--cpu-devices", "2", "--timeout", "200",
               str(Path(__file__).parent / "multiprocess" / "time_worker.py"), str(tmp_path)]
    proc = subprocess.run(command, env=launch_env(), capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    results = [json.loads(line.split(" RESULT ", 1)[1]) for line in proc.stdout.splitlines()
               if " RESULT " in line]
    assert sorted(r["pid"] for r in results) == [0, 1], proc.stdout[-4000:]
    for r in results:
        seconds, shown = r["time"], {k: round(v, 3) for k, v in r["time"].items()}
        assert sum(seconds.values()) == pytest.approx(r["wall"], rel=0.05), (shown, r["wall"])
        # Each part against its stopwatch: the devices cannot be faster than the steps' sleeps, nor
        # the input than the data's; the steps as the loop saw them (end of step 1 to the end of the
        # last) are steps, input and the loop's own cost, of which the steps are most.
        assert seconds["steps"] >= 0.9 * r["steps"] * r["step_sleep"], shown
        assert seconds["input"] >= 0.95 * r["input_slept"], (shown, r["input_slept"])
        assert seconds["steps"] >= 0.7 * (r["loop"] - r["input_slept"]), (shown, r["loop"])
        # Tracing the step is compile on every process (a program JAX's cache holds too). No bound
        # on ``other`` against the wall time: it holds the start, where a process waits for a peer
        # that compiles longer (0.58 s of a 2.85 s fit, its peer's compile 0.41 s longer; 26% of
        # the fit once on a loaded machine). The agreement's wait counted as ``other`` would fail
        # the steps' bound above.
        assert seconds["compile"] > 0, shown
        # The run's configuration (the trackers' parameters) says where it ran, on every process
        # alike.
        assert {k: r["config"][k] for k in ("strategy", "mesh", "devices", "processes",
                                            "global_batch_size", "optimizer.learning_rate")} == {
                                 "strategy": "MultiWorkerMirroredStrategy", "mesh": "replica=4",
                                 "devices": 4, "processes": 2,
                                 "global_batch_size": 16,
                                 "optimizer.learning_rate": 0.02}, r["config"]
    # Then a fit traced steps 3 to 5 on both processes (one host): a run of its own each, named by
    # process, each with its Perfetto file and a step marker per traced step.
    # (sorted by process: each process names its run by the time it started tracing, which may
    # differ)
    runs = sorted((tmp_path / "profile" / "plugins" / "profile").iterdir(),
                  key=lambda run: run.name.rsplit("_", 1)[1])
    assert [run.name.rsplit("_", 1)[1] for run in runs] == ["process0", "process1"], runs
    for run in runs:
        (trace,) = run.glob("*.xplane.pb")
        assert [m["step_num"] for m in step_markers(trace)] == [3, 4, 5]
        assert (run / "perfetto_trace.json.gz").stat().st_size > 0
    print("\n".join(f"process {r['pid']}: wall {r['wall']:.2f} s, steps 2..{r['steps']} "
                    f"{r['loop']:.2f} s, input "
                    f"slept {r['input_slept']:.2f} s; " + ", ".join(f"{k} {v:.3f}" for k, v in r["time"].items())
                    for r in sorted(results, key=lambda r: r["pid"])))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_checkpoints", [True, False])
def test_waiting_for_a_checkpoint_in_flight_counts_as_checkpoint(
    tmp_path, monkeypatch, async_checkpoints
):
    # Every wait for the save in flight (orbax's join, under latest_step / all_steps /
    # poll(wait=True)) takes 0.2 s more here: each one in the fit is "checkpoint" time (the waits at
    # the start of each checkpoint point were "other": 4 of them here).
    from jaxdist.training.checkpoints._checkpointer import Checkpointer

    waits, real, closing = [], Checkpointer._join, Checkpointer.close

    def slow_join(self):
        if None in waits:  # closing, after the fit's clock: not one of its parts
            return real(self)
        start = time.perf_counter()
        time.sleep(0.2)
        real(self)
        waits.append(time.perf_counter() - start)

    def close(self):
        waits.append(None)
        closing(self)

    monkeypatch.setattr(Checkpointer, "_join", slow_join)
    monkeypatch.setattr(Checkpointer, "close", close)
    t = trainer(features=9)
    history, wall = timed(lambda: t.fit(batches(8), steps=8, log_every=4,
                                        checkpoint_dir=tmp_path / "ck",
                                        checkpoint_every=4, async_checkpoints=async_checkpoints,
                                        verbose=0))
    assert_adds_up(history, wall)
    waited = sum(waits[:waits.index(None)])
    assert waited >= 1.0, waits
    assert history.time["checkpoint"] >= waited, (history.time, waits)
    assert history.time["other"] < 0.4, history.time


@pytest.mark.timeout(120)
def test_the_first_evaluations_compile_is_counted_once(monkeypatch):
    # JAX's compile spans on the fit's thread, heard beside the clock: their union is "compile" (a
    # span inside another counts once), and each evaluation's stopwatch is its "evaluation" plus the
    # compiles inside it.
    spans, evaluations = [], []
    fit_thread = threading.get_ident()

    def heard(event, start, end, **_):
        if event in time_module.COMPILE_EVENTS and threading.get_ident() == fit_thread:
            spans.append((start, end))

    jax.monitoring.register_event_time_span_listener(heard)
    from jaxdist.training.loop._fit import FitLoop as Fit

    real = Fit.evaluate

    def evaluate(self):
        before = (time.time(), self.clock.seconds["evaluation"],
                  self.clock.compiled.get("evaluation", 0.0))
        real(self)
        evaluations.append((before[0], time.time(), self.clock.seconds["evaluation"] - before[1],
                            self.clock.compiled.get("evaluation", 0.0) - before[2]))

    monkeypatch.setattr(Fit, "evaluate", evaluate)
    try:
        history = trainer(features=5).fit(batches(8), steps=8, log_every=4, eval_data=batches(2),
                                          eval_every=4, verbose=0)
    finally:
        jax.monitoring.unregister_event_time_span_listener(heard)
    union, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        union += max(stop - max(start, end), 0.0)
        end = max(end, stop)
    assert history.time["compile"] == pytest.approx(union, abs=1e-6)
    (first_start, first_end, first_timed, first_compiled), second = evaluations
    inside = [(a, b) for a, b in spans if first_start <= a and b <= first_end]
    assert inside and first_compiled == pytest.approx(sum(b - a for a, b in inside if not any(
        # the eval step's compile, once
        (c, d) != (a, b) and c <= a and b <= d for c, d in inside)), abs=1e-6)
    # evaluation: what is left of it
    assert 0 <= first_timed - first_compiled <= first_end - first_start
    assert second[3] == 0 and history.time["evaluation"] == pytest.approx(
        first_timed - first_compiled + second[2], abs=1e-6)


@pytest.mark.timeout(120)
def test_the_parts_add_up_with_on_device_loops_and_the_second_fit_compiles_nothing():
    data = batches(12)
    t = trainer(features=11, steps_per_run=3)
    history, wall = timed(lambda: t.fit(data, steps=6, log_every=3, verbose=0))
    assert_adds_up(history, wall)
    assert history.time["compile"] > 0
    again, wall = timed(lambda: t.fit(data, steps=12, log_every=3, verbose=0))
    assert_adds_up(again, wall)
    # the same programs: from JAX's caches, nothing traced or compiled
    assert again.time["compile"] == 0


@pytest.mark.timeout(120)
def test_a_rollback_counts_the_steps_it_threw_away_as_lost(tmp_path):
    t = trainer(features=9)
    with pytest.warns(RuntimeWarning, match=r"step 8 were not finite: rolled back to checkpoint 5"):
        history, wall = timed(lambda: t.fit(batches(30, bad=(8,)), steps=14,
                                            checkpoint_dir=tmp_path,
                                            checkpoint_every=5, log_every=2, verbose=0,
                                            on_non_finite="rollback"))
    assert [r["restored"] for r in history.rollbacks] == [5]
    assert_adds_up(history, wall)
    assert history.time["lost"] > 0
    assert sum(row["time/lost"] for row in history.train) == pytest.approx(history.time["lost"])


class Crash(jd.training.Callback):
    """Fails the fit at ``step`` (after its last checkpoint, without a final one): a crash, or a
    kill. Keeps the progress record at each log."""

    def __init__(self, step, directory):
        self.step, self.directory, self.records = step, directory, []

    def on_log(self, trainer, step, logs):
        self.records.append((step, read_progress(self.directory)))

    def on_step_end(self, trainer, step, metrics):
        if step == self.step:
            raise RuntimeError("crashed")


class Restores(list):
    """The clock's phase at each restore of a resuming fit."""


def restores(monkeypatch) -> Restores:
    record = Restores()
    restore = start_module.restore_live

    def traced(*args, **kwargs):
        clock = time_module._CLOCKS[threading.get_ident()]()
        record.append(clock.phase)
        return restore(*args, **kwargs)

    monkeypatch.setattr(start_module, "restore_live", traced)
    return record


@pytest.mark.timeout(120)
def test_a_resumed_run_counts_the_steps_taken_again_after_a_crash_as_lost(tmp_path, monkeypatch):
    data, ck = batches(12), tmp_path / "ck"
    options = {"checkpoint_dir": ck, "checkpoint_every": 4, "log_every": 2, "verbose": 0}
    # A fresh run in an empty directory loses nothing.
    history, wall = timed(lambda: trainer(features=7).fit(data, steps=2, **options))
    assert_adds_up(history, wall)
    assert history.time["lost"] == 0
    # it ended with a checkpoint of its last step: no record
    assert sorted(p.name for p in ck.iterdir()) == ["2"]
    # It goes on, and crashes at step 7: its last checkpoint is step 4, it got to step 7.
    crash = Crash(7, str(ck))
    with pytest.raises(RuntimeError, match="crashed"):
        trainer(features=7).fit(data, steps=8, callbacks=[crash], **options)
    # recorded at its first log point (a kill after it leaves that)
    assert crash.records[0] == (4, 4)
    assert read_progress(str(ck)) == 7  # and on its way out
    # The next run resumes from step 4 (its restore counted as checkpoint) and takes steps 5, 6 and
    # 7 again.
    phases = restores(monkeypatch)
    again = trainer(features=7)
    history, wall = timed(lambda: again.fit(data, steps=8, **options))
    assert phases == ["checkpoint"] and history.time["checkpoint"] > 0
    assert_adds_up(history, wall)
    assert history.time["lost"] > 0 and read_progress(str(ck)) == 0
    rows = {row["step"]: row for row in history.train}
    assert list(rows) == [6, 8]
    assert rows[6]["time/lost"] == pytest.approx(rows[6]["time/steps"])  # steps 5, 6: taken before
    assert 0 < rows[8]["time/lost"] < rows[8]["time/steps"]  # step 7 was, step 8 was not
    assert sum(row["time/lost"] for row in history.train) == pytest.approx(history.time["lost"])
    # From where a run stopped, nothing is taken again.
    history = trainer(features=7).fit(data, steps=10, **options)
    assert history.time["lost"] == 0


@pytest.mark.timeout(120)
def test_restore_step_counts_the_steps_it_takes_again_as_lost(tmp_path):
    data, ck = batches(12), tmp_path / "ck"
    options = {"checkpoint_dir": ck, "checkpoint_every": 2, "log_every": 2, "verbose": 0}
    trainer(features=7).fit(data, steps=8, **options)
    history, wall = timed(lambda: trainer(features=7).fit(data, steps=8, restore_step=4, **options))
    assert_adds_up(history, wall)
    # Steps 5 to 8 were taken before (they are deleted with their checkpoints, and taken again): all
    # lost.
    assert [row["step"] for row in history.train] == [6, 8]
    for row in history.train:
        assert 0 < row["time/lost"] == pytest.approx(row["time/steps"]), row
    assert sum(row["time/lost"] for row in history.train) == pytest.approx(history.time["lost"])


@pytest.mark.timeout(120)
def test_a_jobs_time_adds_up_its_runs_and_the_restart_after_a_crash(tmp_path):
    from jaxdist.training.loop._job_time import JOB_FILE, JOB_PARTS

    class Crash(jd.training.Callback):
        def on_step_end(self, trainer, step, metrics):
            if step == 6:
                raise RuntimeError("the job crashed at step 6")

    data, ck = batches(16), tmp_path / "ck"
    options = dict(log_every=2, checkpoint_dir=ck, checkpoint_every=4)
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="crashed"):
        trainer(features=6).fit(data, steps=12, callbacks=[Crash()], verbose=0, **options)
    crashed = time.perf_counter()
    time.sleep(0.5)  # the scheduler restarts the job
    restarted = time.perf_counter()
    out = io.StringIO()
    with redirect_stdout(out):
        history = trainer(features=6).fit(data, steps=12, verbose="lines", **options)
    ended = time.perf_counter()
    job = history.job_time
    assert history.job_runs == 2 and list(job) == list(JOB_PARTS), job
    # Against the stopwatch: the whole job, and the gap between the crash and the resumed run (the
    # sleep, and building the second trainer), within the time it takes to raise and to start fit.
    # (bounds, not a tolerance: the job's clock starts inside the first fit and its last record of
    # the crashed run may come a moment before the exception reaches the test, longer on a loaded
    # machine)
    assert 0.5 * (ended - started) <= sum(job.values()) <= ended - started, (job, ended - started)
    assert restarted - crashed <= job["restart"] <= ended - started - sum(history.time.values()), (
        job
    )
    # steps 5 and 6, again
    assert job["lost"] == pytest.approx(history.time["lost"]) and job["lost"] > 0
    assert job["steps"] > history.time["steps"] and job["compile"] >= history.time["compile"]
    assert history.job_goodput == pytest.approx(job["steps"] / sum(job.values()))
    assert any(line.startswith("job over 2 runs ")
               for line in out.getvalue().splitlines()[-4:]), out.getvalue()
    # It ended normally, with a checkpoint of its last step: the job is over, its record removed; a
    # later fit on the directory is a job of its own.
    assert not (ck / JOB_FILE).exists() and read_progress(str(ck)) == 0
    more = trainer(features=6).fit(data, steps=14, verbose=0, **options)
    assert more.job_runs == 1 and more.job_time["restart"] == 0
    assert sum(more.job_time.values()) == pytest.approx(sum(more.time.values()))


def test_a_missing_or_damaged_progress_record_means_nothing_was_taken_before(tmp_path):
    assert read_progress(str(tmp_path)) == 0
    write_progress(str(tmp_path), 12)
    assert read_progress(str(tmp_path)) == 12
    for text in ("", "{", '{"step": "12"}', '{"step": -3}', '{"step": true}', "[12]"):
        (tmp_path / PROGRESS_FILE).write_text(text)
        assert read_progress(str(tmp_path)) == 0, text
    write_progress(str(tmp_path / "missing"), 3)  # cannot be written: no error, no record
    assert read_progress(str(tmp_path / "missing")) == 0


def test_time_is_shown_in_one_line_and_goodput_is_nan_before_a_fit():
    history = jd.training.History()
    assert history.time == {} and np.isnan(history.goodput)
    out = io.StringIO()
    history.time = {"steps": 3.0, "compile": 1.0, "input": 0.0, "other": 0.0}
    jd.training.Progress(mode="lines", stream=out).on_train_end(None, history)
    assert out.getvalue() == "time 4 s, goodput 75%: compile 25%\n"


# ------------------------------------------------------------------------------------ profile_steps
@pytest.mark.timeout(120)
def test_profile_steps_leave_a_trace_under_log_dir_profile(tmp_path):
    t = trainer()
    t.fit(batches(6), steps=6, log_every=3, log_dir=tmp_path, profile_steps=(3, 5), verbose=0)
    traces = list((tmp_path / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert list(traces[0].parent.glob("perfetto_trace.json.gz"))


def step_markers(path):
    """The step markers in the trace ``path`` (an ``.xplane.pb``, the file XProf reads): ``{stat:
    value}`` of each ``train`` event carrying a ``step_num``, in time order."""
    # jaxlib's reader types warn on first use (DeprecationWarning, Python 3.13):
    with warnings.catch_warnings():
        # as an error inside its C++ iterator, an abort
        warnings.simplefilter("ignore", DeprecationWarning)
        data = jax.profiler.ProfileData.from_file(str(path))
        events = [event for plane in data.planes for line in plane.lines for event in line.events]
        found = sorted((event.start_ns, {key: value for key, value in event.stats})
                       for event in events
                       if event.name == "train")
    return [stats for _, stats in found if "step_num" in stats]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("steps_per_run", "log_every", "window", "want"), [
    (1, 4, (3, 6), [{"step_num": 3}, {"step_num": 4}, {"step_num": 5}]),
    # loops [1-2] [3-4] [5-6]: the one running steps 3 and 4
    (3, 2, (3, 5), [{"step_num": 3, "last_step": 4}]),
])
def test_every_traced_step_carries_a_step_marker_xprof_reads(
    tmp_path, steps_per_run, log_every, window, want
):
    t = trainer(steps_per_run=steps_per_run)
    t.fit(batches(8), steps=8, log_every=log_every, log_dir=tmp_path, profile_steps=window,
          verbose=0)
    (trace,) = (tmp_path / "profile" / "plugins" / "profile").glob("*/*.xplane.pb")
    markers = step_markers(trace)
    # a root event: XProf's step (StepTraceAnnotation)
    assert all(m.pop("_r") == 1 for m in markers), markers
    assert markers == want


@pytest.mark.timeout(120)
def test_xprofs_overview_page_finds_the_traced_steps(tmp_path):
    # XProf's own converter (pip install xprof): the overview page's step-time graph has one row per
    # traced step, and a step time (without markers: "No step marker observed", step time 0.0).
    convert = pytest.importorskip("xprof.convert.raw_to_tool_data", exc_type=ImportError)
    trainer().fit(batches(12), steps=12, log_every=4, log_dir=tmp_path, profile_steps=(5, 10),
                  verbose=0)
    (trace,) = (tmp_path / "profile" / "plugins" / "profile").glob("*/*.xplane.pb")
    data, _ = convert.xspace_to_tool_data([str(trace)], "overview_page", {})
    tables = json.loads(data)
    (graph,) = [
        t
        for t in tables
        if isinstance(t, dict) and any(c.get("id") == "stepnum" for c in t.get("cols", ()))
    ]
    assert [row["c"][0]["v"] for row in graph["rows"]] == [f"train {n}" for n in range(5, 10)]
    (summary,) = [t["p"] for t in tables if isinstance(t, dict)
                  and "steptime_ms_average" in t.get("p", {})]
    assert float(summary["steptime_ms_average"]) > 0, summary


class Calls(list):
    """The trace's starts and stops, each with ``trainer.step`` at that moment (no trace is
    taken)."""

    trainer = None


def calls(monkeypatch) -> Calls:
    record = Calls()
    monkeypatch.setattr(jax.profiler, "start_trace",
                        lambda *a, **k: record.append(("start", record.trainer.step)))
    monkeypatch.setattr(jax.profiler, "stop_trace",
                        lambda: record.append(("stop", record.trainer.step)))
    return record


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("steps_per_run", "log_every", "window", "want"), [
    # before step 3 is dispatched; after step 4 has run
    (1, 10, (3, 5), [("start", 2), ("stop", 4)]),
    (1, 10, (1, 2), [("start", 0), ("stop", 1)]),
    # loops [1-2] [3-4] [5-6]: the one running steps 3 and 4
    (3, 2, (3, 5), [("start", 2), ("stop", 4)]),
    (4, 10, (3, 5), [("start", 0), ("stop", 4)]),  # loops [1-4] [5-8]: the first runs steps 3 and 4
    # the fit ends inside the window: stopped at the end
    (1, 10, (5, 20), [("start", 4), ("stop", 8)]),
    (1, 10, (10, 12), []),  # after the fit's last step
])
def test_the_trace_covers_the_window(monkeypatch, tmp_path, steps_per_run, log_every, window, want):
    record = calls(monkeypatch)
    record.trainer = trainer(steps_per_run=steps_per_run)
    fit = lambda: record.trainer.fit(batches(8), steps=8, log_every=log_every, log_dir=tmp_path,  # noqa: E731
                                     profile_steps=window, verbose=0)
    if want:
        fit()
    else:  # a window the fit never reaches is said
        with pytest.warns(UserWarning,
                          match=r"profile_steps=\(10, 12\): no trace taken: this fit ended at step "
                                r"8"):
            fit()
    assert record == want


@pytest.mark.timeout(120)
def test_a_resumed_run_traces_what_is_left_and_a_failing_fit_stops_the_trace(monkeypatch, tmp_path):
    record = calls(monkeypatch)
    record.trainer = trainer()
    record.trainer.fit(batches(8), steps=4, checkpoint_dir=tmp_path / "ck", verbose=0)
    record.trainer = trainer()
    record.trainer.fit(batches(8), steps=8, checkpoint_dir=tmp_path / "ck", log_dir=tmp_path,
                       profile_steps=(3, 7), verbose=0)
    assert record == [("start", 4), ("stop", 6)]  # resumed at step 4: steps 5 and 6 are left

    class Fail(jd.training.Callback):
        def on_step_end(self, trainer, step, metrics):
            if step == 3:
                raise RuntimeError("a callback failed")

    record.clear()
    record.trainer = trainer()
    with pytest.raises(RuntimeError, match="a callback failed"):
        record.trainer.fit(batches(8), steps=8, log_dir=tmp_path, profile_steps=(2, 6),
                           callbacks=[Fail()], verbose=0)
    assert record == [("start", 1), ("stop", 3)]


def test_another_trace_running_is_left_alone_with_a_warning(monkeypatch, tmp_path):
    def busy(*args, **kwargs):
        raise RuntimeError("busy")

    monkeypatch.setattr(jax.profiler, "start_trace", busy)
    t = trainer()
    with pytest.warns(RuntimeWarning,
                      match=r"profile_steps=\(1, 3\): no trace taken, the profiler is busy"):
        t.fit(batches(4), steps=4, log_dir=tmp_path, profile_steps=(1, 3), verbose=0)
    assert t.step == 4


def test_only_the_chosen_processes_trace(monkeypatch, tmp_path):
    assert StepProfile.of((1, 2), (0,), tmp_path,
                          lambda s: 1).directory == str(tmp_path / "profile")
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert StepProfile.of((1, 2), (0,), tmp_path, lambda s: 1) is None
    assert StepProfile.of((1, 2), "all", tmp_path, lambda s: 1) is not None
    assert StepProfile.of((1, 2), 1, tmp_path, lambda s: 1) is not None


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"profile_steps": (3, 5)},
                                r"profile_steps=\(3, 5\) needs log_dir=\.\.\.: the trace is "
                                r"written to <log_dir>/profile"),
    ({"profile_steps": (0, 2), "log_dir": "x"},
                                                r"profile_steps=\(0, 2\) must be \(start, stop\), "
                                                r"two ints with 1 <= start < stop"),
    ({"profile_steps": (3, 3), "log_dir": "x"}, r"profile_steps=\(3, 3\) must be"),
    ({"profile_steps": (3,), "log_dir": "x"}, r"profile_steps=\(3,\) must be"),
    ({"profile_steps": (3.0, 5), "log_dir": "x"}, r"profile_steps=\(3.0, 5\) must be"),
    ({"profile_steps": 3, "log_dir": "x"}, r"profile_steps=3 must be"),
    ({"profile_steps": (1, 2), "log_dir": "x", "profile_processes": (1,)},
     r"profile_processes=\(1,\) must be 'all' or process indices in \[0, 1\)"),
    ({"profile_steps": (1, 2), "log_dir": "x", "profile_processes": "some"},
     r"profile_processes='some' must be"),
])
def test_bad_profile_arguments_are_named(kwargs, match):
    t = trainer()
    with pytest.raises(ValueError, match=match):
        t.fit(batches(2), steps=2, verbose=0, **kwargs)
    assert t.step == 0
