"""Errors that reach the user as one line: the field, the value, and what would be valid."""

from __future__ import annotations


class FivefoldError(Exception):
    """An error the CLI prints as a single line (exit code 2), never with a traceback."""


class SpecError(FivefoldError):
    """Bad input in a spec, plan or flag: names the field, the value, and the fix."""

    def __init__(self, field: str, value: object, fix: str) -> None:
        self.field = field
        self.value = value
        self.fix = fix
        super().__init__(f"{field}={value!r}: {fix}")


def require(condition: bool, field: str, value: object, fix: str) -> None:
    """Raise SpecError(field, value, fix) unless condition holds."""
    if not condition:
        raise SpecError(field, value, fix)
