"""The PNG: steps/s of every stepper, one panel per model (matplotlib, Agg backend)."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.suite import Row, stepper_rates
from benchmarks.timing import spread

__all__ = ["plot"]

# Steppers that are not jaxdist (the references jaxdist is measured against) are drawn in grey.
_REFERENCE_PREFIXES = ("hand.", "plain.", "pmap", "keras.", "sharded.hand")


def plot(rows: Sequence[Row], machine: dict[str, Any], path: pathlib.Path) -> bool:
    """Write a PNG of steps/s by stepper, one panel per model: median bar, whiskers to min/max over
    blocks.

    The x axis is logarithmic when a panel's rates span more than a factor of 5 (one-device steps
    are much faster than eight-device ones here), so equal ratios look equally long.

    Returns:
        False (and writes nothing) when there is no measured row or matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        print("benchmarks: matplotlib is not installed; no plot (pip install -e '.[bench]')",
              file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    rates = stepper_rates(rows)
    models = list(dict.fromkeys(model for model, _ in rates))
    if not models:
        return False
    tallest = max(sum(1 for m, _ in rates if m == model) for model in models)
    sweep = _steps_per_run_sweep(rows)
    fig, axes = plt.subplots(
        1, len(models) + bool(sweep), figsize=(7.5 * len(models) + 4.5 * bool(sweep),
                                               1.2 + 0.38 * tallest),
        squeeze=False, constrained_layout=True,
    )
    if sweep:
        _plot_sweep(axes[0][-1], sweep)
    for ax, model in zip(axes[0], models, strict=False):
        keys = [key for m, key in rates if m == model]
        labels = [rates[model, key][0] for key in keys]
        stats = [spread(rates[model, key][1]) for key in keys]
        med = [s.median for s in stats]
        err = [[s.median - s.min for s in stats], [s.max - s.median for s in stats]]
        colors = ["0.6" if key.startswith(_REFERENCE_PREFIXES) else "tab:blue" for key in keys]
        ax.barh(range(len(keys)), med, height=0.7, xerr=err, color=colors, capsize=3)
        for i, st in enumerate(stats):  # the median, printed just right of the max whisker
            ax.annotate(f"{st.median:.0f}", (st.max, i), xytext=(5, -3), textcoords="offset points",
                        fontsize=7)
        ax.margins(x=0.12)
        if max(s.max for s in stats) > 5 * min(s.min for s in stats):
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            # minor labels overlap on short log spans
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_yticks(range(len(keys)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("steps/s (median over blocks; whiskers: min-max)", fontsize=8)
        batch = next(r.batch for r in rows if r.layers == model)
        ax.set_title(f"MLP {model}, global batch {batch}", fontsize=9)
    fig.suptitle(
        f"jaxdist benchmarks {machine['date'][:10]} - {machine['backend']} "
        f"x{machine['device_count']}, {machine['cpu_count']} cores, jax "
        f"{machine['versions']['jax']} (blue: jaxdist, grey: references)",
        fontsize=9,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _steps_per_run_sweep(rows: Sequence[Row]) -> list[tuple[int, Any]]:
    """``[(steps_per_run, ratio spread vs per-step)]`` from the P3 rows and the tpu-spr row (k =
    20)."""
    found = {}
    for row in rows:
        if not row.measured:
            continue
        if row.key.startswith("P3-"):
            found[int(row.key[3:])] = row.ratio
        elif row.key == "tpu-spr":
            found[20] = row.ratio
    return sorted(found.items()) if len(found) > 1 else []


def _plot_sweep(ax: Any, sweep: list[tuple[int, Any]]) -> None:
    ks = [k for k, _ in sweep]
    med = [r.median for _, r in sweep]
    err = [[r.median - r.ci_low for _, r in sweep], [r.ci_high - r.median for _, r in sweep]]
    ax.errorbar(ks, med, yerr=err, marker="o", capsize=3, color="tab:blue")
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set_xscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    for k, m in zip(ks, med, strict=True):
        ax.annotate(f"{m:.2f}x", (k, m), xytext=(4, 4), textcoords="offset points", fontsize=7)
    ax.set_xlabel("steps_per_run (steps per compiled on-device loop)", fontsize=8)
    ax.set_ylabel("speedup vs one strategy.jit step per batch (95% CI)", fontsize=8)
    ax.set_title("steps_per_run speedup, small MLP (host numpy batches)", fontsize=9)
