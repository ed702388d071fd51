"""What a job's coordination costs as its processes grow (the "A plan for 1,000 hosts" guide).

``python -m benchmarks.coordination [--out DIR] [--processes 2,4,8] [--rounds N] [--smoke]``

For each process count N, one job of N processes with one CPU device each (``python -m
jaxdist.launch -n N --cpu-devices 1``) times, through the job's key-value store (the coordination
service that process 0 hosts; what `jaxdist.job` uses):

* ``exchange``: one `jaxdist.job.exchange` of a short value (``fit``'s start agreement, the
  checkpoint directory's check, the end of the data use it): each process sets one key and reads
  every process's.
* ``tiers``: the two tiers' agreement at a restart (`LocalCheckpointer.restore`): an exchange of
  each process's list of local steps (two steps, the real record format), then `decide` over all of
  them.
* ``beat``: one round of the failure checks' beats (`jaxdist.job.FailureMonitor` in ``fit``), every
  process at once: set its own beat, read every process's beats with one ``key_value_dir_get``; and
  ``poll``, one read of the failure key (each process, every `POLL_SECONDS`).
* ``stragglers``: one log window of the straggler figures (`HostTimes`): every process posts its
  figures, process 0 reads and forgets every other's.

Each figure is the median over ``rounds`` rounds (the slowest process's round for the collective
ones: every process takes part, and the job waits for the last). The checkpoint claim is not timed:
it is one file, written by process 0 only, touched every 10 s, whatever N is. A power law (ms = a
N^k, least squares on the logarithms) is fitted to each figure over the process counts and evaluated
at N = 1,000: EXTRAPOLATED, not measured (and on this machine the processes share 2 cores, so a
round's time grows with N for that reason too; the coordinator's own requests are counted per round
besides). Writes ``<date>-<backend>-coordination.md`` and ``.json`` under ``--out``.

Also the worker: ``python benchmarks/coordination.py worker ROUNDS``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

__all__ = ["FIGURES", "fit_power", "main", "markdown", "worker"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAUNCH = [sys.executable, "-P", str(ROOT / "jaxdist" / "launch.py")]  # as benchmarks.multiproc's
RESULTS = ROOT / "benchmarks" / "results"
_MARK = "COORDINATION "
FIGURES = ("exchange", "tiers", "beat", "poll", "stragglers")
HOSTS = 1000
REQUESTS = {  # the coordinator's requests per round of each figure, for N processes
    "exchange": lambda n: n + n * n,  # each process: one set, one get per process
    "tiers": lambda n: n + n * n,
    "beat": lambda n: 3 * n,  # each: set, read every beat, wait on its goodbye key
    "poll": lambda n: n,
    "stragglers": lambda n: n + 2 * (n - 1),  # each posts; process 0 reads and forgets each other's
}


def _records(me: int, count: int) -> dict[str, Any]:
    """What `LocalCheckpointer.restore` exchanges: this process's two kept local steps (written by
    one run: its token is the job's) and its own run token."""
    base = {"processes": count, "identity": "0" * 16, "layout": "1" * 16, "run": "2" * 32}
    steps = [dict(base, step=s, process=me, peer=(me + 1) % count) for s in (12, 14)]
    return {"records": steps, "run": uuid.uuid4().hex}


