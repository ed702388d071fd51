"""FLOPs of the library calls and kernels a compiled program makes (``custom-call`` instructions).

XLA's own cost analysis counts a custom call as 0 FLOPs; on a GPU most of a step's matrix work is
custom calls. `custom_call_cost` costs each kind from what the compiled text says about it:

* cuBLAS / cuBLASLt gemms (``__cublas$gemm``, ``__cublas$lt$matmul``, ``...$f8``): ``2 x output
  elements x contracted elements``, the contracted dimensions from ``dot_dimension_numbers`` in the
  backend config. A gemm that ``jax.lax.ragged_dot`` became (XLA:GPU multiplies operands masked to
  each group: ``G`` times the work of the grouped product) counts the grouped product's FLOPs: the
  gemm's over ``G``, the masked operand's group dimension.
* cuDNN convolutions (``__cudnn$conv...``): as XLA counts the convolution they replace (its
  ``window`` and ``dim_labels`` stay on the call).
* cuDNN fused attention (``__cudnn$fmha...``): ``2 x B x H x Tq x Tk x D`` per matrix product, two
  forward, five backward (the flash backward recomputes the scores), the extent from
  ``intermediate_tensor_shape``; a causal mask (``mask_type`` ``CAUSAL``) does the lower triangle
  only, a sliding window its band; a padding mask counts the whole extent (the sequence lengths are
  known only when the step runs: an upper bound).
* kernels that say what they compute: tokamax's (its ``metadata_payload`` names the op and its
  operands, e.g. a ragged dot on Mosaic GPU ``mosaic_gpu_v2`` or on TPU); a Pallas kernel with a
  ``cost_estimate`` in its backend config (Mosaic TPU's ``tpu_custom_call``) counts that estimate.
* calls that move or order data (sharding annotations, host transfers, callbacks, sorts, random
  bits) cost no FLOPs.

Any other custom call cannot be costed: `custom_call_cost` returns None; the cost names it."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxdist.costs.text import Instr, Module, arrays, backend_json, op_name

__all__ = ["KernelCost", "conv_flops", "custom_call_cost", "custom_call_target", "ragged_dot_flops",
           "ragged_dot_op"]

_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_PAYLOAD = re.compile(r'metadata_payload="tokamax:((?:[^"\\]|\\.)*)"')
_FREE = re.compile(
    r"^(?:Sharding|SPMDFullToShardShape|SPMDShardToFullShape|LayoutConstraint|MoveToHost|"
    r"MoveToDevice|annotate_device_placement|AllocateBuffer|PartialReduce|TopK|SliceToDynamic|"
    r"PadToStatic|"
    r".*callback.*|.*[Ss]ort.*|.*threefry.*|"
    r"__gpu\$xla\.gpu\.ext\.cu_threefry2x32|X64Combine|X64SplitHigh|X64SplitLow|"
    r"xla\.gpu\.ext\.cu_threefry2x32|tpu_host_transfer|InspectSharding|shard_barrier|.*Barrier.*)$")


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """What one custom call computes.

    Attributes:
        kind: what it is (``"cuBLAS gemm"``, ``"cuDNN attention"``, ``"ragged dot"``, ...).
        flops: its floating-point operations.
        transcendentals: its transcendental operations (fused attention's softmax exponentials).
        recomputed: the part of ``flops`` recomputing forward work (a flash backward's scores).
        skipped: FLOPs the model's math asks for that the kernel skips (the masked-out half of
            causal attention): not in ``flops``, but model FLOPs count them (attention counted
            whole, as in the 6N + 12LdT count).
    """

    kind: str
    flops: float
    transcendentals: float = 0.0
    recomputed: float = 0.0
    skipped: float = 0.0


def custom_call_target(instr: Instr) -> str:
    """The ``custom_call_target`` of a custom call (``"__cublas$lt$matmul"``), or ``""``."""
    m = _TARGET.search(instr.attrs)
    return m.group(1) if m else ""


def _dims(config: dict[str, Any], key: str) -> tuple[int, ...]:
    return tuple(int(d) for d in config.get(key, ()))


def _trace_group(module: Module, name: str, seen: int = 0) -> int | None:
    """The group count ``G`` of the ragged-dot mask an operand comes from (through bitcasts, copies
    and transposes): a fusion selecting its operand into a ``[G, ...]`` array by an iota compare."""
    instr = module.defs.get(name)
    if instr is None or seen > 8:
        return None
    if instr.operands and instr.op in ("bitcast", "copy", "transpose", "reshape",
                                       "get-tuple-element"):
        return _trace_group(module, instr.operands[0], seen + 1)
    if instr.op != "fusion":
        return None
    called = re.findall(r"\bcalls=%([\w.\-]+)", instr.attrs)
    body = [i for c in called for i in module.computations.get(c, ())]
    ops = {i.op for i in body}
    if "select" in ops and "iota" in ops and "compare" in ops:
        shape = arrays(instr.type)
        return shape[0][1][0] if shape and shape[0][1] else None
    if ops <= {"parameter", "transpose", "bitcast", "copy", "reshape"} and instr.operands:
        return _trace_group(module, instr.operands[0], seen + 1)
    return None


def _window(attrs: str, key: str, n: int, default: int) -> list[int]:
    m = re.search(r"\b" + key + r"=([\dx]+)", attrs)
    return [int(v) for v in m.group(1).split("x")] if m else [default] * n


def conv_flops(instr: Instr, types: dict[str, str]) -> float:
    """A convolution's FLOPs (an HLO ``convolution`` or the cuDNN call it became), as XLA counts
    them: 2 x batch x input features per group x output features x the (output, kernel) position
    pairs that read the input rather than its padding or dilation holes, per spatial dimension.

    Args:
        instr: the instruction (its ``window=`` and ``dim_labels=``, its first two operands).
        types: value name -> type text of the module (`jaxdist.costs.text.Module.types`).

    Returns:
        The FLOPs (0 where the attributes are missing).

    Examples:
        >>> from jaxdist.costs.text import parse
        >>> m = parse("\\n".join(["ENTRY %e (x: f32[1,4,4,1], k: f32[3,3,1,2]) -> f32[1,4,4,2] {",
        ...     "  %x = f32[1,4,4,1]{3,2,1,0} parameter(0)",
        ...     "  %k = f32[3,3,1,2]{3,2,1,0} parameter(1)",
        ...     "  ROOT %c = f32[1,4,4,2]{3,2,1,0} convolution(%x, %k), window={size=3x3 "
        ...     "pad=1_1x1_1}, dim_labels=b01f_01io->b01f", "}"]))
        >>> # 2 x 1 x 1 x 2 x (10 valid (out, kernel) pairs per axis) ** 2
        >>> conv_flops(m.defs["c"], m.types)
        400.0
    """
    lhs = arrays(types.get(instr.operands[0], "")) if instr.operands else []
    rhs = arrays(types.get(instr.operands[1], "")) if len(instr.operands) > 1 else []
    out = arrays(instr.type)
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instr.attrs)
    if not lhs or not rhs or not out or not labels:
        return 0.0
    (_, in_shape), (_, k_shape), (_, out_shape) = lhs[0], rhs[0], out[0]
    in_l, k_l, out_l = labels.groups()
    spatial = sorted(c for c in k_l if c.isdigit())
    n = len(spatial)
    size, stride, lhs_dilate, rhs_dilate = (
        _window(instr.attrs, key, n, 1) for key in ("size", "stride", "lhs_dilate", "rhs_dilate"))
    pads = re.search(r"\bpad=([\d_x\-]+)", instr.attrs)
    low = [int(p.split("_")[0]) for p in pads.group(1).split("x")] if pads else [0] * n
    pairs = 1
    for i, d in enumerate(spatial):
        in_size, out_size = in_shape[in_l.index(d)], out_shape[out_l.index(d)]
        o = (np.arange(out_size)[:, None] * stride[i] - low[i]
             + np.arange(size[i])[None, :] * rhs_dilate[i])
        valid = (o >= 0) & (o % lhs_dilate[i] == 0) & (o // lhs_dilate[i] < in_size)
        pairs *= int(valid.sum())
    groups = re.search(r"feature_group_count=(\d+)", instr.attrs)
    batch_groups = re.search(r"batch_group_count=(\d+)", instr.attrs)
    in_features = in_shape[in_l.index("f")] // (int(groups.group(1)) if groups else 1)
    batch = in_shape[in_l.index("b")] // (int(batch_groups.group(1)) if batch_groups else 1)
    return 2.0 * batch * in_features * k_shape[k_l.index("o")] * pairs


def _gemm(instr: Instr, module: Module, config: dict[str, Any]) -> KernelCost | None:
    gemm = config.get("gemm_backend_config", config)
    numbers = gemm.get("dot_dimension_numbers")
    lhs = arrays(module.types.get(instr.operands[0], "")) if instr.operands else []
    out = arrays(instr.type)
    if numbers is None or not lhs or not out:
        return None
    contracted = math.prod(lhs[0][1][d] for d in _dims(numbers, "lhs_contracting_dimensions")
                           if d < len(lhs[0][1]))
    flops = 2.0 * math.prod(out[0][1]) * contracted
    if "ragged_dot" in op_name(instr):
        groups = [g for g in (_trace_group(module, o) for o in instr.operands[:2]) if g]
        if groups:
            return KernelCost("ragged dot (cuBLAS over masked operands)", flops / groups[0])
    return KernelCost("cuBLAS gemm", flops)


def _attention(instr: Instr, module: Module, config: dict[str, Any],
               backward: bool) -> KernelCost | None:
    fmha = config.get("cudnn_fmha_backend_config", config)
    extent = [int(d) for d in fmha.get("intermediate_tensor_shape", {}).get("dimensions", ())]
    q = arrays(module.types.get(instr.operands[0], "")) if instr.operands else []
    if len(extent) != 4 or not q:
        return None
    b, h, tq, tk = extent
    d = q[0][1][-1]  # head dimension: the last of Q's (and K's, V's) dimensions
    mask = str(fmha.get("mask_type", "NO_MASK")).upper()
    window = int(fmha.get("sliding_window_length", 0) or 0)
    pairs = float(tq * tk)
    # the lower triangle, diagonal included (square), or up to the bottom right
    if "CAUSAL" in mask:
        seen = np.arange(1, tq + 1) + (tk - tq if "BOTTOM_RIGHT" in mask else 0)
        pairs = float(np.clip(seen, 0, tk).sum())
    if window > 0:
        pairs = min(pairs, float(tq * min(window, tk)))
    product, masked = 2.0 * b * h * pairs * d, 2.0 * b * h * (tq * tk - pairs) * d
    if backward:  # the scores recomputed, then the gradients of V, the probabilities, Q and K
        return KernelCost("cuDNN attention", 5 * product, b * h * pairs, recomputed=product,
                          skipped=4 * masked)
    return KernelCost("cuDNN attention", 2 * product, b * h * pairs, skipped=2 * masked)


def ragged_dot_flops(lhs: tuple[int, ...], rhs: tuple[int, ...], rhs_skip: set[int]) -> float:
    """The FLOPs of a grouped (ragged) product, whatever the group sizes: 2 x lhs elements x the
    rhs's free elements (``rhs_skip``: its contracting, batch and group dimensions).

    Examples:
        >>> ragged_dot_flops((32768, 1024), (8, 1024, 2048), {0, 1})  # 8 groups of (1024, 2048)
        137438953472.0
    """
    return 2.0 * math.prod(lhs) * math.prod(n for i, n in enumerate(rhs) if i not in rhs_skip)


def ragged_dot_op(instr: Instr, types: dict[str, str]) -> float:
    """The FLOPs of an HLO ``ragged-dot`` (what XLA keeps where the backend has a grouped matmul):
    the grouped product (`ragged_dot_flops`), from its operands' shapes and ``rhs_*_dims``.

    Examples:
        >>> from jaxdist.costs.text import parse
        >>> m = parse("\\n".join(["ENTRY %e (x: f32[64,16], w: f32[4,16,8], g: s32[4]) -> "
        ...                       "f32[64,8] {",
        ...     "  %x = f32[64,16]{1,0} parameter(0)", "  %w = f32[4,16,8]{2,1,0} parameter(1)",
        ...     "  %g = s32[4]{0} parameter(2)",
        ...     "  ROOT %r = f32[64,8]{1,0} ragged-dot(%x, %w, %g), "
        ...     "lhs_contracting_dims={1}, rhs_contracting_dims={1}, lhs_ragged_dims={0}, "
        ...     "rhs_group_dims={0}", "}"]))
        >>> ragged_dot_op(m.defs["r"], m.types) == 2 * 64 * 16 * 8
        True
    """
    lhs = arrays(types.get(instr.operands[0], "")) if instr.operands else []
    rhs = arrays(types.get(instr.operands[1], "")) if len(instr.operands) > 1 else []
    if not lhs or not rhs:
        return 0.0
    skip = set()
    for key in ("rhs_contracting_dims", "rhs_batch_dims", "rhs_group_dims"):
        m = re.search(key + r"=\{([\d,]*)\}", instr.attrs)
        skip |= {int(d) for d in m.group(1).split(",") if d} if m else set()
    return ragged_dot_flops(lhs[0][1], rhs[0][1], skip)


def _tokamax(instr: Instr) -> KernelCost | None:
    m = _PAYLOAD.search(instr.attrs)
    if m is None:
        return None
    try:
        payload = json.loads(m.group(1).replace('\\"', '"').replace("\\\\", "\\"))
    except ValueError:
        return None
    op = str(payload.get("op", {}).get("__type", ""))
    args = payload.get("arguments", {})
    if "RaggedDot" in op:
        lhs, rhs = arrays(str(args.get("lhs", ""))), arrays(str(args.get("rhs", "")))
        numbers = args.get("ragged_dot_dimension_numbers", {})
        (contract, batch) = numbers.get("dot_dimension_numbers", [[[], []], [[], []]])
        if not lhs or not rhs:
            return None
        skip = set(contract[1]) | set(batch[1]) | set(numbers.get("rhs_group_dimensions", []))
        return KernelCost("ragged dot (tokamax)", ragged_dot_flops(lhs[0][1], rhs[0][1], skip))
    return None


def _estimate(config: dict[str, Any]) -> KernelCost | None:
    """A Pallas kernel's own ``cost_estimate`` (``pl.pallas_call(..., cost_estimate=...)``), where
    its backend config carries it (Mosaic TPU)."""
    for holder in (config, config.get("custom_call_config", {})):
        estimate = holder.get("cost_estimate") if isinstance(holder, dict) else None
        if isinstance(estimate, dict) and "flops" in estimate:
            return KernelCost("Pallas kernel (its cost estimate)", float(estimate["flops"]),
                              float(estimate.get("transcendentals", 0)))
    return None


def _conv(instr: Instr, module: Module, config: dict[str, Any]) -> KernelCost | None:
    flops = conv_flops(instr, module.types)
    return KernelCost("cuDNN convolution", flops) if flops else None


_COSTERS: tuple[tuple[re.Pattern[str], Callable[[Instr, Module, dict[str, Any]],
                                                KernelCost | None]], ...] = (
    (re.compile(r"^__cublas"), _gemm),
    (re.compile(r"^__cudnn\$conv"), _conv),
    (re.compile(r"^__cudnn\$fmha.*Backward"), lambda i, m, c: _attention(i, m, c, backward=True)),
    (re.compile(r"^__cudnn\$fmha"), lambda i, m, c: _attention(i, m, c, backward=False)),
)


def custom_call_cost(instr: Instr, module: Module) -> KernelCost | None:
    """What a ``custom-call`` instruction of ``module`` computes (see the module doc).

    Args:
        instr: the custom call.
        module: the parsed module it is in (`jaxdist.costs.text.parse`): types and producers.

    Returns:
        A `KernelCost`, or None for a kernel whose work the text does not give.

    Examples:
        >>> from jaxdist.costs.text import parse
        >>> config = ('{"gemm_backend_config":{"dot_dimension_numbers":'
        ...           '{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}')
        >>> text = "\\n".join([
        ...     "ENTRY %main (a: bf16[64,32], b: bf16[32,16]) -> bf16[64,16] {",
        ...     "  %a = bf16[64,32]{1,0} parameter(0)", "  %b = bf16[32,16]{1,0} parameter(1)",
        ...     "  ROOT %g = (bf16[64,16]{1,0}, s8[0]{0}) custom-call(%a, %b), "
        ...     f'custom_call_target="__cublas$lt$matmul", backend_config={config}',
        ...     "}"])
        >>> m = parse(text)
        >>> custom_call_cost(m.defs["g"], m)  # doctest: +NORMALIZE_WHITESPACE
        KernelCost(kind='cuBLAS gemm', flops=65536.0, transcendentals=0.0, recomputed=0.0,
                   skipped=0.0)
    """
    target = custom_call_target(instr)
    if _FREE.match(target):
        return KernelCost("data movement", 0.0)
    config = backend_json(instr)
    for pattern, coster in _COSTERS:
        if pattern.match(target):
            return coster(instr, module, config)
    return _tokamax(instr) or _estimate(config)
