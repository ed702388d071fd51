"""The multi-process rows: MultiWorkerMirroredStrategy on 2 processes x 4 devices against
hand-written JAX on the same topology (the row with the target), and against MirroredStrategy on 1
process x 8 devices (information).

On 2 shared cores a 2 x 4 run is bound by gloo's all-reduce over TCP loopback between 8 ranks,
whatever the framework: hand-written ``jax.distributed`` + ``jax.jit`` reaches about a tenth of 1 x
8 there too. So the target compares jaxdist with the hand-written program of the same topology and
model, and 1 x 8 is shown only as information.

The sides cannot share a process (a process's device count and cluster are fixed when JAX starts),
so each block is a fresh run: ``python -m jaxdist.launch -n 2 --cpu-devices 4`` for the two-process
sides (the launcher only starts the processes and sets the coordinator environment; the hand-written
side calls ``jax.distributed.initialize`` itself), one process with 8 simulated devices for 1 x 8.
Each run warms up (compiles) and then times ``blocks`` blocks of the same step on device-resident
batches; its steps/s is the median over its blocks. Runs rotate (each pair runs the three sides in a
different order) and each ratio is taken per pair.

Also the worker: ``python benchmarks/multiproc.py worker SIDE MODEL BLOCKS STEPS [WARMUP]`` (started
by the rows; WARMUP steps before the timed blocks, 10 unless given), SIDE one of ``_WORKER_SIDES``.
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
# ``python -m jaxdist.launch``, run as the file (``-P``: its folder stays off sys.path): the same
# launcher, which imports only the standard library, where ``-m`` first imports the package jaxdist
# (jax, flax, orbax: ~1 s of CPU per launch, before any process starts).
LAUNCH = [sys.executable, "-P", str(ROOT / "jaxdist" / "launch.py")]
_MARK = "MULTIPROC_RESULT "


def _jaxdist_side(problem):
    import jax

    import jaxdist as jd

    # the cluster from jaxdist.launch's environment, or alone
    strategy = jd.MultiWorkerMirroredStrategy()
    state = strategy.create_variables(problem.init, jax.random.key(0), problem.sample_x())
    step = strategy.jit(problem.step, donate_argnums=(0,))
    batches = [strategy.experimental_distribute_values(b) for b in problem.host_batches]
    return step, state, batches


def _hand_side(problem):
    """What a JAX user writes by hand: ``jax.distributed.initialize``, one global mesh, ``jax.jit``
    with ``NamedSharding`` in/out shardings and donated state, batches built from each process's own
    rows."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    jax.distributed.initialize(
        os.environ["JAXDIST_COORDINATOR_ADDRESS"],
        int(os.environ["JAXDIST_NUM_PROCESSES"]),
        int(os.environ["JAXDIST_PROCESS_ID"]),
    )
    mesh = Mesh(jax.devices(), ("batch",))
    replicated, split = (NamedSharding(mesh, PartitionSpec()),
                         NamedSharding(mesh, PartitionSpec("batch")))
    state = jax.jit(problem.init, out_shardings=replicated)(jax.random.key(0), problem.sample_x())
    step = jax.jit(
        problem.step, in_shardings=(replicated, split), out_shardings=(replicated, replicated),
        donate_argnums=0
    )

    def place(batch):
        return jax.tree.map(
            lambda a: jax.make_array_from_callback(a.shape, split, lambda index: a[index]), batch
        )

    return step, state, [place(b) for b in problem.host_batches]


# ---------------------------------------------------------------- the LM, HSDP over 2 processes x 4
# lm1b's way of writing rules: every logical name has one, so the hand-written side can lay the
# state out with Flax's own tools (nn.get_partition_spec + nn.logical_to_mesh_sharding) and both
# sides get the same layouts. The batch over data x fsdp, parameters split over 'fsdp' (within a
# process), replicated over 'data'.
HSDP_RULES = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("heads", None), ("mlp", None),
              ("vocab", None), ("kv", None), ("position", None), ("length", None))


