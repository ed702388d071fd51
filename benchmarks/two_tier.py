"""The two-tier row of `benchmarks.checkpointing`: what a lost host costs, with a local tier or not.

``python -m benchmarks.checkpointing --row two-tier [--out DIR] [--pairs N] [--width W] [--smoke]``

A 2-process FSDP job (``python -m jaxdist.launch -n 2 --cpu-devices 4``: ``ShardedStrategy()``,
every kernel and its adam moments split over the 8 devices of both processes) trains a 784-W-W-10
MLP with ``Trainer.fit`` (global batch 256), the persistent tier (``checkpoint_dir``) every
``persistent`` steps. Each side runs the same failure: process 1 is SIGKILLed after step ``kill``
(once the newest step of each tier before it is complete) and its local directory deleted (a fresh
host); the job is started again with the same command and ends at step ``steps``. The sides differ
in one thing: "two tiers" adds ``local_checkpoint_dir`` with ``local_checkpoint_every=local``.

Per side: the steps lost (``kill`` minus the step the restart resumes from); the time to resume, the
restart's launch to the end of its first new step, in three parts: to the cluster joined (processes,
imports, gloo), to ``on_train_begin`` (``fit``'s agreement, the directory's claim, the restore) and
the first step (its compile); and the job's goodput over the crash and the resume
(``History.job_goodput``, the job's record of its runs beside the progress record in
``checkpoint_dir``, read in the restarted run: its ``restart`` part is the gap after the killed
run's last record). Pairs of sides alternate order (two tiers first, then one tier first); ratios
are one tier over two tiers, per pair.

A save's cost, in each two-tier restart after its ``fit`` (the same trained FSDP state): ``saves``
alternating pairs of a local save (`LocalCheckpointer.save`: the neighbour's copy and the copy to
host memory, which the step loop waits for; then its background write, until
``wait_until_finished``) and an asynchronous persistent save (`Checkpointer.save`, orbax: blocked,
then its background write), after one untimed save of each. Both directories are on this machine's
disk: the persistent figure is orbax's write to a local disk, not a shared store's (which at scale
takes minutes).

Also the worker: ``python benchmarks/two_tier.py worker CKPT LOCAL STEPS WIDTH persistent=N batch=N
[local=N] [kill=N] [saves=N]``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["SETTINGS", "Result", "markdown", "measure", "worker"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAUNCH = [sys.executable, "-P", str(ROOT / "jaxdist" / "launch.py")]  # as benchmarks.multiproc's
_MARK = "TWO_TIER "


@dataclasses.dataclass(frozen=True)
class Settings:
    """One run's sizes: total steps, the step process 1 is killed after, the tiers' cadences, the
    MLP's width and global batch, the pairs of sides and the save pairs per two-tier restart."""

    steps: int
    kill: int
    persistent: int
    local: int
    width: int
    batch: int
    pairs: int
    saves: int


SETTINGS = {
    "full": Settings(
        steps=20, kill=15, persistent=10, local=2, width=2048, batch=256, pairs=2, saves=3
    ),
    "smoke": Settings(steps=5, kill=4, persistent=2, local=1, width=16, batch=16, pairs=1, saves=1),
}


