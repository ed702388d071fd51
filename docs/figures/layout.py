"""Draw docs/assets/layout.png: a device mesh, and what each axis role splits over the devices of its axis.

    python docs/figures/layout.py    # scripts/docs runs it before every build

One row per role (data, FSDP, tensor, context and pipeline); each shows a batch (rows x sequence
positions) and a model (layers x weights) over an axis of 4 devices, coloured by the device that holds each part;
grey is a whole copy on every device of the axis. The output is byte-stable (no timestamp, no version), so a
rebuild leaves git clean.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")  # no display: the docs build runs headless

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

OUT = pathlib.Path(__file__).resolve().parent.parent / "assets" / "layout.png"
DEVICES = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]  # device 0..3 of the axis
COPY = "#C8C8C8"  # the same values on every device
PASSING = "#EDEDED"  # held by one stage at a time (pipeline micro-batches)
N = 4  # devices on the axis
ROLES = [  # (role, how it is named, what the batch shows, what the model shows)
    ("data", "batch_axes", "rows split", "a copy on each device"),
    ("FSDP", "fsdp_axes", "rows split", "each weight split;\ngathered to use"),
    ("tensor", "logical_axis_rules", "a copy on each device", "each weight split;\nstays split"),
    ("context", "context_axes", "sequence split", "split like FSDP\n(by default)"),
    ("pipeline", "stage_axes", "micro-batches go\nstage by stage", "layers split\ninto stages"),
]


def _grid(ax, x0, y0, rows, cols, colour, w=0.36, h=0.5):
    """A rows x cols grid of cells at (x0, y0), w wide and h high; colour(r, c) fills each cell."""
    for r in range(rows):
        for c in range(cols):
            ax.add_patch(Rectangle((x0 + c * w / cols, y0 + (rows - 1 - r) * h / rows), w / cols, h / rows,
                                   facecolor=colour(r, c), edgecolor="white", linewidth=0.8))


def _batch(ax, role):
    """8 rows x 12 sequence positions, coloured by the device that holds each."""
    def colour(r, c):
        if role in ("data", "FSDP"):
            return DEVICES[r * N // 8]  # rows split
        if role.startswith("context"):
            return DEVICES[c * N // 12]  # sequence split
        return PASSING if role.startswith("pipeline") else COPY

    _grid(ax, 0.0, 0.0, 8, 12, colour)


def _model(ax, role):
    """4 layers, each a weight matrix drawn as a row of 8 cells, coloured by the device that holds each."""
    for layer in range(4):
        def colour(r, c, layer=layer):
            if role in ("FSDP", "tensor"):
                return DEVICES[c * N // 8]  # each weight split
            return DEVICES[layer] if role.startswith("pipeline") else COPY  # a stage per layer, or a copy

        _grid(ax, 0.0, 0.4 - layer * 0.13, 1, 8, colour, w=0.36, h=0.1)


def _mesh(ax):
    """A 2 x 4 mesh: axis 'data' across 2 hosts, axis 'fsdp' over the 4 devices of a host (HSDP)."""
    ax.set_title("A mesh: devices in a grid, an axis name and a role per axis", loc="left", fontsize=11)
    for host in range(2):
        ax.add_patch(Rectangle((0.02, 0.52 - host * 0.46), 0.5, 0.4, facecolor="none", edgecolor="#888888",
                               linestyle="--", linewidth=1))
        ax.text(0.54, 0.72 - host * 0.46, f"host {host}", va="center", fontsize=9, color="#555555")
        for d in range(N):
            ax.add_patch(Rectangle((0.05 + d * 0.115, 0.57 - host * 0.46), 0.095, 0.3, facecolor=DEVICES[d],
                                   edgecolor="white"))
            ax.text(0.0975 + d * 0.115, 0.72 - host * 0.46, f"{host * N + d}", ha="center", va="center",
                    color="white", fontsize=9, fontweight="bold")
    ax.annotate("", xy=(0.5, 0.95), xytext=(0.05, 0.95), arrowprops={"arrowstyle": "->", "color": "#333333"})
    ax.text(0.27, 0.98, "axis 'fsdp' (4): within a host", ha="center", va="bottom", fontsize=9)
    ax.annotate("", xy=(-0.01, 0.1), xytext=(-0.01, 0.85), arrowprops={"arrowstyle": "->", "color": "#333333"})
    ax.text(-0.03, 0.47, "axis 'data' (2):\nacross hosts", ha="right", va="center", fontsize=9)
    ax.text(0.66, 0.5,
            "mesh = Mesh(devices.reshape(2, 4), ('data', 'fsdp'))\n"
            "ShardedStrategy(mesh=mesh,\n"
            "                batch_axes=('data', 'fsdp'),\n"
            "                fsdp_axes='fsdp')\n\n"
            "HSDP: batch rows split over all 8 devices,\n"
            "parameters split over 'fsdp' (inside a host)\n"
            "and copied over 'data' (across hosts).\n"
            "The colour of a device is its index on its axis.",
            va="center", fontsize=9, family="monospace")
    ax.set_xlim(-0.3, 1.6)
    ax.set_ylim(0, 1.05)
    ax.axis("off")


def draw(out: pathlib.Path = OUT) -> pathlib.Path:
    """Draw the figure to ``out`` and return it."""
    fig = plt.figure(figsize=(10, 10.5), dpi=110)
    grid = fig.add_gridspec(len(ROLES) + 2, 3, height_ratios=[2.2, 0.35] + [1] * len(ROLES),
                            width_ratios=[1.1, 1, 1], hspace=0.35, wspace=0.05)
    _mesh(fig.add_subplot(grid[0, :]))
    for col, head in enumerate(["axis role (argument)", "the batch: rows x sequence", "the model: layers x weights"]):
        ax = fig.add_subplot(grid[1, col])
        ax.text(0.0, 0.2, head, fontsize=11, fontweight="bold")
        ax.axis("off")
    for row, (role, argument, batch, model) in enumerate(ROLES, start=2):
        label = fig.add_subplot(grid[row, 0])
        label.text(0.0, 0.55, role, fontsize=12, fontweight="bold", va="center")
        if argument:
            label.text(0.42, 0.55, argument, fontsize=9, family="monospace", va="center", color="#444444")
        label.axis("off")
        for col, (draw_part, caption) in enumerate([(_batch, batch), (_model, model)], start=1):
            ax = fig.add_subplot(grid[row, col])
            draw_part(ax, role)
            ax.text(0.4, 0.25, caption, fontsize=9, va="center")
            ax.set_xlim(-0.02, 0.9)
            ax.set_ylim(-0.02, 0.52)
            ax.axis("off")
    fig.text(0.5, 0.09, "one axis of 4 devices per row; colour = the device that holds the part; grey = a copy on "
             "every device of the axis", ha="center", fontsize=9, color="#444444")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Software": None}, bbox_inches="tight")  # no version stamp: byte-stable
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(f"wrote {draw()}")
