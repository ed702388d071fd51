"""A search over layouts, rematerialization and micro-batches, by plan: which configuration fits,
and which is fastest.

`plan_search` builds a `jaxdist.training.Trainer` for every configuration (a layout of
``num_devices`` devices x remat on or off x ``grad_accum_steps``), plans its train step on the
global batch (``Trainer.plan``: compiled, never run) and ranks them: the configurations whose
``peak_bytes`` fit ``memory_per_device`` first, fastest first by the roofline estimate on
``accelerator``; then those that do not fit, smallest peak first.

The layouts, on ``jd.plan_mesh`` meshes (real devices when ``num_devices`` is this process's device
count):

* ``"mirrored"``: ``{"data": N}``, every variable whole on every device;
* ``"fsdp"``: ``{"fsdp": N}``, variables split over all devices (ZeRO-3);
* ``"hsdp"``: ``{"data": d, "fsdp": N / d}`` for ``d`` in ``hsdp_groups``: variables split within a
  group of ``N / d`` devices, replicated across the ``d`` groups;
* ``"fsdp_tp"``: ``{"fsdp": N / t, "tensor": t}`` for ``t`` in ``tensor_parallelism``: FSDP x tensor
  parallelism; only with ``rules`` (the model's logical axis rules for a mesh, whose tensor axis
  they name);
* ``"fsdp_ep"``: ``{"fsdp": N / e, "expert": e}`` for ``e`` in ``expert_parallelism`` (none unless
  given: a model with `jaxdist.nn.MoE` layers): the experts split over ``"expert"``, the batch over
  both axes, the other variables FSDP over ``"fsdp"``.

This search sits above the strategy classes, as it builds the strategies it plans on (the plan room,
`jaxdist.strategies.plan`, sits below them); it ranks Trainer configurations (``build`` returns a
Trainer or anything with its ``plan(batch)``) but imports nothing of ``training``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxdist.costs import Estimate, format_bytes
from jaxdist.strategies.base import Strategy
from jaxdist.strategies.mirrored import MirroredStrategy
from jaxdist.strategies.plan import Plan, plan_mesh
from jaxdist.strategies.sharded import ShardedStrategy

__all__ = ["Candidate", "plan_search"]

LAYOUTS = ("mirrored", "fsdp", "hsdp", "fsdp_tp", "fsdp_ep")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration of a `plan_search` and its plan.

    Attributes:
        layout: ``"mirrored"``, ``"fsdp"``, ``"hsdp"``, ``"fsdp_tp"`` or ``"fsdp_ep"``.
        mesh: the mesh's axis sizes.
        remat: whether the model recomputes its activations in the backward pass.
        grad_accum_steps: micro-batches per optimizer step.
        plan: the train step's `jd.Plan` (None when planning failed: see ``error``).
        estimate: the roofline step time on the search's accelerator.
        fits: whether ``plan.peak_bytes`` fits the search's ``memory_per_device``.
        error: why the configuration could not be planned (e.g. a batch its replicas do not divide).
    """

    layout: str
    mesh: dict[str, int]
    remat: bool
    grad_accum_steps: int
    plan: Plan | None
    estimate: Estimate | None
    fits: bool
    error: str | None = None

    def __str__(self) -> str:
        what = (f"{self.layout:<8} {self.mesh!s:<34} remat={self.remat!s:<5} "
                f"grad_accum={self.grad_accum_steps}")
        if self.plan is None:
            return f"{what}  not planned: {self.error}"
        return (f"{what}  peak {format_bytes(self.plan.peak_bytes):>11}  "
                f"{'fits' if self.fits else 'too big'}  {self.estimate.step_s * 1e3:.3g} ms/step "
                f"({self.estimate.bound})")


