"""``python -m jaxdist.launch -n 2 script.py args...``: run N processes of one program on this
machine.

For development and tests. Each process gets the cluster environment that
`MultiWorkerMirroredStrategy` reads (``JAXDIST_COORDINATOR_ADDRESS`` on a free 127.0.0.1 port,
``JAXDIST_NUM_PROCESSES``, ``JAXDIST_PROCESS_ID``); ``--cpu-devices K`` also gives each process K
simulated CPU devices.

Output (stdout and stderr, each through a pipe of its own) is streamed line by line with a ``[i]``
prefix, without the lines gloo (JAX's CPU collectives) prints as its ranks connect ("[Gloo] Rank 0
is connected to 3 peer ranks. ..."; ``--verbose`` shows them). When one process fails, the others
are stopped (SIGTERM and SIGCONT, then SIGKILL after ``--grace`` seconds) and the launcher exits
with the failed process's code; Ctrl-C / SIGTERM to the launcher is passed on to every process. A
job that fails ends with a summary: how each process ended (its status or signal, stopped, stopped
by the launcher), the last step of ``fit`` each reached and what jaxdist said, then the newest
checkpoint and the step a restart resumes from (each process's ``fit`` leaves its progress in
``JAXDIST_LAUNCH_DIR``, a directory the launcher makes).

On several machines use the cluster's own tools instead (SLURM's ``srun``, a TPU pod's ``gcloud ...
ssh --worker=all``, a Kubernetes JobSet / indexed Job): JAX detects SLURM, Open MPI and TPU pods by
itself, and elsewhere set the three ``JAXDIST_*`` variables per process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

__all__ = ["free_port", "launch", "main"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now.

    Examples:
        >>> 1024 <= free_port() <= 65535
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What gloo writes to the processes' output as its ranks connect, one line per rank.
_GLOO_LINE = b"[Gloo] "
# How jaxdist starts what it says about a job's end (`jaxdist.job`): the first such line of a
# process is its reason, repeated in the summary.
_JAXDIST_LINE = "[jaxdist] "


def _pump(stream, prefix: str, out, verbose: bool = True, said: list | None = None) -> None:
    for line in iter(stream.readline, b""):
        if not verbose and line.startswith(_GLOO_LINE):
            continue
        text = line.decode(errors="replace")
        if said is not None and not said and text.startswith(_JAXDIST_LINE):
            said.append(text[len(_JAXDIST_LINE):].split("; last steps")[0].strip())
        out.write(prefix + text)
        out.flush()
    stream.close()


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, SIGTSTP; Linux's /proc; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "Tt"
    except (OSError, IndexError):
        return False


def _ended(code: int | None, stopped: bool, ours: bool) -> str:
    if code is None:
        return "still running"
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    if stopped:
        return f"was stopped (SIGSTOP), then {how} by the launcher"
    # else it ended by itself meanwhile (an abort)
    by_us = ours and -code in (signal.SIGTERM, signal.SIGKILL)
    return f"{how} (stopped by the launcher)" if by_us else how


def _summary(procs: list, progress_dir: str, said: list, stopped: set, ours: set) -> list[str]:
    """The lines of a failed job's summary: how each process ended, at which step and what jaxdist
    said there, then the newest checkpoint and the step a restart resumes from."""
    lines, progress = [], {}
    for i, p in enumerate(procs):
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(progress_dir, f"{i}.json")) as f:
                progress[i] = json.load(f)
        step = f" at step {progress[i]['step']}" if i in progress else ""
        words = f"; it said: {said[i][0]}" if said[i] else ""
        lines.append(f"[launch] process {i} {_ended(p.returncode, i in stopped, i in ours)}{step}"
                     f"{words}")
    if progress:
        latest = progress.get(0) or next(iter(progress.values()))
        checkpoint, where = latest.get("checkpoint"), latest.get("checkpoint_dir")
        if checkpoint is not None:
            lines.append(f"[launch] the newest checkpoint is step {checkpoint} (in {where}): "
                         f"restart the job to resume from step {checkpoint}")
        elif where:
            lines.append(f"[launch] no checkpoint was complete in {where}: a restart starts over "
                         "from step 0")
        else:
            lines.append("[launch] fit had no checkpoint_dir: a restart starts over from step 0")
    return lines


def launch(command: Sequence[str], num_processes: int, cpu_devices: int | None = None,
           timeout: float | None = None, grace: float = 10.0, out=None,
           verbose: bool = False) -> int:
    """Run ``command`` (argv after the Python interpreter) as ``num_processes`` processes of a job.

    Args:
        command: e.g. ``["train.py", "--steps", "10"]`` or ``["-m", "pkg.train"]``.
        num_processes: how many processes (>= 1).
        cpu_devices: simulated CPU devices per process (sets ``JAX_NUM_CPU_DEVICES``,
            ``JAX_PLATFORMS=cpu``).
        timeout: stop everything and return 124 after this many seconds.
        grace: seconds between SIGTERM and SIGKILL when stopping processes.
        out: where to write the prefixed output (default: stdout).
        verbose: also pass on the lines gloo prints as its ranks connect (``[Gloo] Rank i is
            connected to ...``).

    Returns:
        0 when every process exits 0; else the first failing process's exit code (124 on timeout).

    Raises:
        ValueError: for ``num_processes`` < 1 or an empty command.

    Examples:
        >>> import io, pathlib, tempfile
        >>> script = pathlib.Path(tempfile.mkdtemp()) / "hello.py"
        >>> _ = script.write_text("import os; print('process', os.environ['JAXDIST_PROCESS_ID'])")
        >>> out = io.StringIO()
        >>> launch([str(script)], 2, out=out), sorted(out.getvalue().splitlines())
        (0, ['[0] process 0', '[1] process 1'])
    """
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r} must be an int >= 1.")
    if not command:
        raise ValueError("command is empty: pass the script (and its arguments) to run.")
    out = out or sys.stdout
    progress_dir = tempfile.mkdtemp(prefix="jaxdist-launch-")
    env = dict(os.environ, JAXDIST_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
               JAXDIST_NUM_PROCESSES=str(num_processes), PYTHONUNBUFFERED="1",
               JAXDIST_LAUNCH_DIR=progress_dir)
    if cpu_devices is not None:
        env.update(JAX_NUM_CPU_DEVICES=str(cpu_devices), JAX_PLATFORMS="cpu")
    procs, pumps, said, stopped, ours = [], [], [[] for _ in range(num_processes)], set(), set()
    for i in range(num_processes):
        env_i = dict(env, JAXDIST_PROCESS_ID=str(i))
        # One pipe per stream: gloo writes its lines to stderr a piece at a time, so in a pipe
        # shared with stdout a printed line could land inside one of them (and be dropped with it).
        p = subprocess.Popen([sys.executable, *command], env=env_i, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
        procs.append(p)
        for stream in (p.stdout, p.stderr):
            pumps.append(threading.Thread(target=_pump, daemon=True,
                                          args=(stream, f"[{i}] ", out, verbose, said[i])))
            pumps[-1].start()

    def stop(signum=signal.SIGTERM):
        for i, p in enumerate(procs):
            if p.poll() is None:
                ours.add(i)
                if _stopped(p.pid):
                    stopped.add(i)
                with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                    os.killpg(p.pid, signum)
                    os.killpg(p.pid, signal.SIGCONT)  # a stopped process takes its SIGTERM now
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread: no handler to install
            previous[sig] = signal.signal(sig, lambda s, f: (stop(s), sys.exit(128 + s)))
    start = time.monotonic()
    code = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                out.write(f"[launch] process {i} {_ended(code, False, False)}; stopping the "
                          "others\n")
                out.flush()
                stop()
                break
            if all(c == 0 for c in codes):
                break
            if timeout is not None and time.monotonic() - start > timeout:
                out.write(f"[launch] timed out after {timeout:g} s; stopping all processes\n")
                out.flush()
                stop()
                code = 124
                break
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for t in pumps:
            t.join(timeout=5)
        if code != 0:
            out.write("".join(line + "\n"
                              for line in _summary(procs, progress_dir, said, stopped, ours)))
            out.flush()
        shutil.rmtree(progress_dir, ignore_errors=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m jaxdist.launch -n N [--cpu-devices K] [--verbose]
    script.py args...``.

    Returns:
        The exit status (see `launch`; a process killed by signal N: 128 + N).

    Examples:
        >>> import pathlib, tempfile
        >>> script = pathlib.Path(tempfile.mkdtemp()) / "ok.py"
        >>> _ = script.write_text("pass")
        >>> main(["-n", "2", str(script)])
        0
    """
    parser = argparse.ArgumentParser(prog="python -m jaxdist.launch",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--num-processes", type=int, required=True, help="processes to start")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="simulated CPU devices per process")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop everything after this many seconds")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--verbose", action="store_true",
                        help="also show the [Gloo] lines the processes print as they connect")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="script.py args... (or -m module args...)")
    args = parser.parse_args(argv)
    if args.num_processes < 1:
        parser.error(f"-n/--num-processes={args.num_processes} must be >= 1")
    if not args.command:
        parser.error("no script given: python -m jaxdist.launch -n 2 train.py [args...]")
    code = launch(args.command, args.num_processes, args.cpu_devices, args.timeout, args.grace,
                  verbose=args.verbose)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says it


if __name__ == "__main__":
    sys.exit(main())
