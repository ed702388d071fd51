"""The checkpoint row: seconds the step loop is blocked per save, asynchronous vs synchronous
`Checkpointer`.

``python -m benchmarks.checkpointing [--out DIR] [--pairs N] [--saves N] [--every SECONDS] [--width
W]``

``python -m benchmarks.checkpointing --row two-tier [--out DIR] [--pairs N] [--width W] [--smoke]``:
the two-tier row instead (`benchmarks.two_tier`: a lost host with a local tier or not, 2 processes).

The state: a 784-W-W-10 MLP with adam (parameters and both moments, float32; W=2048: 70 MB),
mirrored on 8 simulated CPU devices (`MirroredStrategy`), trained by a ``strategy.jit`` step that
donates it. A run saves every ``every`` seconds with one `Checkpointer` (a fresh directory on the
disk of ``--dir``) and trains in between; the time a save blocks the loop is the wall time of the
``save`` call, taken after the devices finished the steps before it (so that it counts the
checkpoint, not the steps): for an asynchronous save, the copy to host memory and the start of the
background write, plus any wait for the previous save; for a synchronous one, the whole write. The
first save of a run (orbax's one-time setup) is not counted. Runs alternate (async sync, sync async,
...); per pair, ratio = the synchronous run's median blocked seconds / the asynchronous run's (> 1:
async blocks less; target >= 5, i.e. async blocks at most 20% of sync). Also reported, as
information: the steps trained per save period, where a synchronous save takes its write out of the
period and a background write competes with the steps for the CPU.

Writes ``<date>-<backend><devices>-checkpoint.md`` and ``.json`` (every blocked time, the machine
and the versions) under ``--out`` and prints the table. Exit status 0, or 1 when the row could not
be measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["Result", "main", "markdown", "measure"]

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TARGET = 5.0  # sync blocked / async blocked: async blocks at most 20% of sync


@dataclasses.dataclass
class Result:
    """Every figure of one measurement (all into the JSON).

    Attributes:
        state_mb: the checkpointed state's size in MB (10^6 bytes).
        layers: the MLP's widths, e.g. ``784-2048-2048-10``.
        every: seconds from the start of one save to the start of the next.
        blocked_async / blocked_sync: seconds each counted save blocked the loop, per run (one list
            per run).
        steps_async / steps_sync: steps trained per save period, per run (one list per run).
        ratios: per pair, median sync blocked seconds / median async blocked seconds.
    """

    state_mb: float
    layers: str
    every: float
    blocked_async: list[list[float]] = dataclasses.field(default_factory=list)
    blocked_sync: list[list[float]] = dataclasses.field(default_factory=list)
    steps_async: list[list[int]] = dataclasses.field(default_factory=list)
    steps_sync: list[list[int]] = dataclasses.field(default_factory=list)
    ratios: list[float] = dataclasses.field(default_factory=list)


def measure(pairs: int, saves: int, every: float, width: int,
            directory: str | pathlib.Path) -> Result:
    """Alternate ``pairs`` pairs of runs (async, sync), each ``saves`` counted saves ``every``
    seconds apart.

    Example:
        >>> import tempfile
        >>> r = measure(pairs=1, saves=1, every=0.0, width=8, directory=tempfile.mkdtemp())
        >>> len(r.ratios), len(r.blocked_async[0]), r.steps_sync, r.layers
        (1, 1, [[1]], '784-8-8-10')
    """
    import jaxdist as jd
    from benchmarks.models import ModelSpec, make_problem

    problem = make_problem(ModelSpec(f"mlp-ckpt-{width}", (width, width), 64))
    strategy = jd.MirroredStrategy()
    step = strategy.jit(problem.step, donate_argnums=(0,))
    batches = [strategy.experimental_distribute_values(b) for b in problem.host_batches]
    live = {"state": strategy.create_variables(problem.init, jax.random.key(0), problem.sample_x())}
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(live["state"]))
    result = Result(state_mb=nbytes / 1e6, layers=problem.spec.layers, every=every)

    def train(until: float) -> int:
        """Steps until ``until`` (perf_counter time), at least one; then wait for the devices."""
        n = 0
        while n == 0 or time.perf_counter() < until:
            live["state"], _ = step(live["state"], batches[n % len(batches)])
            n += 1
        jax.block_until_ready(live["state"])
        return n

    def run(async_save: bool) -> tuple[list[float], list[int]]:
        root = tempfile.mkdtemp(dir=directory)
        ckpt = jd.training.Checkpointer(root, max_to_keep=2, async_save=async_save)
        blocked, steps, began = [], [], time.perf_counter()
        try:
            for k in range(saves + 1):
                n = train(began + every)
                began = time.perf_counter()
                ckpt.save(k, live["state"])
                if k:  # the first save sets orbax up once per run
                    blocked.append(time.perf_counter() - began)
                    steps.append(n)
            ckpt.wait_until_finished()
        finally:
            ckpt.close()
            shutil.rmtree(root, ignore_errors=True)
        return blocked, steps

    train(0.0)  # compile
    for pair in range(pairs):
        sides = {}
        for async_save in (True, False) if pair % 2 == 0 else (False, True):
            sides[async_save] = run(async_save)
        result.blocked_async.append(sides[True][0])
        result.blocked_sync.append(sides[False][0])
        result.steps_async.append(sides[True][1])
        result.steps_sync.append(sides[False][1])
        result.ratios.append(statistics.median(sides[False][0]) / statistics.median(sides[True][0]))
    return result


def _status(ratio_spread: Any) -> str:
    from benchmarks.suite import _status

    return _status(ratio_spread, TARGET)


def markdown(result: Result, machine: dict[str, Any]) -> str:
    """The row as a markdown table with the machine line (the suite's table style)."""
    from benchmarks.timing import spread

    ratio = spread(result.ratios)
    blocked_a = spread([s for run in result.blocked_async for s in run])
    blocked_s = spread([s for run in result.blocked_sync for s in run])
    steps_a = statistics.median([n for run in result.steps_async for n in run])
    steps_s = statistics.median([n for run in result.steps_sync for n in run])
    v = machine["versions"]
    saves = len(result.blocked_async[0])
    row = [
        "ckpt",
        f"{result.layers} + adam, {result.state_mb:.0f} MB",
        "Checkpointer(async_save=True).save",
        "Checkpointer(async_save=False).save",
        f"**{ratio.median:.2f}**",
        f"{ratio.ci_low:.2f}-{ratio.ci_high:.2f}",
        f"{ratio.q1:.2f}-{ratio.q3:.2f}",
        f"{ratio.min:.2f}-{ratio.max:.2f}",
        f"≥ {TARGET:.2f}",
        f"{blocked_a.median:.3f}",
        f"{blocked_s.median:.3f}",
        f"{steps_a:g} / {steps_s:g}",
        f"{saves} x {ratio.n}",
        _status(ratio),
    ]
    lines = [
        f"# jaxdist checkpoint benchmark - {machine['date'][:10]}, {machine['backend']} "
        f"x{machine['device_count']}",
        "",
        f"- machine: {machine['host_platform']}, {machine['cpu_count']} CPU cores, python "
        f"{machine['python']}",
        f"- versions: jax {v['jax']}, jaxlib {v['jaxlib']}, flax {v['flax']}, optax {v['optax']}, "
        f"jaxdist {v['jaxdist']} (git {machine['git_commit']}); orbax-checkpoint "
        f"{machine.get('orbax')}",
        f"- load average at start (1/5/15 min): {machine['load_average_1_5_15']}",
        f"- method: {len(result.ratios)} pairs of alternating runs (async sync, sync async, ...), "
        f"each {saves} counted saves {result.every:g} s apart; blocked = wall time of "
        "`Checkpointer.save` after the devices finished the steps before it; ratio = sync / async "
        "median blocked seconds per pair (> 1: async blocks less).",
        "",
        "| row | state | candidate | baseline | ratio (median) | 95% CI | IQR | min-max | target "
        "| candidate blocked s/save | baseline blocked s/save | steps per save period (async / "
        "sync) | saves x pairs | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        "| " + " | ".join(row) + " |",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: measure, write ``.md`` and ``.json`` under ``--out``, print the table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpointing",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help=f"results folder (default {RESULTS})")
    parser.add_argument("--dir", default=None,
                        help="where the checkpoints are written (default: a temp dir)")
    parser.add_argument("--row", choices=("ckpt", "two-tier"), default="ckpt",
                        help="ckpt (default) or two-tier (benchmarks.two_tier)")
    parser.add_argument("--smoke", action="store_true", help="two-tier: tiny sizes (does it run?)")
    parser.add_argument("--pairs", type=int, default=None,
                        help="pairs of runs (default 3; two-tier: 2)")
    parser.add_argument("--saves", type=int, default=3, help="counted saves per run (default 3)")
    parser.add_argument("--every", type=float, default=4.0,
                        help="seconds between saves (default 4)")
    parser.add_argument("--width", type=int, default=None,
                        help="hidden width (default 2048: a 70 MB state)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    args = parser.parse_args(argv)
    for name in ("pairs", "saves", "width", "devices"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    if args.every < 0:
        parser.error(f"--every={args.every} must be >= 0")
    if args.row == "two-tier":
        return _two_tier(args)
    args.pairs, args.width = args.pairs or 3, args.width or 2048
    jax.config.update("jax_num_cpu_devices", args.devices)

    from benchmarks.report import _version, machine_info, write_table

    machine = machine_info(jax.devices())
    machine["orbax"] = _version("orbax-checkpoint")
    result, directory = _measured(args.dir, "jaxdist-ckpt-bench-", lambda directory: measure(
        args.pairs, args.saves, args.every, args.width, directory))
    if result is None:
        return 1
    table = markdown(result, machine)
    stem = f"{machine['date'][:10]}-{machine['backend']}{machine['device_count']}-checkpoint"
    write_table(args.out, stem, table, {"machine": machine, "target": TARGET,
                                        "checkpoint_dir": directory, **dataclasses.asdict(result)})
    print(table)
    return 0


def _measured(given: str | None, prefix: str, measure: Any) -> tuple[Any, str]:
    """``measure(directory)`` and the directory: ``--dir`` when given, else a temporary one removed
    afterwards; None for the result (its traceback printed) when it failed."""
    directory = given or tempfile.mkdtemp(prefix=prefix)
    try:
        return measure(directory), directory
    except Exception:
        traceback.print_exc()
        return None, directory
    finally:
        if given is None:
            shutil.rmtree(directory, ignore_errors=True)


def _two_tier(args: argparse.Namespace) -> int:
    """The two-tier row (`benchmarks.two_tier`): measure, write ``<date>-<backend>-two-tier``
    ``.md`` and ``.json`` (``-smoke`` added with ``--smoke``) under ``--out``, print the table."""
    from benchmarks import two_tier
    from benchmarks.report import _version, machine_info, write_table

    settings = two_tier.SETTINGS["smoke" if args.smoke else "full"]
    settings = dataclasses.replace(settings, pairs=args.pairs or settings.pairs,
                                   width=args.width or settings.width)
    machine = machine_info(jax.devices())
    machine["orbax"] = _version("orbax-checkpoint")
    result, _ = _measured(args.dir, "jaxdist-two-tier-bench-",
                          lambda directory: two_tier.measure(settings, directory))
    if result is None:
        return 1
    table = two_tier.markdown(result, machine)
    stem = f"{machine['date'][:10]}-{machine['backend']}-two-tier{'-smoke' if args.smoke else ''}"
    write_table(args.out, stem, table, {"machine": machine, **dataclasses.asdict(result),
                                        "ratios": two_tier.ratios(result)})
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
