"""Plans: what a step costs on a strategy's layout — memory, FLOPs, collectives, time — without running it.

``strategy.jit(step).plan(*args)`` (or ``strategy.plan(step, *args, batch_argnums=...)``) lowers and compiles
the step for the strategy's layout and reads the compiled program; the step never runs and its arguments are
never allocated: they may be real values or `jax.ShapeDtypeStruct`s (``jax.eval_shape(init)``, for a model
too big for this machine). Arguments without a layout get the one the step would give them (a declared batch
split over the batch axes; everything else the strategy's variable layout), so the plan is the program a call
would compile. On a mesh without devices (`jaxdist.strategies.plan._plan_mesh.plan_mesh`) the program is lowered
here and compiled in a subprocess with that many simulated CPU devices.

A `Plan` holds, per device (the SPMD program every device runs; uneven shards counted at the largest):

* memory, from XLA's memory analysis of the compiled program: ``argument_bytes``, ``output_bytes``,
  ``alias_bytes`` (outputs written into donated arguments), ``temp_bytes``, ``peak_bytes`` (arguments +
  outputs - aliased + temporaries: an upper bound, as if all were live at once), ``host_bytes``
  (host-offloaded arguments, outputs and temporaries);
* ``state_bytes``: the arguments' bytes by role (``params``, ``opt_state``, ``batch``, ... : a batch
  argument is ``batch``; an argument with named parts such as a ``TrainState`` is split by part; any other
  argument is named by its parameter) and ``largest_arrays``, the ten largest with their layouts;
* ``flops`` and ``bytes_accessed`` per step: `jaxdist.costs.program_cost` of the compiled program (loop bodies
  counted once per iteration; cuBLAS, cuDNN and Pallas kernels by what they compute; ``uncosted`` names a custom
  call it could not cost, and the FLOPs are then a lower bound);
* ``collectives``: per kind, how many run per step, their bytes and the mesh axes they run over;
* ``replicated_bytes``: the bytes of variables held whole along a mesh axis that could split them (an FSDP
  or model axis of size > 1 that divides a dimension not yet split, for variables of at least
  ``min_shard_size`` elements), the variables named in ``replicated``: a rule that matched nothing
  (a typo, a renamed layer) shows up here before it shows up as an out-of-memory error.

``plan.estimate(accelerator="h100")`` is a roofline step time (`jaxdist.costs.roofline`);
``plan.fits(memory_per_device)`` compares ``peak_bytes`` with a budget; ``str(plan)`` is a readable table.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxdist.costs import COLLECTIVE_KINDS, Accelerator, Estimate, accelerator, program_cost, roofline
from jaxdist.costs.scopes import ATTENTION_SCOPE, GROUPED_MATMUL_SCOPE, moe_dispatch, scoped
from jaxdist.replicate.layouts import entry_axes, path_name, spec_axes
from jaxdist.strategies.input import argument_layouts
from jaxdist.strategies.layout import nnx_layouts
from jaxdist.strategies.plan._plan_mesh import MEMORY_FIELDS, compile_elsewhere, is_plan_mesh

__all__ = ["ArrayPlan", "CollectivePlan", "Plan", "plan_step"]


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
        bytes: the buffers' bytes per device per step (an all-gather's gathered result, a reduction's operand).
        wire_bytes: what each device sends per step under the bandwidth-optimal algorithms.
        axes: the mesh axes they run over.
    """

    kind: str
    count: int
    bytes: int
    wire_bytes: float
    axes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one call of a compiled step costs on each device (see the module doc).

    Attributes:
        mesh: the mesh's axis sizes.
        argument_bytes: the step's arguments on one device (XLA's memory analysis).
        output_bytes: its outputs.
        alias_bytes: outputs written into donated arguments.
        temp_bytes: temporaries.
        peak_bytes: arguments + outputs - aliased + temporaries (an upper bound).
        host_bytes: host-offloaded arguments, outputs and temporaries.
        state_bytes: the arguments' bytes by role (``params``, ``opt_state``, ``batch``, an argument's name).
        largest_arrays: the ten largest arrays (`ArrayPlan`), with their layouts.
        flops: floating-point operations per step (`jaxdist.costs.program_cost`), every loop iteration counted,
            custom calls (cuBLAS, cuDNN, Pallas kernels) by what they compute.
        transcendentals: transcendental operations per step.
        bytes_accessed: memory traffic per step.
        collectives: ``{kind: CollectivePlan}``.
        replicated_bytes: bytes of variables held whole along an axis that could split them.
        replicated: those variables (`ArrayPlan` with ``axes``), largest first.
        unknown_loops: loops whose trip count XLA did not record (counted once).
        plan_seconds: how long planning took (lowering and compiling).
        compiled_on: where the program was compiled.
        axis_types: ``{axis: jax.sharding.AxisType}`` the program runs with: the mesh's own, or Auto where its
            Explicit axes run Auto because the step does not type-check with them (see
            `jaxdist.strategies.layout._axis_types`).
        moe_dispatch: how the program's mixture-of-experts layers (`jaxdist.nn.MoE`) move tokens:
            ``"dropping_all_to_all"`` / ``"dropless_padded_all_to_all"`` (expert parallelism: a capacity
            buffer, or a worst-case one), ``"dropless_ragged_all_to_all"`` (expert parallelism: only the routed
            rows move, grouped matmuls: GPU / TPU; ``..._emulated`` where the exchange runs emulated on CPU),
            ``"dropping_local"`` / ``"dropless_local"`` (every expert on each device),
            ``"dropless_ragged_local"`` (every expert local, grouped matmuls: GPU / TPU); empty without such
            layers.
        uncosted: custom calls whose work could not be told (counted as 0: ``flops`` is then a lower bound).
        attention: the kernels `jaxdist.nn.dot_product_attention` computes with (``"cudnn"``, ``"xla"``,
            ``"einsum"``; `jaxdist.costs.scopes`); empty without it.
        grouped_matmul: the grouped-matmul kernels of the dropless mixture-of-experts layers
            (``"ragged_dot"``: `jax.lax.ragged_dot`, ``"tokamax"``: ``tokamax.ragged_dot``); empty without.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.ShardedStrategy(min_shard_size=1)
        >>> w = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
        >>> x = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
        >>> plan = strategy.plan(lambda w, x: w - 0.1 * jax.grad(lambda w: ((x @ w) ** 2).mean())(w), w, x,
        ...                      batch_argnums=1)
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

    @property
    def num_devices(self) -> int:
        """How many devices the step is partitioned over."""
        return math.prod(self.mesh.values())

    @property
    def network_bytes(self) -> float:
        """Bytes each device sends per step, all collectives together (bandwidth-optimal algorithms)."""
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
                        lower_bound_flops=bool(self.uncosted) or self.unknown_loops > 0)

    def fits(self, memory_per_device: int | str | Accelerator) -> bool:
        """Whether ``peak_bytes`` fits ``memory_per_device``.

        Args:
            memory_per_device: bytes (``16 << 30``), or an accelerator (its HBM).

        Raises:
            ValueError: for a budget that is not a positive int, or an unknown accelerator.
        """
        return self.peak_bytes <= _budget(memory_per_device)

    def __str__(self) -> str:
        lines = [f"Plan for mesh {self.mesh} ({self.num_devices} devices), {self.compiled_on}, "
                 f"planned in {self.plan_seconds:.2f} s"]
        auto = [a for a, t in self.axis_types.items() if t == jax.sharding.AxisType.Auto]
        explicit = [a for a, t in self.axis_types.items() if t == jax.sharding.AxisType.Explicit]
        lines.append("Axis types: " + "; ".join(
            f"{label} {', '.join(axes)}" for label, axes in (("Explicit", explicit), ("Auto", auto)) if axes))
        if self.moe_dispatch:
            lines.append("MoE dispatch: " + ", ".join(p.replace("_", " ") for p in self.moe_dispatch))
        for label, kernels in (("Attention", self.attention), ("Grouped matmuls", self.grouped_matmul)):
            if kernels:
                lines.append(f"{label}: " + ", ".join(kernels))
        lines.append("Memory per device")
        roles = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.state_bytes.items())
        for label, value, note in (
            ("arguments", self.argument_bytes, f"({roles})" if roles else ""),
            ("outputs", self.output_bytes, ""), ("aliased", self.alias_bytes, "(outputs in donated arguments)"),
            ("temporaries", self.temp_bytes, ""), ("peak", self.peak_bytes, "(arguments + outputs - aliased + "
                                                                          "temporaries)"),
            ("host", self.host_bytes, "(host-offloaded)"),
        ):
            lines.append(f"  {label:<16}{format_bytes(value):>12}  {note}".rstrip())
        lines.append("Work per device per step")
        lines.append(f"  {'FLOPs':<16}{format_count(self.flops):>12}")
        lines.append(f"  {'bytes accessed':<16}{format_bytes(self.bytes_accessed):>12}")
        if self.unknown_loops:
            lines.append(f"  ({self.unknown_loops} loop(s) of unknown trip count counted once)")
        if self.uncosted:
            names = ", ".join(self.uncosted[:4])
            lines.append(f"  (FLOPs at least: {len(self.uncosted)} custom call(s) not costed: {names})")
        lines.append("Collectives per device per step (how many, their bytes in all, the bytes sent)")
        if not self.collectives:
            lines.append("  none")
        for c in self.collectives.values():
            lines.append(f"  {c.kind:<20}{c.count:>4} op{'s' if c.count > 1 else ' '}{format_bytes(c.bytes):>12}  sent "
                         f"{format_bytes(c.wire_bytes):>11}  over {', '.join(c.axes) or '?'}")
        lines.append(f"Held whole along an axis that could split them: {format_bytes(self.replicated_bytes)}")
        for a in self.replicated[:5]:
            lines.append(f"  {a.path} {a.shape} {a.layout}: {format_bytes(a.bytes)}, whole along {', '.join(a.axes)}")
        lines.append("Largest arrays per device")
        for a in self.largest_arrays:
            lines.append(f"  {format_bytes(a.bytes):>11}  {a.path} {a.dtype}{list(a.shape)} {a.layout}")
        e = self.estimate("h100")
        lines.append(f"Estimate: {e}")
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units.

    Examples:
        >>> format_bytes(3 * 2**20), format_bytes(12)
        ('3.00 MiB', '12 B')
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_count(n: float) -> str:
    """``n`` with a decimal prefix (``1.5 G``)."""
    for unit, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f}"


