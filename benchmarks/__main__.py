"""Command line: ``python -m benchmarks [--quick | --smoke] [--out DIR] [--rows P1,P2] [--devices
8]``.

Modes:
    full (default): every row on both models, 32 pairs of ~0.15 s blocks (about 10 minutes on 2
        cores).
    --quick: P1 and P2 on both models, the LM rows on one LM config, the other rows on the small
        model, 20 pairs of ~0.1 s blocks (about 3 minutes on 2 cores, plus about 4 for the LM rows
        and memory table).
    --smoke: every row on a tiny model (the LM rows on a tiny LM) with 2-step blocks: checks that
        everything runs and the result files are written, not speed (use with ``--out`` pointing
        at a temporary directory).

Exit status: 0 when every row ran or was skipped for a stated reason, 1 when a row failed, 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import jax

from benchmarks.cases import COMPARISONS, Devices
from benchmarks.lm import LM_MODELS, add_process_entries, memory_table
from benchmarks.models import MODELS, TINY
from benchmarks.multiproc import lm_hsdp_rows, multiproc_rows
from benchmarks.report import machine_info, markdown, write_results
from benchmarks.suite import run_plan
from benchmarks.timing import Settings

# Many short pairs (see benchmarks.timing): the median settles; blocks stay long enough to amortise
# a sync.
SETTINGS = {
    "full": Settings(pairs=32, block_seconds=0.15, warmup_steps=20),
    "quick": Settings(pairs=20, block_seconds=0.1, warmup_steps=10),
    # Block lengths fixed (2 steps, or a stepper's multiple): one timed warm-up block after the
    # compiling one (its estimate sizes nothing).
    "smoke": Settings(
        pairs=2, block_seconds=1e-3, warmup_steps=1, min_steps=2, max_steps=2,
        use_stepper_minimums=False, calibration_blocks=1
    ),
}
ALL_MODELS = {**MODELS, **LM_MODELS}
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
# The multi-process row: (pairs of runs, timed blocks per run, steps per block); each run is new
# processes.
MULTIPROC = {"full": (6, 5, 30), "quick": (3, 3, 30), "smoke": (1, 1, 2)}
# the LM's steps take ~0.4 s over gloo
LM_MULTIPROC = {"full": (6, 3, 5), "quick": (3, 3, 5), "smoke": (1, 1, 2)}
# Untimed steps each multi-process run takes first: the first compiles; the rest settle the
# collectives, which a smoke run (no timing worth the name) skips.
MULTIPROC_WARMUP = {"full": 10, "quick": 10, "smoke": 1}
_PROCESS_ROWS = ("multiproc", "lm-hsdp-mp")  # rows of their own runner (fresh processes per block)


def _multiproc_models(args: argparse.Namespace, mode: str) -> list:
    names = [m for m in args.models.split(",") if m and m in MODELS]
    if mode == "smoke":
        return [MODELS[n] for n in names] or [TINY]
    if names:
        return [MODELS[n] for n in names]
    return [MODELS["mlp-small"]] if mode == "quick" else [MODELS["mlp-small"], MODELS["mlp-large"]]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="short run (a few minutes on 2 cores)")
    mode.add_argument("--smoke", action="store_true",
                      help="tiny model, 2-step blocks: does everything run?")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help=f"results folder (default {RESULTS})")
    parser.add_argument("--rows", default="",
                        help="comma-separated row keys to run (default: all), e.g. P1,P2")
    parser.add_argument("--models", default="",
                        help=f"comma-separated model names, from {sorted(ALL_MODELS)}")
    parser.add_argument("--devices", type=int, default=8,
                        help="simulated CPU devices when on CPU (default 8)")
    parser.add_argument("--pairs", type=int, help="override the number of block pairs")
    parser.add_argument("--block-seconds", type=float, help="override the target block length")
    return parser


def _plan(args: argparse.Namespace, mode: str, parser: argparse.ArgumentParser) -> list:
    keys = [k for k in args.rows.split(",") if k and k not in _PROCESS_ROWS]
    unknown = sorted(set(keys) - {c.key for c in COMPARISONS})
    if unknown:
        known = [c.key for c in COMPARISONS] + list(_PROCESS_ROWS)
        parser.error(f"--rows: unknown row(s) {unknown}; choose from {known}")
    names = [m for m in args.models.split(",") if m]
    bad = sorted(set(names) - set(ALL_MODELS))
    if bad:
        parser.error(f"--models: unknown model(s) {bad}; choose from {sorted(ALL_MODELS)}")
    plan = []
    only_multiproc = args.rows and not keys
    for comparison in COMPARISONS:
        if only_multiproc or (keys and comparison.key not in keys):
            continue
        own = {"smoke": comparison.smoke_models, "quick": comparison.quick_models}.get(
            mode, comparison.models
        )
        if not own:  # a row with no model in this mode (the LM remat row in --smoke)
            continue
        # --models picks, per row, the named models of the row's kind (MLP or LM)
        is_lm = own[0] in LM_MODELS
        models = [m for m in names if (m in LM_MODELS) == is_lm] if names else own
        plan.extend((comparison, ALL_MODELS[m]) for m in models)
    return plan


def main(argv: list[str] | None = None) -> int:
    """Run the suite, write the results files, print the table; return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.devices < 1:
        parser.error(f"--devices={args.devices} must be >= 1")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    settings = SETTINGS[mode]
    overrides = {k: v for k, v in (("pairs", args.pairs), ("block_seconds", args.block_seconds))
                 if v is not None}
    try:
        settings = Settings(**{**settings.__dict__, **overrides})
    except ValueError as error:
        parser.error(str(error))
    plan = _plan(args, mode, parser)

    # Keras reads its backend at import; the CPU device count must be set before any backend starts.
    os.environ.setdefault("KERAS_BACKEND", "jax")
    if mode == "smoke" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        # A smoke run checks that everything runs, not speed: unoptimised code generation halves
        # XLA's CPU compile times, which are most of a smoke run.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
        ).strip()
    jax.config.update("jax_num_cpu_devices", args.devices)
    devices = tuple(jax.devices())
    if devices[0].platform == "cpu":
        devices = devices[: args.devices]
    machine = machine_info(devices)
    print(
        f"benchmarks: {mode} run, {len(plan)} rows on {len(devices)} x {devices[0].device_kind}, "
        f"{machine['cpu_count']} CPU cores",
        file=sys.stderr,
        flush=True,
    )
    shared = Devices(devices)
    rows = run_plan(plan, settings, shared)
    memory = []
    # informational, no timing
    for spec in dict.fromkeys(spec for _, spec in plan if spec.name in LM_MODELS):
        try:
            memory.append(memory_table(spec, devices, shared.mirrored, shared.sharded,
                                       measure_temp=mode != "smoke"))
        except Exception as error:  # reported, not fatal: the timing rows stand on their own
            memory.append({"model": spec.name, "error": f"{type(error).__name__}: {error}"})
        print(f"[memory {spec.name}] {memory[-1]}", file=sys.stderr, flush=True)
    keys = [k for k in args.rows.split(",") if k]
    lm_specs = [spec for spec in dict.fromkeys(spec for _, spec in plan) if spec.name in LM_MODELS]
    if devices[0].platform == "cpu" and ("lm-hsdp-mp" in keys or (not keys and lm_specs)):
        for spec in lm_specs or [LM_MODELS["lm-tiny" if mode == "smoke" else "lm"]]:
            new, entries = lm_hsdp_rows(spec, *LM_MULTIPROC[mode], probe_fsdp=mode != "smoke",
                                        warmup=MULTIPROC_WARMUP[mode])
            print(f"[lm-hsdp-mp {spec.name}] {new[0].status} {new[0].note} {entries}",
                  file=sys.stderr, flush=True)
            rows.extend(new)
            table = next((t for t in memory if t.get("model") == spec.name and "entries" in t),
                         None)
            if table is not None and entries:
                add_process_entries(table, entries)
    if devices[0].platform == "cpu" and (not keys or "multiproc" in keys):
        for spec in _multiproc_models(args, mode):
            pairs, blocks, steps = MULTIPROC[mode]
            new = multiproc_rows(spec, pairs, blocks,
                                 steps if spec.name != "mlp-large" else max(2, steps // 6),
                                 warmup=MULTIPROC_WARMUP[mode])
            for row in new:
                print(f"[{row.key} {spec.name}] {row.status} {row.note}", file=sys.stderr,
                      flush=True)
            rows.extend(new)
    machine["load_average_end_1_5_15"] = (
        list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    )
    paths = write_results(rows, machine, settings, mode, args.out, memory=memory)
    print(markdown(rows, machine, settings, mode, memory=memory))
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}", file=sys.stderr)
    return 1 if any(r.status == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
