"""The multi-process row: MultiWorkerMirroredStrategy on 2 processes x 4 devices vs MirroredStrategy on 1 x 8.

The two sides cannot share a process (a process's device count and cluster are fixed when JAX starts), so
each block is a fresh run: the baseline as one process with 8 simulated devices, the candidate as
``python -m jaxdist.launch -n 2 --cpu-devices 4``. Each run warms up (compiles) and then times ``blocks``
blocks of the same step on device-resident batches; its steps/s is the median over its blocks. Runs
alternate (A B, B A, ...) and the ratio is taken per pair, as in the in-process rows.

Also the worker: ``python benchmarks/multiproc.py worker MODEL BLOCKS STEPS`` (started by the row).
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

__all__ = ["measure_multiproc", "multiproc_row", "worker"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
_MARK = "MULTIPROC_RESULT "


def worker(model: str, blocks: int, steps: int) -> None:
    """One side of the row, in this process (and its peers): time ``blocks`` x ``steps`` training steps."""
    import jaxdist as jd

    strategy = jd.MultiWorkerMirroredStrategy()  # the cluster from jaxdist.launch's environment, or alone

    import jax

    from benchmarks.models import MODELS, make_problem

    problem = make_problem(MODELS[model])
    state = strategy.create_variables(problem.init, jax.random.key(0), problem.sample_x())
    step = strategy.jit(problem.step, donate_argnums=(0,))
    batches = [strategy.experimental_distribute_values(b) for b in problem.host_batches]
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
        result = {"processes": jax.process_count(), "devices": strategy.num_replicas_in_sync, "seconds": seconds}
        print(_MARK + json.dumps(result), flush=True)


def _run(command: list[str], env: dict[str, str], timeout: float) -> dict:
    out = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    for line in out.stdout.splitlines():
        if _MARK in line:
            return json.loads(line.split(_MARK, 1)[1])
    raise RuntimeError(f"{' '.join(command[:6])}... exited {out.returncode}: {(out.stdout + out.stderr)[-800:]}")


def measure_multiproc(model: str, pairs: int, blocks: int, steps: int, timeout: float = 300.0):
    """Alternate single- and two-process runs; return ``(seconds_2x4, seconds_1x8, ratios, first_flags)``.

    ``ratios`` are steps/s(2 x 4) / steps/s(1 x 8), one per pair.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXDIST_")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    script = [str(pathlib.Path(__file__).resolve()), "worker", model, str(blocks), str(steps)]
    sides = {
        "one": ([sys.executable, *script], dict(env, JAX_NUM_CPU_DEVICES="8")),
        "two": ([sys.executable, "-m", "jaxdist.launch", "-n", "2", "--cpu-devices", "4", "--timeout",
                 str(timeout), *script], env),
    }
    seconds_two, seconds_one, ratios, two_first = [], [], [], []
    for pair in range(pairs):
        order = ("two", "one") if pair % 2 == 0 else ("one", "two")
        results = {side: _run(*sides[side], timeout + 30) for side in order}
        r_two, r_one = results["two"], results["one"]
        assert r_two["processes"] == 2 and r_one["processes"] == 1 and r_two["devices"] == r_one["devices"] == 8
        seconds_two.extend(r_two["seconds"])
        seconds_one.extend(r_one["seconds"])
        ratios.append(statistics.median(r_one["seconds"]) / statistics.median(r_two["seconds"]))
        two_first.append(pair % 2 == 0)
    return seconds_two, seconds_one, ratios, two_first


def multiproc_row(spec, pairs: int, blocks: int, steps: int):
    """The ``multiproc`` `Row` for model ``spec`` (or a skipped / error row, with the reason)."""
    from benchmarks.suite import Row, _status
    from benchmarks.timing import spread

    row = Row(
        key="multiproc", title="MultiWorkerMirroredStrategy 2 processes x 4 devices vs MirroredStrategy 1 x 8",
        model=spec.name, layers=spec.layers, batch=spec.batch, candidate="mwms-2x4",
        candidate_label="MultiWorkerMirrored strategy.jit, 2 processes x 4 devices (gloo)",
        baseline="mirrored-1x8", baseline_label="Mirrored strategy.jit, 1 process x 8 devices", target=0.6,
    )
    start = time.perf_counter()
    try:
        two, one, ratios, two_first = measure_multiproc(spec.name, pairs, blocks, steps)
    except Exception as error:  # reported in the row; the suite goes on
        row.status, row.note = "error", f"{type(error).__name__}: {error}"
        return row
    row.steps_per_block = steps
    row.seconds_candidate, row.seconds_baseline = two, one
    row.candidate_first, row.ratios = two_first, ratios
    row.ratio = spread(ratios)
    row.rate_candidate = spread([steps / s for s in two])
    row.rate_baseline = spread([steps / s for s in one])
    row.status = _status(row.ratio, row.target)
    row.wall_seconds = time.perf_counter() - start
    return row


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        sys.path.insert(0, str(ROOT))
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit("usage: python benchmarks/multiproc.py worker MODEL BLOCKS STEPS")
