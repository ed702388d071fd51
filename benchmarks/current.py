"""Today's figures: the newest measurement of every benchmark row, gathered from the results folder.

Each run of the suite writes ``benchmarks/results/<date>-<machine>[-<name>].json`` with the rows it
measured (often a few rows only: ``--rows P1,trainer``). The current figure of a row (its key and
model) is the one of the newest run that measured it, by the run's own timestamp; runs of an older
commit kept for a before/after comparison (``*-before*.json``) never count as current. The older
runs stay in the folder: they are the history, and the CHANGELOG says what changed between them.

Command line::

    python -m benchmarks.current                 # the markdown table (docs/benchmarks.md starts
                                                 # with it)
    python -m benchmarks.current --plot OUT.png  # and the ratio chart of the same rows
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.plot_ratios import plot_ratios

__all__ = ["current_rows", "markdown_table", "plot_current"]

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
_MODELS = {"mlp-small": "784-64-64-10 (64)", "mlp-large": "784-512-512-10 (256)",
           "lm": "transformer LM"}


def current_rows(results: pathlib.Path = RESULTS) -> list[dict[str, Any]]:
    """The newest measured row for every (key, model), each with ``"date"`` (the run's day) and
    ``"file"``.

    Args:
        results: the folder of results JSON files.

    Returns:
        The rows in the suite's order (`_suite_order`), small model before large.
    """
    runs = []
    for path in sorted(results.glob("*.json")):
        if "-before" in path.stem:
            continue
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("rows"), list) and "machine" in data:
            runs.append((data["machine"]["date"], path.name, data["rows"]))
    newest: dict[tuple[str, str], dict[str, Any]] = {}
    for date, name, rows in sorted(runs):  # oldest first: a newer run overwrites
        for row in rows:
            ratio = row.get("ratio")
            if isinstance(ratio, dict) and ratio.get("median") is not None:
                newest[row["key"], row.get("model", "")] = {**row, "date": date[:10], "file": name}
    suite = _suite_order(results)
    sizes = {"mlp-small": 0, "mlp-large": 1}
    return sorted(newest.values(), key=lambda r: (suite.get(r["key"], len(suite)),
                                                  sizes.get(r.get("model"), 2)))


def _suite_order(results: pathlib.Path) -> dict[str, int]:
    """Row keys in the order of the run that has the most of them (the suite's reading order), then
    the rest."""
    best: list[str] = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("rows"), list):
            keys = list(dict.fromkeys(r["key"] for r in data["rows"]))
            if len(keys) > len(best):
                best = keys
    extra = ["lm-fsdp", "lm-tp", "lm-keras", "lm-remat", "lm-mesh", "lm-hsdp-mp", "multiproc",
             "multiproc-1x8"]
    return {key: i for i, key in enumerate(dict.fromkeys(best + extra))}


def _target(row: dict[str, Any]) -> str:
    return "info" if row.get("target") is None else f"≥ {row['target']:.2f}"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as the markdown table of docs/benchmarks.md (one line per row, the run's date
    last)."""
    lines = ["| row | model (batch) | candidate | baseline | ratio | 95% CI | target | status | "
             "measured |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["ratio"]
        model = _MODELS.get(r.get("model", ""), r.get("model", ""))
        lines.append(
            f"| {r['key']} | {model} | {r['candidate_label']} | {r['baseline_label']} | "
            f"**{ratio['median']:.3f}** | {ratio['ci_low']:.3f}-{ratio['ci_high']:.3f} | "
            f"{_target(r)} | {r.get('status', '')} | {r['date']} |"
        )
    return "\n".join(lines)


def plot_current(rows: Sequence[dict[str, Any]], path: pathlib.Path) -> bool:
    """The ratio chart of ``rows`` (`plot_ratios`), each labelled with the day it was measured."""
    days = sorted({r["date"] for r in rows})
    span = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"
    title = (f"jaxdist benchmarks: the newest measurement of each row ({span}; 2 CPU cores, "
             "8 simulated devices)")
    return plot_ratios(rows, title, path, stable=True)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.current",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS, help="the results folder")
    parser.add_argument("--plot", type=pathlib.Path, default=None,
                        help="also draw the ratio chart here (PNG)")
    args = parser.parse_args(argv)
    rows = current_rows(args.results)
    print(markdown_table(rows))
    if args.plot is not None and not plot_current(rows, args.plot):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
