"""What a compiled program does per device per step: FLOPs, bytes accessed, collectives
(`program_cost`).

The one counter every consumer reads (plans, the Trainer's utilisation, the benchmarks). It walks
the compiled module (``compiled.as_text()``: the SPMD-partitioned program every device runs) and
counts what the device executes:

* ``flops``: a ``dot`` ``2 x output elements x contracted elements``; a ``convolution`` as XLA
  counts it (the window positions that read the input); a ``ragged-dot`` (a grouped matmul XLA keeps
  whole) the grouped product; an elementwise or reduction op one per element; transcendentals
  (``exp``, ``tanh``, ...) separately. On CPU this is what XLA's ``compiled.cost_analysis()``
  counts. Fusions count what they fuse. Custom calls, which XLA's analysis counts as 0, count what
  they compute (`jaxdist.costs.kernels`); one whose work the text does not give is named in
  `ProgramCost.uncosted`, and the FLOPs are then a lower bound (`ProgramCost.lower_bound`).
* loops: XLA's analysis counts the body of a ``while`` once; here each body counts once per
  iteration (the ``known_trip_count`` XLA records; a loop without one counts once and shows in
  ``unknown_loops``).
* ``bytes_accessed``: operands plus results of each op that is not fused into another, loops
  multiplied: the memory traffic of the schedule.
* ``collectives``: every all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute
  with its operand and result bytes, group size, mesh axes and how many times it runs. XLA:CPU
  computes 16-bit float collectives in float32; one whose operand was converted from 16 bits, or
  whose result is converted back, is counted at its 16-bit size (what GPU and TPU move). XLA:CPU
  writes a reduce-scatter as an all-reduce each device slices its part of: it is counted as the
  reduce-scatter it is.
* ``recomputed_flops``: the part of ``flops`` that recomputes forward work for the backward pass
  (the ops XLA names ``rematted_computation`` under ``jax.checkpoint``, the scores a flash-attention
  backward kernel recomputes); ``skipped_flops``: work the model's math asks for that a kernel skips
  (the masked half of causal attention in cuDNN). ``model_flops = flops - recomputed_flops +
  skipped_flops`` is the model's work, attention counted whole as in the 6N + 12LdT count: the basis
  of model FLOPs utilisation.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.costs.kernels import conv_flops, custom_call_cost, custom_call_target, ragged_dot_op
from jaxdist.costs.text import Instr, arrays, elements, op_name, parse
from jaxdist.costs.text import array_bytes as _type_bytes

__all__ = ["COLLECTIVE_KINDS", "CollectiveOp", "ProgramCost", "program_cost"]

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                    "collective-permute")
_CALLS = re.compile(r"\b(?:calls|body|condition|to_apply)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_NARROW = re.compile(r"(?:bf16|f16)\[")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_REMAT = "rematted_computation"
_NO_TRAFFIC = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
    "replica-id", "iota", "add-dependency", "opt-barrier", "all-gather-done", "all-reduce-done",
    "collective-permute-done", "async-done", "copy-done", "send-done", "recv-done",
})
_TRANSCENDENTAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "sine",
    "cosine", "tan", "atan2", "sqrt", "rsqrt", "cbrt", "power", "erf",
})
_ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "compare",
    "select", "clamp", "and", "or", "xor", "not", "remainder", "sign", "floor", "ceil",
    "round-nearest-afz", "round-nearest-even", "is-finite", "shift-left", "shift-right-arithmetic",
    "shift-right-logical",
})


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective of a compiled module.

    Attributes:
        name: the HLO instruction's name.
        kind: ``"all-gather"``, ``"reduce-scatter"``, ``"all-reduce"``, ``"all-to-all"`` or
            ``"collective-permute"`` (async ``-start`` forms under their base kind).
        operand_bytes: bytes each device hands the collective.
        result_bytes: bytes each device gets back.
        group_size: devices in each of its groups.
        axes: the mesh axes its groups span (empty when they cannot be told).
        times: how many times it runs per call of the program (loops multiply).

    Examples:
        >>> op = CollectiveOp("ag", "all-gather", 256, 2048, 8, ("fsdp",), 1)
        >>> op.bytes, op.wire_bytes
        (2048, 1792.0)
    """

    name: str
    kind: str
    operand_bytes: int
    result_bytes: int
    group_size: int
    axes: tuple[str, ...]
    times: int = 1

    @property
    def bytes(self) -> int:
        """The whole buffer's bytes on one device: the gathered result of an all-gather, the reduced
        operand of a reduce-scatter or all-reduce, the exchanged operand of all-to-all / permute."""
        return max(self.operand_bytes, self.result_bytes)

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends under the bandwidth-optimal (ring) algorithm: all-reduce
        ``2(n-1)/n B``, all-gather / reduce-scatter / all-to-all ``(n-1)/n B``, permute ``B`` (``B``
        = `bytes`)."""
        n, b = self.group_size, self.bytes
        if n <= 1 and self.kind != "collective-permute":
            return 0.0
        return {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(self.kind,
                                                                               (n - 1) / n) * b


class _Undercount:
    """``lower_bound`` for the costs that count ``uncosted`` custom calls and ``unknown_loops``:
    `ProgramCost`, `jaxdist.costs.Plan` and `jaxdist.costs.StepCost`."""

    __slots__ = ()
    uncosted: tuple[str, ...]
    unknown_loops: int

    @property
    def lower_bound(self) -> bool:
        """Whether ``flops`` may fall short: an uncosted custom call, or a loop of unknown trips."""
        return bool(self.uncosted) or self.unknown_loops > 0


@dataclasses.dataclass(frozen=True)
class ProgramCost(_Undercount):
    """What one call of a compiled program costs on one device (see the module doc).

    Attributes:
        flops: floating-point operations (transcendentals excluded), loop bodies counted per
            iteration, custom calls by what they compute.
        transcendentals: transcendental operations, the same way.
        bytes_accessed: memory traffic of the ops that are not fused into others.
        collectives: the collectives, in program order.
        unknown_loops: loops whose trip count XLA did not record (counted once).
        uncosted: the custom calls whose work could not be told (``"target (op name)"``, once each):
            counted as 0, so ``flops`` is a lower bound while any is named.
        kernels: FLOPs by the kind of custom call that does them (``{"cuBLAS gemm": ..., "cuDNN
            attention": ...}``), loops multiplied; the rest of ``flops`` is XLA's own code.
        recomputed_flops: the part of ``flops`` that recomputes forward work for the backward pass.
        skipped_flops: FLOPs of the model's math that kernels skip (causal attention's masked half):
            not in ``flops``.

    Examples:
        >>> ProgramCost(10.0, 0.0, 4.0, (), uncosted=("my_kernel (jit(f)/my_kernel)",)).lower_bound
        True
    """

    flops: float
    transcendentals: float
    bytes_accessed: float
    collectives: tuple[CollectiveOp, ...]
    unknown_loops: int = 0
    uncosted: tuple[str, ...] = ()
    kernels: dict[str, float] = dataclasses.field(default_factory=dict)
    recomputed_flops: float = 0.0
    skipped_flops: float = 0.0

    @property
    def model_flops(self) -> float:
        """The work the model asks for (the basis of MFU): ``flops`` without recomputation, with
        what kernels skip under a mask."""
        return self.flops - self.recomputed_flops + self.skipped_flops

    @property
    def network_bytes(self) -> float:
        """Bytes each device sends per call, all collectives (bandwidth-optimal algorithms)."""
        return float(sum(c.times * c.wire_bytes for c in self.collectives))


def _dims(attrs: str, key: str) -> tuple[int, ...]:
    m = re.search(key + r"=\{([\d,]*)\}", attrs)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def _dot_flops(instr: Instr, types: dict[str, str]) -> float:
    lhs = arrays(types.get(instr.operands[0], "")) if instr.operands else []
    if not lhs:
        return 0.0
    contracted = math.prod(lhs[0][1][d] for d in _dims(instr.attrs, "lhs_contracting_dims")
                           if d < len(lhs[0][1]))
    return 2.0 * elements(instr.type) * contracted


def _group_ids(attrs: str, devices: int) -> list[list[int]] | None:
    """The device (partition) ids of each group of a collective; None when given by mesh axes."""
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        groups, size = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return ids.reshape(groups, size).tolist()
    for key in ("replica_groups", "source_target_pairs"):
        m = re.search(key + r"=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", attrs)
        if m:
            return [[int(x) for x in g.split(",") if x]
                    for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    if "replica_groups={}" in attrs or "replica_groups=" not in attrs:
        return [list(range(devices))]
    return None


def _mesh_groups(attrs: str, axis_names: Sequence[str]) -> tuple[int, tuple[str, ...]] | None:
    """``replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``: (group size, axes)."""
    m = re.search(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<used>[^}]*)\}", attrs)
    if not m:
        return None
    sizes = {k.strip().strip("'\""): int(v)
             for k, v in re.findall(r"([^,=]+)=(\d+)", m.group("axes"))}
    order = list(sizes)
    used = [a.strip().strip("'\"") for a in m.group("used").split(",") if a.strip()]
    used = [re.sub(r":\(.*\)$", "", a) for a in used]
    size = math.prod(sizes.get(a, 1) for a in used)

    def named(a: str) -> str:  # XLA may rename the mesh's axes axis_0, axis_1, ... in mesh order
        i = order.index(a) if a in order else -1
        return axis_names[i] if a not in axis_names and 0 <= i < len(axis_names) else a

    return size, tuple(named(a) for a in used)


def _axes_of(groups: list[list[int]], shape: Sequence[int],
             axis_names: Sequence[str]) -> tuple[str, ...]:
    total = math.prod(shape)
    used: set[str] = set()
    # every group of a collective spans the same axes; a permute's pairs may differ
    for group in groups[:64]:
        if len(group) < 2 or not shape or max(group) >= total:
            continue
        coords = np.array(np.unravel_index(group, tuple(shape)))
        used.update(a for a, row in zip(axis_names, coords, strict=True)
                    if len(set(row.tolist())) > 1)
    return tuple(a for a in axis_names if a in used)


def _part_values(instr: Instr, users: dict[str, list[Instr]]) -> list[list[str]]:
    """For each operand of a collective, the names its result part is read through (the collective
    itself, or the ``get-tuple-element``s of a combined one)."""
    if not instr.type.startswith("("):
        return [[instr.name]]
    getters = [u for u in users.get(instr.name, []) if u.op == "get-tuple-element"]
    return [[g.name for g in getters if re.search(rf"\bindex={j}\b", g.attrs)]
            for j in range(len(instr.operands))]


def _sliced(values: list[str], part: str, size: int, users: dict[str, list[Instr]],
            converts: Callable[[Instr], bool]) -> bool:
    """Every device only slices its 1/``size`` of the all-reduced ``part`` (after converting it back
    to 16 bits, where XLA:CPU widened it): XLA:CPU's reduce-scatter (GPU and TPU compilers turn the
    pattern into one)."""
    consumers = [u for v in values for u in users.get(v, [])]
    consumers = [c for u in consumers for c in (
        users.get(u.name, []) if elements(u.type) == elements(part) and converts(u) else [u])]
    return size > 1 and bool(values) and bool(consumers) and all(
        u.op in ("dynamic-slice", "fusion") and elements(u.type) * size == elements(part)
        for u in consumers)


def _mesh_of(compiled: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The axis names and sizes of the mesh a compiled program's inputs are on (empty: none)."""
    try:
        shardings = jax.tree.leaves(compiled.input_shardings)
    except Exception:  # an executable without sharding information: collectives get no axis names
        return (), ()
    for sharding in shardings:
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and getattr(mesh, "axis_names", None):
            return tuple(mesh.axis_names), tuple(mesh.shape.values())
    return (), ()


