"""Reading a compiled module's text (``compiled.as_text()``): its computations, instructions and
array types, for the cost walk (`jaxdist.costs.program`) and the kernel costs
(`jaxdist.costs.kernels`)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

__all__ = ["Instr", "Module", "array_bytes", "arrays", "backend_json", "elements", "op_name",
           "parse"]

_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_SHAPE = re.compile(r"\b(?P<dtype>pred|token|[a-z]+\d+[a-z0-9]*)\[(?P<dims>[\d,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')


@dataclasses.dataclass
class Instr:
    """One HLO instruction.

    Attributes:
        name: the value it defines.
        type: its result type's text (``"f32[8,16]{1,0}"``, or a tuple ``"(f32[2], s8[64])"``).
        op: the opcode (``"dot"``, ``"fusion"``, ``"custom-call"``, ...).
        operands: the names of its operands, in order.
        attrs: the text after its operand list (attributes, metadata, backend config).
    """

    name: str
    type: str
    op: str
    operands: list[str]
    attrs: str


@dataclasses.dataclass
class Module:
    """A parsed module: ``computations`` (name -> instructions), the ``entry`` computation's name,
    ``types`` (value name -> type text) and ``defs`` (value name -> its instruction)."""

    computations: dict[str, list[Instr]]
    entry: str | None
    types: dict[str, str]
    defs: dict[str, Instr]


def _dtype_bytes(dtype: str) -> float:
    if dtype in ("pred", "token"):
        return 1 if dtype == "pred" else 0
    bits = re.match(r"[a-z]+(\d+)", dtype)
    return int(bits.group(1)) / 8 if bits else 0


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """``[(dtype, shape), ...]`` of the arrays in an HLO type's text (a tuple's elements in order).

    Examples:
        >>> arrays("(bf16[8,1024]{1,0}, s8[64]{0})")
        [('bf16', (8, 1024)), ('s8', (64,))]
    """
    text = re.sub(r"/\*.*?\*/", "", type_text)
    return [(m.group("dtype"), tuple(int(d) for d in m.group("dims").split(",") if d))
            for m in _SHAPE.finditer(text)]


def array_bytes(type_text: str) -> int:
    """Bytes of all the arrays in an HLO type's text.

    Examples:
        >>> array_bytes("(bf16[8,1024]{1,0}, pred[4])")
        16388
    """
    return math.ceil(sum(_dtype_bytes(d) * math.prod(s) for d, s in arrays(type_text)))


def elements(type_text: str) -> int:
    """Elements of the first array in an HLO type's text (0 for none).

    Examples:
        >>> elements("f32[3,4]{1,0}")
        12
    """
    found = arrays(type_text)
    return math.prod(found[0][1]) if found else 0


def op_name(instr: Instr) -> str:
    """The ``op_name`` of an instruction's metadata (``"jit(f)/dot_general"``), or ``""``."""
    m = _OP_NAME.search(instr.attrs)
    return m.group(1) if m else ""


def backend_json(instr: Instr) -> dict[str, Any]:
    """An instruction's ``backend_config`` when it is JSON, else ``{}``: written as JSON (cuBLAS,
    cuDNN) or as a quoted string holding JSON (a custom call's own config, e.g. Mosaic TPU's
    ``tpu_custom_call``).

    Examples:
        >>> quoted = json.dumps('{"cost_estimate": {"flops": 7}}')  # '"{\\"cost_estimate\\": ...}"'
        >>> backend_json(Instr("k", "f32[2]", "custom-call", [], f"backend_config={quoted}"))
        {'cost_estimate': {'flops': 7}}
    """
    start = instr.attrs.find("backend_config=")
    if start < 0:
        return {}
    text = instr.attrs[start + len("backend_config="):]
    decoder = json.JSONDecoder()
    try:
        value, _ = decoder.raw_decode(text)
        if isinstance(value, str):  # a quoted config: the JSON is inside the string
            value, _ = decoder.raw_decode(value)
    except ValueError:  # an MLIR attribute dictionary (Mosaic GPU), not JSON
        return {}
    return value if isinstance(value, dict) else {}


def _split_type(rest: str) -> tuple[str, str]:
    rest = rest.lstrip()
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    end = _balanced(rest, 0)[1]
    return rest[:end], rest[end:]


def _balanced(text: str, start: int) -> tuple[str, int]:
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return text[start + 1: i], i + 1
    return text[start + 1:], len(text)


def parse(text: str) -> Module:
    """Parse a compiled module's text.

    Examples:
        >>> m = parse("ENTRY %main (p: f32[4]) -> f32[4] {\\n  %p = f32[4]{0} parameter(0)\\n"
        ...           "  ROOT %n = f32[4]{0} negate(%p)\\n}")
        >>> m.entry, [(i.name, i.op, i.operands) for i in m.computations["main"]]
        ('main', [('p', 'parameter', []), ('n', 'negate', ['p'])])
    """
    computations: dict[str, list[Instr]] = {}
    types: dict[str, str] = {}
    entry = None
    current: list[Instr] | None = None
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
        current.append(Instr(m.group("name"), type_text, op.group(1), _OPERAND.findall(args),
                             rest[end:]))
    defs = {i.name: i for instrs in computations.values() for i in instrs}
    return Module(computations, entry, types, defs)
