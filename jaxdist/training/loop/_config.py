"""How a run is configured: the flat record ``fit`` hands its callbacks once (``on_config``), which
the trackers keep as the run's parameters (MLflow) or configuration (W&B).

The record is what ``fit`` knows for certain, one flat ``{name: value}`` of JSON scalars (a
tracker's parameters are flat, and MLflow's are strings): ``fit``'s arguments that shape the run
(`_FIT`); the trainer's ``steps_per_run``, ``grad_accum_steps``, ``compute_dtype``, ``ema_decay``,
``seed``; ``strategy`` (its class), ``mesh`` (``"replica=8"``), ``devices``, ``device_kind``,
``processes``, ``num_replicas_in_sync``; ``global_batch_size`` (None before the first batch); and
``optimizer`` (its state's types, ``"ScaleByAdamState"``: optax's transformations carry no name)
with, for one built with `optax.inject_hyperparams`, each scalar hyperparameter as
``optimizer.<name>`` (not a ``/``: MLflow's file store would need a folder named like the file
``optimizer``). It reads no device value but those hyperparameters (once per ``fit``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxdist.training.data import global_rows

__all__ = ["run_config"]


def _scalar(value: Any) -> Any:
    """A JSON scalar for ``value``: bools, ints, floats, strings and None as they are; paths as
    strings; tuples of scalars as ``"a,b"``; anything else by its name or ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, (int, float, str)) for v in value):
        return ",".join(str(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    name = getattr(value, "__name__", None) or getattr(value, "name", None)
    return name if isinstance(name, str) else str(value)


def _optimizer(opt_state: Any) -> dict[str, Any]:
    """What the optimizer's state says of it: its state types, outer first, and
    `optax.inject_hyperparams`' scalars (at the precision of their dtype)."""
    out: dict[str, Any] = {}
    kinds: list[str] = []

    def walk(node: Any) -> None:
        if hasattr(node, "_fields"):  # optax's states are NamedTuples
            kind = type(node).__name__
            if kind != "EmptyState" and kind not in kinds:
                kinds.append(kind)
            hyper = getattr(node, "hyperparams", None)
            for name, value in (hyper.items() if isinstance(hyper, Mapping) else ()):
                if isinstance(value, jax.Array):  # this process's copy (it may span processes)
                    value = value.addressable_data(0)
                array = np.asarray(jax.device_get(value))
                if array.shape == () and array.dtype.kind in "biuf":
                    value = array.item()
                    if array.dtype.kind == "f":  # at the precision of its dtype
                        value = float(f"{value:.{np.finfo(array.dtype).precision + 1}g}")
                    out[f"optimizer.{name}"] = value
        if isinstance(node, (tuple, list)):
            for child in node:
                walk(child)
        elif isinstance(node, Mapping):
            for child in node.values():
                walk(child)

    walk(opt_state)
    return {"optimizer": ",".join(kinds), **out} if kinds else out


def run_config(settings: Mapping[str, Any], live: Any,
               arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The run's configuration (see the module): ``fit``'s ``arguments``, the trainer's
    ``settings``, its strategy, mesh and devices, the global batch size and the optimizer as its
    state in ``live`` says.

    Args:
        settings: the trainer's settings (``steps_per_run``, ``grad_accum_steps``, ...; missing ones
            are left out).
        live: its `LiveState` (the strategy, the state, the batch signature).
        arguments: ``fit``'s arguments by name (those in `_FIT` are kept).

    Returns:
        ``{name: JSON scalar}``, in a fixed order.

    Examples:
        >>> import types, jaxdist as jd
        >>> live = types.SimpleNamespace(strategy=jd.OneDeviceStrategy(), state=None,
        ...                              batches=types.SimpleNamespace(signature=None))
        >>> config = run_config({"steps_per_run": 1}, live, {"steps": 100, "log_every": 10})
        >>> config["steps"], config["strategy"], config["mesh"], config["global_batch_size"]
        (100, 'OneDeviceStrategy', 'replica=1', None)
    """
    config: dict[str, Any] = {key: _scalar(arguments[key]) for key in _FIT if key in arguments}
    for key in ("steps_per_run", "grad_accum_steps", "compute_dtype", "ema_decay", "seed"):
        if key in settings:
            config[key] = _scalar(settings[key])
    strategy, mesh = live.strategy, live.strategy.mesh
    devices = list(mesh.devices.flat)
    config.update({
        "strategy": type(strategy).__name__,
        "mesh": ",".join(f"{name}={size}" for name, size in mesh.shape.items()),
        "num_replicas_in_sync": int(strategy.num_replicas_in_sync),
        "devices": len(devices),
        "device_kind": _scalar(getattr(devices[0], "device_kind", None)),
        "processes": len({d.process_index for d in devices}),
        "global_batch_size": global_rows(live.batches.signature),
    })
    state = getattr(live, "state", None)
    if state is not None:
        config.update(_optimizer(state.opt_state))
    return config


_FIT = ("steps", "epochs", "steps_per_epoch", "log_every", "eval_every", "checkpoint_every",
        "keep_checkpoints", "async_checkpoints", "checkpoint_dir", "restore_step", "step_timeout",
        "on_non_finite", "profile_steps")
"""The arguments of ``fit`` kept in the record (those that shape the run, not where its logs are
shown)."""
