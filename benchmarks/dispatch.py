"""Host time per call: what ``strategy.jit`` and ``Trainer.fit`` add to a step over hand-written
JAX.

On an accelerator a small step is timed by the host: every microsecond of Python per call is lost
throughput. That host work is the same on a CPU as on a GPU, so it is measured here as the calling
thread's CPU time (``time.thread_time``) per call, both sides in one process, in alternating blocks;
each pair of blocks gives one difference (candidate minus baseline, microseconds per call), and the
table reports their median with its 95% interval. Both sides run the same program on the same
arrays, so what the devices do cancels out.

Cases (each device count in a process of its own: ``jax_num_cpu_devices`` is fixed when the backend
starts):

* ``1dev-trivial``: ``OneDeviceStrategy.jit`` of ``w + x`` against plain ``jax.jit`` on arrays
  committed to the device (limit: 1.5 us);
* ``<role>-50``: a 50-leaf state (64 x 64 each) and a split batch on 8 devices, ``strategy.jit``
  against ``jax.jit`` with the same in/out shardings and donated state, for ``MirroredStrategy`` and
  ``ShardedStrategy`` with FSDP, tensor and expert roles, on meshes with Auto axes (limit: 5 us);
  and FSDP on ``jax.make_mesh``'s default mesh (Explicit axes: the path that reads the layouts'
  provenance);
* ``run-mirrored-50``: ``strategy.run`` of a per-replica update of the 50-leaf state (its outputs
  proven mirrored) against ``jax.jit(jax.shard_map(...))``; also both sides' first call in wall
  seconds (``run``'s includes the on-device check of its mirrored outputs and the compile of the
  unchecked program);
* ``trainer-<n>dev``: ``Trainer.fit`` per optimizer step against a hand loop of the same step
  (``jax.jit``, one ``jax.device_put`` of each host batch, the loss read at every 10th step as
  ``fit``'s log points do), on the small MLP of `benchmarks.models`, one ``fit`` call of ``steps``
  steps per block (limit: 25 us); also both sides' Python function calls per step, counted once
  under cProfile: a figure the machine's load does not move.

Run: ``python -m benchmarks.dispatch`` (``--smoke``: short blocks, a check that it runs;
``--cases trainer``: only the cases whose name contains ``trainer``; the trainer cases run a quarter
of ``--pairs``, so ``--cases trainer --pairs 400`` gives each 100 pairs, about a minute a case).
Writes ``benchmarks/results/<date>-<backend>-dispatch[-<cases>].md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
LIMITS = {"1dev-trivial": 1.5, "trainer": 25.0}  # microseconds per call over hand-written JAX
DEFAULT_LIMIT = 5.0
LEAVES = 50
DEVICE_COUNTS = (1, 8)
# steps per fit call (a block): fit's fixed cost per call diluted as in real use
TRAINER_STEPS = 200
CASES = ("1dev-trivial", "trainer-1dev", "mirrored-50", "run-mirrored-50", "fsdp-50", "tensor-50",
         "expert-50", "fsdp-50-explicit", "trainer-8dev")  # the order of the table


def limit_of(case: str) -> float:
    """The issue's limit for ``case`` (extra microseconds per call)."""
    return LIMITS.get(case.split("-")[0] if case.startswith("trainer") else case, DEFAULT_LIMIT)


def _pairs(candidate: Callable[[], Any], baseline: Callable[[], Any], calls: int,
           pairs: int) -> dict[str, Any]:
    """Alternating blocks of ``calls`` calls each; thread CPU microseconds per call of both
    sides."""
    import jax

    def block(fn: Callable[[], Any]) -> float:
        start = time.thread_time()
        for _ in range(calls):
            out = fn()
        spent = time.thread_time() - start
        jax.block_until_ready(out)
        return spent / calls * 1e6

    for fn in (candidate, baseline, candidate, baseline):  # compile and warm both
        block(fn)
    a, b = [], []
    for i in range(pairs):
        for fn, acc in (
            ((candidate, a), (baseline, b)) if i % 2 == 0 else ((baseline, b), (candidate, a))
        ):
            acc.append(block(fn))
    return _summary(a, b)


