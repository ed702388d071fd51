"""Draw docs/assets/profile.png: a timeline of the steps a ``fit(profile_steps=(3, 6))`` traced.

    python docs/figures/profile.py              # scripts/docs runs it before every build
    python docs/figures/profile.py --capture    # run the fit again and rewrite the data the figure reads

The figure reads docs/figures/data/profile-steps.json, a small extract of one trace (``--capture`` writes it):
a 3-layer MLP trained with ``MirroredStrategy`` on 8 simulated CPU devices, steps 3 to 5 traced with
``jax.profiler`` into ``<log_dir>/profile``. From the trace's ``perfetto_trace.json.gz`` (Chrome trace events)
it keeps the host's Python thread (reading each batch, dispatching each step, waiting for the window's last
step, writing the trace) and, for each device, each execution of the compiled step cut into its compute and its
all-reduce (the device's XLA operations merged while they are of one kind). Every span carries its start and
length in microseconds from the trace's first event. The output is byte-stable (the data is committed), so a
rebuild leaves git clean.
"""

from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "figures" / "data" / "profile-steps.json"
OUT = ROOT / "docs" / "assets" / "profile.png"
WINDOW = (3, 6)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
COLOURS = {"input": "#8C8C8C", "dispatch": "#4C72B0", "wait": "#DD8452", "trace": "#CCB974",
           "compute": "#55A868", "all-reduce": "#C44E52"}
HOST_SPANS = {  # the Python tracer's name of a host span -> what the figure calls it
    "$builtins next": "input", "PjitFunction(fit_step)": "dispatch", "block_until_ready": "wait",
    "stop_trace": "trace", "start_trace": "trace"}


# --- capture: run a small fit with a profile window and keep the events that matter ---------------------


