"""What a compiled program does per device, read from its HLO text: FLOPs, bytes accessed and collectives.

XLA's own cost analysis (``compiled.cost_analysis()``) counts the body of a ``while`` loop once, however
many times it runs: a model whose layers are a ``lax.scan`` (``nn.scan``, ``nnx.scan``) is undercounted by
the number of layers. This module walks the compiled module instead and multiplies each loop body by its
trip count (the ``known_trip_count`` XLA records on the loop; a loop without one is counted once and
reported in `ModuleCost.unknown_loops`).

What is counted, per device (the SPMD-partitioned program every device runs):

* ``flops``: a ``dot`` ``2 x output elements x contracted elements``; a ``convolution`` ``2 x output
  elements x kernel elements / output features``; an elementwise or reduction op one per element (as
  XLA's analysis counts them); transcendentals (``exp``, ``tanh``, ...) separately, as XLA does. Fusions are
  counted by what they fuse; custom calls (Pallas, cuDNN kernels) count 0.
* ``bytes_accessed``: operands plus results of each op that is not fused into another (a fusion: its
  operands and result), loops multiplied by their trip count: the memory traffic of the schedule.
* ``collectives``: every all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute with its
  operand and result bytes, the size of its device groups, the mesh axes it runs over, and how many times
  it runs (loops multiply). XLA:CPU computes 16-bit float collectives in float32; one whose operand was
  converted from 16 bits, or whose result is converted back, is counted at its 16-bit size (what GPU and TPU
  move). XLA:CPU writes a reduce-scatter as an all-reduce each device slices its part of: it is counted as the
  reduce-scatter it is.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["MOE_SCOPE", "CollectiveOp", "ModuleCost", "moe_dispatch", "module_cost"]

MOE_SCOPE = "jaxdist_moe_"
"""The prefix of the named scope a mixture-of-experts layer runs in (``jaxdist_moe_<dispatch path>``): the
compiled module's op names say which dispatch path a program took (`moe_dispatch`)."""

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_SHAPE = re.compile(r"\b(?P<dtype>pred|token|[a-z]+\d+[a-z0-9]*)\[(?P<dims>[\d,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"\b(?:calls|body|condition|to_apply)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_NARROW = re.compile(r"(?:bf16|f16)\[")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_NO_TRAFFIC = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
    "replica-id", "iota", "add-dependency", "opt-barrier", "all-gather-done", "all-reduce-done",
    "collective-permute-done", "async-done", "copy-done", "send-done", "recv-done",
})
_TRANSCENDENTAL = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "logistic", "sine", "cosine",
    "tan", "atan2", "sqrt", "rsqrt", "cbrt", "power", "erf",
})
_ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "compare", "select",
    "clamp", "and", "or", "xor", "not", "remainder", "sign", "floor", "ceil", "round-nearest-afz",
    "round-nearest-even", "is-finite", "shift-left", "shift-right-arithmetic", "shift-right-logical",
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
        """The whole buffer's bytes on one device: the gathered result of an all-gather, the reduced operand
        of a reduce-scatter or all-reduce, the exchanged operand of an all-to-all or permute."""
        return max(self.operand_bytes, self.result_bytes)

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends under the bandwidth-optimal (ring) algorithm: all-reduce ``2(n-1)/n B``,
        all-gather / reduce-scatter / all-to-all ``(n-1)/n B``, permute ``B`` (``B`` = `bytes`)."""
        n, b = self.group_size, self.bytes
        if n <= 1 and self.kind != "collective-permute":
            return 0.0
        factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(self.kind, (n - 1) / n)
        return factor * b


@dataclasses.dataclass(frozen=True)
class ModuleCost:
    """What one call of a compiled module costs on one device (see the module doc).

    Attributes:
        flops: floating-point operations (transcendentals excluded), loop bodies counted per iteration.
        transcendentals: transcendental operations, the same way.
        bytes_accessed: memory traffic of the ops that are not fused into others.
        collectives: the collectives, in program order.
        unknown_loops: loops whose trip count XLA did not record (counted once).
    """

    flops: float
    transcendentals: float
    bytes_accessed: float
    collectives: tuple[CollectiveOp, ...]
    unknown_loops: int = 0


@dataclasses.dataclass
class _Instr:
    name: str
    type: str
    op: str
    operands: list[str]
    attrs: str


def _dtype_bytes(dtype: str) -> float:
    if dtype in ("pred", "token"):
        return 1 if dtype == "pred" else 0
    bits = re.match(r"[a-z]+(\d+)", dtype)
    return int(bits.group(1)) / 8 if bits else 0


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    text = re.sub(r"/\*.*?\*/", "", type_text)
    return [(m.group("dtype"), tuple(int(d) for d in m.group("dims").split(",") if d)) for m in _SHAPE.finditer(text)]


def _type_bytes(type_text: str) -> int:
    return math.ceil(sum(_dtype_bytes(d) * math.prod(s) for d, s in _arrays(type_text)))


def _elements(type_text: str) -> int:
    arrays = _arrays(type_text)
    return math.prod(arrays[0][1]) if arrays else 0


def _split_type(rest: str) -> tuple[str, str]:
    rest = rest.lstrip()
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[: i + 1], rest[i + 1:]
    return rest, ""


def _balanced(text: str, start: int) -> tuple[str, int]:
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return text[start + 1: i], i + 1
    return text[start + 1:], len(text)


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str | None, dict[str, str]]:
    """``({computation: [instructions]}, entry name, {value name: type})``."""
    computations: dict[str, list[_Instr]] = {}
    types: dict[str, str] = {}
    entry = None
    current: list[_Instr] | None = None
    for line in text.splitlines():
        if current is None:
            if line.endswith("{") and not line.startswith((" ", "HloModule")) and "(" in line:
                is_entry = line.startswith("ENTRY ")
                name = line.removeprefix("ENTRY ").split(" ", 1)[0].lstrip("%")
                current = computations.setdefault(name, [])
                entry = name if is_entry else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _DEF.match(line)
        if not m:
            continue
        type_text, rest = _split_type(m.group("rest"))
        types[m.group("name")] = type_text
        op = re.match(r"\s*([\w\-]+)\(", rest)
        if op is None:
            continue
        args, end = _balanced(rest, op.end() - 1)
        current.append(_Instr(m.group("name"), type_text, op.group(1), _OPERAND.findall(args), rest[end:]))
    return computations, entry, types


def _dims(attrs: str, key: str) -> tuple[int, ...]:
    m = re.search(key + r"=\{([\d,]*)\}", attrs)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def _dot_flops(instr: _Instr, types: dict[str, str]) -> float:
    lhs = _arrays(types.get(instr.operands[0], "")) if instr.operands else []
    if not lhs:
        return 0.0
    contracted = math.prod(lhs[0][1][d] for d in _dims(instr.attrs, "lhs_contracting_dims") if d < len(lhs[0][1]))
    return 2.0 * _elements(instr.type) * contracted


def _conv_flops(instr: _Instr, types: dict[str, str]) -> float:
    kernel = _arrays(types.get(instr.operands[1], "")) if len(instr.operands) > 1 else []
    labels = re.search(r"dim_labels=\w+_(\w+)->", instr.attrs)
    if not kernel or not labels or "o" not in labels.group(1):
        return 0.0
    shape = kernel[0][1]
    out_features = shape[labels.group(1).index("o")] or 1
    return 2.0 * _elements(instr.type) * math.prod(shape) / out_features


def _group_ids(attrs: str, devices: int) -> list[list[int]] | None:
    """The device (partition) ids of each group of a collective, or None when written by mesh axes."""
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        groups, size = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return ids.reshape(groups, size).tolist()
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", attrs)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"source_target_pairs=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", attrs)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    if "replica_groups={}" in attrs or "replica_groups=" not in attrs:
        return [list(range(devices))]
    return None


def _mesh_groups(attrs: str, axis_names: Sequence[str]) -> tuple[int, tuple[str, ...]] | None:
    """``replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``: (group size, axes)."""
    m = re.search(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<used>[^}]*)\}", attrs)
    if not m:
        return None
    sizes = {k.strip().strip("'\""): int(v) for k, v in re.findall(r"([^,=]+)=(\d+)", m.group("axes"))}
    order = list(sizes)
    used = [a.strip().strip("'\"") for a in m.group("used").split(",") if a.strip()]
    used = [re.sub(r":\(.*\)$", "", a) for a in used]
    size = math.prod(sizes.get(a, 1) for a in used)

    def named(a: str) -> str:  # XLA may rename the mesh's axes axis_0, axis_1, ... in mesh order
        i = order.index(a) if a in order else -1
        return axis_names[i] if a not in axis_names and 0 <= i < len(axis_names) else a

    return size, tuple(named(a) for a in used)


def _axes_of(groups: list[list[int]], shape: Sequence[int], axis_names: Sequence[str]) -> tuple[str, ...]:
    total = math.prod(shape)
    used: set[str] = set()
    for group in groups[:64]:  # every group of a collective spans the same axes; a permute's pairs may differ
        if len(group) < 2 or not shape or max(group) >= total:
            continue
        coords = np.array(np.unravel_index(group, tuple(shape)))
        used.update(a for a, row in zip(axis_names, coords, strict=True) if len(set(row.tolist())) > 1)
    return tuple(a for a in axis_names if a in used)


def _part_values(instr: _Instr, users: dict[str, list[_Instr]]) -> list[list[str]]:
    """For each operand of a collective, the names its result part is read through (the collective itself, or
    the ``get-tuple-element``s of a combined one)."""
    if not instr.type.startswith("("):
        return [[instr.name]]
    getters = [u for u in users.get(instr.name, []) if u.op == "get-tuple-element"]
    return [[g.name for g in getters if re.search(rf"\bindex={j}\b", g.attrs)] for j in range(len(instr.operands))]


def _sliced(values: list[str], part: str, size: int, users: dict[str, list[_Instr]],
            converts: Callable[[_Instr], bool]) -> bool:
    """Every device only slices its 1/``size`` of the all-reduced ``part`` (after converting it back to 16 bits,
    where XLA:CPU widened it): XLA:CPU's reduce-scatter (GPU and TPU compilers turn the pattern into one)."""
    consumers = [u for v in values for u in users.get(v, [])]
    consumers = [c for u in consumers for c in (
        users.get(u.name, []) if _elements(u.type) == _elements(part) and converts(u) else [u])]
    return size > 1 and bool(values) and bool(consumers) and all(
        u.op in ("dynamic-slice", "fusion") and _elements(u.type) * size == _elements(part) for u in consumers)