def program_cost(compiled_or_text: Any, *, axis_names: Sequence[str] | None = None,
                 axis_sizes: Sequence[int] | None = None) -> ProgramCost:
    """What one call of a compiled program does on one device: FLOPs (loops multiplied, custom calls
    costed), bytes accessed and collectives (see the module doc). The count `jaxdist.Plan` reports
    as ``flops``.

    Args:
        compiled_or_text: a compiled program (``jax.jit(f).lower(...).compile()``, a
            `jax.stages.Compiled`) or its text (``compiled.as_text()``, e.g. from a GPU or TPU).
        axis_names: the mesh's axis names, in order, to say which axes each collective runs over
            (default: the mesh of a compiled program's inputs; none for text).
        axis_sizes: their sizes (partition ``i`` is the mesh's ``i``-th device in row-major order).

    Returns:
        A `ProgramCost`.

    Raises:
        ValueError: for an argument that is neither a compiled program nor its text (a
            `jax.stages.Lowered` among them: compile it first), or names and sizes of unequal count.

    Examples:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> def f(w, x):
        ...     return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=10)[0]
        >>> cost = jd.program_cost(jax.jit(f).lower(jnp.ones((4, 4)), jnp.ones((2, 4))).compile())
        >>> cost.flops >= 10 * 2 * 2 * 4 * 4, cost.uncosted  # ten dots of (2, 4) x (4, 4)
        (True, ())
    """
    if isinstance(compiled_or_text, str):
        text = compiled_or_text
        names, sizes = (), ()
    elif isinstance(compiled_or_text, jax.stages.Compiled):
        text = compiled_or_text.as_text()
        names, sizes = _mesh_of(compiled_or_text)
    else:
        fix = ("compile it first: program_cost(lowered.compile())"
               if isinstance(compiled_or_text, jax.stages.Lowered)
               else "pass jax.jit(f).lower(*args).compile() or its .as_text()")
        raise ValueError(f"compiled_or_text={type(compiled_or_text).__name__} is not a compiled "
                         f"program or its text: {fix}.")
    names = tuple(axis_names) if axis_names is not None else names
    sizes = tuple(int(s) for s in axis_sizes) if axis_sizes is not None else sizes
    if names and sizes and len(names) != len(sizes):
        raise ValueError(f"axis_names={names!r} and axis_sizes={sizes!r} differ in length: give "
                         "one size per mesh axis, in the mesh's order.")
    return _walk_module(text, names, sizes)


