"""The plan of a compiled step: what one call costs each device (memory, FLOPs, collectives).

`Plan` is the record `jaxdist.strategies` fills when it plans a step for a strategy's layout
(``strategy.jit(step).plan(...)``, ``Trainer.plan(batch)``); `read_plan` turns a compiled program
(or its text and XLA's memory analysis) into one. The records live here, below every package that
fills or reads them; they import nothing of jaxdist but the cost model.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.costs.peaks import Accelerator, accelerator
from jaxdist.costs.program import COLLECTIVE_KINDS, _Undercount, program_cost
from jaxdist.costs.roofline import Estimate, roofline
from jaxdist.costs.scopes import ATTENTION_SCOPE, GROUPED_MATMUL_SCOPE, moe_dispatch, scoped
from jaxdist.costs.units import format_bytes, format_flops

__all__ = ["MEMORY_FIELDS", "ArrayPlan", "CollectivePlan", "Plan", "read_plan"]

# The fields of XLA's memory analysis (``compiled.memory_analysis()``) a plan reads.
MEMORY_FIELDS = (
    "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
    "host_argument_size_in_bytes", "host_output_size_in_bytes", "host_alias_size_in_bytes",
    "host_temp_size_in_bytes",
)


@dataclasses.dataclass(frozen=True)
class ArrayPlan:
    """One array of a plan: where it lives and what it costs each device.

    Attributes:
        path: the argument and path (``"state.params/Dense_0/kernel"``).
        shape: its global shape.
        dtype: its dtype's name.
        layout: its `PartitionSpec` as text (``"P('fsdp', 'tensor')"``), or ``"whole"``.
        bytes: bytes on one device.
        axes: for `Plan.replicated`, the mesh axes it is held whole along that could split it.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    layout: str
    bytes: int
    axes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class CollectivePlan:
    """The collectives of one kind in a step, per device.

    Attributes:
        kind: ``"all-gather"``, ``"reduce-scatter"``, ``"all-reduce"``, ``"all-to-all"`` or
            ``"collective-permute"``.
        count: how many run per step (loops multiply).
        bytes: the buffers' bytes per device per step (an all-gather's gathered result, a
            reduction's operand).
        wire_bytes: what each device sends per step under the bandwidth-optimal algorithms.
        axes: the mesh axes they run over.
    """

    kind: str
    count: int
    bytes: int
    wire_bytes: float
    axes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Plan(_Undercount):
    """What one call of a compiled step costs on each device (see the module doc).

    Attributes:
        mesh: the mesh's axis sizes.
        argument_bytes: the step's arguments on one device (XLA's memory analysis).
        output_bytes: its outputs.
        alias_bytes: outputs written into donated arguments.
        temp_bytes: temporaries.
        peak_bytes: arguments + outputs - aliased + temporaries (an upper bound).
        host_bytes: host-offloaded arguments, outputs and temporaries.
        state_bytes: the arguments' bytes by role (``params``, ``opt_state``, ``batch``, an
            argument's name).
        largest_arrays: the ten largest arrays (`ArrayPlan`), with their layouts.
        flops: floating-point operations per step (`jaxdist.costs.program_cost`), every loop
            iteration counted, custom calls (cuBLAS, cuDNN, Pallas kernels) by what they compute.
        transcendentals: transcendental operations per step.
        bytes_accessed: memory traffic per step.
        collectives: ``{kind: CollectivePlan}``.
        replicated_bytes: bytes of variables held whole along an axis that could split them.
        replicated: those variables (`ArrayPlan` with ``axes``), largest first.
        unknown_loops: loops whose trip count XLA did not record (counted once: a lower bound).
        plan_seconds: how long planning took (lowering and compiling).
        compiled_on: where the program was compiled.
        axis_types: ``{axis: jax.sharding.AxisType}`` the program runs with: the mesh's own, or Auto
            where its Explicit axes run Auto because the step does not type-check with them (see
            `jaxdist.strategies.layout._axis_types`).
        moe_dispatch: how the program's mixture-of-experts layers (`jaxdist.nn.MoE`) move tokens:
            ``"dropping_all_to_all"`` / ``"dropless_padded_all_to_all"`` (expert parallelism: a
            capacity buffer, or a worst-case one), ``"dropless_ragged_all_to_all"`` (expert
            parallelism: only the routed rows move, grouped matmuls: GPU / TPU; ``..._emulated``
            where the exchange runs emulated on CPU), ``"dropping_local"`` / ``"dropless_local"``
            (every expert on each device), ``"dropless_ragged_local"`` (every expert local, grouped
            matmuls: GPU / TPU); empty without such layers.
        uncosted: custom calls whose work could not be told (counted as 0: a lower bound).
        attention: the kernels `jaxdist.nn.dot_product_attention` computes with (``"cudnn"``,
            ``"xla"``, ``"einsum"``; `jaxdist.costs.scopes`); empty without it.
        grouped_matmul: the grouped-matmul kernels of the dropless mixture-of-experts layers
            (``"ragged_dot"``: `jax.lax.ragged_dot`, ``"tokamax"``: ``tokamax.ragged_dot``), or ().
        model_flops: the model's FLOPs per step (`jaxdist.costs.ProgramCost.model_flops`: ``flops``
            without recomputation, with what kernels skip under a mask; MFU's basis), or None.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.ShardedStrategy(min_shard_size=1)
        >>> w = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
        >>> x = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
        >>> step = lambda w, x: w - 0.1 * jax.grad(lambda w: ((x @ w) ** 2).mean())(w)
        >>> plan = strategy.plan(step, w, x, batch_argnums=1)
        >>> plan.state_bytes["w"] == 1024 * 256 * 4 // 8   # FSDP: an eighth of w on each device
        True
        >>> plan.fits(1 << 30), plan.estimate("h100").bound in ("compute", "memory", "network")
        (True, True)
    """

    mesh: dict[str, int]
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int
    host_bytes: int
    state_bytes: dict[str, int]
    largest_arrays: tuple[ArrayPlan, ...]
    flops: float
    transcendentals: float
    bytes_accessed: float
    collectives: dict[str, CollectivePlan]
    replicated_bytes: int
    replicated: tuple[ArrayPlan, ...]
    unknown_loops: int
    plan_seconds: float
    compiled_on: str
    axis_types: dict[str, jax.sharding.AxisType]
    moe_dispatch: tuple[str, ...] = ()
    uncosted: tuple[str, ...] = ()
    attention: tuple[str, ...] = ()
    grouped_matmul: tuple[str, ...] = ()
    model_flops: float | None = None

    @property
    def num_devices(self) -> int:
        """How many devices the step is partitioned over."""
        return math.prod(self.mesh.values())

    @property
    def network_bytes(self) -> float:
        """Bytes each device sends per step, all collectives (bandwidth-optimal algorithms)."""
        return float(sum(c.wire_bytes for c in self.collectives.values()))

    def estimate(self, accelerator: str | Accelerator = "h100") -> Estimate:
        """The roofline step time on ``accelerator`` (`jaxdist.costs.roofline`): compute, memory and
        network terms, and which one bounds the step.

        Args:
            accelerator: a name of `ACCELERATORS` (``"h100"``, ``"h200"``, ``"b200"``, ``"a100"``,
                ``"tpu-v4"``, ``"tpu-v5e"``, ``"tpu-v5p"``, ``"tpu-v6e"``) or an `Accelerator`.

        Raises:
            ValueError: for a name not in the table.
        """
        return roofline(self.flops, self.bytes_accessed, self.network_bytes, accelerator,
                        lower_bound_flops=self.lower_bound)

    def fits(self, memory_per_device: int | str | Accelerator) -> bool:
        """Whether ``peak_bytes`` fits ``memory_per_device``.

        Args:
            memory_per_device: bytes (``16 << 30``), or an accelerator (its HBM).

        Raises:
            ValueError: for a budget that is not a positive int, or an unknown accelerator.
        """
        return self.peak_bytes <= _budget(memory_per_device)

    def __str__(self) -> str:
        where = f", {self.compiled_on}" if self.compiled_on else ""
        lines = [f"Plan for mesh {self.mesh} ({self.num_devices} devices){where}, planned in "
                 f"{self.plan_seconds:.2f} s"]
        auto = [a for a, t in self.axis_types.items() if t == jax.sharding.AxisType.Auto]
        explicit = [a for a, t in self.axis_types.items() if t == jax.sharding.AxisType.Explicit]
        if explicit or auto:
            lines.append("Axis types: " + "; ".join(
                f"{label} {', '.join(axes)}"
                for label, axes in (("Explicit", explicit), ("Auto", auto)) if axes))
        if self.moe_dispatch:
            lines.append("MoE dispatch: " + ", ".join(p.replace("_", " ")
                                                      for p in self.moe_dispatch))
        for label, kernels in (("Attention", self.attention),
                               ("Grouped matmuls", self.grouped_matmul)):
            if kernels:
                lines.append(f"{label}: " + ", ".join(kernels))
        lines.append("Memory per device")
        roles = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.state_bytes.items())
        for label, value, note in (
            ("arguments", self.argument_bytes, f"({roles})" if roles else ""),
            ("outputs", self.output_bytes, ""),
            ("aliased", self.alias_bytes, "(outputs in donated arguments)"),
            ("temporaries", self.temp_bytes, ""),
            ("peak", self.peak_bytes, "(arguments + outputs - aliased + temporaries)"),
            ("host", self.host_bytes, "(host-offloaded)"),
        ):
            lines.append(f"  {label:<16}{format_bytes(value):>12}  {note}".rstrip())
        lines.append("Work per device per step")
        lines.append(f"  {'FLOPs':<16}{format_flops(self.flops):>12}")
        lines.append(f"  {'bytes accessed':<16}{format_bytes(self.bytes_accessed):>12}")
        if self.unknown_loops:
            lines.append(f"  ({self.unknown_loops} loop(s) of unknown trip count counted once)")
        if self.uncosted:
            lines.append(f"  (FLOPs at least: {len(self.uncosted)} custom call(s) not costed: "
                         f"{', '.join(self.uncosted[:4])})")
        lines.append("Collectives per device per step (how many, their bytes in all, the bytes "
                     "sent)")
        if not self.collectives:
            lines.append("  none")
        for c in self.collectives.values():
            lines.append(f"  {c.kind:<20}{c.count:>4} "
                         f"op{'s' if c.count > 1 else ' '}{format_bytes(c.bytes):>12}  sent "
                         f"{format_bytes(c.wire_bytes):>11}  over {', '.join(c.axes) or '?'}")
        lines.append("Held whole along an axis that could split them: "
                     f"{format_bytes(self.replicated_bytes)}")
        for a in self.replicated[:5]:
            lines.append(f"  {a.path} {a.shape} {a.layout}: {format_bytes(a.bytes)}, whole along "
                         f"{', '.join(a.axes)}")
        lines.append("Largest arrays per device")
        for a in self.largest_arrays:
            lines.append(f"  {format_bytes(a.bytes):>11}  {a.path} {a.dtype}{list(a.shape)} "
                         f"{a.layout}")
        lines.append(f"Estimate: {self.estimate('h100')}")
        return "\n".join(lines)


