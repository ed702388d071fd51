"""Cluster operations: processes that compiled different programs, a stuck process, the compilation
cache.

Real processes (2 x 4 CPU devices, gloo) where it says so; every wait is bounded.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from registry import launch_env

import jaxdist as jd
from jaxdist.launch import free_port

HERE = Path(__file__).parent
ROOT = HERE.parent


def _env(**extra):
    return launch_env(**{"JAX_NUM_CPU_DEVICES": "4", **extra})


def _two(script, *args, env=None, timeout=120):
    """Start ``script address pid *args`` twice; return [(returncode, stdout then stderr)] (both
    killed at the timeout). The streams are read apart: gloo writes its lines to stderr a piece at a
    time, and in a shared pipe one could land inside a printed line."""
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), address, str(i), *map(str, args)],
                              env=env or _env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    out = []
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            text, errors = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, text + errors))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_learning_rate_that_differs_on_one_process_is_an_error_on_both_before_the_first_step():
    """Slow because it starts 2 processes (imports, gloo); they end before the first step."""
    results = _two(HERE / "multiprocess" / "mismatch_worker.py")
    for pid, (code, text) in enumerate(results):
        assert code == 3, f"process {pid} exited {code}:\n{text[-3000:]}"
        assert "step 1" not in text  # nothing ran
        line = next(line for line in text.splitlines() if line.startswith("MISMATCH"))
        assert "process(es) [1] differ from process 0" in line and "learning rate" in line, line


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_compilation_cache_makes_a_second_start_compile_nothing(tmp_path):
    """jd.configure_compilation_cache: the first start compiles and writes every program; a restart
    of the same job loads every one of them (cache hits == compile requests, no miss). Slow because
    it starts two Pythons one after the other (the second needs the first's cache)."""

    def start(cache):
        out = subprocess.run([sys.executable, str(HERE / "multiprocess" / "cache_worker.py"),
                              str(cache)],
                             env=_env(JAX_NUM_CPU_DEVICES="8"), capture_output=True, text=True,
                             timeout=100)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = start(tmp_path / "cache"), start(tmp_path / "cache")
    requests = first["events"]["compile_requests_use_cache"]
    # everything compiled, and written
    assert requests >= 2 and first["events"].get("cache_misses") == requests
    assert second["events"]["compile_requests_use_cache"] == requests
    assert second["events"].get("cache_hits") == requests and "cache_misses" not in second["events"]
    print(f"time to first step: {first['first_step_s']:.2f} s cold, {second['first_step_s']:.2f} s "
          "from the cache")
    with pytest.raises(ValueError,
                       match=r"min_compile_seconds=-1 must be a number of seconds >= 0"):
        jd.configure_compilation_cache(tmp_path, min_compile_seconds=-1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"is a file: pass a directory"):
        jd.configure_compilation_cache(tmp_path / "file")


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_process_that_stalls_trips_the_step_watchdog_on_every_process():
    """Process 1 stalls in a callback after step 3 (alive: its heartbeats go on). Each process's
    watchdog prints why and every thread's stack and exits 124 within step_timeout + 30 s of the
    stall. Slow because of its 2 processes (imports, gloo, a compile) and the step_timeout it waits
    out (3 s, once 5: steps 2 and 3 of a dense layer take milliseconds; the first step has its own
    600 s allowance.)"""
    timeout = 3
    started = time.monotonic()
    results = _two(HERE / "multiprocess" / "stall_worker.py", timeout, timeout=120)
    elapsed = time.monotonic() - started
    for pid, (code, text) in enumerate(results):
        assert code == 124, f"process {pid} exited {code}:\n{text[-3000:]}"
        assert re.search(rf"no step finished in {timeout} s after step \d+ "
                         rf"\(step_timeout={timeout} s\): a peer may "
                         "be stuck or dead", text), text[-3000:]
        assert "Thread 0x" in text and "most recent call first" in text  # faulthandler's stacks
        assert "fit returned" not in text
    assert "stalling" in results[1][1]
    print(f"both processes exited {elapsed:.1f} s after start (step_timeout {timeout} s)")


def test_watchdog_and_step_timeout_arguments_are_checked():
    from jaxdist.training.loop import FitOptions

    with pytest.raises(ValueError, match=r"timeout=0 must be a number of seconds > 0"):
        jd.training.Watchdog(0)
    with pytest.raises(ValueError, match=r"first_timeout='x' must be a number of seconds > 0"):
        jd.training.Watchdog(1, first_timeout="x")
    with pytest.raises(ValueError, match=r"exit_code=0 must be a non-zero int"):
        jd.training.Watchdog(1, exit_code=0)
    with pytest.raises(ValueError,
                       match=r"step_timeout=-1 must be a number of seconds > 0, or None"):
        FitOptions(steps=1, step_timeout=-1)
    dog = jd.training.Watchdog(5)
    assert dog.first_timeout == 600.0  # the first step (compilation) gets its own allowance


def test_program_agreement_names_a_peer_that_never_arrives(monkeypatch):
    """The coordination service's get times out: the error names the missing process, never a
    wait."""
    from jaxdist.strategies.compile import _agreement as agreement

    class Client:
        def __init__(self):
            self.store = {}

        def key_value_set(self, key, value):
            self.store[key] = value

        def blocking_key_value_get(self, key, timeout_ms):
            if key not in self.store:
                raise RuntimeError("DEADLINE_EXCEEDED: timed out")
            return self.store[key]

    client = Client()
    monkeypatch.setattr(agreement.jax, "process_count", lambda: 2)
    monkeypatch.setattr(agreement.jax, "process_index", lambda: 0)
    monkeypatch.setattr(agreement._distributed.global_state, "client", client)
    with pytest.raises(agreement.ProgramMismatchError, match=r"process 1 did not reach program \d+ "
                                                             r"\('step'\) "
                                                             r"within 1 s: it is stuck, dead, or "
                                                             r"running another"):
        agreement.agree("step", "ab" * 32, timeout=1)
    n = int(next(iter(client.store)).split("/")[2]) + 1
    # process 1 arrives first with another one
    client.store[f"jaxdist/program/{n}/1"] = "cd" * 32 + " step"
    with pytest.raises(agreement.ProgramMismatchError,
                       match=r"process\(es\) \[1\] differ from process 0"):
        agreement.agree("step", "ab" * 32, timeout=1)


_HELD = """
import ctypes, sys, time
from jaxdist.training.loop import Watchdog
dog = Watchdog({timeout}, first_timeout={timeout}).start()
dog.beat()
print(f"holding {{time.monotonic()}}", flush=True)
ctypes.pythonapi.usleep(60_000_000)  # the C library's usleep, called with the interpreter lock held: no thread runs
print("not reached", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_watchdog_dumps_and_exits_on_time_while_the_main_thread_holds_the_interpreter_lock_in_c():
    """The main thread sleeps 60 s inside a C call that keeps the interpreter lock, so the
    watchdog's Python thread cannot run: its backstop writes every thread's stack within 2x the
    timeout and exits 124. Slow because it starts a Python (imports jaxdist) and waits out the 2 s
    timeout and the backstop's slack."""
    timeout = 2.0
    proc = subprocess.Popen([sys.executable, "-c", _HELD.format(timeout=timeout)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, held, dumped = [], None, None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("holding "):
                # CLOCK_MONOTONIC: one clock for every process of the machine
                held = float(line.split()[1])
            if line.startswith("Timeout (") and dumped is None:
                # read late, if anything: the dump came no later than this
                dumped = time.monotonic()
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
    text = "".join(lines)
    assert code == 124, f"exited {code}:\n{text[-3000:]}"
    assert held is not None and dumped is not None, text[-3000:]
    assert ("Thread 0x" in text and "most recent call first" in text
            and 'File "<string>", line 7' in text), text
    assert "not reached" not in text
    assert dumped - held < 2 * timeout, (
        f"the stacks came {dumped - held:.2f} s after the last step (timeout {timeout})"
    )


_HELD_IN_FIT = """
import ctypes, time
import flax.linen as nn, numpy as np, optax
import jaxdist as jd


class Hold(jd.training.Callback):
    def on_step_end(self, trainer, step, logs):
        if step == 2:
            print(f"holding {{time.monotonic()}}", flush=True)
            ctypes.pythonapi.usleep(60_000_000)  # the interpreter lock held in C: no Python thread runs


data = [(np.ones((8, 2), np.float32), np.ones(8, np.float32))] * 8
trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1), optax.sgd(0.1),
                              lambda out, y: ((out[:, 0] - y) ** 2).mean())
trainer.fit(data, steps=8, step_timeout={timeout}, callbacks=[Hold()], verbose=0)
print("not reached", flush=True)
"""


# a Python of its own (imports jaxdist, compiles a step), then the 2 s timeout and its slack
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_in_fit_the_backstop_covers_the_second_step_and_says_why_before_the_stacks():
    """step_timeout=2 with the first step's allowance left at its default (600 s): a callback holds
    the interpreter lock in C after step 2. The backstop (armed at the end of the first step) says
    jaxdist's reason, then the stacks, within 2x the timeout, and exits 124 (it slept through the
    first 600 s before)."""
    timeout = 2.0
    proc = subprocess.Popen([sys.executable, "-c", _HELD_IN_FIT.format(timeout=timeout)],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, held, said = [], None, None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("holding "):
                held = float(line.split()[1])
            if "[jaxdist watchdog]" in line and said is None:
                said = time.monotonic()
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
    text = "".join(lines)
    assert code == 124, f"exited {code}:\n{text[-3000:]}"
    assert held is not None and said is not None, text[-3000:]
    assert said - held < 2 * timeout, (
        f"the reason came {said - held:.2f} s after step 2 (timeout {timeout})"
    )
    (reason,) = [line for line in lines if "[jaxdist watchdog]" in line]
    # The step the watchdog saw last: the first step's end armed the backstop; step 2's came too
    # soon after it for the watchdog's thread to re-arm (it does every slack / 2 s), and the steps
    # never arm it themselves.
    assert re.search(r"no step finished in 2\.5 s or more after step [12] \(the last one the "
                     r"watchdog saw; "
                     r"step_timeout=2 s\), and the watchdog's thread could not run", reason), reason
    assert "Exiting with status 124" in reason
    assert text.index("[jaxdist watchdog]") < text.index("Timeout (") < text.index("Thread 0x"), (
        text[-3000:]
    )
    assert "not reached" not in text
