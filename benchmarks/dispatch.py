"""Per-call cost of ``strategy.jit`` against hand-written ``jax.jit``, at 1, 8, 64 and 256 devices.

The small MLP of `benchmarks.models` (784-64-64-10, adam; global batch 64, or one row per device where
there are more) is a step short enough that what a call costs besides the program shows: at 1 device
``OneDeviceStrategy.jit`` against plain ``jax.jit`` committed to the device, elsewhere ``MirroredStrategy.jit``
against ``jax.jit`` with the same ``NamedSharding`` in/out shardings and donated state (`runners.HandJit`),
both on batches placed once, in alternating blocks (`benchmarks.timing`). Each device count runs in a
process of its own (``jax_num_cpu_devices`` is fixed when the backend starts). Target: >= 0.97 at every count.
``--explicit``: the strategy on ``jax.make_mesh``'s default mesh (Explicit axes; the step, unannotated, runs with
them Auto: `jaxdist.strategies.axis_types`), against ``jax.jit`` on the Auto mesh its user would build, so the
per-call cost of that decision shows.

Run: ``python -m benchmarks.dispatch`` (``--smoke``: 1 and 8 devices, 2 short pairs). Writes
``benchmarks/results/<date>-<backend>-dispatch[-explicit].md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TARGET = 0.97
DEVICES = (1, 8, 64, 256)


def measure(devices: int, pairs: int, block_seconds: float, explicit: bool = False) -> dict[str, Any]:
    """One device count, in this process (which must not have started its JAX backend yet)."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    import jaxdist as jd
    from benchmarks import runners
    from benchmarks.models import SMALL, make_problem
    from benchmarks.report import machine_info
    from benchmarks.timing import Settings, calibrate, measure_pair, spread

    problem = make_problem(dataclasses.replace(SMALL, batch=max(SMALL.batch, devices)))
    if devices == 1:
        strategy = jd.OneDeviceStrategy()
        baseline = runners.PlainJit(jax.devices()[0], problem)
    else:
        strategy = jd.MirroredStrategy(mesh=jax.make_mesh((devices,), ("data",)) if explicit else None)
        # The hand-written step is unannotated: plain jax.jit refuses it on Explicit axes, so its user builds the
        # mesh with Auto ones (what jaxdist's program runs with inside, on the user's Explicit mesh).
        auto = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        baseline = runners.HandJit(auto if explicit else strategy.mesh, problem)
    candidate = runners.StrategyJit(strategy, problem)
    settings = Settings(pairs=pairs, block_seconds=block_seconds)
    try:
        per_step = (calibrate(candidate, settings), calibrate(baseline, settings))
        result = measure_pair(candidate, baseline, settings, per_step)
    finally:
        candidate.close()
        baseline.close()
    machine = machine_info(jax.devices())
    return {"devices": devices, "explicit": explicit, "batch": problem.spec.batch,
            "ratio": dataclasses.asdict(spread(result.ratios)),
            "steps_per_sec": sorted(result.rates_a)[len(result.rates_a) // 2],
            "hand_steps_per_sec": sorted(result.rates_b)[len(result.rates_b) // 2],
            "steps_per_block": result.steps, "backend": machine["backend"], "machine": machine}


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table: one row per device count."""
    first = rows[0]["machine"] if rows else {"date": "", "backend": "?"}
    mesh = "jax.make_mesh (Explicit axes)" if rows and rows[0].get("explicit") else "jaxdist's own (Auto axes)"
    lines = [f"# Per-call cost of strategy.jit ({first['date'][:10]}, {first['backend']}, mesh: {mesh})", "",
             "Small MLP (784-64-64-10, adam), batches placed once. Ratio: steps/s of `strategy.jit` / steps/s of "
             "hand-written `jax.jit` (1 device: plain `jax.jit`; more: in/out `NamedSharding`s, donated state), "
             "median of alternating pairs with its 95% interval.", "",
             "| devices | global batch | ratio | 95% interval | strategy.jit steps/s | jax.jit steps/s | "
             f"target >= {TARGET} |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["ratio"]
        met = "met" if q["median"] >= TARGET else "missed"
        lines.append(f"| {r['devices']} | {r['batch']} | {q['median']:.3f} | [{q['ci_low']:.3f}, "
                     f"{q['ci_high']:.3f}] | {r['steps_per_sec']:.1f} | {r['hand_steps_per_sec']:.1f} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: one process per device count, then the table (printed, and written under ``--out``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatch", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help=f"results folder (default {RESULTS})")
    parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICES), help="device counts")
    parser.add_argument("--pairs", type=int, default=60, help="pairs of blocks per device count (default 60)")
    parser.add_argument("--block-seconds", type=float, default=0.2, help="seconds per block (default 0.2)")
    parser.add_argument("--smoke", action="store_true", help="1 and 8 devices, 2 short pairs: does it run?")
    parser.add_argument("--explicit", action="store_true", help="on jax.make_mesh's default mesh (Explicit axes)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one device count
    args = parser.parse_args(argv)
    if args.smoke:
        args.devices, args.pairs, args.block_seconds = [1, 8], 2, 0.01
    if args.one is not None:
        print(json.dumps(measure(args.one, args.pairs, args.block_seconds, args.explicit)))
        return 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXDIST_")}
    rows = []
    for n in args.devices:
        child = subprocess.run(
            [sys.executable, "-m", "benchmarks.dispatch", "--one", str(n), "--pairs", str(args.pairs),
             "--block-seconds", str(args.block_seconds), *(["--explicit"] if args.explicit else [])],
            cwd=pathlib.Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=1800,
        )
        if child.returncode != 0:
            print(child.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(f"{n} devices: {rows[-1]['ratio']['median']:.3f} of jax.jit", file=sys.stderr)
    from benchmarks.report import write_table

    table = markdown(rows)
    print(table)
    kind = ("-explicit" if args.explicit else "") + ("-smoke" if args.smoke else "")
    write_table(args.out, f"{rows[0]['machine']['date'][:10]}-{rows[0]['backend']}-dispatch{kind}", table, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
