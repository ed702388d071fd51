"""Draw docs/assets/placement.png: which part of a weight matrix each of 8 devices holds, under each layout.

    python docs/figures/placement.py    # scripts/docs runs it before every build

8 devices on 2 hosts of 4. Each device is a box with the whole matrix drawn small inside it: the cells the
device holds are coloured, the rest left white; the same colour on two devices is the same values (a copy).
Data parallel: the whole matrix on every device. FSDP over all 8: a band of rows each. FSDP (4) x tensor
parallelism (2): a band of rows and half of the columns. HSDP: FSDP over the 4 devices of a host, the same
bands copied on the other host. The output is byte-stable (no timestamp, no version), so a rebuild leaves git
clean.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")  # no display: the docs build runs headless

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

OUT = pathlib.Path(__file__).resolve().parent.parent / "assets" / "placement.png"
ROWS, COLS = 8, 4  # the weight matrix, in cells
PIECES = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
COPY = "#C8C8C8"


def data_parallel(device):  # every cell, one colour: the same values everywhere
    return {(r, c): COPY for r in range(ROWS) for c in range(COLS)}


def fsdp(device):  # rows split 8 ways
    return {(device, c): PIECES[device] for c in range(COLS)}


def fsdp_tensor(device):  # mesh (fsdp=4, tensor=2): rows split 4 ways, columns 2 ways
    f, t = divmod(device, 2)
    return {(r, c): PIECES[device] for r in (2 * f, 2 * f + 1) for c in range(2 * t, 2 * t + 2)}


def hsdp(device):  # mesh (data=2 hosts, fsdp=4): rows split 4 ways inside a host, copied across hosts
    f = device % 4
    return {(r, c): PIECES[f] for r in (2 * f, 2 * f + 1) for c in range(COLS)}


LAYOUTS = [
    ("data parallel\n(MirroredStrategy)", "a whole copy on every device", data_parallel),
    ("FSDP over 8\n(ShardedStrategy())", "1/8 each; gathered to use, then dropped", fsdp),
    ("FSDP 4 x tensor 2\n(model_parallelism=2)", "1/8 each; the tensor half stays split", fsdp_tensor),
    ("HSDP: FSDP in a host,\ndata across hosts", "1/4 each; host 1 copies host 0", hsdp),
]


def main() -> None:
    cell = 0.11
    fig, ax = plt.subplots(figsize=(11, 1.25 * len(LAYOUTS) + 0.6))
    for row, (name, note, holds) in enumerate(LAYOUTS):
        y0 = (len(LAYOUTS) - 1 - row) * 1.25
        ax.text(-0.15, y0 + 0.45, name, ha="right", va="center", fontsize=9)
        for device in range(8):
            x0 = device * 0.68 + (0.3 if device >= 4 else 0.0)  # a gap between the two hosts
            held = holds(device)
            for r in range(ROWS):
                for c in range(COLS):
                    ax.add_patch(Rectangle((x0 + c * cell, y0 + (ROWS - 1 - r) * cell), cell, cell,
                                           facecolor=held.get((r, c), "white"), edgecolor="0.75", lw=0.4))
            ax.add_patch(Rectangle((x0 - 0.03, y0 - 0.03), COLS * cell + 0.06, ROWS * cell + 0.06,
                                   fill=False, edgecolor="0.3", lw=0.8))
            if row == 0:
                ax.text(x0 + COLS * cell / 2, y0 + ROWS * cell + 0.12, f"device {device}", ha="center",
                        fontsize=7)
        ax.text(8 * 0.68 + 0.35, y0 + 0.45, note, ha="left", va="center", fontsize=8, color="0.2")
    top = (len(LAYOUTS) - 1) * 1.25 + ROWS * cell + 0.35
    for host, x in ((0, 4 * 0.68 / 2 - 0.2), (1, 4 * 0.68 + 0.3 + 4 * 0.68 / 2 - 0.2)):
        ax.text(x, top, f"host {host}", ha="center", fontsize=9, weight="bold")
    ax.set_xlim(-2.2, 8.6)
    ax.set_ylim(-0.2, top + 0.25)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("One weight matrix (8 x 4 cells) on 8 devices: coloured = held by that device, "
                 "same colour = same values", fontsize=9)
    fig.savefig(OUT, metadata={"Software": None}, bbox_inches="tight", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
