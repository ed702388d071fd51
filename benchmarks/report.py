"""Results: the machine record, the markdown table, the JSON of every figure and the steps/s
plot."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import jax

from benchmarks.cases import COMPARISONS
from benchmarks.plot import plot
from benchmarks.plot_ratios import plot_ratios, title_of
from benchmarks.runners import FIT_MIN_BLOCK_SECONDS
from benchmarks.suite import Row, stepper_rates
from benchmarks.timing import Settings, spread

__all__ = ["machine_info", "markdown", "write_results"]

_PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "keras", "jaxdist")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            # "-dirty": the working tree had uncommitted changes to tracked files when the run
            # started
            ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=7"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info(devices: Sequence[jax.Device]) -> dict[str, Any]:
    """Where and with what a run was measured: host, devices, package versions, load, git commit."""
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host_platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device_count": len(devices),
        "device_kind": devices[0].device_kind if devices else None,
        "simulated_cpu_devices": devices[0].platform == "cpu" and len(devices) > 1 if devices
        else False,
        "load_average_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": {p: _version(p) for p in _PACKAGES},
        "git_commit": _git_commit(),
        "argv": sys.argv[1:],
    }


def _fmt_ratio(row: Row) -> tuple[str, str, str, str]:
    if not row.measured:
        return "-", "-", "-", "-"
    r = row.ratio
    return (
        f"**{r.median:.3f}**",
        f"{r.ci_low:.3f}-{r.ci_high:.3f}",
        f"{r.q1:.3f}-{r.q3:.3f}",
        f"{r.min:.3f}-{r.max:.3f}",
    )


def _factors() -> str:
    more = [f"{c.pairs_factor}x for {c.key}" for c in COMPARISONS if c.pairs_factor != 1]
    return f" ({', '.join(more)})" if more else ""


def _minimums(settings: Settings) -> str:
    if not settings.use_stepper_minimums:
        return ""
    return (
        ", at least 5x the prefetch depth for a prefetching side and "
        f"{FIT_MIN_BLOCK_SECONDS:g} s for a fit call per block"
    )


def _blocks(row: Row) -> str:
    return f"{row.steps_per_block} x {row.ratio.n}" if row.measured else "-"


def _status(row: Row) -> str:
    if row.status in ("skipped", "error"):
        return f"{row.status}: {row.note}"
    return row.status


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _memory_lines(memory: Sequence[dict[str, Any]]) -> list[str]:
    """The LM memory table (informational, no timing): per-device state bytes and XLA temp bytes per
    layout."""
    if not memory:
        return []
    lines = [
        "## LM memory per device (informational)",
        "",
        "Params and optimizer state: the most bytes any one device holds (the placed arrays' "
        "addressable shards). Temp: XLA `memory_analysis().temp_size_in_bytes` of the compiled "
        "step (a hand-written `jax.jit` with the strategy's layouts). Steps/s with and without "
        "remat: the `lm-remat` row.",
        "",
        "| model (batch) | layout | params MiB | optimizer MiB | state MiB | state / Mirrored | "
        "temp MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = []
    for table in memory:
        if "error" in table:
            notes.append(f"- {table['model']}: not measured ({table['error']})")
            continue
        mirrored = table["entries"]["Mirrored"]["state_bytes"]
        for name, e in table["entries"].items():
            lines.append(
                f"| {table['layers']} ({table['batch']}) | {name} | {_mib(e['param_bytes'])} "
                f"| {_mib(e['optimizer_bytes'])} | {_mib(e['state_bytes'])} | "
                f"{e['state_bytes'] / mirrored:.3f} | {_mib(e['temp_bytes'])} |"
            )
        for name, verdict in table.get("process_targets", {}).items():
            notes.append(
                f"- {table['layers']}: {name} state per device = {verdict['fraction']:.3f} of "
                f"Mirrored's (target <= {verdict['target']:.3f}): "
                f"{'pass' if verdict['pass'] else 'above target'}"
            )
        if "tp_state_fraction_of_mirrored" in table:
            verdict = "pass" if table["tp_state_pass"] else "above target"
            notes.append(
                f"- {table['layers']}: FSDP x TP state per device = "
                f"{table['tp_state_fraction_of_mirrored']:.3f} of Mirrored's (target <= 1/N + 0.05 "
                f"= {table['tp_state_target']:.3f}): {verdict}"
            )
    return [*lines, "", *notes, ""]


def markdown(
    rows: Sequence[Row],
    machine: dict[str, Any],
    settings: Settings,
    mode: str,
    memory: Sequence[dict[str, Any]] = (),
) -> str:
    """The results as markdown: machine line, head-to-head table, the LM memory table (when
    measured)."""
    v = machine["versions"]
    lines = [
        f"# jaxdist benchmarks ({mode}) - {machine['date'][:10]}, {machine['backend']} "
        f"x{machine['device_count']}",
        "",
        f"- machine: {machine['host_platform']}, {machine['cpu_count']} CPU cores, python "
        f"{machine['python']}",
        f"- devices: {machine['device_count']} x {machine['device_kind']}"
        + (" (simulated on the host CPU)" if machine["simulated_cpu_devices"] else ""),
        f"- versions: jax {v['jax']}, jaxlib {v['jaxlib']}, flax {v['flax']}, optax {v['optax']}, "
        f"numpy {v['numpy']}, keras {v['keras'] or 'not installed'}, jaxdist {v['jaxdist']} "
        f"(git {machine['git_commit']})",
        f"- load average at start (1/5/15 min): {machine['load_average_1_5_15']}",
        f"- method: warm-up, then {settings.pairs} pairs of alternating blocks{_factors()} (A B, B "
        f"A, ...; about {settings.block_seconds:g} s per block{_minimums(settings)}; "
        "block_until_ready at each block's end); ratio = steps/s of the candidate / steps/s of the "
        "baseline, one per pair; reported: the median over pairs, its 95% confidence interval "
        "(order statistics), the interquartile range and min-max. The `null` row (two identical "
        "steppers) shows the noise floor. "
        'Status "below target (within noise)": the median misses the target but its confidence '
        'interval '
        "reaches it.",
        "",
        "| row | model (batch) | candidate | baseline | ratio (median) | 95% CI | IQR | min-max | "
        "target | candidate steps/s | baseline steps/s | steps/block x pairs | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        med, ci, iqr, rng = _fmt_ratio(row)
        rate_c = f"{row.rate_candidate.median:.1f}" if row.measured else "-"
        rate_b = f"{row.rate_baseline.median:.1f}" if row.measured else "-"
        target = f"≥ {row.target:.2f}" if row.target is not None else "info"
        lines.append(
            f"| {row.key} | {row.layers} ({row.batch}) | {row.candidate_label} | "
            f"{row.baseline_label} | {med} | {ci} | {iqr} | {rng} | {target} | {rate_c} | {rate_b} "
            f"| {_blocks(row)} | {_status(row)} |"
        )
    lines += [
        "",
        "The plot's steps/s pool every block a stepper ran, across rows measured minutes apart; "
        "only the ratios compare adjacent blocks. Every block time is in the JSON next to this "
        "file. The `multiproc` rows alternate whole runs (new processes each; compile excluded) "
        "instead of blocks in one process; with 2 or 3 runs per side their confidence interval is "
        "wide on 2 shared cores.",
        "",
        *_memory_lines(memory),
    ]
    return "\n".join(lines)


def write_table(out_dir: pathlib.Path, stem: str, table: str, data: Any) -> None:
    """Write a runner's ``<stem>.md`` (``table``) and ``<stem>.json`` (``data``) under ``out_dir``
    and say so."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(table)
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"wrote {out_dir / stem}.md and .json", file=sys.stderr)