def _hsdp_mesh():
    """``(data, fsdp) = (processes, local devices)``: 'data' across the processes, 'fsdp' within
    each."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices).reshape(jax.process_count(), -1), ("data", "fsdp"))


def _jaxdist_lm_side(problem, layout):
    import jaxdist as jd

    if layout == "hsdp":
        strategy = jd.ShardedStrategy(mesh=_hsdp_mesh(), batch_axes=("data", "fsdp"),
                                      fsdp_axes=("fsdp",), logical_axis_rules=HSDP_RULES,
                                      activation_axes=("batch", "length"))
    else:  # the short form: FSDP over every device of every process
        strategy = jd.ShardedStrategy()
    state = strategy.mirror(problem.host_state)  # in the strategy's variable layout
    step = strategy.jit(problem.step, donate_argnums=(0,))
    batches = [strategy.experimental_distribute_values(b) for b in problem.host_batches]
    return step, state, batches


def _hand_lm_side(problem, layout):
    """What an lm1b / MaxText user writes: ``jax.distributed.initialize``, their mesh, shardings
    from the model's logical annotations through Flax's rules, ``jax.jit`` traced under the mesh and
    the rules."""
    import flax.linen as nn
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _hsdp_mesh()
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(problem.host_state), mesh,
                                            HSDP_RULES)
    split = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

    def place(a, sharding):
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    state = jax.tree.map(place, nn.unbox(problem.host_state), nn.unbox(shardings))
    state = jax.tree.map(lambda s, a: s.replace_boxed(a) if isinstance(s, nn.Partitioned) else a,
                         problem.host_state, state, is_leaf=lambda x: isinstance(x, nn.Partitioned))

    def step(state, batch):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(HSDP_RULES):
            return problem.step(state, batch)

    replicated = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(step, in_shardings=(shardings, split), out_shardings=(shardings, replicated),
                     donate_argnums=0)
    return jitted, state, [jax.tree.map(lambda a: place(a, split), b) for b in problem.host_batches]


def _state_bytes(state) -> int:
    """The most bytes any one of this process's devices holds of ``state``."""
    import jax

    per = {}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values(), default=0)


def worker(side: str, model: str, blocks: int, steps: int, warmup: int = 10) -> None:
    """One side of the rows, in this process (and its peers): ``warmup`` steps (the first compiles),
    then time ``blocks`` x ``steps`` training steps.

    Sides: ``jaxdist`` / ``hand`` (an MLP of `benchmarks.models`, data parallel), ``jaxdist-hsdp`` /
    ``hand-hsdp`` / ``jaxdist-fsdp`` (an LM of `benchmarks.lm`). With ``blocks`` 0 nothing is
    compiled: the run reports the state's bytes per device only (the memory table).
    """
    import jax

    if side in ("jaxdist", "hand"):
        from benchmarks.models import MODELS, make_problem

        problem = make_problem(MODELS[model])
        step, state, batches = {"jaxdist": _jaxdist_side, "hand": _hand_side}[side](problem)
        full = None
    else:
        kind, layout = side.split("-")
        # before anything touches a device: the mesh needs every process's devices
        if kind == "jaxdist":
            import jaxdist as jd

            jd.initialize_cluster()
        else:
            jax.distributed.initialize(
                os.environ["JAXDIST_COORDINATOR_ADDRESS"],
                int(os.environ["JAXDIST_NUM_PROCESSES"]),
                int(os.environ["JAXDIST_PROCESS_ID"]),
            )
        from benchmarks.lm import LM_MODELS, lm_problem

        problem = lm_problem(LM_MODELS[model])
        step, state, batches = (_jaxdist_lm_side if kind == "jaxdist" else _hand_lm_side)(
            problem, layout
        )
        full = sum(a.nbytes for a in jax.tree.leaves(problem.host_state))
    state_bytes = _state_bytes(state)
    seconds = []
    if blocks:
        for i in range(warmup):  # warm-up: compile, settle the collectives
            state, loss = step(state, batches[i % len(batches)])
        jax.block_until_ready(loss)
        for _ in range(blocks):
            start = time.perf_counter()
            for i in range(steps):
                state, loss = step(state, batches[i % len(batches)])
            jax.block_until_ready(loss)
            seconds.append(time.perf_counter() - start)
    if jax.process_index() == 0:
        result = {"processes": jax.process_count(), "devices": jax.device_count(),
                  "seconds": seconds, "state_bytes": state_bytes, "full_state_bytes": full}
        print(_MARK + json.dumps(result), flush=True)


