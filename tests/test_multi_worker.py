"""MultiWorkerMirroredStrategy with real processes (2 x 4 CPU devices, gloo), the launcher, cluster
config."""

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from multiprocess_model import batches, init_state, train_step
from registry import launch_env

import jaxdist as jd
from jaxdist.job import detected_cluster, resolve_cluster
from jaxdist.launch import free_port, launch

HERE = Path(__file__).parent
ROOT = HERE.parent


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_processes_train_like_one_device(tmp_path):
    """Slow because of its 2-process job; started through ``python -m jaxdist.launch`` (the module
    entry point, which the other multi-process tests skip: `registry.LAUNCH`)."""
    out = tmp_path / "result.npz"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdist.launch", "-n", "2", "--cpu-devices", "4", "--timeout",
         "200",
         str(HERE / "multiprocess" / "train_worker.py"), str(out), str(tmp_path / "checkpoints")],
        env=launch_env(), capture_output=True, text=True, timeout=230,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "[0] process 0 done" in proc.stdout and "[1] process 1 done" in proc.stdout
    with np.load(out) as saved:  # closed here, not when the collector runs
        result = {name: saved[name] for name in saved.files}
    # The single-device reference, on the same global batches.
    state = init_state(jax.random.key(0))
    step = jax.jit(train_step)
    losses = []
    for batch in batches():
        state, loss = step(state, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state[0]):
        key = jax.tree_util.keystr(path)
        np.testing.assert_allclose(result[f"global/{key}"], leaf, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result[f"replica/{key}"], leaf, rtol=1e-5, atol=1e-6)
    # The checkpoint both processes wrote restores in this single process, onto another strategy.
    strategy = jd.OneDeviceStrategy()
    shapes = jax.eval_shape(init_state, jax.random.key(0))
    target = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes,
                          strategy.variable_shardings(shapes))
    ckpt = jd.training.Checkpointer(tmp_path / "checkpoints")
    restored, meta = ckpt.restore(target)
    ckpt.close()
    assert meta["step"] == 20
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_killed_worker_makes_the_survivor_fail_fast():
    """Slow because of its 2 processes and the survivor's wait for the dead peer's heartbeats (5 s
    timeout)."""
    address = f"127.0.0.1:{free_port()}"
    script = str(HERE / "multiprocess" / "killed_worker.py")
    env = launch_env(JAX_NUM_CPU_DEVICES="4")
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, script, address, str(i)], env=env,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        survivor_out, _ = procs[0].communicate(timeout=90)
        victim_out, _ = procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    elapsed = time.monotonic() - start
    assert procs[1].returncode == -9, victim_out[-2000:]
    assert procs[0].returncode != 0, survivor_out[-3000:]
    assert "process 0 in step loop" in survivor_out
    assert "another task died" in survivor_out or "unhealthy" in survivor_out, survivor_out[-3000:]
    assert elapsed < 60, f"the survivor took {elapsed:.0f} s to fail"


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_launcher_stops_the_others_when_one_fails(tmp_path):
    script = tmp_path / "worker.py"
    marker = tmp_path / "others_started"
    script.write_text(
        "import os, sys, time\n"
        "pid = int(os.environ['JAXDIST_PROCESS_ID'])\n"
        "print('hello from', pid, os.environ['JAXDIST_NUM_PROCESSES'], "
        "os.environ['JAXDIST_COORDINATOR_ADDRESS'])\nsys.stdout.flush()\n"
        "if pid == 1:\n"
        f"    while not os.path.exists({str(marker)!r}):\n"
        "        time.sleep(0.05)\n"
        "    sys.exit(3)\n"
        f"open({str(marker)!r} + str(pid), 'w').close()\n"
        f"other = {str(marker)!r} + ('2' if pid == 0 else '0')\n"
        "if os.path.exists(other):\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "time.sleep(600)\n"
    )
    lines = []

    class Sink:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    start = time.monotonic()
    code = launch([str(script)], 3, grace=2, out=Sink())
    text = "".join(lines)
    assert code == 3
    assert time.monotonic() - start < 30
    assert "[1] hello from 1 3 127.0.0.1:" in text and "[0] hello from 0 3" in text
    assert "[launch] process 1 exited with status 3; stopping the others" in text


