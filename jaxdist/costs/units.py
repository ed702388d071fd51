"""Bytes and FLOPs for people: the one byte formatter and the one FLOP formatter of every table and
message, so a size reads the same everywhere: three significant digits, binary prefixes for bytes
(``KiB`` = 1024 B), decimal ones for FLOPs (``GFLOP`` = 10^9)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_bytes", "format_flops"]

_BYTE_PREFIXES = ("", "Ki", "Mi", "Gi", "Ti", "Pi")
_FLOP_PREFIXES = ("", "k", "M", "G", "T", "P", "E")


def _scaled(n: float, unit: str, base: float, prefixes: Sequence[str]) -> str:
    for prefix in prefixes:
        if abs(n) < base or prefix == prefixes[-1]:
            text = f"{n:.3g}"
            # 1000-1023 KiB: three digits would print "1e+03"; the whole number reads better
            return f"{n:.0f} {prefix}{unit}" if "e" in text else f"{text} {prefix}{unit}"
        n /= base
    raise AssertionError("unreachable: the last prefix always returns")


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units, three significant digits.

    Args:
        n: a number of bytes (an int or a float: a plan's bytes accessed or sent are floats).

    Returns:
        ``"1.5 KiB"``, ``"12 B"``, ``"80 GiB"``.

    Examples:
        >>> format_bytes(1536), format_bytes(12), format_bytes(3 * 2**20), format_bytes(80e9)
        ('1.5 KiB', '12 B', '3 MiB', '74.5 GiB')
        >>> format_bytes(1000 * 1024)  # under one MiB: the whole number of KiB
        '1000 KiB'
    """
    return _scaled(n, "B", 1024.0, _BYTE_PREFIXES)


def format_flops(n: float) -> str:
    """``n`` floating-point operations in decimal units, three significant digits (append ``/s`` for
    a rate, ``/step`` for a step's).

    Args:
        n: a number of FLOPs.

    Returns:
        ``"1.23 GFLOP"``, ``"989 TFLOP"``.

    Examples:
        >>> format_flops(1.23e9), format_flops(989.4e12) + "/s", format_flops(128)
        ('1.23 GFLOP', '989 TFLOP/s', '128 FLOP')
    """
    return _scaled(n, "FLOP", 1000.0, _FLOP_PREFIXES)