def _run(command: list[str], env: dict[str, str], timeout: float) -> dict:
    out = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    for line in out.stdout.splitlines():
        if _MARK in line:
            return json.loads(line.split(_MARK, 1)[1])
    raise RuntimeError(f"{' '.join(command[:6])}... exited {out.returncode}: "
                       f"{(out.stdout + out.stderr)[-800:]}")


_SIDES = ("jaxdist", "hand", "one")
_WORKER_SIDES = ("jaxdist", "hand", "jaxdist-hsdp", "hand-hsdp", "jaxdist-fsdp")


def measure_multiproc(
    model: str, pairs: int, blocks: int, steps: int, timeout: float = 300.0,
    sides: tuple[str, ...] = _SIDES, warmup: int = 10,
) -> dict:
    """Rotate the sides' runs; return ``{side: (block seconds, median seconds per run, run order,
    result)}`` (``result``: the last run's worker result).

    Sides: ``jaxdist`` (MultiWorkerMirroredStrategy, 2 x 4), ``hand`` (hand-written JAX, 2 x 4) and
    ``one`` (MirroredStrategy, 1 x 8) for an MLP; ``jaxdist-hsdp`` / ``hand-hsdp`` (2 x 4) for an
    LM. Pair ``k`` runs them in the order ``sides`` rotated by ``k``. Each run takes ``warmup``
    untimed steps first.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXDIST_")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    script = [str(pathlib.Path(__file__).resolve()), "worker"]
    tail = [model, str(blocks), str(steps), str(warmup)]
    two = [*LAUNCH, "-n", "2", "--cpu-devices", "4", "--timeout",
           str(timeout)]
    commands = {side: ([*two, *script, side, *tail], env, 2) for side in _WORKER_SIDES}
    commands["one"] = ([sys.executable, *script, "jaxdist", *tail],
                       dict(env, JAX_NUM_CPU_DEVICES="8"), 1)
    out = {side: ([], [], [], None) for side in sides}
    for pair in range(pairs):
        k = pair % len(sides)
        for position, side in enumerate(sides[k:] + sides[:k]):
            command, side_env, processes = commands[side]
            result = _run(command, side_env, timeout + 30)
            assert result["processes"] == processes and result["devices"] == 8, result
            out[side][0].extend(result["seconds"])
            out[side][1].append(statistics.median(result["seconds"]))
            out[side][2].append(position)
            out[side] = (*out[side][:3], result)
    return out


def memory_probe(model: str, side: str, timeout: float = 300.0) -> dict:
    """One run of ``side`` that only places the state: ``{"state_bytes", "full_state_bytes"}`` per
    device."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXDIST_")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    command = [*LAUNCH, "-n", "2", "--cpu-devices", "4", "--timeout",
               str(timeout), str(pathlib.Path(__file__).resolve()), "worker", side, model, "0", "0"]
    return _run(command, env, timeout + 30)


def multiproc_rows(spec, pairs: int, blocks: int, steps: int, warmup: int = 10) -> list:
    """The ``multiproc`` (vs hand-written 2 x 4) and ``multiproc-1x8`` (vs 1 x 8) `Row` s for model
    ``spec`` (error rows, with the reason, when a run fails)."""
    from benchmarks.suite import Row

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
        runs = measure_multiproc(spec.name, pairs, blocks, steps, warmup=warmup)
    except Exception as error:  # reported in the rows; the suite goes on
        for row in rows:
            row.status, row.note = "error", f"{type(error).__name__}: {error}"
        return rows
    _fill(rows, runs, "jaxdist", ("hand", "one"), steps, start)
    return rows