def _calls_per_step(fn: Callable[[], Any], steps: int) -> float:
    """Python function calls (C builtins included) the calling thread makes per step in one
    ``fn()`` block of ``steps`` steps: a count, the same on a quiet machine and a loaded one."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(fn)
    return pstats.Stats(profile).total_calls / steps


def _summary(a: list[float], b: list[float]) -> dict[str, Any]:
    import dataclasses

    from benchmarks.timing import spread

    return {"extra_us": dataclasses.asdict(spread([x - y for x, y in zip(a, b, strict=True)])),
            "candidate_us": sorted(a)[len(a) // 2], "baseline_us": sorted(b)[len(b) // 2],
            "ratio": sorted(y / x for x, y in zip(a, b, strict=True))[len(a) // 2]}


def _state_case(strategy: Any, pairs: int, calls: int) -> dict[str, Any]:
    """The 50-leaf state on ``strategy``'s mesh: ``strategy.jit`` against ``jax.jit`` with its
    layouts."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    def step(state, batch):
        return jax.tree.map(lambda w: w * 0.5 + batch.mean(), state), batch.sum()

    state = {f"w{i:02d}": jnp.full((64, 64), float(i)) for i in range(LEAVES)}
    batch = strategy.experimental_distribute_values(jnp.ones((64, 64)))
    compiled = strategy.jit(step, donate_argnums=0, batch_argnums=1)
    holder = {"state": compiled(strategy.create_variables(lambda: state), batch)[0]}
    layouts = jax.tree.map(lambda x: x.sharding, holder["state"])
    hand = jax.jit(step, in_shardings=(layouts, batch.sharding),
                   out_shardings=(layouts, NamedSharding(strategy.mesh, PartitionSpec())),
                   donate_argnums=0)
    theirs = {"state": jax.device_put(state, layouts)}

    def ours() -> Any:
        holder["state"], loss = compiled(holder["state"], batch)
        return loss

    def baseline() -> Any:
        theirs["state"], loss = hand(theirs["state"], batch)
        return loss

    return _pairs(ours, baseline, calls, pairs)


def _run_case(strategy: Any, pairs: int, calls: int) -> dict[str, Any]:
    """``strategy.run`` of a per-replica step (the 50-leaf state updated with an all-reduced value:
    mirrored outputs, proven so) against ``jax.jit(jax.shard_map(...))`` written by hand; also each
    side's first call (trace, compile and, for ``run``, the on-device check of its mirrored outputs
    and the plain program's compile)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxdist as jd

    def replica_step(state, batch):
        g = jd.get_replica_context().all_reduce(jd.ReduceOp.MEAN, batch.mean())
        return jax.tree.map(lambda w: w * 0.5 + g, state), batch.sum()

    def hand_step(state, batch):
        g = jax.lax.pmean(batch.mean(), "replica")
        return jax.tree.map(lambda w: w * 0.5 + g, state), batch.sum()[None]

    state = strategy.mirror({f"w{i:02d}": jnp.full((64, 64), float(i)) for i in range(LEAVES)})
    batch = strategy.experimental_distribute_values(jnp.ones((64, 64)))
    hand = jax.jit(jax.shard_map(hand_step, mesh=strategy.mesh, in_specs=(P(), P("replica")),
                                 out_specs=(P(), P("replica")), check_vma=False))
    first = {}
    for side, call in (("candidate", lambda: strategy.run(replica_step, args=(state, batch))),
                       ("baseline", lambda: hand(state, batch))):
        start = time.perf_counter()
        jax.block_until_ready(call())
        first[side] = time.perf_counter() - start
    result = _pairs(lambda: strategy.run(replica_step, args=(state, batch))[1].stacked,
                    lambda: hand(state, batch)[1], calls, pairs)
    result["first_call_s"] = first
    return result


def _trivial_case(pairs: int, calls: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import jaxdist as jd

    def add(w, x):
        return w + x

    device = jax.devices()[0]
    w, x = jax.device_put(jnp.ones(4), device), jax.device_put(jnp.ones(4), device)
    ours, hand = jd.OneDeviceStrategy().jit(add, batch_argnums=()), jax.jit(add)
    return _pairs(lambda: ours(w, x), lambda: hand(w, x), calls, pairs)


def _trainer_case(strategy: Any, pairs: int, steps: int) -> dict[str, Any]:
    """``Trainer.fit`` against the hand loop of the same step, per optimizer step (one fit call per
    block)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import jaxdist as jd
    from benchmarks.models import SMALL, make_problem

    problem = make_problem(SMALL)
    trainer = jd.training.Trainer(strategy, problem.model, problem.optimizer,
                                  problem.loss_of_logits)
    data = list(problem.host_batches)
    mesh = strategy.mesh
    split, whole = (NamedSharding(mesh, PartitionSpec(mesh.axis_names)),
                    NamedSharding(mesh, PartitionSpec()))

    hand = jax.jit(problem.step, in_shardings=(whole, split), out_shardings=(whole, whole),
                   donate_argnums=0)
    holder = {
        "state": jax.jit(problem.init, out_shardings=whole)(jax.random.key(0), problem.sample_x())
    }

    def baseline_block() -> Any:
        state, loss = holder["state"], None
        for i in range(steps):
            state, loss = hand(state, jax.device_put(data[i % len(data)], split))
            if i % 10 == 9:
                float(loss)
        holder["state"] = state
        return loss

    def trainer_block() -> Any:
        trainer.fit(data, steps=trainer.step + steps, verbose=0)
        return trainer.state

    result = _pairs(trainer_block, baseline_block, 1, pairs)
    result["calls_per_step"] = {"candidate": _calls_per_step(trainer_block, steps),
                                "baseline": _calls_per_step(baseline_block, steps)}
    for k in ("candidate_us", "baseline_us"):
        result[k] /= steps
    result["extra_us"] = {k: (v / steps if isinstance(v, float) else v)
                          for k, v in result["extra_us"].items()}
    return result


