"""Quantities with units, as flags and files spell them: sizes (B, KB, MB, GB powers of 1000; KiB, MiB, GiB powers
of 1024), rates (FLOP/s, B/s with the same prefixes) and times (s, ms, us, ns). Read by placement's device
descriptions and by array sizing's memory budget."""
from __future__ import annotations

import math
import re
from typing import Any

from onnxfuse.core.errors import ConfigError

__all__ = ["parse_size", "parse_rate", "parse_time"]

_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _split(text: Any, what: str) -> tuple[float, str]:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text), ""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*", str(text))
    if not m:
        raise ConfigError(f"'{text}' is not a {what} (e.g. {_EXAMPLE[what]})")
    return float(m.group(1)), m.group(2)


_EXAMPLE = {"size": "16GiB or 512MB", "rate": "10GB/s or 20TFLOP/s", "time": "20us or 1.5ms"}


def parse_size(text: Any) -> float:
    """'16GiB' -> 17179869184.0; a plain number is bytes; 'inf' or None means unlimited."""
    if text is None or str(text).strip().lower() in ("inf", "unlimited", "none"):
        return math.inf
    value, unit = _split(text, "size")
    unit = unit[:-1] if unit.endswith("B") else unit
    if unit not in _PREFIX:
        raise ConfigError(f"'{text}': unknown size unit '{unit}B' (use B, KB, MB, GB, KiB, MiB, GiB)")
    return value * _PREFIX[unit]


def parse_rate(text: Any) -> float:
    """'10GB/s' -> 1e10, '20TFLOP/s' -> 2e13, '5e9' -> 5e9 (per second)."""
    value, unit = _split(text, "rate")
    unit = unit.replace("/s", "")
    for suffix in ("FLOPS", "FLOP", "B"):
        if unit.endswith(suffix):
            unit = unit[: -len(suffix)]
            break
    if unit not in _PREFIX:
        raise ConfigError(f"'{text}': unknown rate unit (use e.g. GB/s, MB/s, TFLOP/s, GFLOP/s)")
    return value * _PREFIX[unit]


def parse_time(text: Any) -> float:
    """'20us' -> 2e-5; a plain number is seconds."""
    value, unit = _split(text, "time")
    if unit == "":
        return value
    if unit not in _TIME:
        raise ConfigError(f"'{text}': unknown time unit '{unit}' (use s, ms, us, ns)")
    return value * _TIME[unit]
