"""Draw docs/assets/benchmark-ratios.png: the newest measurement of every benchmark row (`benchmarks.current`).

    python docs/figures/benchmarks.py    # scripts/docs runs it before every build

The rows come from the results folder (benchmarks/results/*.json), each from the newest run that measured it;
docs/benchmarks.md shows the same rows as its first table (`python -m benchmarks.current` prints it, and a
test compares the two). The output is byte-stable, so a rebuild leaves git clean.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the benchmarks package of this checkout

from benchmarks.current import current_rows, plot_current  # noqa: E402

if __name__ == "__main__":
    plot_current(current_rows(), ROOT / "docs" / "assets" / "benchmark-ratios.png")