def measure(devices: int, pairs: int, calls: int, steps: int,
            cases: str = "") -> list[dict[str, Any]]:
    """Every case of one device count whose name contains ``cases``, in this process (which must
    not have started its JAX backend yet)."""
    import warnings

    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    import jaxdist as jd
    from benchmarks.report import machine_info

    auto = (jax.sharding.AxisType.Auto,) * 2
    rows: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if devices == 1:
        rows.append(("1dev-trivial", lambda: _trivial_case(pairs, calls)))
    else:
        from jax.sharding import PartitionSpec as P

        # Simulated CPU devices run an 8-device step's collectives in milliseconds of wall time
        # (host time per call is a fraction of that): fewer calls per block keep the run short.
        calls = max(calls // 8, 5)

        rows += [
            ("mirrored-50", lambda: _state_case(jd.MirroredStrategy(), pairs, calls)),
            ("run-mirrored-50", lambda: _run_case(jd.MirroredStrategy(), pairs, calls)),
            ("fsdp-50", lambda: _state_case(jd.ShardedStrategy(min_shard_size=1), pairs, calls)),
            ("tensor-50", lambda: _state_case(jd.ShardedStrategy(
                mesh=jax.make_mesh((4, 2), ("data", "model"), axis_types=auto), batch_axes="data",
                layout_rules=[(r"w\d+$", P(None, "model"))], min_shard_size=1), pairs, calls)),
            ("expert-50", lambda: _state_case(jd.ShardedStrategy(
                mesh=jax.make_mesh((2, 4), ("data", "expert"), axis_types=auto),
                batch_axes=("data", "expert"),
                expert_axes="expert", layout_rules=[(r"w\d+$", P("expert"))], min_shard_size=1),
                                              pairs, calls)),
            ("fsdp-50-explicit", lambda: _state_case(jd.ShardedStrategy(
                mesh=jax.make_mesh((8,), ("fsdp",)), batch_axes="fsdp", fsdp_axes="fsdp",
                min_shard_size=1),
                pairs, calls)),
        ]
    rows.append(
        (f"trainer-{devices}dev",
         lambda: _trainer_case(jd.MirroredStrategy(), max(pairs // 4, 2), steps))
    )
    rows = [(name, run) for name, run in rows if cases in name]
    machine = machine_info(jax.devices())
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. an idle axis of the tensor case's unannotated step
        for name, run in rows:
            result = run()
            out.append({"case": name, "devices": devices, "limit_us": limit_of(name), **result,
                        "backend": machine["backend"], "machine": machine})
            print(f"{name}: +{result['extra_us']['median']:.2f} us per call", file=sys.stderr)
    return out


def _sides_table(rows: list[dict[str, Any]], key: str, title: str, fmt: str,
                 extra: bool = False) -> list[str]:
    """A table of both sides' ``row[key]`` (``{"candidate": x, "baseline": y}``) for the rows that
    have it (with ``extra``, also jaxdist minus hand-written); no lines when none has."""
    have = [r for r in rows if key in r]
    if not have:
        return []
    head = "| case | jaxdist | hand-written |" + (" extra |" if extra else "")
    lines = ["", title, "", head, "|---" * head.count(" |") + "|"]
    for r in have:
        a, b = r[key]["candidate"], r[key]["baseline"]
        lines.append(f"| {r['case']} | {fmt.format(a)} | {fmt.format(b)} |"
                     + (f" {a - b:+.1f} |" if extra else ""))
    return lines


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table: one row per case."""
    first = rows[0]["machine"] if rows else {"date": "", "backend": "?"}
    lines = [f"# Host time per call over hand-written JAX ({first['date'][:10]}, "
             f"{first['backend']})", "",
             "Calling thread's CPU time per call (Trainer: per optimizer step), jaxdist minus "
             "hand-written JAX, median of alternating pairs of blocks with its 95% interval; both "
             "sides' own time per call and their ratio (hand / jaxdist: 1.0 is parity).", "",
             "| case | devices | extra us per call | 95% interval | jaxdist us | hand-written us | "
             "ratio | limit |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["extra_us"]
        met = "met" if q["median"] <= r["limit_us"] else "missed"
        lines.append(f"| {r['case']} | {r['devices']} | {q['median']:+.2f} | [{q['ci_low']:+.2f}, "
                     f"{q['ci_high']:+.2f}] | {r['candidate_us']:.1f} | {r['baseline_us']:.1f} | "
                     f"{r['ratio']:.3f} | <= {r['limit_us']:g}: {met} |")
    lines += _sides_table(
        rows, "first_call_s", "First call (trace and compile; for `strategy.run` also the "
        "on-device check of its mirrored outputs and the compile of the program later calls "
        "run), wall seconds:", "{:.3f}")
    lines += _sides_table(
        rows, "calls_per_step", "Python function calls per optimizer step on the calling thread "
        "(C builtins included; one block each, under cProfile): a count, which load does not "
        "change as it changes the times above:", "{:.1f}", extra=True)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: one process per device count, then the table (printed, and written under
    ``--out``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatch",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help=f"results folder (default {RESULTS})")
    parser.add_argument("--pairs", type=int, default=30,
                        help="pairs of blocks per case (default 30); the trainer cases take a "
                             "quarter of them (each of their blocks is a fit of --steps steps)")
    parser.add_argument("--calls", type=int, default=1000,
                        help="calls per block on one device, an eighth of it on 8 (default 1000)")
    parser.add_argument("--steps", type=int, default=TRAINER_STEPS, help="Trainer steps per block")
    parser.add_argument("--smoke", action="store_true", help="short blocks: does it run?")
    parser.add_argument("--cases", default="",
                        help="run only the cases whose name contains this text (e.g. trainer)")
    # a child process: one device count
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        # 2 pairs: every case's blocks, differences and summary run (n=2); more time nothing here
        args.pairs, args.calls, args.steps = 2, 5, 5
    if args.one is not None:
        print(json.dumps(measure(args.one, args.pairs, args.calls, args.steps, args.cases)))
        return 0
    if not any(args.cases in case for case in CASES):
        print(f"--cases {args.cases!r} matches no case: pass part of one of {', '.join(CASES)}",
              file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXDIST_")}
    rows = []
    for n in DEVICE_COUNTS:
        child = subprocess.run(
            [sys.executable, "-m", "benchmarks.dispatch", "--one", str(n), "--pairs",
             str(args.pairs), "--calls", str(args.calls), "--steps", str(args.steps),
             "--cases", args.cases],
            cwd=pathlib.Path(__file__).resolve().parent.parent, env=env, capture_output=True,
            text=True, timeout=1800,
        )
        if child.returncode != 0:
            print(child.stderr[-3000:], file=sys.stderr)
            return 1
        print(child.stderr, end="", file=sys.stderr)
        rows += json.loads(child.stdout.strip().splitlines()[-1])
    from benchmarks.report import write_table

    table = markdown(rows)
    print(table)
    # a selection is a table of its own: it never overwrites the day's full one
    kind = (f"-{args.cases}" if args.cases else "") + ("-smoke" if args.smoke else "")
    write_table(args.out, f"{rows[0]['machine']['date'][:10]}-{rows[0]['backend']}-dispatch{kind}",
                table, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
