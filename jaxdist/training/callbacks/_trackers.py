"""Experiment trackers: `WandbLogger` (Weights & Biases) and `MLflowLogger` (MLflow), offline by
default.

Both write what `TensorBoardLogger` writes, on process 0 only, and record the run's configuration
(``on_config``) under the user's ``config``. The trackers are optional (``pip install
'jaxdist[trackers]'``): each is imported when its logger is built, a missing one an ImportError
there.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

from jaxdist.training.callbacks._callbacks import History, _MetricWriter

__all__ = ["MLflowLogger", "WandbLogger"]

_INSTALL = "pip install 'jaxdist[trackers]'"


def _require(module: str, logger: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as error:
        raise ImportError(f"{logger} needs the {module.split('.')[0]} package, which is not "
                          f"installed: {_INSTALL} (or pip install "
                          f"{'wandb' if module == 'wandb' else 'mlflow-skinny'}).") from error


class WandbLogger(_MetricWriter):
    """Write metrics to a Weights & Biases run: ``train/loss``, ``eval/accuracy``, ... against
    ``step`` (the trainer's step).

    The run starts at the first value written (on the writing process only) with
    ``wandb.init(project=..., name=..., config=..., dir=..., mode=..., **init_kwargs)`` and is
    finished when ``fit`` ends. Without a ``mode`` and without ``WANDB_MODE`` in the environment it
    runs offline: nothing leaves the machine; the run is written under ``<dir>/wandb/offline-run-*``
    (``wandb sync <that folder>`` uploads it). Pass ``mode="online"`` (after ``wandb login``) to
    stream it. The values use ``step`` as their x-axis (``run.define_metric``), so a run that goes
    back (a rollback, a resumed job) still records every value.

    Args:
        run: an existing run (``wandb.init(...)``'s) to write into instead; it stays open.
        project: the W&B project (``wandb.init``'s).
        name: the run's name.
        config: the run's configuration (hyperparameters), beside ``fit``'s record of it
            (``on_config``; the values given here win).
        dir: the folder the run's files go under (``<dir>/wandb/``; default: the working directory).
        mode: ``"offline"``, ``"online"`` or ``"disabled"``; None: ``"offline"`` unless
            ``WANDB_MODE`` is set.
        **init_kwargs: more ``wandb.init`` arguments (``id=..., resume="allow"`` continues one run
            across restarts of a job).

    Raises:
        ImportError: when wandb is not installed (naming ``pip install 'jaxdist[trackers]'``).
        TypeError: for a ``run`` without ``log``, or ``run`` together with ``wandb.init`` arguments.

    Examples:
        >>> import tempfile, jaxdist as jd
        >>> logger = jd.training.WandbLogger(project="demo", dir=tempfile.mkdtemp())
        >>> logger.init_kwargs["mode"]
        'offline'
    """

    def __init__(self, run: Any = None, *, project: str | None = None, name: str | None = None,
                 config: Mapping[str, Any] | None = None, dir: str | os.PathLike | None = None,
                 mode: str | None = None, **init_kwargs: Any):
        self._wandb = _require("wandb", "WandbLogger")
        given = {k: v for k, v in dict(project=project, name=name, config=config, dir=dir,
                                       mode=mode).items() if v is not None}
        if run is not None:
            if not callable(getattr(run, "log", None)):
                raise TypeError(f"run={run!r} is not a wandb run: pass wandb.init(...)'s run, or "
                                "leave run out.")
            if given or init_kwargs:
                raise TypeError(f"WandbLogger got run={run!r} and wandb.init arguments "
                                f"({', '.join([*given, *init_kwargs])}): pass one or the other "
                                "(the run was initialised already).")
        if "dir" in given:
            given["dir"] = os.fspath(given["dir"])
        if mode is None and "WANDB_MODE" not in os.environ:
            given["mode"] = "offline"  # no server unless asked for
        self.init_kwargs: dict[str, Any] = {**given, **init_kwargs}
        self.run, self._owns, self._defined = run, run is None, False
        self._fit_config: dict[str, Any] = {}

    def on_config(self, trainer: Any, config: Mapping[str, Any]) -> None:
        self._fit_config = dict(config)  # the run's config, under the user's, when it starts

    def _write(self, split: str, step: int, values: Mapping[str, float]) -> None:
        if self.run is None:
            if self.init_kwargs.get("dir") is not None:
                os.makedirs(self.init_kwargs["dir"], exist_ok=True)
            kwargs = dict(self.init_kwargs)
            if self._fit_config:
                kwargs["config"] = {**self._fit_config, **dict(kwargs.get("config") or {})}
            self.run = self._wandb.init(**kwargs)
        if not self._defined:
            self.run.define_metric("step")
            for prefix in ("train", "eval", "time"):
                self.run.define_metric(f"{prefix}/*", step_metric="step")
            self._defined = True
        scalars = self.scalars(split, values)
        if scalars:
            self.run.log({"step": int(step), **scalars})

    def on_train_end(self, trainer: Any, history: History) -> None:
        self.close()

    def close(self) -> None:
        """Finish the run this logger started (a run it was given stays open); a later value starts
        a new one."""
        if self.run is not None and self._owns:
            self.run.finish()
            self.run, self._defined = None, False


@contextlib.contextmanager
def _file_store_allowed() -> Iterator[None]:
    """MLflow 3 keeps its file store behind ``MLFLOW_ALLOW_FILE_STORE``: allowed while the logger
    opens the store it chose itself (MLflow caches the store; the environment is left as it was)."""
    before = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = before


def _as_uri(where: str | os.PathLike) -> str:
    """A tracking URI as given (``http://...``, ``sqlite:///...``, ``file:///...``), or a folder's
    file URI."""
    text = os.fspath(where)
    if "://" in text or text.startswith(("databricks", "sqlite:", "file:")):
        return text
    return "file://" + os.path.abspath(text)


class MLflowLogger(_MetricWriter):
    """Write metrics to an MLflow run: ``train/loss``, ``eval/accuracy``, ... at the trainer's step.

    The run is created at the first value written (on the writing process only), in
    ``experiment_name`` (created when missing), with ``config`` as its parameters and ``tags`` as
    its tags, and marked finished when ``fit`` ends. Where it goes: ``tracking_uri`` (a URI, or a
    folder for a local file store); else MLflow's own setting (``MLFLOW_TRACKING_URI``,
    ``mlflow.set_tracking_uri``); else a local file store in ``./mlruns``. Read a file store back
    with ``mlflow.tracking.MlflowClient(uri)`` or ``mlflow ui --backend-store-uri uri`` (MLflow 3
    opens file stores only with ``MLFLOW_ALLOW_FILE_STORE=true`` in the environment; the logger
    allows it for the store it writes). MLflow 3 also sends usage telemetry of its own unless
    ``MLFLOW_DISABLE_TELEMETRY=true`` (or ``DO_NOT_TRACK=true``) is set: set it on machines that
    must stay offline.

    Args:
        run: an existing run (an ``mlflow.start_run()`` or ``MlflowClient.create_run`` result) to
            write into instead; it stays open.
        experiment_name: the experiment (default ``"jaxdist"``).
        run_name: the run's name (default: MLflow's).
        tracking_uri: where to write (see above).
        config: the run's parameters (``{"lr": 1e-3}``), written once as strings, beside ``fit``'s
            record of its configuration (``on_config``; the values given here win).
        tags: the run's tags.

    Raises:
        ImportError: when mlflow is not installed (naming ``pip install 'jaxdist[trackers]'``).
        TypeError: for a ``run`` without ``info.run_id``, or ``run`` together with
            ``experiment_name`` / ``run_name`` / ``config`` / ``tags``.

    Examples:
        >>> import os, tempfile, jaxdist as jd
        >>> logger = jd.training.MLflowLogger(experiment_name="demo",
        ...                                   tracking_uri=tempfile.mkdtemp())
        >>> logger.on_log(None, 10, {"loss": 0.5})
        >>> logger.close()  # at the end of fit
        >>> history = logger.client.get_metric_history(logger.run_id, "train/loss")
        >>> [(m.step, m.value) for m in history]
        [(10, 0.5)]
    """

    def __init__(self, run: Any = None, *, experiment_name: str | None = None,
                 run_name: str | None = None, tracking_uri: str | os.PathLike | None = None,
                 config: Mapping[str, Any] | None = None, tags: Mapping[str, str] | None = None):
        self._mlflow = _require("mlflow", "MLflowLogger")
        self._entities = _require("mlflow.entities", "MLflowLogger")
        if run is not None:
            run_id = getattr(getattr(run, "info", None), "run_id", None)
            if not isinstance(run_id, str):
                raise TypeError(f"run={run!r} is not an MLflow run: pass mlflow.start_run()'s run, "
                                "or leave run out.")
            given = [k for k, v in dict(experiment_name=experiment_name, run_name=run_name,
                                        config=config, tags=tags).items() if v is not None]
            if given:
                raise TypeError(f"MLflowLogger got run={run_id!r} and {', '.join(given)}: pass one "
                                "or the other (the run exists already; its experiment, name, "
                                "parameters and tags are its own).")
        if tracking_uri is not None:
            self.tracking_uri = _as_uri(tracking_uri)
        elif self._mlflow.is_tracking_uri_set():
            self.tracking_uri = self._mlflow.get_tracking_uri()
        else:
            self.tracking_uri = _as_uri("mlruns")
        self.experiment_name = experiment_name or "jaxdist"
        self.run_name, self.config, self.tags = run_name, dict(config or {}), dict(tags or {})
        self.run_id: str | None = None if run is None else run.info.run_id  # the run written last
        self._owns = run is None
        self._open_run = False  # a run is being written (closed by `close`)
        self.client: Any = None  # the MlflowClient, from the first value on
        self._fit_config: dict[str, Any] = {}

    def on_config(self, trainer: Any, config: Mapping[str, Any]) -> None:
        self._fit_config = dict(config)  # the run's parameters, under the user's, when it starts

    def _open(self) -> None:
        file_store = self.tracking_uri.startswith("file:")
        with _file_store_allowed() if file_store else contextlib.nullcontext():
            if self.client is None:
                self.client = self._mlflow.tracking.MlflowClient(self.tracking_uri)
            self._open_run = True
            if not self._owns:
                return
            experiment = self.client.get_experiment_by_name(self.experiment_name)
            experiment_id = (self.client.create_experiment(self.experiment_name)
                             if experiment is None else experiment.experiment_id)
            run = self.client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
            self.run_id = run.info.run_id
            config = {**self._fit_config, **self.config}
            if config:
                params = [self._entities.Param(str(k), str(v)) for k, v in config.items()]
                self.client.log_batch(self.run_id, params=params)

    def _write(self, split: str, step: int, values: Mapping[str, float]) -> None:
        if not self._open_run:
            self._open()
        now = int(time.time() * 1000)
        metrics = [self._entities.Metric(k, v, now, int(step))
                   for k, v in self.scalars(split, values).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def on_train_end(self, trainer: Any, history: History) -> None:
        self.close()

    def close(self) -> None:
        """Mark the run this logger started finished (a run it was given stays open); a later value
        starts a new one."""
        if self._open_run and self._owns:
            self.client.set_terminated(self.run_id)
        self._open_run = False