# ------------------------------------------------------------------------------------ the worker
def worker(ckpt: str, local: str, steps: int, width: int, options: dict[str, str]) -> None:
    """One process of the job (both run it): ``fit`` with the tiers asked for, process 1 killed
    after step ``kill=`` when given; then, with ``saves=``, the save pairs. Prints `_MARK` lines
    (process 0)."""
    began = time.time()
    import jaxdist as jd

    strategy = jd.ShardedStrategy()  # joins the job first: FSDP over every device of both processes
    joined = time.time()
    import flax.linen as nn
    import jax
    import numpy as np
    import optax

    pid, kill, batch = jax.process_index(), int(options.get("kill", 0)), int(options["batch"])
    every, local_every = int(options["persistent"]), int(options.get("local", 0)) or None

    def say(**record: Any) -> None:
        if pid == 0:
            print(_MARK + json.dumps(record), flush=True)

    say(event="start", began=began, joined=joined)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(10)(nn.relu(nn.Dense(width)(x)))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, 4 * batch).astype(np.int32)

    def data_fn(epoch):
        return [(x[i : i + batch], y[i : i + batch]) for i in range(0, 4 * batch, batch)]

    def ce(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def committed(directory: str, step: int) -> bool:
        return os.path.isdir(os.path.join(directory, str(step)))

    class Tell(jd.training.Callback):
        def on_train_begin(self, trainer):
            say(event="begin", t=time.time())

        def on_step_end(self, trainer, step, metrics):
            say(event="step", step=step, t=time.time())
            if (
                step == kill and pid == 1
            ):  # a lost host, once each tier's newest step before it is complete
                wanted = [
                    (ckpt, (step - 1) // every * every)
                ]  # (a save at this step waits for process 1)
                if local_every:
                    wanted.append(
                        (local.replace("{process}", "0"), (step - 1) // local_every * local_every)
                    )
                deadline = time.monotonic() + 120
                while not all(committed(*w) for w in wanted) and time.monotonic() < deadline:
                    time.sleep(0.02)
                os.kill(os.getpid(), 9)

    tiers = (
        {"local_checkpoint_dir": local, "local_checkpoint_every": local_every}
        if local_every
        else {}
    )
    trainer = jd.training.Trainer(strategy, MLP(), optax.adam(1e-3), ce)
    say(event="fit", t=time.time())
    history = trainer.fit(
        data_fn,
        steps=steps,
        checkpoint_dir=ckpt,
        checkpoint_every=every,
        verbose=0,
        log_every=5,
        callbacks=[Tell()],
        **tiers,
    )
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(trainer.state))
    say(
        event="history",
        time=history.time,
        job_time=history.job_time,
        job_runs=history.job_runs,
        job_goodput=history.job_goodput,
        goodput=history.goodput,
        state_mb=state_bytes / 1e6,
    )
    saves = int(options.get("saves", 0))
    if saves:
        say(event="saves", **_save_pairs(trainer.state, ckpt, local, saves, steps))


def _save_pairs(state: Any, ckpt: str, local: str, pairs: int, step: int) -> dict[str, list[float]]:
    """``pairs`` alternating pairs of a local and a persistent save of ``state`` (after one untimed
    save of each: one-time setup), each: the seconds the call blocked and the seconds its background
    write took after it."""
    import jaxdist as jd

    tiers = {
        "local": jd.training.LocalCheckpointer(
            local.replace("{process}", "saves-{process}"), max_to_keep=1
        ),
        "persistent": jd.training.Checkpointer(ckpt + "-saves", max_to_keep=1, async_save=True),
    }
    out: dict[str, list[float]] = {
        f"{k}_{part}": [] for k in tiers for part in ("blocked", "write")
    }
    try:
        for k in range(pairs + 1):
            for name in ("local", "persistent") if k % 2 == 0 else ("persistent", "local"):
                began = time.perf_counter()
                tiers[name].save(step + k, state)
                blocked = time.perf_counter()
                tiers[name].wait_until_finished()
                if k:
                    out[f"{name}_blocked"].append(blocked - began)
                    out[f"{name}_write"].append(time.perf_counter() - blocked)
    finally:
        for tier in tiers.values():
            tier.close()
    return out


# --------------------------------------------------------------------------------------- the row
SIDES = ("two tiers", "one tier")


@dataclasses.dataclass
class Result:
    """Every figure of one measurement (all into the JSON).

    Attributes:
        settings: the run's sizes (`Settings`).
        pairs: per pair, per side (``"two tiers"``, ``"one tier"``): ``first`` (whether it ran
            first), ``resumed_from`` (the step before the restart's first new step), ``steps_lost``,
            ``resume_s`` (the restart's launch to the end of its first new step) and its parts
            ``join_s``, ``restore_s`` (``fit`` called to ``on_train_begin``), ``first_step_s``;
            ``history`` (the restarted run's ``History``: ``time``, ``job_time``, ``job_goodput``,
            ...); ``wall_s`` (both jobs, launch to exit).
        saves: the save pairs' seconds (``local_blocked``, ``local_write``, ``persistent_blocked``,
            ``persistent_write``), over every two-tier restart.
        state_mb: the checkpointed state (parameters and adam's moments), MB.
    """

    settings: dict[str, int]
    pairs: list[dict[str, dict[str, Any]]] = dataclasses.field(default_factory=list)
    saves: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    state_mb: float = 0.0


def _launch(args: list[str], timeout: float) -> tuple[int, list[dict[str, Any]], str, float, float]:
    """Run the worker on 2 processes x 4 devices: exit code, process 0's records, the output's tail,
    the launch's wall-clock start and its seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXDIST_")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    command = [
        *LAUNCH,
        "-n",
        "2",
        "--cpu-devices",
        "4",
        "--timeout",
        str(timeout),
        "--grace",
        "2",
        str(pathlib.Path(__file__).resolve()),
        "worker",
        *args,
    ]
    start, began = time.time(), time.perf_counter()
    proc = subprocess.run(
        command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 30
    )
    seconds = time.perf_counter() - began
    records = [
        json.loads(line.split(_MARK, 1)[1]) for line in proc.stdout.splitlines() if _MARK in line
    ]
    return proc.returncode, records, (proc.stdout + proc.stderr)[-3000:], start, seconds


def _side(name: str, s: Settings, directory: str, timeout: float) -> tuple[dict[str, Any], dict]:
    """One side: the job that loses process 1, then its restart; its figures and (two tiers) the
    saves'."""
    root = tempfile.mkdtemp(prefix=name.replace(" ", "-") + "-", dir=directory)
    ckpt, local = os.path.join(root, "ckpt"), os.path.join(root, "local-{process}")
    common = [
        ckpt,
        local,
        str(s.steps),
        str(s.width),
        f"persistent={s.persistent}",
        f"batch={s.batch}",
    ]
    if name == "two tiers":
        common.append(f"local={s.local}")
    try:
        code, _, tail, _, killed_s = _launch([*common, f"kill={s.kill}"], timeout)
        if code == 0:
            raise RuntimeError(f"{name}: the job meant to lose process 1 ended normally: {tail}")
        shutil.rmtree(
            local.replace("{process}", "1"), ignore_errors=True
        )  # 1 comes back on a fresh host
        extra = [f"saves={s.saves}"] if name == "two tiers" else []
        code, records, tail, start, resumed_s = _launch([*common, *extra], timeout)
        if code != 0:
            raise RuntimeError(f"{name}: the restarted job exited {code}: {tail}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    first = {r["event"]: r for r in reversed(records)}  # each event's first record
    step = first["step"]
    side = {
        "resumed_from": step["step"] - 1,
        "steps_lost": s.kill - (step["step"] - 1),
        "resume_s": step["t"] - start,
        "join_s": first["start"]["joined"] - start,
        "restore_s": first["begin"]["t"] - first["fit"]["t"],
        "first_step_s": step["t"] - first["begin"]["t"],
        "history": first["history"],
        "wall_s": killed_s + resumed_s,
    }
    return side, {k: v for k, v in first.get("saves", {}).items() if k != "event"}


def measure(s: Settings, directory: str | pathlib.Path, timeout: float = 240.0) -> Result:
    """``s.pairs`` pairs of both sides, in ``directory``; pair ``k`` runs two tiers first when ``k``
    is even."""
    result = Result(settings=dataclasses.asdict(s))
    for k in range(s.pairs):
        pair: dict[str, dict[str, Any]] = {}
        for position, name in enumerate(SIDES if k % 2 == 0 else SIDES[::-1]):
            side, saves = _side(name, s, os.fspath(directory), timeout)
            pair[name] = {"first": position == 0, **side}
            for key, values in saves.items():
                result.saves.setdefault(key, []).extend(values)
            result.state_mb = side["history"]["state_mb"]
        result.pairs.append(pair)
        print(
            f"[two-tier] pair {k}: "
            + json.dumps(
                {
                    n: {key: v for key, v in side.items() if key != "history"}
                    for n, side in pair.items()
                }
            ),
            file=sys.stderr,
            flush=True,
        )
    return result


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ratios(result: Result) -> dict[str, list[float]]:
    """Per pair, one tier / two tiers: steps lost, time to resume, restore seconds, job goodput."""

    def per(get: Any) -> list[float]:
        out = []
        for pair in result.pairs:
            one, two = get(pair["one tier"]), get(pair["two tiers"])
            out.append(one / two if two else float("inf"))
        return out

    return {
        "steps_lost": per(lambda p: p["steps_lost"]),
        "resume_s": per(lambda p: p["resume_s"]),
        "restore_s": per(lambda p: p["restore_s"]),
        "job_goodput": per(lambda p: p["history"]["job_goodput"]),
    }


def markdown(result: Result, machine: dict[str, Any]) -> str:
    """The row as markdown tables with the machine line (the suite's table style)."""
    s, v, m = result.settings, machine["versions"], machine

    def med(name: str, key: str) -> float:
        return _median([pair[name][key] for pair in result.pairs])

    def job(name: str, part: str | None) -> float:
        times = [pair[name]["history"]["job_time"] for pair in result.pairs]
        return _median([t.get(part, 0.0) if part else sum(t.values()) for t in times])

    def goodput(name: str) -> float:
        return _median([pair[name]["history"]["job_goodput"] for pair in result.pairs])

    width, size = s["width"], f"{result.state_mb:.0f} MB"
    lines = [
        f"# jaxdist two-tier checkpoint benchmark - {m['date'][:10]}, {m['backend']}, "
        "2 processes x 4 devices",
        "",
        f"- machine: {m['host_platform']}, {m['cpu_count']} CPU cores, python {m['python']}",
        f"- versions: jax {v['jax']}, jaxlib {v['jaxlib']}, flax {v['flax']}, optax {v['optax']}, "
        f"jaxdist {v['jaxdist']} (git {m['git_commit']}); orbax-checkpoint {m.get('orbax')}",
        f"- load average at start (1/5/15 min): {m['load_average_1_5_15']}",
        f"- job: `Trainer.fit` of a 784-{width}-{width}-10 MLP + adam ({size} of state), global "
        f"batch {s['batch']}, `ShardedStrategy()` (FSDP over the 8 devices of 2 processes, gloo), "
        f"{s['steps']} steps, persistent tier every {s['persistent']} steps; two tiers: local "
        f"every {s['local']}. Process 1 SIGKILLed after step {s['kill']}, its local directory "
        "deleted, the job restarted.",
        f"- {len(result.pairs)} pairs of sides, alternating order; medians over the pairs; ratio = "
        "one tier / two tiers, per pair (median). Time to resume = the restart's launch to the end "
        "of its first new step: join (processes, imports, gloo), then the start of `fit`, restore "
        "(`fit` called to `on_train_begin`: agreement, claim, restore), first step (its compile).",
        "",
        "| side | resumed from | steps lost | time to resume s | join s | restore s | first step s "
        "| job: steps / compile / checkpoint / restart / total s | job goodput |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in SIDES:
        parts = " / ".join(f"{job(name, part):.1f}" for part in ("steps", "compile", "checkpoint",
                                                                 "restart", None))
        lines.append(
            f"| {name} | {med(name, 'resumed_from'):g} | {med(name, 'steps_lost'):g} | "
            f"{med(name, 'resume_s'):.1f} | {med(name, 'join_s'):.1f} | "
            f"{med(name, 'restore_s'):.2f} | {med(name, 'first_step_s'):.1f} | {parts} | "
            f"{goodput(name):.3f} |"
        )
    r = {k: _median(v) for k, v in ratios(result).items()}
    lines.append(
        f"| ratio | | **{r['steps_lost']:.2f}** | {r['resume_s']:.2f} | | {r['restore_s']:.2f} | | "
        f"| {r['job_goodput']:.2f} |"
    )
    if result.saves:
        sv = {k: _median(v) for k, v in result.saves.items()}
        local = sv["local_blocked"] + sv["local_write"]
        persistent = sv["persistent_blocked"] + sv["persistent_write"]
        lines += [
            "",
            f"A save of the same {size} FSDP state: {len(result.saves['local_blocked'])} saves of "
            "each tier, alternating, after one untimed save of each (median seconds; both "
            "directories on this machine's disk).",
            "",
            "| save | loop waits s | background write s | total s |",
            "|---|---|---|---|",
            "| local: `LocalCheckpointer.save` (own + neighbour's shards, .npz) | "
            f"{sv['local_blocked']:.3f} | {sv['local_write']:.3f} | {local:.3f} |",
            "| persistent: `Checkpointer(async_save=True).save` (orbax) | "
            f"{sv['persistent_blocked']:.3f} | {sv['persistent_write']:.3f} | {persistent:.3f} |",
            f"| ratio persistent / local | {sv['persistent_blocked'] / sv['local_blocked']:.2f} | "
            f"{sv['persistent_write'] / sv['local_write']:.2f} | {persistent / local:.2f} |",
        ]
    return "\n".join([*lines, ""])


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.path.insert(0, str(ROOT))
    worker(
        sys.argv[2],
        sys.argv[3],
        int(sys.argv[4]),
        int(sys.argv[5]),
        dict(a.split("=", 1) for a in sys.argv[6:]),
    )
