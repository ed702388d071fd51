"""The ratio plot: each row's median ratio with its 95% interval, against the row's target
(matplotlib, Agg).

Ratios are what the suite measures side by side (candidate steps/s over baseline steps/s, one per
pair of adjacent blocks), so they are what a plot may compare; absolute steps/s of rows measured
minutes apart are not.

Command line: ``python -m benchmarks.plot_ratios RESULTS.json OUT.png`` redraws the plot of any
run's JSON.
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["plot_ratios"]

_MODELS = {"mlp-small": "small MLP", "mlp-large": "large MLP", "mlp-tiny": "tiny MLP", "lm": "LM",
           "lm-tiny": "tiny LM"}


def plot_ratios(rows: Sequence[dict[str, Any]], title: str, path: pathlib.Path,
                stable: bool = False) -> bool:
    """Write a PNG with one line per measured row: median ratio (dot), 95% CI (bar), target (dashed
    tick).

    Args:
        rows: the rows as in the results JSON (``key``, ``model``, ``candidate_label``,
            ``baseline_label``, ``target``, ``ratio`` with ``median`` / ``ci_low`` / ``ci_high``);
            unmeasured rows are skipped.
        title: the figure's title (date, machine, versions).
        path: where the PNG goes.
        stable: leave matplotlib's version out of the PNG, so the same rows give the same bytes (a
            figure kept in git). A row with a ``"date"`` shows it after its label.

    Returns:
        False (and writes nothing) when no row was measured or matplotlib is not installed.
    """
    measured = [r for r in rows if isinstance(r.get("ratio"), dict)
                and r["ratio"].get("median") is not None]
    if not measured:
        return False
    try:
        import matplotlib
    except ImportError:
        print("benchmarks: matplotlib is not installed; no plot (pip install -e '.[bench]')",
              file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 1.3 + 0.34 * len(measured)), constrained_layout=True)
    for i, row in enumerate(measured):
        r = row["ratio"]
        target = row.get("target")
        met = target is None or r["median"] >= target
        color = "tab:blue" if target is None else ("tab:green" if met else "tab:red")
        ax.errorbar(
            r["median"], i, xerr=[[r["median"] - r["ci_low"]], [r["ci_high"] - r["median"]]],
            fmt="o", color=color, capsize=3, markersize=4,
        )
        if target is not None:
            ax.plot([target, target], [i - 0.35, i + 0.35], color="0.25", ls="--", lw=1)
        ax.annotate(f"{r['median']:.3f}", (r["ci_high"], i), xytext=(5, -3),
                    textcoords="offset points", fontsize=7)
    ax.axvline(1.0, color="0.7", lw=0.8)
    ax.set_yticks(range(len(measured)), [_label(r) for r in measured], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(
        "ratio = candidate / baseline steps/s (median and 95% CI; > 1: jaxdist faster; dashed: the "
        "row's target)",
        fontsize=8,
    )
    ax.set_title(title + "\ngreen: target met, red: missed, blue: information (baselines: see the "
                         "table)", fontsize=8)
    fig.savefig(path, dpi=110, **({"metadata": {"Software": None}} if stable else {}))
    plt.close(fig)
    return True


def _label(row: dict[str, Any]) -> str:
    model = _MODELS.get(row.get("model", ""), row.get("model", ""))
    text = f"{row['key']} ({model}): {row['candidate_label']}"
    text = text if len(text) <= 64 else text[:63] + "…"
    return f"{text} [{row['date'][5:]}]" if "date" in row else text


def title_of(machine: dict[str, Any], mode: str) -> str:
    """The plot title for a run: date, mode, devices, cores, jax version."""
    return (
        f"jaxdist benchmarks {machine['date'][:10]} ({mode}) - {machine['backend']} "
        f"x{machine['device_count']}, {machine['cpu_count']} cores, jax "
        f"{machine['versions']['jax']}"
    )


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m benchmarks.plot_ratios RESULTS.json OUT.png", file=sys.stderr)
        return 2
    data = json.loads(pathlib.Path(argv[0]).read_text())
    ok = plot_ratios(data["rows"], title_of(data["machine"], data.get("mode", "")),
                     pathlib.Path(argv[1]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
