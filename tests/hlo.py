"""Test helper: how many bytes a compiled program's collectives move, read from its HLO text.

The synchronizer tests judge compressors by bytes, not by time on a simulated mesh: `collectives`
lists the collective ops of a compiled module (all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute, and their async ``-start`` forms) with their operand bytes and replica-group
size; `collective_bytes` totals them.

Two measures, both per device:

* operand bytes: the bytes of each collective's operands (dtype size * elements), what the program
  hands the collective;
* wire bytes (``wire=True``): what each device sends under the bandwidth-optimal algorithms, which
  makes different collectives comparable: ring all-reduce ``2(n-1)/n·B``, reduce-scatter and
  all-to-all ``(n-1)/n·B``, all-gather ``(n-1)·B``, collective-permute ``B`` (n = group size, B =
  operand bytes).

Read the COMPILED module (``jitted.lower(...).compile().as_text()``): the backend's passes change
collectives (XLA:CPU, for one, converts every 16-bit float collective to float32). To measure a
``strategy.run`` step, lower ``strategy.jit(lambda *a: strategy.run(fn, args=a))``: under a plain
`jax.jit` the distributed batches passed to ``run`` are not recognised as batches.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["CollectiveOp", "collective_bytes", "collectives"]

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_SHAPE = re.compile(r"\b(?P<dtype>pred|token|[a-z]+\d+[a-z0-9]*)\[(?P<dims>[\d,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_HEADER_INT = re.compile(r"\b(replica_count|num_partitions)=(\d+)")


class CollectiveOp(NamedTuple):
    """One collective op of a compiled module.

    Attributes:
        name: the HLO instruction name.
        kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"`` or
            ``"collective-permute"`` (async ``-start`` ops are reported under their base kind).
        operand_bytes: bytes of the operands on one device.
        group_size: devices in each replica group.

    Example:
        >>> CollectiveOp("ar", "all-reduce", operand_bytes=1024, group_size=8).wire_bytes
        1792.0
    """

    name: str
    kind: str
    operand_bytes: int
    group_size: int

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends under the bandwidth-optimal algorithm for this collective."""
        n, b = self.group_size, self.operand_bytes
        if n <= 1:
            return 0.0
        return {
            "all-reduce": 2 * (n - 1) / n * b,
            "reduce-scatter": (n - 1) / n * b,
            "all-to-all": (n - 1) / n * b,
            "all-gather": (n - 1) * b,
        }.get(self.kind, float(b))


def _dtype_bytes(dtype: str) -> float:
    if dtype == "pred":
        return 1
    if dtype == "token":
        return 0
    bits = re.match(r"[a-z]+(\d+)", dtype)
    return int(bits.group(1)) / 8 if bits else 0


def _type_bytes(type_text: str) -> int:
    """Bytes of an HLO type (an array or a tuple of arrays); layouts ``{1,0}`` and comments
    ignored."""
    total = 0.0
    for m in _SHAPE.finditer(re.sub(r"/\*.*?\*/", "", type_text)):
        dims = [int(d) for d in m.group("dims").split(",") if d]
        total += _dtype_bytes(m.group("dtype")) * math.prod(dims)
    return math.ceil(total)


def _split_type(rest: str) -> tuple[str, str]:
    """``"(f32[2], u8[4]) op(...)"`` -> (type, remainder)."""
    rest = rest.lstrip()
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :]
    return rest, ""


