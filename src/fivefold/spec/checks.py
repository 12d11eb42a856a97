"""Checks shared by the specs: exact types (TOML `true` is not the integer 1, `2.0` is not a count), finite
numbers, table shapes, and upper limits that answer an absurd size at once instead of building lists or
allocating per device for it. No torch here."""

from __future__ import annotations

import math

from fivefold.errors import SpecError, require

# Far beyond any machine or model built so far, small enough that a list per device (placement, slots) is
# cheap. Larger values are refused at once with one line.
MAX_DEVICES = 1 << 20  # devices in one cluster (the largest clusters today have ~10^5)
MAX_COUNT = 1 << 24  # any other count or width: hidden, heads, vocab, sequence length, batch, ...
MAX_LAYERS = 4096  # the deepest models have ~200; the planner's stage balancing works per layer


def is_int(value: object) -> bool:
    """An integer that is not a boolean (TOML and Python treat True as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A finite int or float that is not a boolean."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_count(value: object, field: str, minimum: int = 1, limit: int = MAX_COUNT, what: str = "") -> int:
    """An integer in [minimum, limit]; names the field, the value and what would be valid."""
    if not is_int(value):
        raise SpecError(field, value, f"must be an integer, not a {type(value).__name__}")
    count = int(value)  # type: ignore[call-overload]  # is_int: an int (not a bool)
    bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    require(count >= minimum, field, value, f"must be {bound}" + (f" ({what})" if what else ""))
    require(count <= limit, field, value, f"must be at most {limit:,}; a larger value is not a real configuration")
    return count


def check_positive_real(value: object, field: str, what: str = "a positive finite number") -> float:
    require(is_real(value) and value > 0, field, value, f"must be {what}")  # type: ignore[operator]
    return float(value)  # type: ignore[arg-type]


def check_table(value: object, field: str, fix: str) -> dict:
    """A TOML table (dict); `fix` says what to write instead."""
    if not isinstance(value, dict):
        raise SpecError(field, _short(value), fix)
    return value


def _short(value: object) -> object:
    """Keep a wrong-shaped value readable inside a one-line error."""
    text = repr(value)
    return value if len(text) <= 60 else text[:57] + "..."


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) steps (n may be a user's number)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def check_field_types(obj: object, where: str) -> None:
    """Every field of a spec dataclass holds its declared kind: int (not bool), finite float, bool, str.
    Annotations are strings here (`from __future__ import annotations`); `X | None` also allows None."""
    import dataclasses

    for field in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, field.name)
        kinds = {k.strip() for k in str(field.type).split("|")}
        if value is None and "None" in kinds:
            continue
        name = f"{where}.{field.name}"
        if "int" in kinds and "float" not in kinds:
            if not is_int(value):
                raise SpecError(name, value, f"must be an integer, not a {type(value).__name__}")
        elif "float" in kinds:
            require(is_real(value), name, value, "must be a finite number")
        elif "bool" in kinds:
            require(isinstance(value, bool), name, value, "must be true or false")
        elif "str" in kinds:
            require(isinstance(value, str), name, value, "must be a string")