def _budget(memory_per_device: Any) -> int:
    if isinstance(memory_per_device, (str, Accelerator)):
        return accelerator(memory_per_device).memory
    if not isinstance(memory_per_device, (int, np.integer)) or isinstance(memory_per_device, bool) or (
            memory_per_device <= 0):
        raise ValueError(
            f"memory_per_device={memory_per_device!r} must be a positive number of bytes (e.g. 16 << 30) or an "
            "accelerator name such as 'h100'."
        )
    return int(memory_per_device)


# ------------------------------------------------------------------------------------------- arguments
def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def abstract_argument(policy: Any, value: Any, batch: bool, where: str) -> Any:
    """``value`` as `jax.ShapeDtypeStruct`s in the layout a call of the step would give it: its own where it is
    on the strategy's mesh, else a batch's (``batch``) or the variable layout. An nnx graph object comes back
    with abstract state (nothing is moved); Python values are returned as they are.

    Raises:
        ValueError: for a batch whose rows the replicas do not divide.
    """
    if nnx.graph.is_graph_node(value):  # the module's state as abstract values in the layouts a call gives them
        graphdef, state = nnx.split(value)
        layouts, _ = nnx_layouts(policy, state)
        values = [jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x),
                                       sharding=layout if isinstance(layout, jax.sharding.Sharding) else None)
                  for x, layout in zip(jax.tree.leaves(state), layouts, strict=True)]
        return nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(state), values))
    layouts = argument_layouts(policy, value, batch, where)  # what a call places, and where

    def one(x, layout):
        if not _is_array(x):
            return x
        return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x),
                                    sharding=getattr(x, "sharding", None) if layout is None else layout)

    return jax.tree.map(one, value, layouts, is_leaf=lambda x: x is None)