def _meshes(layouts: Sequence[str], n: int, hsdp_groups: Sequence[int], tensor: Sequence[int],
            rules: Any, experts: Sequence[int] = ()) -> list[tuple[str, dict[str, int]]]:
    out = []
    for layout in layouts:
        if layout == "mirrored":
            out.append((layout, {"data": n}))
        elif layout == "fsdp":
            out.append((layout, {"fsdp": n}))
        elif layout == "hsdp":
            out += [(layout, {"data": d, "fsdp": n // d}) for d in hsdp_groups if 1 < d < n
                    and n % d == 0]
        elif layout == "fsdp_tp" and rules is not None:
            out += [(layout, {"fsdp": n // t, "tensor": t}) for t in tensor if 1 < t < n
                    and n % t == 0]
        elif layout == "fsdp_ep":
            out += [(layout, {"fsdp": n // e, "expert": e}) for e in experts if 1 < e <= n
                    and n % e == 0]
    return out


def _strategy(layout: str, shape: dict[str, int], rules: Any,
              activation_axes: Sequence[str]) -> Strategy:
    real = len(jax.devices()) == math.prod(shape.values())  # compiled here; else in a subprocess
    names = tuple(shape)
    mesh = (jax.make_mesh(tuple(shape.values()), names,
                          axis_types=(jax.sharding.AxisType.Auto,) * len(names))
            if real else plan_mesh(shape))
    if layout == "mirrored":
        return MirroredStrategy(mesh=mesh)
    model_axis = "tensor" if "tensor" in shape else None
    batch_axes = tuple(a for a in names if a != model_axis)
    extra = {"expert_axes": "expert"} if "expert" in shape else {}
    if rules is not None:
        extra.update(logical_axis_rules=rules(batch_axes, model_axis),
                     activation_axes=tuple(activation_axes))
    return ShardedStrategy(mesh=mesh, batch_axes=batch_axes, fsdp_axes="fsdp" if "fsdp" in shape
                           else (), **extra)


def plan_search(
    build: Callable[..., Any], batch: Any, *, num_devices: int, memory_per_device: int | str,
    accelerator: str = "h100", layouts: Sequence[str] = LAYOUTS,
    remat: Sequence[bool] = (False, True), grad_accum_steps: Sequence[int] = (1,),
    hsdp_groups: Sequence[int] = (2, 4, 8), tensor_parallelism: Sequence[int] = (2, 4, 8),
    expert_parallelism: Sequence[int] = (),
    rules: Callable[[tuple[str, ...], str | None], Any] | None = None,
    activation_axes: Sequence[str] = (), progress: Callable[[Candidate], Any] | None = None,
) -> list[Candidate]:
    """Plan every configuration and rank them (see the module doc).

    Args:
        build: ``build(strategy, remat=..., grad_accum_steps=...) -> Trainer``: the trainer of one
            configuration (its model built with or without remat).
        batch: the global batch (arrays or `jax.ShapeDtypeStruct`s), as for ``Trainer.plan``.
        num_devices: how many devices to plan for.
        memory_per_device: the budget in bytes, or an accelerator name (its HBM).
        accelerator: what `Plan.estimate` ranks by.
        layouts: which of ``"mirrored"``, ``"fsdp"``, ``"hsdp"``, ``"fsdp_tp"``, ``"fsdp_ep"`` to
            try.
        remat: the remat settings to try.
        grad_accum_steps: the micro-batch counts to try.
        hsdp_groups: the replica-group counts of the HSDP layouts.
        tensor_parallelism: the tensor-axis sizes of the FSDP x TP layouts.
        expert_parallelism: the expert-axis sizes of the FSDP x EP layouts (MoE models).
        rules: ``rules(batch_axes, model_axis) -> logical_axis_rules`` for the model (needed for
            "fsdp_tp").
        activation_axes: logical names only activations use (see `ShardedStrategy`).
        progress: called with each `Candidate` as soon as it is planned (e.g. ``print``).

    Returns:
        Every `Candidate`: those that fit first, fastest first; then the others, smallest peak
        first.

    Raises:
        ValueError: for an unknown layout, or a ``num_devices`` that is not an int >= 1.
    """
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise ValueError(f"layouts={tuple(layouts)!r} names {unknown[0]!r}: choose among "
                         f"{LAYOUTS}.")
    if not isinstance(num_devices, int) or isinstance(num_devices, bool) or num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r} must be an int >= 1.")
    candidates = []
    for layout, shape in _meshes(layouts, num_devices, hsdp_groups, tensor_parallelism, rules,
                                 expert_parallelism):
        strategy = _strategy(layout, shape, rules, activation_axes)
        for r in remat:
            for k in grad_accum_steps:
                try:
                    trainer = build(strategy, remat=r, grad_accum_steps=k)
                    with strategy.scope():
                        plan = trainer.plan(batch)
                except ValueError as error:
                    # e.g. a batch the replicas (x micro-batches) do not divide
                    candidate = Candidate(layout, shape, r, k, None, None, False,
                                          str(error).split("\n")[0])
                else:
                    candidate = Candidate(layout, shape, r, k, plan, plan.estimate(accelerator),
                                          plan.fits(memory_per_device))
                candidates.append(candidate)
                if progress is not None:
                    progress(candidate)

    def rank(c: Candidate) -> tuple:
        if c.plan is None:
            return (2, 0.0)
        return (0, c.estimate.step_s) if c.fits else (1, c.plan.peak_bytes)

    return sorted(candidates, key=rank)