def _fill(rows: list, runs: dict, candidate: str, baselines: tuple[str, ...], steps: int,
          start: float) -> None:
    from benchmarks.suite import _status
    from benchmarks.timing import spread

    seconds, medians, positions, _ = runs[candidate]
    for row, side in zip(rows, baselines, strict=True):
        base_seconds, base_medians, base_positions, _ = runs[side]
        row.steps_per_block = steps
        row.seconds_candidate, row.seconds_baseline = seconds, base_seconds
        row.candidate_first = [a < b for a, b in zip(positions, base_positions, strict=True)]
        row.ratios = [b / a for a, b in zip(medians, base_medians, strict=True)]
        row.ratio = spread(row.ratios)
        row.rate_candidate = spread([steps / s for s in seconds])
        row.rate_baseline = spread([steps / s for s in base_seconds])
        row.status = _status(row.ratio, row.target)
        row.wall_seconds = time.perf_counter() - start


def lm_hsdp_rows(
    spec, pairs: int, blocks: int, steps: int, probe_fsdp: bool = True, warmup: int = 10
) -> tuple[list, dict]:
    """The ``lm-hsdp-mp`` `Row` (ShardedStrategy HSDP on the user's mesh vs hand-written, both 2 x
    4) for LM ``spec``, and the multi-process memory entries: per-device state of HSDP 2 x 4 and
    (``probe_fsdp``: one more run) of FSDP over the 8 devices of both processes, as fractions of the
    whole state (what Mirrored holds on every device)."""
    from benchmarks.suite import Row

    row = Row(
        key="lm-hsdp-mp",
        title="LM: ShardedStrategy HSDP on the user's (data, fsdp) mesh vs hand-written "
              "jax.distributed + jit, 2 x 4",
        model=spec.name,
        layers=spec.layers,
        batch=spec.batch,
        candidate="hsdp-2x4",
        candidate_label="Sharded (HSDP, mesh data=2 processes x fsdp=4) strategy.jit, 2 processes "
                        "x 4 devices",
        baseline="hand-hsdp-2x4",
        baseline_label="hand-written jax.distributed + jax.jit, same mesh, Flax-rule shardings",
        target=0.95,
    )
    start = time.perf_counter()
    memory: dict = {}
    try:
        runs = measure_multiproc(
            spec.name, pairs, blocks, steps, sides=("jaxdist-hsdp", "hand-hsdp"), warmup=warmup
        )
        _fill([row], runs, "jaxdist-hsdp", ("hand-hsdp",), steps, start)
        hsdp = runs["jaxdist-hsdp"][3]
        memory = {"HSDP 2 x 4": {"state_bytes": hsdp["state_bytes"],
                                 "full": hsdp["full_state_bytes"], "target": 1 / 4 + 0.05}}
        if probe_fsdp:
            fsdp = memory_probe(spec.name, "jaxdist-fsdp")
            memory["FSDP, 2 processes x 4"] = {"state_bytes": fsdp["state_bytes"],
                                               "full": fsdp["full_state_bytes"],
                                               "target": 1 / 8 + 0.05}
    except Exception as error:  # reported in the row; the suite goes on
        row.status, row.note = "error", f"{type(error).__name__}: {error}"
    return [row], memory


if __name__ == "__main__":
    if len(sys.argv) in (6, 7) and sys.argv[1] == "worker" and sys.argv[2] in _WORKER_SIDES:
        sys.path.insert(0, str(ROOT))
        worker(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:]))
    else:
        sys.exit(f"usage: python benchmarks/multiproc.py worker {{{','.join(_WORKER_SIDES)}}} "
                 "MODEL BLOCKS STEPS [WARMUP]")
