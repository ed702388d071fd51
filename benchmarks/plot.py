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
    """Write a PNG of steps/s by stepper, one panel per model: median bar, whiskers to min/max over blocks.

    The x axis is logarithmic when a panel's rates span more than a factor of 5 (one-device steps are much
    faster than eight-device ones here), so equal ratios look equally long.

    Returns:
        False (and writes nothing) when there is no measured row or matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        print("benchmarks: matplotlib is not installed; no plot (pip install -e '.[bench]')", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    rates = stepper_rates(rows)
    models = list(dict.fromkeys(model for model, _ in rates))
    if not models:
        return False
    tallest = max(sum(1 for m, _ in rates if m == model) for model in models)
    fig, axes = plt.subplots(
        1, len(models), figsize=(7.5 * len(models), 1.2 + 0.38 * tallest), squeeze=False, constrained_layout=True
    )
    for ax, model in zip(axes[0], models, strict=True):
        keys = [key for m, key in rates if m == model]
        labels = [rates[model, key][0] for key in keys]
        stats = [spread(rates[model, key][1]) for key in keys]
        med = [s.median for s in stats]
        err = [[s.median - s.min for s in stats], [s.max - s.median for s in stats]]
        colors = ["0.6" if key.startswith(_REFERENCE_PREFIXES) else "tab:blue" for key in keys]
        ax.barh(range(len(keys)), med, height=0.7, xerr=err, color=colors, capsize=3)
        for i, st in enumerate(stats):  # the median, printed just right of the max whisker
            ax.annotate(f"{st.median:.0f}", (st.max, i), xytext=(5, -3), textcoords="offset points", fontsize=7)
        ax.margins(x=0.12)
        if max(s.max for s in stats) > 5 * min(s.min for s in stats):
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())  # minor labels overlap on short log spans
        ax.set_yticks(range(len(keys)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("steps/s (median over blocks; whiskers: min-max)", fontsize=8)
        batch = next(r.batch for r in rows if r.layers == model)
        ax.set_title(f"MLP {model}, global batch {batch}", fontsize=9)
    fig.suptitle(
        f"jaxdist benchmarks {machine['date'][:10]} - {machine['backend']} x{machine['device_count']}, "
        f"{machine['cpu_count']} cores, jax {machine['versions']['jax']} (blue: jaxdist, grey: references)",
        fontsize=9,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