def worker(rounds: int) -> None:
    """One process of the job: time each figure ``rounds`` times; process 0 prints the results."""
    import jaxdist as jd

    jd.initialize_cluster()
    import jax

    from jaxdist.job import _failure, exchange, forget, post, read
    from jaxdist.training.checkpoints._local import decide

    client, me, count = _failure._client(), jax.process_index(), jax.process_count()
    seconds: dict[str, list[float]] = {name: [] for name in FIGURES}
    sizes: dict[str, int] = {}
    beat = {"step": 1200, "checkpoint": 1000, "directory": "/mnt/shared/checkpoints/run-0042"}

    def timed(name: str, fn: Any) -> Any:
        began = time.perf_counter()
        out = fn()
        seconds[name].append(time.perf_counter() - began)
        return out

    for r in range(rounds):
        exchange("round", str(r), 60.0)  # everyone starts each round together
        timed("exchange", lambda: exchange("bench", "x" * 64, 60.0))

        mine = json.dumps(_records(me, count))
        sizes["tiers"] = len(mine)

        def agree(mine: str = mine) -> Any:
            everyone = [json.loads(v) for v in exchange("tiers", mine, 60.0)]
            return decide([e["records"] for e in everyone], identity="0" * 16, layout="1" * 16,
                          persistent_step=10)

        assert timed("tiers", agree)[0] == 14

        exchange("beats", "", 60.0)
        prefix = f"bench/beats/{r}/"
        value = json.dumps({"beat": r, **beat})
        sizes["beat"] = len(f"{prefix}{me}") + len(value)  # one entry of the read, key and value

        def one_beat(prefix: str = prefix, value: str = value) -> list:
            client.key_value_set(f"{prefix}{me}", value, allow_overwrite=True)
            return client.key_value_dir_get(prefix)

        entries = timed("beat", one_beat)
        sizes["beat_read"] = sum(len(k) + len(v) for k, v in entries)

        def poll() -> None:
            try:
                client.key_value_try_get("bench/failure")
            except Exception:  # not there: no failure (what the monitor sees every POLL_SECONDS)
                pass

        timed("poll", poll)

        exchange("windows", "", 60.0)
        figures = json.dumps({"step_s": 0.123456, "input_s": 0.001234, "host": f"host-{me:04d}"})
        sizes["stragglers"] = len(figures)

        def window(r: int = r, figures: str = figures) -> None:
            post(f"bench/hosts/{r}/{me}", figures)
            if me == 0:
                for pid in range(1, count):
                    read(f"bench/hosts/{r}/{pid}", 60.0)
                    forget(f"bench/hosts/{r}/{pid}")

        timed("stragglers", window)
    # the slowest process's rounds for the collective figures (the job waits for the last)
    everyone = [json.loads(v) for v in exchange("results", json.dumps(seconds), 60.0)]
    if me == 0:
        out = {name: [max(e[name][r] for e in everyone) for r in range(rounds)]
               for name in ("exchange", "tiers", "beat")}
        out.update(poll=seconds["poll"], stragglers=seconds["stragglers"])
        print(_MARK + json.dumps({"processes": count, "seconds": out, "bytes": sizes}), flush=True)


def _job(processes: int, rounds: int, timeout: float = 300.0) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXDIST_")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    command = [*LAUNCH, "-n", str(processes), "--cpu-devices", "1",
               "--timeout", str(timeout), str(pathlib.Path(__file__).resolve()), "worker",
               str(rounds)]
    proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout + 30)
    for line in proc.stdout.splitlines():
        if _MARK in line:
            return json.loads(line.split(_MARK, 1)[1])
    raise RuntimeError(f"{processes} processes exited {proc.returncode}: "
                       f"{(proc.stdout + proc.stderr)[-2000:]}")


