"""The cluster recipes of ``examples/cluster``: the SLURM batch script's data-parallel command
trains under a simulated SLURM job (2 processes x 4 CPU devices, SLURM's variables and nothing else)
exactly as one device does, its HSDP command asks for the mesh of the nodes it books, and the
Kubernetes manifest sets what jaxdist reads and runs what the example accepts.

The commands come from the recipes themselves, so a recipe that stops working breaks these tests."""

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from registry import load_char_lm

from jaxdist.job import CLUSTER_VARIABLES

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "examples" / "cluster"
SBATCH = CLUSTER / "slurm_char_lm.sbatch"
MANIFEST = CLUSTER / "kubernetes" / "char_lm.yaml"
# A tiny run: the recipes' sizes are for GPUs.
SMALL = {"--steps": "6", "--batch-size": "16", "--seq-len": "16", "--d-model": "32",
         "--layers": "1", "--val-batches": "2", "--sample-length": "4", "--log-every": "1"}
SLURM_PORTS = (65535 - 2**12 + 1, 65535)  # JAX's SlurmCluster: port = SLURM_JOB_ID % 4096 + 61440


lm = load_char_lm("char_lm_recipes")


# -------------------------------------------------------------------------------------------- SLURM
def _srun_commands() -> dict[str, list[str]]:
    """``{case label: the srun line's words}`` of the batch script's ``case`` arms (continuations
    joined)."""
    text = SBATCH.read_text().replace("\\\n", " ")
    commands, label = {}, None
    for line in text.splitlines():
        if match := re.match(r"^\s*([a-z_]+)\)", line):
            label = match.group(1)
        elif line.strip().startswith("srun "):
            assert label is not None, (
                f"{SBATCH.name}: an srun line outside the case arms: {line.strip()}"
            )
            commands[label] = shlex.split(line, comments=True)
    return commands


def _sbatch_options() -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SBATCH.read_text(), re.M))


def _program(srun: list[str], variables: dict[str, str]) -> list[str]:
    """The command srun runs on every task: srun's own options dropped, ``python`` this interpreter,
    the shell's ``${VAR}`` expanded from ``variables`` (what SLURM sets in the batch script)."""
    assert srun[0] == "srun"
    words = srun[1:]
    while words[0].startswith("-"):
        words = words[1:]
    assert words[:2] == ["python", "examples/char_lm.py"], words
    return [sys.executable, *(re.sub(r"\$\{?(\w+)\}?", lambda m: variables[m.group(1)], w)
                              for w in words[1:])]


def _small(command: list[str]) -> list[str]:
    """``command`` with the sizes of ``SMALL`` (replacing the recipe's, or added)."""
    out = list(command)
    for flag, value in SMALL.items():
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def _free_slurm_port() -> int:
    """A port of SlurmCluster's range that nothing listens on (above Linux's ephemeral range, so
    nothing should take it between this check and the coordinator's bind)."""
    for port in np.random.default_rng().permutation(np.arange(SLURM_PORTS[0], SLURM_PORTS[1] + 1))[
        :200
    ]:
        with socket.socket() as s:
            try:
                s.bind(("", int(port)))
            except OSError:
                continue
            return int(port)
    pytest.skip(f"no free port in {SLURM_PORTS}")


def _base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAXDIST_", "SLURM_", "OMPI_", "PMI_")) and k not in (
               "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT", "JAX_LOCAL_DEVICE_IDS",
               "JAX_NUM_CPU_DEVICES")}
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **extra}


def _slurm_env(job_id: int, nodes: int, devices: int) -> dict[str, str]:
    """What srun sets for a job step of ``nodes`` nodes x 1 task (the same for every task but the
    ids)."""
    return {"SLURM_JOB_ID": str(job_id), "SLURM_STEP_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_NTASKS": str(nodes), "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NNODES": str(nodes), "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_GPUS_ON_NODE": str(devices)}


