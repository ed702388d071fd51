"""`WandbLogger` and `MLflowLogger` record what the TensorBoard writer records, offline, on the
writing process.

W&B runs offline (its ``wandb.Api`` reads servers only): the run's ``.wandb`` transaction log is
read back with wandb's own record type (`wandb.proto.wandb_internal_pb2.Record`) from its
LevelDB-style framing. MLflow writes to a local file store, read back with
``MlflowClient(uri).get_metric_history``.
"""

from __future__ import annotations

import json
import struct
import sys
import types

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist as jd


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Nothing goes to the network: no usage telemetry either."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


def fit(callbacks, steps=4):
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=8).astype(np.float32))
            for _ in range(4)]
    trainer = jd.training.Trainer(jd.MirroredStrategy(), nn.Dense(1),
                                  optax.inject_hyperparams(optax.sgd)(0.1),
                                  lambda out, y: ((out[:, 0] - y) ** 2).mean(),
                                  metrics={"mae": mae})
    return trainer.fit(data, steps=steps, log_every=2, eval_data=data[:2], eval_every=2,
                       callbacks=callbacks, verbose=0)


def mae(out, y):
    return jnp.abs(out[:, 0] - y).mean()


def expected(history):
    """``{(step, "train/loss"): value, ...}``: what the TensorBoard writer writes for ``history`` (a
    window's seconds by part under their own ``time/<part>`` names)."""
    out = {}
    for split in ("train", "eval"):
        for row in getattr(history, split):
            for key, value in row.items():
                if (key != "step" and isinstance(value, (int, float))
                        and not isinstance(value, bool)):
                    out[(row["step"], key if key.startswith("time/")
                         else f"{split}/{key}")] = float(value)
    return out


FIT_CONFIG = {"steps": 4, "log_every": 2, "eval_every": 2, "strategy": "MirroredStrategy",
              "mesh": "replica=8",
              "devices": 8, "processes": 1, "global_batch_size": 8,
              "optimizer": "InjectStatefulHyperparamsState",
              "optimizer.learning_rate": 0.1, "on_non_finite": "stop", "steps_per_run": 1}
"""Some of what ``fit`` records of the run's configuration (``on_config``) for `fit`'s run."""


def wandb_records(path):
    """The records of a ``.wandb`` transaction log: a 7-byte file header, then 32 KiB blocks of
    chunks, each ``crc32 (4) | length (2) | type (1: full, 2: first, 3: middle, 4: last)`` and its
    bytes."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, parts = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record
            parts = b""


def test_wandb_logger_records_the_logged_scalars_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the logger's own default
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "home" / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", "")
    logger = jd.training.WandbLogger(project="jaxdist-test", name="ema",
                                     config={"lr": 0.1, "log_every": "mine"}, dir=tmp_path / "wb")
    assert logger.init_kwargs["mode"] == "offline"
    history = fit([logger])
    assert logger.run is None  # finished at the end of fit
    # wandb's service may still hold the log's last block in memory after `finish` (it closes the
    # file when the stream ends): end the service, as the interpreter's exit does, before reading
    # the file.
    import wandb
    wandb.teardown()
    logs = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1, logs
    got, config = {}, {}
    for record in wandb_records(logs[0]):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):  # the config the run started with, and later updates
            items = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in items})
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            got.update({(row["step"], k): v for k, v in row.items()
                        if k.startswith(("train/", "eval/", "time/"))})
    want = expected(history)
    assert {k for k in want if k[1] == "train/loss"} == {(2, "train/loss"), (4, "train/loss")}
    assert {(4, "eval/mae"), (2, "train/steps_per_sec"), (4, "time/steps")} <= set(want)
    assert got == pytest.approx(want, rel=1e-6)
    # The run's config: fit's record of it, the user's values on top.
    assert config["lr"] == 0.1 and config["log_every"] == "mine", config
    assert all(config[k] == v for k, v in FIT_CONFIG.items() if k != "log_every"), config


def test_wandb_logger_arguments(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the user's setting wins: no mode passed
    assert "mode" not in jd.training.WandbLogger(project="p").init_kwargs
    assert jd.training.WandbLogger(mode="online").init_kwargs["mode"] == "online"
    with pytest.raises(TypeError, match=r"run=.* is not a wandb run"):
        jd.training.WandbLogger(run=object())
    run = types.SimpleNamespace(log=lambda values: None)
    with pytest.raises(TypeError,
                       match=r"WandbLogger got run=.* and wandb.init arguments \(project\)"):
        jd.training.WandbLogger(run, project="p")


def test_mlflow_logger_records_the_logged_scalars_in_a_local_file_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read MLflow 3's file store back here
    from mlflow.tracking import MlflowClient

    logger = jd.training.MLflowLogger(experiment_name="jaxdist-test", run_name="ema",
                                      config={"lr": 0.1, "log_every": "mine"},
                                      tracking_uri=tmp_path / "mlruns")
    assert logger.tracking_uri == (tmp_path / "mlruns").as_uri()
    history = fit([logger])
    client = MlflowClient(logger.tracking_uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "ema"
    # The run's parameters: fit's record of its configuration, the user's values on top.
    params = run.data.params
    assert params["lr"] == "0.1" and params["log_every"] == "mine", params
    assert all(params[k] == str(v) for k, v in FIT_CONFIG.items() if k != "log_every"), params
    assert client.get_experiment(run.info.experiment_id).name == "jaxdist-test"
    got = {(m.step, key): m.value for key in run.data.metrics
           for m in client.get_metric_history(logger.run_id, key)}
    want = expected(history)
    assert {(2, "train/loss"), (4, "train/loss"), (4, "eval/mae")} <= set(want)
    assert got == pytest.approx(want, rel=1e-6)

    # A run of the user's: written into, left open.
    mine = client.create_run(run.info.experiment_id)
    given = jd.training.MLflowLogger(mine, tracking_uri=logger.tracking_uri)
    fit([given], steps=2)
    assert client.get_run(mine.info.run_id).info.status == "RUNNING"
    assert [m.step for m in client.get_metric_history(mine.info.run_id, "train/loss")] == [2]


def test_mlflow_logger_defaults_to_a_local_mlruns_folder_and_writes_on_one_process(
    tmp_path, monkeypatch
):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    # set by the process (mlflow.set_tracking_uri): that setting wins
    if mlflow.is_tracking_uri_set():
        assert jd.training.MLflowLogger().tracking_uri == mlflow.get_tracking_uri()
    else:
        assert jd.training.MLflowLogger().tracking_uri == (tmp_path / "mlruns").as_uri()
    quiet = jd.training.MLflowLogger(tracking_uri=tmp_path / "other")
    not_writer = types.SimpleNamespace(strategy=types.SimpleNamespace(should_save_summary=False))
    quiet.on_log(not_writer, 2, {"loss": 1.0})
    quiet.on_eval_end(not_writer, 2, {"loss": 1.0})
    quiet.on_train_end(not_writer, jd.training.History())
    assert quiet.client is None and not (tmp_path / "other").exists()
    with pytest.raises(TypeError, match=r"run='abc' is not an MLflow run"):
        jd.training.MLflowLogger("abc")


@pytest.mark.parametrize(("cls", "module"), [("WandbLogger", "wandb"), ("MLflowLogger", "mlflow")])
def test_a_missing_tracker_is_an_import_error_naming_the_extra(cls, module, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(
        ImportError, match=rf"{cls} needs the {module} package.*pip install 'jaxdist\[trackers\]'"
    ):
        getattr(jd.training, cls)()