def fit_power(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares on the logarithms, ``y = a x ** k``: ``(a, k)`` (``k`` 0 for a single point).

    Examples:
        >>> a, k = fit_power([2, 4, 8], [2.0, 8.0, 32.0])
        >>> round(a, 6), round(k, 6)
        (0.5, 2.0)
    """
    if len(xs) < 2:
        return float(ys[0]), 0.0
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    covariance = sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True))
    k = covariance / sum((x - mx) ** 2 for x in lx)
    return math.exp(my - k * mx), k


def _load(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The coordinator's load per second from the beats and polls (rates from `jaxdist.job`'s
    constants), measured where N was measured and extrapolated at `HOSTS`."""
    from jaxdist.job import BEAT_SECONDS, POLL_SECONDS

    def rates(n: int, beat_bytes: float) -> dict[str, float]:
        # a beat: set its own, read every beat, wait on its goodbye key (held until the next beat)
        return {"requests_per_s": n * 3 / BEAT_SECONDS + n / POLL_SECONDS,
                "read_bytes_per_s": n * n * beat_bytes / BEAT_SECONDS}

    entry = statistics.fmean(r["bytes"]["beat"] for r in results)
    return {"beat_entry_bytes": entry, "beat_seconds": BEAT_SECONDS, "poll_seconds": POLL_SECONDS,
            "measured": {r["processes"]: rates(r["processes"], entry) for r in results},
            "extrapolated": rates(HOSTS, entry)}


def markdown(results: list[dict[str, Any]], machine: dict[str, Any]) -> str:
    """The table: each figure's median per process count, its fitted line and its value at
    `HOSTS`."""
    counts = [r["processes"] for r in results]
    v = machine["versions"]
    lines = [
        f"# jaxdist coordination costs - {machine['date'][:10]}, {machine['backend']}, "
        f"{', '.join(map(str, counts))} processes x 1 device",
        "",
        f"- machine: {machine['host_platform']}, {machine['cpu_count']} CPU cores (every process "
        f"shares them), python {machine['python']}",
        f"- versions: jax {v['jax']}, jaxlib {v['jaxlib']}, jaxdist {v['jaxdist']} "
        f"(git {machine['git_commit']})",
        f"- load average at start (1/5/15 min): {machine['load_average_1_5_15']}",
        f"- milliseconds per round, median of {len(results[0]['seconds']['exchange'])} rounds; "
        f"fit: ms = a N^k (least squares on the logarithms); the N = {HOSTS:,} column is "
        "EXTRAPOLATED from the fit.",
        "",
        "| figure | " + " | ".join(f"N = {n} ms" for n in counts)
        + f" | fit a N^k (ms) | N = {HOSTS:,} ms (extrapolated) | requests per round, N = "
        f"{max(counts)} / {HOSTS:,} |",
        "|---|" + "---|" * (len(counts) + 3),
    ]
    for name in FIGURES:
        ms = [1e3 * statistics.median(r["seconds"][name]) for r in results]
        a, k = fit_power(counts, ms)
        lines.append(f"| {name} | " + " | ".join(f"{x:.2f}" for x in ms)
                     + f" | {a:.3f} N^{k:.2f} | {a * HOSTS ** k:,.0f} | "
                     f"{REQUESTS[name](max(counts)):,} / {REQUESTS[name](HOSTS):,} |")
    load = _load(results)
    lines += [
        "",
        f"The coordinator's load from the failure checks alone (every process beats every "
        f"{load['beat_seconds']:g} s: 3 requests, one of them reading every beat of "
        f"{load['beat_entry_bytes']:.0f} bytes; and polls every {load['poll_seconds']:g} s):",
        "",
        "| N | requests/s | beat bytes read/s |",
        "|---|---|---|",
    ]
    for n, rate in [*load["measured"].items(), (f"{HOSTS:,} (extrapolated)", load["extrapolated"])]:
        lines.append(f"| {n} | {rate['requests_per_s']:.0f} | {rate['read_bytes_per_s']:,.0f} |")
    return "\n".join([*lines, ""])


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: one job per process count, then the table (``.md`` and ``.json`` under
    ``--out``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.coordination",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help=f"results folder ({RESULTS})")
    parser.add_argument("--processes", default="2,4,8", help="process counts (default 2,4,8)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds per figure (default 30)")
    parser.add_argument("--smoke", action="store_true", help="2 processes, 2 rounds: does it run?")
    args = parser.parse_args(argv)
    counts = [2] if args.smoke else [int(n) for n in args.processes.split(",") if n]
    rounds = 2 if args.smoke else args.rounds
    if rounds < 1 or any(n < 2 for n in counts):
        parser.error("--rounds must be >= 1 and every process count >= 2")
    import jax

    from benchmarks.report import machine_info, write_table

    machine = machine_info(jax.devices())
    results = []
    for n in counts:
        results.append(_job(n, rounds))
        print(f"[coordination] {n} processes: "
              + json.dumps({k: statistics.median(v) for k, v in results[-1]["seconds"].items()}),
              file=sys.stderr, flush=True)
    table = markdown(results, machine)
    stem = f"{machine['date'][:10]}-{machine['backend']}-coordination"
    stem += "-smoke" if args.smoke else ""
    data = {"machine": machine, "results": results, "load": _load(results), "hosts": HOSTS}
    write_table(args.out, stem, table, data)
    print(table)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.path.insert(0, str(ROOT))
    worker(int(sys.argv[2]))
elif __name__ == "__main__":
    sys.exit(main())
