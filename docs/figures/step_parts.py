"""Draw docs/assets/step-parts.png: where a training step's time goes, from the newest measured run.

    python docs/figures/step_parts.py    # scripts/docs runs it before every build

The run is the newest benchmarks/results/*-step-parts.json (``python -m benchmarks.step_parts`` writes one):
forward, backward, the gradient all-reduce, the optimizer update and the host's part of a ``Trainer.fit`` step,
each the median difference of two programs timed back to back. A part measured below 0 (noise larger than the
part) is drawn as 0 and labelled so. The output is byte-stable, so a rebuild leaves git clean.
"""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")  # no display: the docs build runs headless

import matplotlib.pyplot as plt

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "assets" / "step-parts.png"
COLOURS = ["#4C72B0", "#55A868", "#C44E52", "#8172B3", "#8C8C8C"]


def main() -> None:
    runs = sorted((ROOT / "benchmarks" / "results").glob("*-step-parts.json"))
    run = json.loads(runs[-1].read_text())
    parts = run["parts_seconds"]
    fig, ax = plt.subplots(figsize=(10, 2.3))
    left = 0.0
    for (name, seconds), colour in zip(parts.items(), COLOURS, strict=False):
        ms = max(seconds, 0.0) * 1e3
        ax.barh(0, ms, left=left, color=colour, height=0.5)
        label = f"{name}\n{seconds * 1e3:.2f} ms" if seconds > 0 else f"{name}\n≈ 0 (below the noise)"
        ax.annotate(label, (left + ms / 2, 0.3), ha="center", va="bottom", fontsize=8)
        left += ms
    machine = run["machine"]
    ax.set_yticks([])
    ax.set_xlim(0, left * 1.02)
    ax.set_ylim(-0.4, 1.1)
    ax.set_xlabel(f"milliseconds per step (median of {run['blocks']} blocks of {run['steps_per_block']} steps)",
                  fontsize=8)
    ax.set_title(
        f"One training step of a {run['model']}, global batch {run['global_batch']}, MirroredStrategy on "
        f"{run['devices']} simulated CPU devices\n({machine['cpu_count']} cores at load "
        f"{machine['load_average_1_5_15'][0]:.1f}, jax {machine['versions']['jax']}, {machine['date'][:10]}; "
        f"{runs[-1].relative_to(ROOT)})", fontsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.savefig(OUT, metadata={"Software": None}, bbox_inches="tight", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
