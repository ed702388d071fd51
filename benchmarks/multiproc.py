"""The multi-process rows: MultiWorkerMirroredStrategy on 2 processes x 4 devices against hand-written JAX on
the same topology (the row with the target), and against MirroredStrategy on 1 process x 8 devices (information).

On 2 shared cores a 2 x 4 run is bound by gloo's all-reduce over TCP loopback between 8 ranks, whatever the
framework: hand-written ``jax.distributed`` + ``jax.jit`` reaches about a tenth of 1 x 8 there too. So the
target compares jaxdist with the hand-written program of the same topology and model, and 1 x 8 is shown only
as information.

The sides cannot share a process (a process's device count and cluster are fixed when JAX starts), so each
block is a fresh run: ``python -m jaxdist.launch -n 2 --cpu-devices 4`` for the two-process sides (the launcher
only starts the processes and sets the coordinator environment; the hand-written side calls
``jax.distributed.initialize`` itself), one process with 8 simulated devices for 1 x 8. Each run warms up
(compiles) and then times ``blocks`` blocks of the same step on device-resident batches; its steps/s is the
median over its blocks. Runs rotate (each pair runs the three sides in a different order) and each ratio is
taken per pair.

Also the worker: ``python benchmarks/multiproc.py worker SIDE MODEL BLOCKS STEPS`` (started by the rows), SIDE
``jaxdist`` or ``hand``.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

__all__ = ["measure_multiproc", "multiproc_rows", "worker"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
_MARK = "MULTIPROC_RESULT "


def _jaxdist_side(problem):
    import jax

    import jaxdist as jd

    strategy = jd.MultiWorkerMirroredStrategy()  # the cluster from jaxdist.launch's environment, or alone
    state = strategy.create_variables(problem.init, jax.random.key(0), problem.sample_x())
    step = strategy.jit(problem.step, donate_argnums=(0,))
    batches = [strategy.experimental_distribute_values(b) for b in problem.host_batches]
    return step, state, batches


def _hand_side(problem):
    """What a JAX user writes by hand: ``jax.distributed.initialize``, one global mesh, ``jax.jit`` with
    ``NamedSharding`` in/out shardings and donated state, batches built from each process's own rows."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    jax.distributed.initialize(
        os.environ["JAXDIST_COORDINATOR_ADDRESS"],
        int(os.environ["JAXDIST_NUM_PROCESSES"]),
        int(os.environ["JAXDIST_PROCESS_ID"]),
    )
    mesh = Mesh(jax.devices(), ("batch",))
    replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("batch"))
    state = jax.jit(problem.init, out_shardings=replicated)(jax.random.key(0), problem.sample_x())
    step = jax.jit(
        problem.step, in_shardings=(replicated, split), out_shardings=(replicated, replicated), donate_argnums=0
    )

    def place(batch):
        return jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, split, lambda index: a[index]), batch)

    return step, state, [place(b) for b in problem.host_batches]


def worker(side: str, model: str, blocks: int, steps: int) -> None:
    """One side of the rows, in this process (and its peers): time ``blocks`` x ``steps`` training steps."""
    from benchmarks.models import MODELS, make_problem

    problem = make_problem(MODELS[model])
    step, state, batches = {"jaxdist": _jaxdist_side, "hand": _hand_side}[side](problem)

    import jax

    for i in range(10):  # warm-up: compile, settle the collectives
        state, loss = step(state, batches[i % len(batches)])
    jax.block_until_ready(loss)
    seconds = []
    for _ in range(blocks):
        start = time.perf_counter()
        for i in range(steps):
            state, loss = step(state, batches[i % len(batches)])
        jax.block_until_ready(loss)
        seconds.append(time.perf_counter() - start)
    if jax.process_index() == 0:
        result = {"processes": jax.process_count(), "devices": jax.device_count(), "seconds": seconds}
        print(_MARK + json.dumps(result), flush=True)


def _run(command: list[str], env: dict[str, str], timeout: float) -> dict:
    out = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    for line in out.stdout.splitlines():
        if _MARK in line:
            return json.loads(line.split(_MARK, 1)[1])
    raise RuntimeError(f"{' '.join(command[:6])}... exited {out.returncode}: {(out.stdout + out.stderr)[-800:]}")


