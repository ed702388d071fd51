"""The benchmark suite runs end to end (correctness only: tiny model, 2-step blocks; no timing
asserts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import dispatch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.multiprocess  # its multi-process rows launch 2-process runs
@pytest.mark.timeout(300)
def test_bench_smoke_writes_table_json_and_plot(tmp_path):
    """Slow because it compiles every stepper of the suite's rows (tiny MLP, tiny LM) in a fresh
    process and starts the multi-process rows' runs (4 launches of 2 processes, 1 of one);
    ``--smoke`` leaves out only rows whose stepper another row runs (see benchmarks/README.md)."""
    _smoke("benchmarks", tmp_path)
    files = sorted(p.name.split("-")[-1] if p.name.endswith("-rates.png") else p.suffix
                   for p in tmp_path.iterdir())
    assert files == [".json", ".md", ".png", "rates.png"]  # the ratio plot, and steps/s per stepper
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    keys = {row["key"] for row in data["rows"]}
    assert {"P1", "P2", "null", "multiproc", "multiproc-1x8", "lm-mesh", "lm-hsdp-mp"} <= keys
    assert all(row["status"] != "error" for row in data["rows"]), [r["note"] for r in data["rows"]]
    table = next(tmp_path.glob("*.md")).read_text()
    assert "| P1 |" in table and "| multiproc |" in table and "| lm-hsdp-mp |" in table
    assert "HSDP 2 x 4 state per device" in table  # the memory table's multi-process entry


@pytest.mark.slow
@pytest.mark.timeout(300)
def _smoke(module, tmp_path):
    """``python -m <module> --smoke --out tmp_path``, which must succeed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXDIST_")}
    out = subprocess.run([sys.executable, "-m", module, "--smoke", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dispatch_smoke_writes_one_row_per_case(tmp_path):
    """Slow because each device count runs in a process of its own (1 and 8 devices) and compiles
    each case's two sides."""
    _smoke("benchmarks.dispatch", tmp_path)
    rows = json.loads(next(tmp_path.glob("*-dispatch-smoke.json")).read_text())
    assert [r["case"] for r in rows] == list(dispatch.CASES) == [
        "1dev-trivial", "trainer-1dev", "mirrored-50", "run-mirrored-50", "fsdp-50", "tensor-50",
        "expert-50", "fsdp-50-explicit", "trainer-8dev"]
    first = next(r for r in rows if r["case"] == "run-mirrored-50")["first_call_s"]
    assert first["candidate"] > 0 and first["baseline"] > 0
    assert all(r["extra_us"]["n"] >= 2 and r["candidate_us"] > 0 and r["baseline_us"] > 0
               for r in rows)
    assert [r["limit_us"] for r in rows[:3]] == [1.5, 25.0, 5.0]
    counts = [r["calls_per_step"] for r in rows if r["case"].startswith("trainer")]
    assert len(counts) == 2 and all(c["candidate"] > 0 and c["baseline"] > 0 for c in counts)
    assert "| 1dev-trivial | 1 |" in next(tmp_path.glob("*-dispatch-smoke.md")).read_text()


def test_dispatch_refuses_cases_that_match_nothing(capsys):
    assert dispatch.main(["--cases", "trainer-4dev"]) == 2  # before any process starts
    err = capsys.readouterr().err
    assert "--cases 'trainer-4dev' matches no case: pass part of one of 1dev-trivial," in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_moe_smoke_writes_the_memory_all_to_all_and_step_time_rows(tmp_path):
    """Slow because it is a fresh process that compiles the MoE LM under each layout it compares."""
    _smoke("benchmarks.moe", tmp_path)
    table = next(tmp_path.glob("*-moe-smoke.md")).read_text()
    for heading in ("## (a)", "## (b)", "## (c)"):
        assert heading in table, heading
    # 1/EP of the experts per device
    assert "| jd.nn.MoE, (data=2, expert=4) | P('expert',) | 0.2500 |" in table
    assert "buffer-based" in table and "(ok)" in table  # all-to-all bytes as analysed; losses agree


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_moe_dropless_smoke_compares_the_ragged_and_padded_paths(tmp_path):
    """Slow because it is a fresh process that compiles the ragged and the padded MoE programs on 8
    devices."""
    _smoke("benchmarks.moe_dropless", tmp_path)
    data = json.loads(next(tmp_path.glob("*-moe-dropless-smoke.json")).read_text())
    assert [r["dispatch"] for r in data["rows"]] == [["dropless_ragged_all_to_all_emulated"],
                                                     ["dropless_padded_all_to_all"]]
    assert data["max_rel_loss_diff"] <= 1e-4 and data["ratio"]["n"] == 2
    assert "ragged / padded steps/s" in next(tmp_path.glob("*-moe-dropless-smoke.md")).read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accelerator_smoke_runs_every_part_and_labels_cpu_numbers(tmp_path):
    """Slow because it is a fresh process that compiles every part on one device: the four rows'
    steppers, the LM twice (one attention each), the MoE's two paths and each attention kernel."""
    _smoke("benchmarks.accelerator", tmp_path)
    data = json.loads(next(tmp_path.glob("*-accelerator-smoke.json")).read_text())
    assert [r["key"] for r in data["rows"]] == ["P1", "1dev", "trainer", "fsdp"]
    assert all(r["status"] != "error" for r in data["rows"]), [r["note"] for r in data["rows"]]
    first, second = data["lm"]
    assert (first["attention"] == "jd.nn.dot_product_attention"
            and "implementation=" in second["attention"])
    # the model FLOPs program_cost counts against 6N + 12LdT (tiny: norms and Adam show)
    for row in data["lm"]:
        assert (0.9 < row["program_over_analytic"] < 1.5 and row["uncosted"] == []
                and row["mfu_analytic"] is None)
    # CPU keeps no statistics
    assert first["plan_peak_bytes"] > 0 and first["peak_bytes_in_use"] is None
    assert [r["path"] for r in data["moe"]["rows"]] == ["ragged", "padded"]
    timed = [r for r in data["attention"] if "ms" in r]
    assert len(timed) >= 2 and all(r["tflops_program"] > 0 for r in timed)
    table = next(tmp_path.glob("*-accelerator-smoke.md")).read_text()
    assert ("mean nothing about an accelerator" in table and "| P1 |" in table
            and "cuDNN needs an NVIDIA GPU" in table)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_coordination_smoke_times_every_figure_on_two_processes(tmp_path):
    """Slow because it launches a job of 2 processes (about 7 s of CPU)."""
    _smoke("benchmarks.coordination", tmp_path)
    data = json.loads(next(tmp_path.glob("*-coordination-smoke.json")).read_text())
    (result,) = data["results"]
    assert result["processes"] == 2
    assert sorted(result["seconds"]) == sorted(["exchange", "tiers", "beat", "poll", "stragglers"])
    assert all(len(v) == 2 and min(v) > 0 for v in result["seconds"].values())
    assert "(extrapolated)" in next(tmp_path.glob("*-coordination-smoke.md")).read_text()


def test_accelerator_refuses_an_unknown_part(capsys):
    from benchmarks import accelerator

    with pytest.raises(SystemExit) as exit_info:
        accelerator.main(["--parts", "lm,attension"])
    assert exit_info.value.code == 2
    assert ("--parts: unknown part(s) ['attension']; choose from ['rows', 'lm', 'moe', 'attention']"
            in (capsys.readouterr().err))