def _fit_and_trace(workdir: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """Runs the traced fit in ``workdir``; returns its perfetto trace and what ran it."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(ROOT))
    import flax.linen as nn
    import numpy as np
    import optax

    import jaxdist as jd
    from benchmarks.report import machine_info

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(256)(x))
            x = nn.relu(nn.Dense(256)(x))
            return nn.Dense(1)(x)

    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(256, 64)).astype(np.float32), rng.normal(size=256).astype(np.float32))
            for _ in range(8)]
    trainer = jd.training.Trainer(jd.MirroredStrategy(), MLP(), optax.adam(1e-3),
                                  lambda out, y: ((out[:, 0] - y) ** 2).mean())
    trainer.fit(data, steps=8, log_dir=str(workdir / "logs"), profile_steps=WINDOW, verbose=0)
    trace = next((workdir / "logs" / "profile").rglob("perfetto_trace.json.gz"))
    about = {
        "what": "Trainer.fit(steps=8, profile_steps=(3, 6)) of a 3-layer MLP (64-256-256-1, Adam), global batch "
                "256, MirroredStrategy on 8 simulated CPU devices (jax_num_cpu_devices=8)",
        "machine": machine_info(jax.devices()),
        "command": "python docs/figures/profile.py --capture",
    }
    return trace, about


def _nested_out(spans: list[dict]) -> list[dict]:
    """The spans not inside an earlier one (a span's parts traced on other threads), in time order."""
    kept: list[dict] = []
    for span in sorted(spans, key=lambda s: (s["ts"], -s["dur"])):
        if not kept or span["ts"] >= kept[-1]["ts"] + kept[-1]["dur"]:
            kept.append(span)
    return kept


def extract(events: list[dict], window: tuple[int, int]) -> dict:
    """The host's and each device's spans of a Chrome trace (``traceEvents``), microseconds from its start.

    Host: the Python thread's batch reads, step dispatches, waits and trace start/stop. Devices: each
    execution of the step program (``jit_fit_step``), its XLA operations merged into runs of compute and of
    collectives. Executions are numbered as steps counting back from the window's last one (the trace ends
    when it finishes), so the ones before ``window[0]`` were dispatched before the trace started.
    """
    threads = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    t0 = min(e["ts"] for e in spans)
    host = []
    for e in _nested_out([e for e in spans if threads.get(e["tid"]) == "python" and any(
            e["name"] == k or e["name"].endswith(" " + k) for k in HOST_SPANS)]):
        kind = next(v for k, v in HOST_SPANS.items() if e["name"] == k or e["name"].endswith(" " + k))
        host.append({"kind": kind, "start_us": round(e["ts"] - t0, 1), "dur_us": round(e["dur"], 1)})
    runs: dict[tuple[int, int], list[dict]] = {}
    for e in spans:
        args = e.get("args") or {}
        if args.get("hlo_module") == "jit_fit_step" and "hlo_op" in args and not e["name"].startswith("end:"):
            runs.setdefault((int(args["device_ordinal"]), int(args["run_id"])), []).append(e)
    run_ids = sorted({run for _, run in runs})
    step_of = {run: window[1] - len(run_ids) + i for i, run in enumerate(run_ids)}
    devices = []
    for (device, run), ops in sorted(runs.items()):
        merged: list[dict] = []
        for op in _nested_out(ops):
            kind = "all-reduce" if any(c in op["args"]["hlo_op"] for c in COLLECTIVES) else "compute"
            if merged and merged[-1]["kind"] == kind:
                merged[-1]["end"] = op["ts"] + op["dur"]
                merged[-1]["ops"] += 1
            else:
                merged.append({"kind": kind, "start": op["ts"], "end": op["ts"] + op["dur"], "ops": 1})
        devices += [{"device": device, "step": step_of[run], "kind": m["kind"], "ops": m["ops"],
                     "start_us": round(m["start"] - t0, 1), "dur_us": round(m["end"] - m["start"], 1)}
                    for m in merged]
    if not host or not devices:
        raise RuntimeError(f"the trace has {len(host)} host spans and {len(devices)} device spans: the "
                           "profiler's event names changed; update HOST_SPANS / extract()")
    return {"host": host, "devices": devices}


def dumps(data: dict) -> str:
    """``data`` as JSON, one span a line (a diff of two captures reads span by span)."""
    about = json.dumps(data["about"], indent=1).replace("\n", "\n ")
    parts = [f'"about": {about}', f'"window": {json.dumps(data["window"])}']
    for key in ("host", "devices"):
        spans = ",\n  ".join(json.dumps(span) for span in data[key])
        parts.append(f'"{key}": [\n  {spans}\n ]')
    return "{\n " + ",\n ".join(parts) + "\n}\n"


def capture() -> None:
    import gzip
    import tempfile

    with tempfile.TemporaryDirectory(prefix="jaxdist-profile-") as tmp:
        trace, about = _fit_and_trace(pathlib.Path(tmp))
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    data = {"about": about, "window": list(WINDOW), **extract(events, WINDOW)}
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(dumps(data))
    print(f"{DATA.relative_to(ROOT)}: {len(data['host'])} host spans, {len(data['devices'])} device spans")


# --- draw ---------------------------------------------------------------------------------------------------


def draw() -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: the docs build runs headless
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    data = json.loads(DATA.read_text())
    devices = sorted({d["device"] for d in data["devices"]})
    rows = ["host (Python)", *(f"device {d}" for d in devices)]
    fig, ax = plt.subplots(figsize=(11, 0.36 * len(rows) + 1.6))
    y = {row: len(rows) - 1 - i + (i == 0) * 0.4 for i, row in enumerate(rows)}  # room for the step labels

    def bars(row, spans):
        for kind in COLOURS:
            mine = [(s["start_us"] / 1e3, s["dur_us"] / 1e3) for s in spans if s["kind"] == kind]
            if mine:
                ax.broken_barh(mine, (y[row] - 0.35, 0.7), facecolors=COLOURS[kind], linewidth=0)

    bars(rows[0], data["host"])
    for d in devices:
        bars(f"device {d}", [s for s in data["devices"] if s["device"] == d])
    top = y[f"device {devices[0]}"] + 0.42
    for step in sorted({s["step"] for s in data["devices"]}):
        spans = [s for s in data["devices"] if s["step"] == step]
        start = min(s["start_us"] for s in spans) / 1e3
        end = max(s["start_us"] + s["dur_us"] for s in spans) / 1e3
        traced = data["window"][0] <= step < data["window"][1]
        label = f"step {step}" if traced else f"step {step}\n(dispatched earlier)"
        ax.annotate(label, ((start + end) / 2, top), ha="center", va="bottom", fontsize=7,
                    color="black" if traced else "dimgray")
    for s in data["host"]:
        if s["kind"] == "dispatch":
            ax.annotate("", (s["start_us"] / 1e3, y[rows[0]] + 0.42), (s["start_us"] / 1e3, y[rows[0]] + 0.9),
                        arrowprops={"arrowstyle": "->", "color": COLOURS["dispatch"], "lw": 0.8})
    ax.set_yticks(list(y.values()), list(y))
    ax.tick_params(labelsize=8)
    ax.set_ylim(-0.6, len(rows) + 0.6)
    ax.set_xlim(0, max(s["start_us"] + s["dur_us"] for s in data["host"] + data["devices"]) / 1e3 * 1.01)
    ax.set_xlabel("milliseconds from the start of the trace", fontsize=8)
    names = {"input": "host: reading a batch", "dispatch": "host: dispatching a step (arrow)",
             "wait": "host: waiting for the last step", "trace": "host: starting / writing the trace",
             "compute": "device: compute (forward, backward, update)", "all-reduce": "device: gradient all-reduce"}
    ax.legend(handles=[Patch(color=COLOURS[k], label=v) for k, v in names.items()], fontsize=7, ncol=3,
              loc="upper center", bbox_to_anchor=(0.5, -0.13), frameon=False)
    machine = data["about"]["machine"]
    ax.set_title(
        f"fit(profile_steps=({data['window'][0]}, {data['window'][1]})): MirroredStrategy on 8 simulated CPU devices "
        f"({machine['cpu_count']} cores at load {machine['load_average_1_5_15'][0]:.1f}, "
        f"jax {machine['versions']['jax']}, {machine['date'][:10]})\n"
        "the host dispatches and moves on; the devices run the steps later (on CPU the 8 devices share "
        "the cores, so the all-reduce is mostly waiting)", fontsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.savefig(OUT, metadata={"Software": None}, bbox_inches="tight", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1:] == ["--capture"]:
        capture()
    draw()