_SIDES = ("jaxdist", "hand", "one")


def measure_multiproc(model: str, pairs: int, blocks: int, steps: int, timeout: float = 300.0) -> dict:
    """Rotate the three sides' runs; return ``{side: (block seconds, median seconds per run, run order)}``.

    Sides: ``jaxdist`` (MultiWorkerMirroredStrategy, 2 x 4), ``hand`` (hand-written JAX, 2 x 4) and ``one``
    (MirroredStrategy, 1 x 8). Pair ``k`` runs them in the order ``_SIDES`` rotated by ``k``.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXDIST_")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    script = [str(pathlib.Path(__file__).resolve()), "worker"]
    tail = [model, str(blocks), str(steps)]
    two = [sys.executable, "-m", "jaxdist.launch", "-n", "2", "--cpu-devices", "4", "--timeout", str(timeout)]
    sides = {
        "jaxdist": ([*two, *script, "jaxdist", *tail], env, 2),
        "hand": ([*two, *script, "hand", *tail], env, 2),
        "one": ([sys.executable, *script, "jaxdist", *tail], dict(env, JAX_NUM_CPU_DEVICES="8"), 1),
    }
    out = {side: ([], [], []) for side in _SIDES}
    for pair in range(pairs):
        order = _SIDES[pair % 3 :] + _SIDES[: pair % 3]
        for position, side in enumerate(order):
            command, side_env, processes = sides[side]
            result = _run(command, side_env, timeout + 30)
            assert result["processes"] == processes and result["devices"] == 8, result
            out[side][0].extend(result["seconds"])
            out[side][1].append(statistics.median(result["seconds"]))
            out[side][2].append(position)
    return out


def multiproc_rows(spec, pairs: int, blocks: int, steps: int) -> list:
    """The ``multiproc`` (vs hand-written 2 x 4) and ``multiproc-1x8`` (vs 1 x 8) `Row` s for model ``spec``
    (error rows, with the reason, when a run fails)."""
    from benchmarks.suite import Row, _status
    from benchmarks.timing import spread

    row = functools.partial(
        Row,
        model=spec.name,
        layers=spec.layers,
        batch=spec.batch,
        candidate="mwms-2x4",
        candidate_label="MultiWorkerMirrored strategy.jit, 2 processes x 4 devices (gloo)",
    )
    rows = [
        row(
            key="multiproc",
            title="MultiWorkerMirroredStrategy vs hand-written jax.distributed + jit, 2 x 4",
            baseline="hand-2x4",
            baseline_label="hand-written jax.distributed + jax.jit, 2 processes x 4 devices",
            target=0.95,
        ),
        row(
            key="multiproc-1x8",
            title="MultiWorkerMirroredStrategy 2 x 4 vs MirroredStrategy 1 x 8",
            baseline="mirrored-1x8",
            baseline_label="Mirrored strategy.jit, 1 process x 8 devices",
            target=None,
        ),
    ]
    start = time.perf_counter()
    try:
        runs = measure_multiproc(spec.name, pairs, blocks, steps)
    except Exception as error:  # reported in the rows; the suite goes on
        for row in rows:
            row.status, row.note = "error", f"{type(error).__name__}: {error}"
        return rows
    seconds, medians, positions = runs["jaxdist"]
    for row, side in zip(rows, ("hand", "one"), strict=True):
        base_seconds, base_medians, base_positions = runs[side]
        row.steps_per_block = steps
        row.seconds_candidate, row.seconds_baseline = seconds, base_seconds
        row.candidate_first = [a < b for a, b in zip(positions, base_positions, strict=True)]
        row.ratios = [b / a for a, b in zip(medians, base_medians, strict=True)]
        row.ratio = spread(row.ratios)
        row.rate_candidate = spread([steps / s for s in seconds])
        row.rate_baseline = spread([steps / s for s in base_seconds])
        row.status = _status(row.ratio, row.target)
        row.wall_seconds = time.perf_counter() - start
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "worker" and sys.argv[2] in ("jaxdist", "hand"):
        sys.path.insert(0, str(ROOT))
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        sys.exit("usage: python benchmarks/multiproc.py worker {jaxdist,hand} MODEL BLOCKS STEPS")
