"""Byte sizes as people write them: "3GiB", "256MiB", "1.5GB", "1e9", "4096"."""
from __future__ import annotations

import math
import re

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(s: str | int) -> int:
    """Parse a byte count; decimal units (kB, MB, GB) are powers of 1000, binary (KiB, MiB, GiB) of 1024.

    Raises ValueError naming the text when it is not a non-negative size in whole bytes.
    """
    if isinstance(s, int):
        if s < 0:
            raise ValueError(f"byte size must be >= 0, got {s}")
        return s
    m = _SIZE.match(s)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {s!r} (expected e.g. 4096, 1e9, 256MiB, 3GiB, 2GB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value):
        raise ValueError(f"not a byte size: {s!r}")
    n = round(value)
    if abs(value - n) > 1e-6 * max(1.0, value):
        raise ValueError(f"byte size {s!r} is not a whole number of bytes")
    return int(n)


def format_bytes(n: int | float) -> str:
    """Binary units, about 3 significant digits: 512 -> '512 B', 6291456 -> '6.00 MiB'."""
    sign = "-" if n < 0 else ""
    x = float(abs(n))
    if x < 1024:
        return f"{sign}{int(x)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        x /= 1024
        if x < 1024 or unit == "TiB":
            return f"{sign}{x:.0f} {unit}" if x >= 100 else f"{sign}{x:.2f} {unit}"
    raise AssertionError("unreachable")