def _walk_module(text: str, axis_names: Sequence[str], axis_sizes: Sequence[int]) -> ProgramCost:
    module = parse(text)
    computations, entry, types = module.computations, module.entry, module.types
    users: dict[str, dict[str, list[Instr]]] = {}
    for cname, instrs in computations.items():
        table = users[cname] = {}
        for instr in instrs:
            for o in instr.operands:
                table.setdefault(o, []).append(instr)
    defs = {i.name: i for instrs in computations.values() for i in instrs}

    def fused_converts(instr: Instr, into16: bool) -> bool:
        """A fusion holding a convert from (``into16`` False) or to (True) a same-size 16-bit
        float."""
        return any(i.op == "convert"
                   and bool(_NARROW.match(i.type if into16 else types.get(i.operands[0], "")))
                   and elements(i.type) in (elements(instr.type), 0)
                   for c in _CALLS.findall(instr.attrs) for i in computations.get(c, ())
                   if i.operands)

    def narrows(u: Instr) -> bool:
        return ((u.op == "convert" and bool(_NARROW.match(u.type)))
                or (u.op == "fusion" and fused_converts(u, True)))

    def widened(value: str, part: str, reads: list[str], table: dict[str, list[Instr]]) -> bool:
        """XLA:CPU computes a 16-bit float collective in float32: the operand ``value`` (of type
        ``part``) was converted from 16 bits, or every consumer of its result (read through
        ``reads``) converts it back."""
        if not part.startswith("f32["):
            return False
        source = defs.get(value)
        if source is not None and source.operands and (
                (source.op == "convert" and _NARROW.match(types.get(source.operands[0], ""))) or
                (source.op == "fusion" and fused_converts(source, into16=False))):
            return True
        consumers = [u for r in reads for u in table.get(r, [])]
        return bool(consumers) and all(narrows(u) for u in consumers)

    devices = math.prod(axis_sizes) if axis_sizes else 1
    header = re.search(r"num_partitions=(\d+)", text.split("\n", 1)[0])
    if header and not axis_sizes:
        devices = int(header.group(1))
    collectives: list[CollectiveOp] = []
    unknown = [0]
    uncosted: dict[str, None] = {}
    kernels: dict[str, float] = {}
    skipped = [0.0]

    def walk(name: str, times: int, fused: bool) -> tuple[float, float, float, float]:
        """(flops, transcendentals, bytes, recomputed flops) of one call of computation ``name``;
        collectives and kernels recorded with ``times`` (once per computation and multiplier: a
        computation called from two places is walked twice)."""
        flops = trans = traffic = redo = 0.0
        for instr in computations.get(name, ()):
            op = instr.op
            base = op.removesuffix("-start")
            if base in COLLECTIVE_KINDS:
                table = users.get(name, {})
                parts = [types.get(o, "") for o in instr.operands]
                start = op.endswith("-start")  # async (GPU, TPU): as the backend wrote it
                values = [[] for _ in parts] if start else _part_values(instr, table)
                narrow = [1 if start or not widened(o, part, v, table) else 2
                          for o, part, v in zip(instr.operands, parts, values, strict=True)]
                operand = sum(_type_bytes(part) // n for part, n in zip(parts, narrow, strict=True))
                results = arrays(instr.type)
                if start:  # the result is (operands, outputs[, context])
                    result = (max(_type_bytes(instr.type) - operand, 0) if base != "all-reduce"
                              else operand)
                elif len(results) == len(parts):
                    result = sum(_type_bytes(f"{d}[{','.join(map(str, shape))}]") // n
                                 for (d, shape), n in zip(results, narrow, strict=True))
                else:
                    result = _type_bytes(instr.type)
                mesh = _mesh_groups(instr.attrs, axis_names)
                if mesh is not None:
                    size, axes = mesh
                else:
                    groups = _group_ids(instr.attrs, devices) or [list(range(devices))]
                    size = 2 if base == "collective-permute" else len(groups[0])
                    axes = _axes_of(groups, axis_sizes, axis_names)
                if base == "all-reduce" and not start:
                    scattered = sum(_type_bytes(part) // n
                                    for part, n, v in zip(parts, narrow, values, strict=True)
                                    if _sliced(v, part, size, table, narrows))
                    # XLA:CPU's reduce-scatter: an all-reduce each device slices its part of
                    if scattered:
                        collectives.append(CollectiveOp(instr.name, "reduce-scatter", scattered,
                                                        scattered // size, size, axes, times))
                        operand, result = operand - scattered, result - scattered
                if operand or result:
                    collectives.append(CollectiveOp(instr.name, base, operand, result, size, axes,
                                                    times))
                traffic += operand + result
                continue
            if op == "while":
                trips = _TRIPS.search(instr.attrs)
                n = int(trips.group(1)) if trips else 1
                unknown[0] += trips is None
                for called in _CALLS.findall(instr.attrs):
                    f, t, b, r = walk(called, times * n, fused)
                    flops, trans = flops + n * f, trans + n * t
                    traffic, redo = traffic + n * b, redo + n * r
                continue
            if op == "conditional":
                branches = _BRANCHES.search(instr.attrs)
                names = [b.strip().lstrip("%")
                         for b in branches.group(1).split(",")] if branches else []
                names += re.findall(r"(?:true|false)_computation=%([\w.\-]+)", instr.attrs)
                costs = [walk(b, times, fused) for b in names] or [(0.0, 0.0, 0.0, 0.0)]
                f, t, b, r = max(costs)
                flops, trans, traffic, redo = flops + f, trans + t, traffic + b, redo + r
                continue
            if op in ("call", "async-start"):
                for called in _CALLS.findall(instr.attrs):
                    f, t, b, r = walk(called, times, fused)
                    flops, trans, traffic, redo = flops + f, trans + t, traffic + b, redo + r
                continue
            work = 0.0
            if op == "fusion":
                for called in _CALLS.findall(instr.attrs):
                    f, t, _, r = walk(called, times, True)
                    flops, trans, redo = flops + f, trans + t, redo + r
            elif op == "custom-call":
                kernel = custom_call_cost(instr, module)
                if kernel is None:
                    uncosted[f"{custom_call_target(instr) or '?'} "
                             f"({op_name(instr) or instr.name})"] = None
                else:
                    flops, trans, redo = (flops + kernel.flops, trans + kernel.transcendentals,
                                          redo + kernel.recomputed)
                    skipped[0] += times * kernel.skipped
                    if kernel.flops:
                        kernels[kernel.kind] = kernels.get(kernel.kind, 0.0) + times * kernel.flops
            elif op == "dot":
                work = _dot_flops(instr, types)
            elif op == "convolution":
                work = conv_flops(instr, types)
            elif op == "ragged-dot":  # the grouped product, whatever the group sizes
                work = ragged_dot_op(instr, types)
            elif op in _TRANSCENDENTAL:
                trans += elements(instr.type)
            elif op in _ELEMENTWISE:
                work = elements(instr.type)
            elif op in ("reduce", "reduce-window"):
                work = elements(types.get(instr.operands[0], "")) if instr.operands else 0
            flops += work
            if work and _REMAT in op_name(instr):
                redo += work
            if not fused and op not in _NO_TRAFFIC:
                traffic += _type_bytes(instr.type) + sum(_type_bytes(types.get(o, ""))
                                                         for o in instr.operands)
        return flops, trans, traffic, redo

    flops, trans, traffic, redo = walk(entry, 1, False) if entry else (0.0, 0.0, 0.0, 0.0)
    return ProgramCost(flops, trans, traffic, tuple(collectives), unknown[0], tuple(uncosted),
                       kernels, redo, skipped[0])