def moe_dispatch(text: str) -> tuple[str, ...]:
    """The dispatch paths of the mixture-of-experts layers in a compiled module's ``text``, by their named scope
    (`MOE_SCOPE`): e.g. ``("dropping_all_to_all",)``; empty for none.

    Examples:
        >>> moe_dispatch('%a = f32[2] add(...), metadata={op_name="jit(f)/jaxdist_moe_dropless_padded/add"}')
        ('dropless_padded',)
    """
    return tuple(sorted(set(re.findall(re.escape(MOE_SCOPE) + r"(\w+)", text))))


def module_cost(text: str, axis_names: Sequence[str] = (), axis_sizes: Sequence[int] = ()) -> ModuleCost:
    """The per-device cost of one call of a compiled module (see the module doc).

    Args:
        text: the compiled module's text (``compiled.as_text()``: after SPMD partitioning).
        axis_names: the mesh's axis names, in order (to say which axes each collective runs over).
        axis_sizes: their sizes (partition id ``i`` is the mesh's ``i``-th device in row-major order).

    Returns:
        A `ModuleCost`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def f(w, x):
        ...     return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=10)[0]
        >>> text = jax.jit(f).lower(jnp.ones((4, 4)), jnp.ones((2, 4))).compile().as_text()
        >>> module_cost(text).flops >= 10 * 2 * 2 * 4 * 4  # ten dots of (2, 4) x (4, 4)
        True
    """
    computations, entry, types = _parse(text)
    users: dict[str, dict[str, list[_Instr]]] = {}
    for cname, instrs in computations.items():
        table = users[cname] = {}
        for instr in instrs:
            for o in instr.operands:
                table.setdefault(o, []).append(instr)
    defs = {i.name: i for instrs in computations.values() for i in instrs}

    def fused_converts(instr: _Instr, into16: bool) -> bool:
        """A fusion holding a convert from (``into16`` False) or to (True) a 16-bit float of its size."""
        return any(i.op == "convert" and bool(_NARROW.match(i.type if into16 else types.get(i.operands[0], "")))
                   and _elements(i.type) in (_elements(instr.type), 0)
                   for c in _CALLS.findall(instr.attrs) for i in computations.get(c, ()) if i.operands)

    def narrows(u: _Instr) -> bool:
        return (u.op == "convert" and bool(_NARROW.match(u.type))) or (u.op == "fusion" and fused_converts(u, True))

    def widened(value: str, part: str, reads: list[str], table: dict[str, list[_Instr]]) -> bool:
        """XLA:CPU computes a 16-bit float collective in float32: the operand ``value`` (of type ``part``) was
        converted from 16 bits, or every consumer of its result (read through ``reads``) converts it back."""
        if not part.startswith("f32["):
            return False
        source = defs.get(value)
        if source is not None and source.operands and (
                (source.op == "convert" and _NARROW.match(types.get(source.operands[0], ""))) or
                (source.op == "fusion" and fused_converts(source, into16=False))):
            return True
        consumers = [u for r in reads for u in table.get(r, [])]
        return bool(consumers) and all(
            (u.op == "convert" and _NARROW.match(u.type)) or (u.op == "fusion" and fused_converts(u, into16=True))
            for u in consumers)

    devices = math.prod(axis_sizes) if axis_sizes else 1
    header = re.search(r"num_partitions=(\d+)", text.split("\n", 1)[0])
    if header and not axis_sizes:
        devices = int(header.group(1))
    collectives: list[CollectiveOp] = []
    unknown = [0]

    def walk(name: str, times: int, fused: bool) -> tuple[float, float, float]:
        """(flops, transcendentals, bytes) of one call of computation ``name``; collectives recorded with
        ``times`` (recorded once per computation and multiplier: a computation called from two places is
        walked twice)."""
        flops = trans = traffic = 0.0
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
                results = _arrays(instr.type)
                if start:  # the result is (operands, outputs[, context])
                    result = max(_type_bytes(instr.type) - operand, 0) if base != "all-reduce" else operand
                elif len(results) == len(parts):
                    result = sum(math.ceil(_dtype_bytes(d) * math.prod(shape)) // n
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
                    scattered = sum(_type_bytes(part) // n for part, n, v in zip(parts, narrow, values, strict=True)
                                    if _sliced(v, part, size, table, narrows))
                    if scattered:  # XLA:CPU's reduce-scatter: an all-reduce each device slices its part of
                        collectives.append(CollectiveOp(instr.name, "reduce-scatter", scattered,
                                                        scattered // size, size, axes, times))
                        operand, result = operand - scattered, result - scattered
                if operand or result:
                    collectives.append(CollectiveOp(instr.name, base, operand, result, size, axes, times))
                traffic += operand + result
                continue
            if op == "while":
                trips = _TRIPS.search(instr.attrs)
                n = int(trips.group(1)) if trips else 1
                unknown[0] += trips is None
                for called in _CALLS.findall(instr.attrs):
                    f, t, b = walk(called, times * n, fused)
                    flops, trans, traffic = flops + n * f, trans + n * t, traffic + n * b
                continue
            if op == "conditional":
                branches = _BRANCHES.search(instr.attrs)
                names = [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else []
                names += re.findall(r"(?:true|false)_computation=%([\w.\-]+)", instr.attrs)
                costs = [walk(b, times, fused) for b in names] or [(0.0, 0.0, 0.0)]
                f, t, b = max(costs)
                flops, trans, traffic = flops + f, trans + t, traffic + b
                continue
            if op in ("call", "async-start"):
                for called in _CALLS.findall(instr.attrs):
                    f, t, b = walk(called, times, fused)
                    flops, trans, traffic = flops + f, trans + t, traffic + b
                continue
            if op == "fusion":
                for called in _CALLS.findall(instr.attrs):
                    f, t, _ = walk(called, times, True)
                    flops, trans = flops + f, trans + t
            elif op == "dot":
                flops += _dot_flops(instr, types)
            elif op == "convolution":
                flops += _conv_flops(instr, types)
            elif op in _TRANSCENDENTAL:
                trans += _elements(instr.type)
            elif op in _ELEMENTWISE:
                flops += _elements(instr.type)
            elif op in ("reduce", "reduce-window"):
                flops += _elements(types.get(instr.operands[0], "")) if instr.operands else 0
            if not fused and op not in _NO_TRAFFIC:
                traffic += _type_bytes(instr.type) + sum(_type_bytes(types.get(o, "")) for o in instr.operands)
        return flops, trans, traffic

    flops, trans, traffic = walk(entry, 1, False) if entry else (0.0, 0.0, 0.0)
    return ModuleCost(flops, trans, traffic, tuple(collectives), unknown[0])
