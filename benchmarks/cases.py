"""What the suite compares: the steppers and the head-to-head rows (with targets).

Adding a row: register its steppers in `STEPPERS` (a builder from a `Problem` and the shared
`Devices`) and append a `Comparison` to `COMPARISONS`. A stepper that cannot run on this machine (a
missing optional package, an API that errors) raises `runners.Unavailable`, so its rows come out
"skipped" rather than failing the suite.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

import jaxdist as jd
from benchmarks import keras_lm, lm, runners
from benchmarks.models import LARGE, SMALL, TINY, Problem
from benchmarks.timing import Stepper

__all__ = ["COMPARISONS", "STEPPERS", "Comparison", "Devices", "StepperDef"]


class Devices:
    """The devices a run uses and the strategies over them, created once and shared by every
    stepper."""

    def __init__(self, devices: tuple[jax.Device, ...]):
        if not devices:
            raise ValueError("devices=() is empty: the suite needs at least one device.")
        self.devices = devices

    @functools.cached_property
    def mirrored(self) -> jd.MirroredStrategy:
        """`MirroredStrategy` over every device of the run."""
        return jd.MirroredStrategy(self.devices)

    @functools.cached_property
    def one_device(self) -> jd.OneDeviceStrategy:
        """`OneDeviceStrategy` on the first device."""
        return jd.OneDeviceStrategy(self.devices[0])

    @functools.cached_property
    def sharded(self) -> jd.ShardedStrategy:
        """`ShardedStrategy` (FSDP) over every device of the run."""
        return jd.ShardedStrategy(self.devices)

    def tpu(self, steps_per_run: int) -> jd.TPUStrategy:
        """`TPUStrategy` over every device of the run (the default backend's devices: CPU here)."""
        return jd.TPUStrategy(steps_per_run=steps_per_run, devices=self.devices)


@dataclasses.dataclass(frozen=True)
class StepperDef:
    """A named way of running the training step.

    Attributes:
        key: identifier used by comparisons and in the JSON.
        label: what the table and plot call it.
        build: ``build(problem, devices) -> Stepper``; raises `runners.Unavailable` to skip.
    """

    key: str
    label: str
    build: Callable[[Problem, Devices], Stepper]


def _keras(spe: int) -> Callable[[Problem, Devices], Stepper]:
    return lambda p, d: runners.KerasFit(d.devices, p, steps_per_execution=spe)


def _lm(
    stepper: type, layout: str, remat: bool = False, **options: Any
) -> Callable[[Problem, Devices], Stepper]:
    """An LM stepper (`benchmarks.lm`, `benchmarks.keras_lm`) on the FSDP (``"fsdp"``), FSDP x TP
    (``"tp"``) or user-mesh (``"mesh"``: ``(data, fsdp, tensor)``, HSDP x TP) strategy, built with
    ``options``; it reads only the problem's spec, which must be an `lm.LMSpec`."""

    def build(p: Problem, d: Devices) -> Stepper:
        if not isinstance(p.spec, lm.LMSpec):
            raise runners.Unavailable(f"this row trains the transformer LM; model {p.spec.name!r} "
                                      "is not one")
        strategy = {"fsdp": lambda: d.sharded, "tp": lambda: lm.tp_strategy(d.devices),
                    "mesh": lambda: lm.mesh_strategy(d.devices)}[layout]()
        return stepper(strategy, lm.lm_problem(p.spec, remat=remat), **options)

    return build


STEPPERS: dict[str, StepperDef] = {
    s.key: s
    for s in (
        StepperDef("mirrored.jit", "Mirrored strategy.jit",
                   lambda p, d: runners.StrategyJit(d.mirrored, p)),
        StepperDef(
            "mirrored.jit#2",
            "Mirrored strategy.jit (second instance)",
            lambda p, d: runners.StrategyJit(d.mirrored, p),
        ),
        StepperDef(
            "mirrored.jit+dataset",
            "Mirrored strategy.jit + distribute_dataset (host numpy)",
            lambda p, d: runners.StrategyJit(d.mirrored, p, feed="dataset"),
        ),
        StepperDef(
            "hand.jit",
            "hand-written jax.jit + NamedSharding",
            lambda p, d: runners.HandJit(d.mirrored.mesh, p),
        ),
        StepperDef("onedevice.jit", "OneDevice strategy.jit",
                   lambda p, d: runners.StrategyJit(d.one_device, p)),
        StepperDef("plain.jit", "plain jax.jit (1 device)",
                   lambda p, d: runners.PlainJit(d.devices[0], p)),
        StepperDef(
            "mirrored.run",
            "Mirrored strategy.run + all_reduce",
            lambda p, d: runners.StrategyRun(d.mirrored, p),
        ),
        StepperDef("pmap", "legacy jax.pmap", lambda p, d: runners.Pmap(d.devices, p)),
        StepperDef("keras.spe1", "Keras 3 DataParallel fit (spe=1)", _keras(1)),
        StepperDef("keras.spe20", "Keras 3 DataParallel fit (spe=20)", _keras(20)),
        StepperDef(
            "tpu.spr20",
            "TPUStrategy run_steps_on_dataset, 20 steps/loop (host numpy)",
            lambda p, d: runners.StepsPerRun(d.tpu(20), p, iterations=20),
        ),
        *(
            StepperDef(
                f"tpu.spr{k}",
                f"TPUStrategy run_steps_on_dataset, {k} steps/loop (host numpy)",
                lambda p, d, k=k: runners.StepsPerRun(d.tpu(k), p, iterations=k),
            )
            for k in (1, 5, 50)
        ),
        StepperDef("trainer.fit", "training.Trainer.fit (host numpy)",
                   lambda p, d: runners.TrainerFit(d.mirrored, p)),
        StepperDef(
            "trainer.fit+device",
            "training.Trainer.fit (device-resident batches)",
            lambda p, d: runners.TrainerFit(d.mirrored, p, feed="device"),
        ),
        StepperDef(
            "mirrored.jit+host_metric",
            "Mirrored strategy.jit, accuracy in outside_compilation",
            lambda p, d: runners.HostMetricJit(d.mirrored, p, host=True),
        ),
        StepperDef(
            "mirrored.jit+device_metric",
            "Mirrored strategy.jit, accuracy on device",
            lambda p, d: runners.HostMetricJit(d.mirrored, p, host=False),
        ),
        StepperDef("sharded.jit", "Sharded (FSDP) strategy.jit",
                   lambda p, d: runners.StrategyJit(d.sharded, p)),
        StepperDef(
            "sharded.hand",
            "hand-written jax.jit, FSDP layouts",
            lambda p, d: runners.LayoutJit(d.sharded, p),
        ),
        # The transformer LM (benchmarks.lm). The hand-written sides' keys start "sharded.hand" (a
        # reference).
        StepperDef("lm.fsdp.jit", "LM: Sharded (FSDP) strategy.jit", _lm(lm.LMStrategyJit, "fsdp")),
        StepperDef("sharded.hand.lm-fsdp", "LM: hand-written jax.jit, FSDP layouts",
                   _lm(lm.LMHandJit, "fsdp")),
        StepperDef("lm.tp.jit", "LM: Sharded (FSDP x TP, model=2) strategy.jit",
                   _lm(lm.LMStrategyJit, "tp")),
        StepperDef(
            "sharded.hand.lm-tp",
            "LM: hand-written jax.jit, FSDP x TP layouts and rules",
            _lm(lm.LMHandJit, "tp"),
        ),
        StepperDef("lm.mesh.jit", "LM: Sharded on a user mesh (data, fsdp, tensor) strategy.jit",
                   _lm(lm.LMStrategyJit, "mesh")),
        StepperDef(
            "sharded.hand.lm-mesh",
            "LM: hand-written jax.jit, the same user mesh, layouts and rules",
            _lm(lm.LMHandJit, "mesh"),
        ),
        StepperDef(
            "lm.tp.jit+remat",
            "LM: Sharded (FSDP x TP) strategy.jit, remat",
            _lm(lm.LMStrategyJit, "tp", remat=True),
        ),
        StepperDef(
            "lm.tp.jit+host",
            "LM: Sharded (FSDP x TP) strategy.jit, host numpy batches",
            _lm(lm.LMStrategyJit, "tp", feed="host"),
        ),
        StepperDef(
            "keras.lm.tp",
            "LM: Keras 3 ModelParallel + LayoutMap fit, FSDP x TP layouts",
            _lm(keras_lm.KerasLMFit, "tp"),
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One head-to-head row: ``ratio = steps/s(candidate) / steps/s(baseline)``.

    Attributes:
        key: short id (``P1``, ``P2``, ...).
        title: what is compared.
        candidate: `STEPPERS` key of the side under test (the numerator).
        baseline: `STEPPERS` key of the reference (the denominator).
        target: the ratio the candidate must reach (``ratio >= target``), or None for an
            informational row.
        models: model names in a full run.
        quick_models: model names in a ``--quick`` run.
        pairs_factor: this row runs ``pairs_factor`` times the run's pairs (the rows with targets
            get more, so that their median is resolved to about the 3% that separates 0.97 from
            parity).
        smoke_models: model names in a ``--smoke`` run.
    """

    key: str
    title: str
    candidate: str
    baseline: str
    target: float | None
    models: tuple[str, ...] = (SMALL.name, LARGE.name)
    quick_models: tuple[str, ...] = (SMALL.name,)
    pairs_factor: int = 1
    smoke_models: tuple[str, ...] = (TINY.name,)

    def __post_init__(self) -> None:
        for side in (self.candidate, self.baseline):
            if side not in STEPPERS:
                raise ValueError(f"Comparison {self.key!r}: stepper {side!r} is not in STEPPERS "
                                 f"({sorted(STEPPERS)}).")


_BOTH = (SMALL.name, LARGE.name)
_LM = (lm.LM_QUICK.name,)
_LM_SMOKE = (lm.LM_TINY.name,)

COMPARISONS: tuple[Comparison, ...] = (
    # A/A: two identical steppers. Its spread is the noise floor of this machine; its median should
    # be 1.
    Comparison(
        "null",
        "A/A noise floor: strategy.jit vs a second identical strategy.jit",
        "mirrored.jit",
        "mirrored.jit#2",
        None,
    ),
    Comparison(
        "P1",
        "strategy.jit vs hand-written jax.jit (device batches)",
        "mirrored.jit",
        "hand.jit",
        0.97,
        quick_models=_BOTH,
        pairs_factor=2,
    ),
    Comparison(
        "P2",
        "distribute_dataset (host numpy) vs device-resident batches",
        "mirrored.jit+dataset",
        "mirrored.jit",
        0.95,
        quick_models=_BOTH,
        pairs_factor=2,
    ),
    Comparison("1dev", "OneDevice strategy.jit vs plain jax.jit", "onedevice.jit", "plain.jit",
               None),
    Comparison("run", "strategy.run + all_reduce vs strategy.jit", "mirrored.run", "mirrored.jit",
               None),
    Comparison("pmap", "strategy.jit vs legacy jax.pmap", "mirrored.jit", "pmap", None),
    Comparison(
        "keras1", "strategy.jit + distribute_dataset vs Keras fit, spe=1", "mirrored.jit+dataset",
        "keras.spe1", 1.0, quick_models=_BOTH,
    ),
    Comparison(
        "keras20", "strategy.jit + distribute_dataset vs Keras fit, spe=20", "mirrored.jit+dataset",
        "keras.spe20", None
    ),
    Comparison(
        "tpu-spr",
        "TPUStrategy steps_per_run=20 on-device loop vs strategy.jit per step (host numpy)",
        "tpu.spr20",
        "mirrored.jit+dataset",
        1.25,
        models=(SMALL.name,),
    ),
    # P3: the steps_per_run sweep, each against the per-step strategy.jit loop (the plot's speedup
    # panel).
    *(
        Comparison(
            f"P3-{k}",
            f"steps_per_run={k} on-device loop vs strategy.jit per step (host numpy)",
            f"tpu.spr{k}",
            "mirrored.jit+dataset",
            None,
            models=(SMALL.name,),
            # --smoke: P3-50 only; P3-1 and P3-5 run the same stepper (runners.StepsPerRun) and row
            # code with another loop length, and tpu-spr runs it at 20: two more compiles that check
            # nothing new.
            smoke_models=(TINY.name,) if k == 50 else (),
        )
        for k in (1, 5, 50)
    ),
    Comparison(
        "spr-keras",
        "TPUStrategy steps_per_run=20 vs Keras DataParallel fit, steps_per_execution=20",
        "tpu.spr20",
        "keras.spe20",
        1.5,
        models=(SMALL.name,),
    ),
    Comparison(
        "trainer",
        "training.Trainer.fit vs hand-written strategy.jit loop (host numpy)",
        "trainer.fit",
        "mirrored.jit+dataset",
        0.97,
        pairs_factor=2,
    ),
    # The Trainer's P2: its batch path (check, place, read ahead) against batches it need not move.
    Comparison(
        "trainer-P2",
        "training.Trainer.fit on host numpy vs on device-resident batches",
        "trainer.fit",
        "trainer.fit+device",
        0.95,
        pairs_factor=2,
    ),
    Comparison(
        "outside",
        "step with an outside_compilation host call vs the same step on device",
        "mirrored.jit+host_metric",
        "mirrored.jit+device_metric",
        None,
    ),
    Comparison(
        "fsdp",
        "ShardedStrategy (FSDP) strategy.jit vs hand-written jax.jit, same layouts",
        "sharded.jit",
        "sharded.hand",
        None,
    ),
    # The transformer LM of examples/char_lm.py: strategy.jit vs hand-written jax.jit with the same
    # layouts.
    Comparison(
        "lm-fsdp",
        "LM: ShardedStrategy (FSDP) strategy.jit vs hand-written jax.jit, same layouts",
        "lm.fsdp.jit",
        "sharded.hand.lm-fsdp",
        0.97,
        models=_LM,
        quick_models=_LM,
        smoke_models=_LM_SMOKE,
    ),
    Comparison(
        "lm-tp",
        "LM: ShardedStrategy FSDP x TP strategy.jit vs hand-written jax.jit, same layouts and "
        "rules",
        "lm.tp.jit",
        "sharded.hand.lm-tp",
        0.97,
        models=_LM,
        quick_models=_LM,
        smoke_models=_LM_SMOKE,
    ),
    Comparison(
        "lm-mesh",
        "LM: ShardedStrategy on the user's (data, fsdp, tensor) mesh vs hand-written jax.jit, same "
        "mesh and layouts",
        "lm.mesh.jit",
        "sharded.hand.lm-mesh",
        0.97,
        models=_LM,
        quick_models=_LM,
        smoke_models=_LM_SMOKE,
    ),
    Comparison(
        "lm-keras",
        "LM: ShardedStrategy FSDP x TP strategy.jit vs Keras 3 ModelParallel + LayoutMap fit, same "
        "layouts",
        "lm.tp.jit+host",
        "keras.lm.tp",
        1.0,
        models=_LM,
        quick_models=_LM,
        smoke_models=_LM_SMOKE,
    ),
    Comparison(
        "lm-remat",
        "LM: FSDP x TP strategy.jit with remat vs without",
        "lm.tp.jit+remat",
        "lm.tp.jit",
        None,
        models=_LM,
        quick_models=_LM,
        smoke_models=(),  # a third LM compile: too slow for a smoke run
    ),
)