def write_results(
    rows: Sequence[Row],
    machine: dict[str, Any],
    settings: Settings,
    mode: str,
    out_dir: pathlib.Path,
    memory: Sequence[dict[str, Any]] = (),
) -> dict[str, pathlib.Path]:
    """Write ``<date>-<backend><devices>[-mode].{md,json,png}`` under ``out_dir``; return the paths
    written.

    ``memory``: the LM memory tables (`benchmarks.lm.memory_table`), written to the markdown and the
    JSON.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{machine['date'][:10]}-{machine['backend']}{machine['device_count']}"
    if mode != "full":
        stem += f"-{mode}"
    paths = {"markdown": out_dir / f"{stem}.md", "json": out_dir / f"{stem}.json",
             "plot": out_dir / f"{stem}.png"}
    paths["markdown"].write_text(markdown(rows, machine, settings, mode, memory))
    data = {
        "mode": mode,
        "machine": machine,
        "settings": dataclasses.asdict(settings),
        "rows": [dataclasses.asdict(r) for r in rows],
        "steppers": [
            {"model": model, "stepper": key, "label": label,
             "steps_per_s": dataclasses.asdict(spread(rates))}
            for (model, key), (label, rates) in stepper_rates(rows).items()
        ],
        "memory": list(memory),
    }
    paths["json"].write_text(json.dumps(data, indent=2) + "\n")
    if not plot_ratios(data["rows"], title_of(machine, mode), paths["plot"]):
        del paths["plot"]
    # absolute steps/s per stepper (not to be compared across rows)
    paths["rates"] = out_dir / f"{stem}-rates.png"
    if not plot(rows, machine, paths["rates"]):
        del paths["rates"]
    return paths
