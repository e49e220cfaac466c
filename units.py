"""Parsing and printing the quantities users type and read: sizes, bandwidths, times (every command)."""

from __future__ import annotations

import math
import re
from typing import Iterable, Sequence

from .artifacts import BadInput
from .schema import MAX_BYTES, MAX_RATE

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def parse_size(text: str, flag: str = "--memory-limit") -> int:
    """``'16GiB'`` -> 17179869184. Decimal (GB) and binary (GiB) units; a bare number is bytes."""
    # A sign is read so that a negative size meets the "at least 1 byte" below, not "not a size".
    match = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise BadInput(f"{flag} {text!r} is not a size: write it like 16GiB, 80GB or 512MB")
    value = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if not math.isfinite(value):
        raise BadInput(f"{flag} {text!r} is too large to be a size")
    if value < 1:
        raise BadInput(f"{flag} must be at least 1 byte, got {text!r}")
    # The plan records it: within the ceiling its format holds (schema.MAX_BYTES).
    if value > MAX_BYTES:
        raise BadInput(f"{flag} {text!r} is more than 1 EiB (2^60 bytes), more than any device holds: give the "
                       "device's memory, or leave the option out for no limit")
    return int(value)


def parse_bandwidth(text: str, flag: str = "--link-bandwidth") -> float:
    """A bandwidth in GB/s (``--link-bandwidth``, ``--network-bandwidth``) -> bytes per second;
    ``'inf'`` -> ``math.inf`` (ignore communication)."""
    t = str(text).strip().lower().removesuffix("gb/s").strip()
    if t in ("inf", "infinity", "none", "off"):
        return math.inf
    try:
        value = float(t)
    except ValueError:
        raise BadInput(f"{flag} {text!r} is not a number of GB/s (or 'inf' to ignore communication)") from None
    if not value > 0 or not math.isfinite(value):
        raise BadInput(f"{flag} must be a positive number of GB/s or 'inf', got {text!r}")
    if value * 1e9 > MAX_RATE:      # the plan records it within its format's ceiling
        raise BadInput(f"{flag} {text!r} is more than {MAX_RATE / 1e9:.0e} GB/s: give 'inf' for a link "
                       "that costs nothing")
    return value * 1e9


def format_bytes(n: float | None, round_up: bool = False) -> str:
    """``4362076`` -> ``4.16 MiB``. ``round_up``: never print less than ``n`` (``4.17 MiB``), for a
    least amount that works: a user who types the figure back as ``--memory-limit`` must get a plan."""
    if n is None:
        return "-"
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            value = math.ceil(n / size * 100) / 100 if round_up else n / size
            return f"{value:.2f} {unit}"
    return f"{math.ceil(n) if round_up else n:.0f} B"


def format_seconds(s: float | None, digits: int | None = None) -> str:
    """Seconds in s, ms or µs; ``digits`` significant digits (default: 3 decimals)."""
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "-"
    if s == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= scale or unit == "µs":
            value = s / scale
            if digits is None:
                return f"{value:.3f} {unit}" if unit != "µs" else f"{value:.1f} {unit}"
            decimals = max(0, digits - len(str(int(abs(value)))))
            return f"{value:.{decimals}f} {unit}"
    return f"{s} s"  # pragma: no cover


def format_percent(fraction: float | None, decimals: int = 0, sign: bool = False) -> str:
    """A fraction as a percentage, never ``-0%``.

    A measured bubble or idle share a hair below zero (busy spans that add up to a little more
    than the step, from rounding) would print as ``-0%``; a figure that rounds to zero is zero.
    ``sign``: always show the sign of a non-zero figure (``+5%``), as for an error.
    """
    if fraction is None or (isinstance(fraction, float) and math.isnan(fraction)):
        return "-"
    value = round(fraction * 100, decimals)
    if value == 0:
        value = 0.0     # drops the sign of -0.0
    return f"{value:{'+' if sign and value else ''}.{decimals}f}%"


# A table's column holds figures of one quantity in one unit, named in its heading (gpipe_plan/tables.py):
# the unit of the column's largest figure, so that it reads 1 or more and the rest fall in below it.
TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6))
BYTE_UNITS = (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10), ("B", 1.0))


def column_unit(values: Iterable[float | None], units: Sequence[tuple[str, float]]) -> tuple[str, float]:
    """``(name, size)`` of the largest of ``units`` the column's largest figure is at least one of
    (the smallest unit when every figure is below it, or there is none)."""
    largest = max((abs(v) for v in values if v is not None and math.isfinite(v)), default=0.0)
    for name, size in units:
        if largest >= size:
            return name, size
    return units[-1]


def format_figure(value: float | None, size: float = 1.0, digits: int = 3) -> str:
    """``value`` in units of ``size`` with ``digits`` significant digits and never an exponent:
    ``0.108``, ``6.43``, ``64.3``, ``643``, ``6431``; ``-`` for None."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    scaled = value / size
    if scaled == 0:
        return "0"
    decimals = min(9, max(0, digits - 1 - math.floor(math.log10(abs(scaled)))))
    return f"{scaled:.{decimals}f}"
