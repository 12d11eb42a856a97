"""Parsing of quantities written by people: bandwidths, byte sizes, latencies.

Everything is stored in SI base units: bytes/s, bytes, seconds.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

from fivefold.errors import SpecError

GIB = 2**30  # bytes in a GiB: the one definition, for every memory figure fivefold prints

_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")

# Bandwidth units: 'B' is bytes, 'b' is bits; decimal prefixes as network and NVLink specs use.
_BANDWIDTH_UNITS = {
    "GB/s": 1e9, "Gb/s": 1e9 / 8, "MB/s": 1e6, "Mb/s": 1e6 / 8, "TB/s": 1e12, "Tb/s": 1e12 / 8,
    "Gbps": 1e9 / 8, "GBps": 1e9,
}
_SIZE_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
               "KiB": 2**10, "MiB": 2**20, "GiB": GIB, "TiB": 2**40}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _parse(text: str | float | int, field: str, units: dict[str, float], default_unit: str) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), default_unit
    else:
        match = _NUMBER_UNIT.match(str(text))
        if not match:
            raise SpecError(field, text, f"expected a number with a unit, one of {', '.join(units)}")
        value, unit = float(match.group(1)), match.group(2) or default_unit
    if unit not in units:
        raise SpecError(field, text, f"unknown unit {unit!r}; use one of {', '.join(units)}")
    if not math.isfinite(value) or value <= 0:
        raise SpecError(field, text, "must be positive (and finite)")
    scale = units[unit]
    # Divide by whole reciprocals so '5us' is exactly the float 5e-6 and files round-trip unchanged.
    return value / round(1 / scale) if scale < 1 else value * scale


def parse_bandwidth(text: str | float | int, field: str) -> float:
    """'400Gb/s' -> 5e10 bytes/s; '150GB/s' -> 1.5e11 bytes/s; a bare number means GB/s."""
    return _parse(text, field, _BANDWIDTH_UNITS, "GB/s")


def parse_size(text: str | float | int, field: str) -> float:
    """'80GiB' -> bytes; a bare number means GiB."""
    return _parse(text, field, _SIZE_UNITS, "GiB")


def parse_time(text: str | float | int, field: str) -> float:
    """'5us' -> seconds; a bare number means microseconds."""
    return _parse(text, field, _TIME_UNITS, "us")


def format_bandwidth(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.12g}GB/s"


def format_size(num_bytes: float) -> str:
    if num_bytes % GIB == 0:
        return f"{int(num_bytes) // GIB}GiB"
    return f"{num_bytes / 1e9:.12g}GB"


def format_time(seconds: float) -> str:
    return f"{seconds * 1e6:.12g}us"


def read_toml_file(path: str | Path, flag: str) -> dict:
    """The parsed TOML file named by a command-line flag; a missing or malformed file is a SpecError."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(flag, str(path), "no such file")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(flag, str(path), f"not valid TOML ({exc})") from None