def _budget(memory_per_device: Any) -> int:
    if isinstance(memory_per_device, (str, Accelerator)):
        return accelerator(memory_per_device).memory
    if (not isinstance(memory_per_device, (int, np.integer)) or isinstance(memory_per_device, bool)
            or (memory_per_device <= 0)):
        raise ValueError(f"memory_per_device={memory_per_device!r} must be a positive number of "
                         "bytes (e.g. 16 << 30) or an accelerator name such as 'h100'.")
    return int(memory_per_device)


def memory_of(compiled: Any) -> dict[str, int]:
    """XLA's memory analysis of a compiled program, as `MEMORY_FIELDS` (0 where XLA gives none)."""
    stats = compiled.memory_analysis()
    return {k: int(getattr(stats, k, 0) or 0) for k in MEMORY_FIELDS}


def read_plan(program: Any, *, memory: Mapping[str, int] | None = None,
              mesh: Mapping[str, int] | None = None, state_bytes: Mapping[str, int] | None = None,
              largest_arrays: Sequence[ArrayPlan] = (), replicated: Sequence[ArrayPlan] = (),
              axis_types: Mapping[str, jax.sharding.AxisType] | None = None,
              compiled_on: str = "", started: float | None = None,
              scopes: str | None = None) -> Plan:
    """The `Plan` of a compiled program: its FLOPs, bytes accessed and collectives (`program_cost`),
    its memory (XLA's memory analysis) and what the caller knows of its arguments.

    Args:
        program: a compiled program (``jitted.lower(...).compile()``) or its text
            (``compiled.as_text()``).
        memory: XLA's memory analysis as `MEMORY_FIELDS`; read from ``program`` when it is compiled.
        mesh: the mesh's axis sizes (names the collectives' axes); None: ``{"devices": 1}``.
        state_bytes: the arguments' bytes per device by role (`bytes_per_device`).
        largest_arrays: the largest arrays (the ten largest are kept).
        replicated: variables held whole along an axis that could split them.
        axis_types: the axis types the program runs with.
        compiled_on: where it was compiled.
        started: `time.perf_counter` when planning started (for ``plan_seconds``).
        scopes: the text the kernels' named scopes are read from (``attention``,
            ``grouped_matmul``, ``moe_dispatch``): the lowered module's
            ``as_text(debug_info=True)``. None: ``program``'s text. Pass it where ``program`` may
            come from JAX's persistent compilation cache, whose key leaves the op names out (a
            program loaded from it carries those of the first one compiled).

    Returns:
        The `Plan`.

    Raises:
        ValueError: for program text without a module (``program_cost``) or without ``memory``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((8, 4)), jnp.ones((4, 2)))
        >>> plan = read_plan(compiled.compile(), state_bytes={"a": 128, "b": 32})
        >>> plan.flops, plan.output_bytes, plan.lower_bound
        (128.0, 64, False)
    """
    started = time.perf_counter() if started is None else started
    if memory is None:
        if isinstance(program, str):
            raise ValueError("read_plan(program=<text>) needs memory=: XLA's memory analysis of "
                             "the program (the text alone does not say it).")
        memory = memory_of(program)
    text = program if isinstance(program, str) else program.as_text()
    scopes = text if scopes is None else scopes
    mesh = dict(mesh) if mesh else {"devices": 1}
    names = tuple(mesh)
    cost = program_cost(text, axis_names=names, axis_sizes=tuple(mesh.values()))
    kinds: dict[str, list] = {}
    for op in cost.collectives:
        kinds.setdefault(op.kind, []).append(op)
    collectives = {kind: CollectivePlan(
        kind, sum(o.times for o in ops), sum(o.times * o.bytes for o in ops),
        sum(o.times * o.wire_bytes for o in ops),
        tuple(a for a in names if any(a in o.axes for o in ops)))
        for kind in COLLECTIVE_KINDS if (ops := kinds.get(kind))}
    arg, out, alias, temp = (int(memory.get(f"{k}_size_in_bytes", 0))
                             for k in ("argument", "output", "alias", "temp"))
    host = sum(int(memory.get(f"host_{k}_size_in_bytes", 0))
               for k in ("argument", "output", "temp"))
    replicated = tuple(sorted(replicated, key=lambda a: -a.bytes))
    return Plan(
        mesh=mesh, argument_bytes=arg, output_bytes=out, alias_bytes=alias, temp_bytes=temp,
        peak_bytes=arg + out - alias + temp, host_bytes=host, state_bytes=dict(state_bytes or {}),
        largest_arrays=tuple(sorted(largest_arrays, key=lambda a: -a.bytes)[:10]), flops=cost.flops,
        transcendentals=cost.transcendentals, bytes_accessed=cost.bytes_accessed,
        collectives=collectives, replicated_bytes=sum(a.bytes for a in replicated),
        replicated=replicated, unknown_loops=cost.unknown_loops,
        plan_seconds=time.perf_counter() - started, compiled_on=compiled_on,
        axis_types=dict(axis_types or {}), moe_dispatch=moe_dispatch(scopes),
        uncosted=cost.uncosted, attention=scoped(scopes, ATTENTION_SCOPE),
        grouped_matmul=scoped(scopes, GROUPED_MATMUL_SCOPE), model_flops=cost.model_flops)
