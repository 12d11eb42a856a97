"""Reading a JSON object that fivefold did not just build: a foreign file (a Hugging Face config.json, a
safetensors index, a tokenizer sidecar) or one of fivefold's own files read back (metrics, trace spans, checkpoint
metadata). Every value is taken with its exact type — no coercion: the string "false" is not a boolean, 4.9 is not
a count, true is not 1 — and every error is one line naming the file, the file's own key, the value and what was
expected. One home for the rule, so a new reader gets it by using `Fields`.
"""

from __future__ import annotations

import math
from typing import Any

from fivefold.errors import SpecError
from fivefold.spec.checks import MAX_COUNT, is_int

_MISSING = object()


class Fields:
    """Typed access to the keys of one JSON object read from `source` (a file name, optionally with a path
    inside it, e.g. 'config.json' or 'metrics.jsonl:3')."""

    def __init__(self, data: object, source: str) -> None:
        if not isinstance(data, dict):
            raise SpecError(source, type(data).__name__, "must be a JSON object")
        self.data = data
        self.source = source

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def _get(self, key: str, default: object) -> object:
        value = self.data.get(key, _MISSING)
        if value is _MISSING or (value is None and default is not _MISSING):
            if default is _MISSING:
                raise SpecError(f"{self.source}:{key}", None, "required field is missing")
            return default
        return value

    def fail(self, key: str, value: object, fix: str) -> SpecError:
        return SpecError(f"{self.source}:{key}", value, fix)

    def count(self, key: str, default: object = _MISSING, minimum: int = 1, limit: int = MAX_COUNT) -> Any:
        """An integer in [minimum, limit] (JSON true and 4.0 are refused)."""
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return default
        if not is_int(value):
            raise self.fail(key, value, f"must be an integer, not a {type(value).__name__}")
        if not minimum <= value <= limit:  # type: ignore[operator]
            raise self.fail(key, value, f"must be an integer from {minimum} to {limit:,}")
        return value

    def real(self, key: str, default: object = _MISSING, minimum: float = -math.inf, maximum: float = math.inf,
             above: bool = False) -> Any:
        """A finite number (int or float, not a boolean) in [minimum, maximum] ((minimum, maximum] if above)."""
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(key, value, "must be a finite number")
        if value < minimum or value > maximum or (above and value == minimum):
            low = f"above {minimum:g}" if above else f"at least {minimum:g}"
            raise self.fail(key, value, f"must be {low}" + (f" and at most {maximum:g}" if maximum < math.inf else ""))
        return value

    def flag(self, key: str, default: object = _MISSING) -> Any:
        """A JSON boolean (the string "false" and the number 0 are refused)."""
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, value, "must be true or false")
        return value

    def text(self, key: str, default: object = _MISSING) -> Any:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self.fail(key, value, "must be a string")
        return value

    def table(self, key: str, default: object = _MISSING) -> Any:
        value = self._get(key, default)
        if not isinstance(value, dict):
            raise self.fail(key, value, "must be a JSON object")
        return value

    def counts(self, key: str, default: object = _MISSING, minimum: int = 0) -> Any:
        """A list of integers (each >= minimum)."""
        value = self._get(key, default)
        if not isinstance(value, list) or not all(is_int(item) and item >= minimum for item in value):
            raise self.fail(key, value, f"must be a list of integers >= {minimum}")
        return value

    def reals(self, key: str, default: object = _MISSING) -> Any:
        """A list of finite numbers."""
        value = self._get(key, default)
        if not isinstance(value, list) or not all(
                not isinstance(item, bool) and isinstance(item, (int, float)) and math.isfinite(item)
                for item in value):
            raise self.fail(key, value, "must be a list of finite numbers")
        return value