def _results(output: str) -> tuple[np.ndarray, float]:
    losses = [float(x) for x in re.findall(r"^step \d+/\d+ loss (\S+)", output, re.M)]
    final = re.findall(r"^final val loss: (\S+)$", output, re.M)
    assert len(losses) == int(SMALL["--steps"]) and len(final) == 1, output[-3000:]
    return np.asarray(losses), float(final[0])


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Every process's ``(stdout, stderr)``, each within ``timeout`` s; whatever still runs after
    that is killed. (Apart: gloo writes its lines to stderr a piece at a time, and in a shared pipe
    one could land inside a printed line.)"""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)


def _one_device(command: list[str]) -> list[str]:
    """``command`` on one device: ``--strategy one_device``, no mesh, and none of the run's own
    files (checkpoints, compiled programs)."""
    out, words = [], iter(command)
    for word in words:
        if word in ("--strategy", "--mesh", "--fsdp-axes", "--model-axis", "--checkpoint-dir",
                    "--compilation-cache"):
            next(words)
        else:
            out.append(word)
    return [*out, "--strategy", "one_device"]


def test_the_batch_script_runs_one_process_per_gpu():
    options = _sbatch_options()
    # JAX's SLURM detection gives task i of a node GPU i: as many tasks as GPUs, each seeing all of
    # them.
    assert options["ntasks-per-node"] == options["gpus-per-node"], options
    assert "gpus-per-task" not in options and "ntasks-per-gpu" not in options, options
    assert set(_srun_commands()) == {"multi_worker", "hsdp"}
    nodes, gpus = int(options["nodes"]), int(options["gpus-per-node"])
    variables = {"SLURM_JOB_NUM_NODES": str(nodes), "SLURM_GPUS_ON_NODE": str(gpus),
                 "RUN_DIR": "runs/char-lm"}
    commands = {label: _program(srun, variables) for label, srun in _srun_commands().items()}
    # The two train the same model the same way: the data-parallel one stands for both in the next
    # test.
    assert _one_device(commands["hsdp"]) == _one_device(commands["multi_worker"])
    for label, command in commands.items():
        args = lm.parse_args(command[2:])
        assert args.batch_size % (nodes * gpus) == 0, (
            f"{label}: --batch-size {args.batch_size} over {nodes * gpus}"
        )
        if label == "hsdp":
            assert lm.parse_mesh(args.mesh) == {"data": nodes,
                                                "fsdp": gpus} and args.fsdp_axes == "fsdp"
        else:
            assert args.strategy == "multi_worker" and args.mesh is None
        # a restarted job resumes: checkpoints, compiled programs and a step watchdog
        assert (args.checkpoint_dir.startswith("runs/char-lm/")
                and args.compilation_cache == "runs/char-lm/jax-cache")
        assert args.step_timeout and args.step_timeout >= 60


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_slurm_recipe_trains_like_one_device(monkeypatch, tmp_path):
    """The data-parallel command of the script. (Its HSDP command differs only by --mesh, checked
    above; the mesh across processes is tests/test_sharded_multiprocess.py's.) Slow because it runs
    the example 3 times at once: 2 SLURM tasks and the one-device reference."""
    from jax._src.clusters import SlurmCluster  # what jax.distributed.initialize will use

    nodes, devices = 2, 4  # 2 "nodes" (this machine twice) x 1 task with 4 CPU devices
    port = _free_slurm_port()
    job_id = 4096 * 100 + port - SLURM_PORTS[0]  # SlurmCluster derives the coordinator port from it
    slurm = _slurm_env(job_id, nodes, devices)
    for key, value in {**slurm, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(key, value)
    assert SlurmCluster.is_env_present()
    assert SlurmCluster.get_coordinator_address(None, None) == f"localhost:{port}"

    command = _small(_program(_srun_commands()["multi_worker"],
                              {**slurm, "RUN_DIR": str(tmp_path)}))
    env = _base_env(JAX_NUM_CPU_DEVICES=str(devices), **slurm)  # SLURM's variables, no JAXDIST_*
    procs = [subprocess.Popen(command, cwd=ROOT, env={**env, "SLURM_PROCID": str(i),
                                                      "SLURM_LOCALID": "0"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(nodes)]
    procs.append(subprocess.Popen(_one_device(command), cwd=ROOT,
                                  env=_base_env(JAX_NUM_CPU_DEVICES="1"),
                                  # the reference
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    streams = _finish(procs, timeout=200)
    for p, (out, err) in zip(procs, streams, strict=True):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
    outputs = [out for out, _ in streams]
    first = outputs[0].splitlines()[0]
    assert first.startswith("MultiWorkerMirroredStrategy(num_hosts=2, num_replicas_in_sync=8)"), (
        first
    )
    losses, val_loss = _results(outputs[0])
    want_losses, want_val = _results(outputs[2])
    assert losses[-1] < losses[0] - 0.3  # it learns
    np.testing.assert_allclose(losses, want_losses, atol=1.5e-3)  # printed with 3 decimals
    np.testing.assert_allclose(val_loss, want_val, rtol=1e-4)
    # the final checkpoint, for a restart
    assert (tmp_path / "multi_worker" / SMALL["--steps"]).is_dir()
    assert any((tmp_path / "jax-cache").iterdir())  # process 0 cached the compiled programs


# --------------------------------------------------------------------------------------- Kubernetes
def _manifest() -> tuple[dict, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Job", "Service"], kinds
    return next(d for d in docs if d["kind"] == "Service"), next(
        d for d in docs if d["kind"] == "Job"
    )


def test_the_kubernetes_job_sets_the_cluster_jaxdist_reads():
    service, job = _manifest()
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    address, count, index = CLUSTER_VARIABLES  # jaxdist's names: a rename breaks this test
    assert set(env) == set(CLUSTER_VARIABLES), sorted(env)
    # An indexed Job whose pods all run at once, one process each.
    processes = int(env[count]["value"])
    assert (spec["completionMode"] == "Indexed"
            and spec["completions"] == spec["parallelism"] == processes > 1)
    assert pod["restartPolicy"] == "Never"
    # The process id is the pod's completion index (the downward API).
    field = env[index]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    # The coordinator: pod 0's stable name through the headless Service, on a port the container
    # exposes.
    host, port = env[address]["value"].rsplit(":", 1)
    name = job["metadata"]["name"]
    assert (service["spec"]["clusterIP"] == "None"
            and service["spec"]["publishNotReadyAddresses"] is True)
    assert pod["subdomain"] == service["metadata"]["name"]
    assert host == f"{name}-0.{service['metadata']['name']}", host
    assert service["spec"]["selector"] == {"job-name": name}
    assert int(port) in {p["containerPort"] for p in container["ports"]}
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}


def test_the_kubernetes_job_runs_the_example_with_arguments_it_accepts():
    _, job = _manifest()
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "examples/char_lm.py"]
    args = lm.parse_args(container["args"])  # argparse exits on an unknown or malformed argument
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    replicas = job["spec"]["parallelism"] * gpus
    assert args.strategy == "multi_worker" and args.batch_size % replicas == 0, (args, replicas)
    # The HSDP variant its comment gives: a mesh of (pods, GPUs per pod).
    hsdp = re.search(r'"--mesh", "([^"]+)", "--fsdp-axes", "fsdp"', MANIFEST.read_text())
    assert hsdp, "the manifest's HSDP comment is gone"
    assert lm.parse_mesh(hsdp.group(1)) == {"data": job["spec"]["parallelism"], "fsdp": gpus}