def _balanced(text: str, start: int) -> str:
    """The text inside the parentheses opening at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return text[start + 1 : i]
    return text[start + 1 :]


def _group_size(attrs: str, default: int) -> int:
    m = re.search(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<used>[^}]*)\}", attrs)
    if m:
        sizes = {
            k.strip().strip("'\""): int(v)
            for k, v in re.findall(r"([^,=]+)=(\d+)", m.group("axes"))
        }
        used = [a.strip().strip("'\"") for a in m.group("used").split(",") if a.strip()]
        return math.prod(sizes.get(a, 1) for a in used)
    # iota form: [num_groups, group_size]<=[...]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x.strip()])
    return default  # replica_groups={} (or none): every device


def _hlo_text(hlo: Any) -> str:
    if isinstance(hlo, str):
        return hlo
    if isinstance(hlo, jax.stages.Lowered):
        return hlo.compile().as_text()
    if isinstance(hlo, jax.stages.Compiled):
        return hlo.as_text()
    raise TypeError(
        f"hlo={type(hlo).__name__} is not HLO: pass jitted.lower(*args) (it is compiled), "
        "jitted.lower(*args).compile(), or the compiled module's as_text()."
    )


def collectives(hlo: Any) -> list[CollectiveOp]:
    """The collective ops of a compiled module, in program order.

    Args:
        hlo: a `jax.stages.Lowered` (compiled here), a `jax.stages.Compiled`, or compiled HLO text.

    Returns:
        A list of `CollectiveOp`.

    Raises:
        TypeError: when ``hlo`` is none of these.

    Example:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.MirroredStrategy()
        >>> f = strategy.jit(lambda x: strategy.run(lambda v: jd.get_replica_context().all_reduce("sum", v),
        ...                                         args=(x,)))
        >>> [(op.kind, op.operand_bytes, op.group_size) for op in collectives(f.lower(strategy.mirror(jnp.ones(4))))]
        [('all-reduce', 16, 8)]
    """
    text = _hlo_text(hlo)
    header = dict(_HEADER_INT.findall(text.split("\n", 1)[0]))
    devices = int(header.get("replica_count", 1)) * int(header.get("num_partitions", 1))
    types: dict[str, str] = {}
    found: list[tuple[str, str, str, str]] = []
    for line in text.splitlines():
        m = _DEF.match(line)
        if not m:
            continue
        type_text, rest = _split_type(m.group("rest"))
        types[m.group("name")] = type_text
        op = re.match(r"\s*([\w\-]+)\(", rest)
        if op is None:
            continue
        kind = op.group(1).removesuffix("-start")
        if kind in _KINDS:
            args = _balanced(rest, op.end() - 1)
            found.append((m.group("name"), kind, args, rest[op.end() - 1 + len(args) + 2 :]))
    ops = []
    for name, kind, args, attrs in found:
        operand_bytes = 0
        for piece in args.split(","):
            ref = _OPERAND.search(piece)
            typed = _SHAPE.search(piece)
            if typed:  # operand printed with its type (unoptimized text)
                operand_bytes += _type_bytes(piece[: ref.start()] if ref else piece)
            elif ref and ref.group(1) in types:
                operand_bytes += _type_bytes(types[ref.group(1)])
        ops.append(CollectiveOp(name, kind, operand_bytes, _group_size(attrs, devices)))
    return ops


def collective_bytes(hlo: Any, *, wire: bool = False,
                     kinds: tuple[str, ...] | None = None) -> int | float:
    """Total bytes the collectives of a compiled module move, per device.

    Args:
        hlo: a `jax.stages.Lowered` (compiled here), a `jax.stages.Compiled`, or compiled HLO text.
        wire: False (default): operand bytes; True: bytes sent under bandwidth-optimal algorithms
            (see the module doc), comparable across different collectives.
        kinds: count only these kinds (e.g. ``("all-reduce",)``); default all.

    Returns:
        The total (an int for operand bytes, a float for wire bytes).

    Raises:
        TypeError: when ``hlo`` is not HLO.
        ValueError: for an unknown kind.

    Example:
        >>> import jax, jax.numpy as jnp, jaxdist as jd
        >>> strategy = jd.MirroredStrategy()
        >>> f = strategy.jit(lambda x: strategy.run(lambda v: jd.get_replica_context().all_reduce("mean", v),
        ...                                         args=(x,)))
        >>> compiled = f.lower(strategy.mirror(jnp.ones((256, 256)))).compile()
        >>> collective_bytes(compiled), collective_bytes(compiled, wire=True)
        (262144, 458752.0)
    """
    if kinds is not None:
        unknown = [k for k in kinds if k not in _KINDS]
        if unknown:
            raise ValueError(f"kinds={kinds!r} has unknown kinds {unknown}: use some of "
                             f"{', '.join(_KINDS)}.")
    ops = [op for op in collectives(hlo) if kinds is None or op.kind in kinds]
    if wire:
        return float(np.sum([op.wire_bytes for op in ops], dtype=np.float64)) if ops else 0.0
    return sum(op.operand_bytes for op in ops)