@pytest.mark.multiprocess
def test_launcher_timeout_and_success(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text("print('fine')\n")
    with open(os.devnull, "w") as devnull:
        assert launch([str(ok)], 2, out=devnull) == 0
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(600)\n")
    with open(os.devnull, "w") as devnull:
        assert launch([str(slow)], 1, timeout=1, grace=1, out=devnull) == 124
    with pytest.raises(ValueError, match="num_processes=0 must be an int >= 1"):
        launch([str(ok)], 0)
    with pytest.raises(ValueError, match="command is empty"):
        launch([], 1)


def test_cluster_resolution(monkeypatch):
    for key in ("JAXDIST_COORDINATOR_ADDRESS", "JAXDIST_NUM_PROCESSES", "JAXDIST_PROCESS_ID"):
        monkeypatch.delenv(key, raising=False)
    assert resolve_cluster() is None
    assert resolve_cluster("10.0.0.1:1234", 4, 3) == ("10.0.0.1:1234", 4, 3)
    monkeypatch.setenv("JAXDIST_COORDINATOR_ADDRESS", "127.0.0.1:999")
    with pytest.raises(ValueError, match="JAXDIST_NUM_PROCESSES, JAXDIST_PROCESS_ID not set"):
        resolve_cluster()
    monkeypatch.setenv("JAXDIST_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXDIST_PROCESS_ID", "1")
    assert resolve_cluster() == ("127.0.0.1:999", 2, 1)
    monkeypatch.setenv("JAXDIST_PROCESS_ID", "x")
    with pytest.raises(ValueError, match="must be integers"):
        resolve_cluster()
    with pytest.raises(ValueError, match="num_processes, process_id missing"):
        resolve_cluster("127.0.0.1:1")
    with pytest.raises(ValueError, match=r"coordinator_address='nohost' .* must be 'host:port'"):
        resolve_cluster("nohost", 2, 0)
    with pytest.raises(ValueError, match=r"process_id=2 \(keyword arguments\) must be in \[0, 2\)"):
        resolve_cluster("h:1", 2, 2)
    with pytest.raises(ValueError, match="num_processes=0"):
        resolve_cluster("h:1", 0, 0)


def test_single_process_cluster():
    # a cluster of one: nothing to connect
    strategy = jd.MultiWorkerMirroredStrategy("127.0.0.1:1", 1, 0)
    assert strategy.num_hosts == 1 and strategy.num_replicas_in_sync == 8 and strategy.is_chief
    params = strategy.create_variables(init_state, jax.random.key(0))
    assert jax.tree.leaves(params)[0].sharding.is_fully_replicated


@pytest.mark.multiprocess
def test_created_after_computation_in_a_fresh_process():
    code = (
        "import jax, jax.numpy as jnp, jaxdist as jd\n"
        "jnp.ones(2).block_until_ready()\n"
        "try:\n"
        "    jd.MultiWorkerMirroredStrategy('127.0.0.1:1', 2, 0, initialization_timeout=5)\n"
        "except RuntimeError as e:\n"
        "    print('ERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=launch_env(), capture_output=True,
                         text=True, timeout=60)
    assert "must come before any JAX computation" in out.stdout, out.stdout + out.stderr


def test_an_unconnected_multi_process_job_is_an_error_not_a_strategy_per_process(monkeypatch):
    """The JAXDIST_* (or SLURM, ...) environment describes 2 processes that nothing connected: a
    strategy made now would span this process alone, so it says so and names the fix."""
    jax.devices()  # this process's backend runs: joining a cluster now is too late
    monkeypatch.setenv("JAXDIST_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("JAXDIST_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXDIST_PROCESS_ID", "0")
    assert detected_cluster() == ("JAXDIST_*", 2)
    with pytest.raises(RuntimeError,
                                           match=r"MirroredStrategy in a job of 2 processes "
                                                 r"\(JAXDIST_\* environment\), but "
                                           r"jax.distributed is not "
                                           r"initialized.*MultiWorkerMirroredStrategy"):
        jd.MirroredStrategy()
    # Sharded and TPU join the cluster themselves, which must come before any computation (it has
    # run here).
    for make in (jd.ShardedStrategy, jd.TPUStrategy):
        with pytest.raises(RuntimeError,
                                               match=r"must come before any JAX "
                                                     r"computation.*JAXDIST_\* variables "
                                               r"describes a job of several processes"):
            make()
    with pytest.raises(RuntimeError,
                       match=r"call jd.initialize_cluster\(\) at the top of the program"):
        jd.MirroredStrategy()
    monkeypatch.setenv("JAXDIST_NUM_PROCESSES", "1")  # a job of one process is no cluster
    assert detected_cluster() is None and jd.MirroredStrategy().num_replicas_in_sync == 8


def test_a_slurm_job_of_several_tasks_is_detected(monkeypatch):
    for key in ("JAXDIST_COORDINATOR_ADDRESS", "JAXDIST_NUM_PROCESSES", "JAXDIST_PROCESS_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "node[1-2]",
                       "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}.items():
        monkeypatch.setenv(key, value)
    assert detected_cluster() is None  # one task: this process is the job
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert detected_cluster() == ("Slurm", 4)
    with pytest.raises(RuntimeError, match=r"job of 4 processes \(Slurm environment\)"):
        jd.MirroredStrategy()


def test_a_single_host_tpu_vm_is_no_unconnected_job(monkeypatch):
    """JAX's TPU detector says yes on every TPU VM, one host included: that alone is no job of
    several processes (JAX connects pods by itself when a strategy joins its cluster)."""
    from jax._src.clusters import cloud_tpu_cluster

    monkeypatch.setattr(cloud_tpu_cluster.GceTpuCluster, "is_env_present",
                        classmethod(lambda cls: True))
    assert detected_cluster() is None and jd.MirroredStrategy().num_replicas_in_sync == 8


def test_launcher_command_line_errors(capsys):
    from jaxdist.launch import main

    with pytest.raises(SystemExit):
        main(["-n", "0", "x.py"])
    assert "-n/--num-processes=0 must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["-n", "2"])
    assert "no script given" in capsys.readouterr().err


class _FakeEnv:
    """A JAX cluster detector stand-in: present or not, as set."""

    opt_in_only_method = False
    present = False

    @classmethod
    def is_env_present(cls) -> bool:
        return cls.present


@pytest.mark.parametrize(("present", "started", "connects"), [
    (False, False, False),  # no detector finds its environment: this process alone
    (True, False, True),  # one does (a TPU pod, Kubernetes): JAX connects with its detection
    (True, True, False),  # JAX already runs here: too late to connect, this process alone
])
def test_jax_detection_connects_only_where_a_detector_finds_its_environment(
        monkeypatch, present, started, connects):
    """Decided from JAX's detectors and whether its backend runs, never from an error's words."""
    from jaxdist.job import _join

    calls = []
    monkeypatch.setattr(_FakeEnv, "present", present)
    monkeypatch.setattr(_join._ClusterEnv, "_cluster_types", [_FakeEnv])
    monkeypatch.setattr(_join, "_backends_started", lambda: started)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    _join._jax_detection({"initialization_timeout": 7})
    assert calls == ([{"initialization_timeout": 7}] if connects else [])