def _per_device(shape: Sequence[int], dtype: Any, sharding: Any) -> tuple[int, list[int]]:
    """(bytes on the device holding the most, parts each dimension is split into)."""
    parts = [1] * len(shape)
    if isinstance(sharding, NamedSharding):
        sizes = dict(sharding.mesh.shape)
        for i, entry in enumerate(sharding.spec):
            parts[i] = math.prod(sizes[n] for n in entry_axes(entry))
    dims = [-(-d // p) for d, p in zip(shape, parts, strict=True)]
    # a typed PRNG key (``key<fry>``) is no NumPy dtype; its dtype knows its size
    itemsize = dtype.itemsize if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else np.dtype(dtype).itemsize
    return math.prod(dims) * itemsize, parts


def _layout_text(sharding: Any) -> str:
    spec = getattr(sharding, "spec", None)
    if spec is None or not any(e is not None for e in spec):
        return "whole"
    return repr(spec)


def _leaves(value: Any) -> list[tuple[Any, Any]]:
    if nnx.graph.is_graph_node(value):
        value = nnx.state(value)
    return [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(value) if _is_array(x)]


def _role(name: str, value: Any, path: tuple) -> str:
    """A variable argument's role: its part for a struct (``TrainState.params``) or a dict holding
    ``"params"``; else the argument's name."""
    if not path:
        return name
    first = path[0]
    if isinstance(first, jax.tree_util.GetAttrKey):
        return first.name
    if isinstance(first, jax.tree_util.DictKey) and isinstance(value, dict) and "params" in value:
        return str(first.key)
    return name


def _state(policy: Any, arguments: Sequence[tuple[str, Any, bool]]) -> tuple[dict, list, list]:
    """(bytes per role, every array as an `ArrayPlan`, the variables held whole along an axis that could
    split them)."""
    roles: dict[str, int] = {}
    arrays: list[ArrayPlan] = []
    replicated: list[ArrayPlan] = []
    mesh_sizes = dict(policy.mesh.shape)
    could_split = [a for a in (*policy.roles.fsdp_axes, *policy.roles.model_axes) if mesh_sizes[a] > 1]
    min_size = policy.rules.min_shard_size
    for name, value, batch in arguments:
        for path, x in _leaves(value):
            shape, dtype = tuple(np.shape(x)), jax.dtypes.result_type(x)
            sharding = getattr(x, "sharding", None)
            size, parts = _per_device(shape, dtype, sharding)
            role = "batch" if batch else _role(name, value, path)
            roles[role] = roles.get(role, 0) + size
            where = f"{name}.{path_name(path).removesuffix('/value')}" if path else name  # a Flax box's value
            plan = ArrayPlan(where, shape, str(dtype), _layout_text(sharding), size)
            arrays.append(plan)
            if batch or not shape or math.prod(shape) < min_size:
                continue
            spec = getattr(sharding, "spec", None) or ()
            used = spec_axes(spec)
            axes = tuple(a for a in could_split if a not in used and any(
                d % (p * mesh_sizes[a]) == 0 for d, p in zip(shape, parts, strict=True)))
            if axes:
                replicated.append(dataclasses.replace(plan, axes=axes))
    return roles, arrays, replicated


# ----------------------------------------------------------------------------------------------- plans
def plan_step(
    policy: Any,
    trace: Callable[..., jax.stages.Traced],
    args: tuple,
    kwargs: dict,
    *,
    axis_types_of: Callable[[jax.stages.Traced], dict[str, jax.sharding.AxisType]],
    names: Sequence[str],
    batch: Sequence[int],
    batch_names: Sequence[str],
    static: Sequence[int],
    static_names: Sequence[str],
) -> Plan:
    """The `Plan` of a step (what ``StrategyFunction.plan`` returns; see the module doc).

    Args:
        policy: the strategy's `LayoutPolicy`.
        trace: the step's ``trace`` (arguments in, `jax.stages.Traced` out, for the strategy's layout).
        axis_types_of: the axis types a traced program runs with.
        args, kwargs: the arguments, bound to the step's positional parameters where they have names.
        names: the step's positional parameter names (for the roles; ``argument i`` beyond them).
        batch, batch_names: the declared batch arguments.
        static, static_names: the static ones.

    Raises:
        ValueError: for a batch the replicas do not divide.
        RuntimeError: when compiling for a plan mesh fails in its subprocess.
    """
    start = time.perf_counter()
    placed, described = [], []
    for i, a in enumerate(args):
        if i in static:
            placed.append(a)
            continue
        name = names[i] if i < len(names) else f"argument {i}"
        placed.append(abstract_argument(policy, a, i in batch, f"argument {i} ({name!r})"))
        described.append((name, placed[-1], i in batch))
    placed_kwargs = {}
    for k, v in kwargs.items():
        if k in static_names:
            placed_kwargs[k] = v
            continue
        placed_kwargs[k] = abstract_argument(policy, v, k in batch_names, f"argument {k!r}")
        described.append((k, placed_kwargs[k], k in batch_names))
    mesh = policy.mesh
    if is_plan_mesh(mesh):  # lowered for the CPU compiler of the subprocess (a mesh without devices has none)
        traced = trace(*placed, **placed_kwargs)
        lowered = traced.lower(lowering_platforms=("cpu",))
        memory, text = compile_elsewhere(lowered.as_text(debug_info=True), mesh.size)  # op names kept
        where = f"compiled for {mesh.size} simulated CPU devices in a subprocess"
    else:
        with policy.call_scope():  # traced and lowered on the strategy's mesh, as a call is
            traced = trace(*placed, **placed_kwargs)
            compiled = traced.lower().compile()
        stats = compiled.memory_analysis()
        memory = {k: int(getattr(stats, k, 0) or 0) for k in MEMORY_FIELDS}
        text = compiled.as_text()
        where = f"compiled here ({mesh.devices.flat[0].platform})"
    cost = program_cost(text, axis_names=mesh.axis_names, axis_sizes=tuple(mesh.shape.values()))
    roles, arrays, replicated = _state(policy, described)
    kinds: dict[str, list] = {}
    for op in cost.collectives:
        kinds.setdefault(op.kind, []).append(op)
    collectives = {
        kind: CollectivePlan(
            kind, sum(o.times for o in kinds[kind]), sum(o.times * o.bytes for o in kinds[kind]),
            sum(o.times * o.wire_bytes for o in kinds[kind]),
            tuple(a for a in mesh.axis_names if any(a in o.axes for o in kinds[kind])),
        )
        for kind in COLLECTIVE_KINDS if kind in kinds
    }
    arg, out, alias, temp = (memory[f"{k}_size_in_bytes"] for k in ("argument", "output", "alias", "temp"))
    host = sum(memory[f"host_{k}_size_in_bytes"] for k in ("argument", "output", "temp"))
    return Plan(
        mesh=dict(mesh.shape), argument_bytes=arg, output_bytes=out, alias_bytes=alias, temp_bytes=temp,
        peak_bytes=arg + out - alias + temp, host_bytes=host, state_bytes=roles,
        largest_arrays=tuple(sorted(arrays, key=lambda a: -a.bytes)[:10]), flops=cost.flops,
        transcendentals=cost.transcendentals, bytes_accessed=cost.bytes_accessed, collectives=collectives,
        replicated_bytes=sum(a.bytes for a in replicated),
        replicated=tuple(sorted(replicated, key=lambda a: -a.bytes)), unknown_loops=cost.unknown_loops,
        plan_seconds=time.perf_counter() - start, compiled_on=where, axis_types=axis_types_of(traced),
        moe_dispatch=moe_dispatch(text), uncosted=cost.uncosted, attention=scoped(text, ATTENTION_SCOPE),
        grouped_matmul=scoped(text, GROUPED_MATMUL_SCOPE),
    )
