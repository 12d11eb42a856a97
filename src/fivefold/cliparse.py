"""The command line's error path: argparse mistakes as one line (not the usage dump), and the JSON form of
any error for scripts (`--json`: an object on stdout, the line on stderr)."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import NoReturn

from fivefold.errors import SpecError

_INVALID = re.compile(r"^argument (?P<flag>[^:]+): invalid (?P<kind>\w+) value: '(?P<value>.*)'$", re.S)
_CHOICE = re.compile(r"^argument (?P<flag>[^:]+): invalid choice: '?(?P<value>[^' ]*)'? \(choose from (?P<ok>.*)\)$")
_ONE = re.compile(r"^argument (?P<flag>[^:]+): (?P<what>expected .*)$")
_KINDS = {"int": "an integer", "float": "a number"}
# Every number a flag takes is finite and of a size that is some real setting; a verb's own checks then state
# each flag's range. Here, so that a new flag declared with type=float or type=int is covered by construction.
FLAG_FLOAT_LIMIT = 1e12
FLAG_INT_LIMIT = 2**63 - 1


class UsageError(SpecError):
    """A command line argparse could not read, as field / value / fix."""

    def __init__(self, field: str, value: object, fix: str) -> None:
        super().__init__(field, value, fix)
        if value is None:  # "--model: expected one argument", not "--model=None: ..."
            self.args = (f"{field}: {fix}",)


class OneLineParser(argparse.ArgumentParser):
    """argparse, except that a mistake raises UsageError (printed as one line by main) instead of printing
    the usage block and exiting."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if action.type in (float, int) and isinstance(value, (int, float)) and value is not action.default:
                check_flag_number(action.option_strings[-1] if action.option_strings else action.dest, value)
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        see = f"see `{self.prog} --help`"
        if match := _INVALID.match(message):
            kind = _KINDS.get(match["kind"], match["kind"])
            raise UsageError(match["flag"].split("/")[-1], match["value"], f"must be {kind}; {see}")
        if match := _CHOICE.match(message):
            raise UsageError(match["flag"].split("/")[-1], match["value"],
                             f"use one of {match['ok'].replace(chr(39), '')}")
        if match := _ONE.match(message):
            raise UsageError(match["flag"].split("/")[-1], None, f"{match['what']}; {see}")
        if message.startswith("unrecognized arguments: "):
            extra = message.removeprefix("unrecognized arguments: ").split()
            raise UsageError(extra[0], None if len(extra) == 1 else " ".join(extra),
                             "not a flag of this verb; see `fivefold VERB --help`")
        if message.startswith("the following arguments are required: "):
            raise UsageError(message.removeprefix("the following arguments are required: "), None,
                             f"required; {see}")
        raise UsageError(self.prog, None, f"{message}; {see}")


def check_flag_number(flag: str, value: float) -> None:
    """A number given on the command line is finite and not absurdly large (a flag's own range is checked by
    its verb); refused here, before anything runs, so no worker ever overflows on it."""
    if isinstance(value, float) and (math.isnan(value) or abs(value) > FLAG_FLOAT_LIMIT):
        raise UsageError(flag, value, f"must be a finite number (at most {FLAG_FLOAT_LIMIT:g} in size)")
    if isinstance(value, int) and abs(value) > FLAG_INT_LIMIT:
        raise UsageError(flag, value, "must be an integer below 2**63")


def wants_json(argv: list[str] | None) -> bool:
    """Whether the command line asked for --json (read before, or without, a successful parse)."""
    return "--json" in (sys.argv[1:] if argv is None else argv)


def print_json_error(exc: BaseException, exit_code: int) -> None:
    """{"error": line, "field", "value", "fix", "exit_code"} on stdout, for scripts that pass --json."""
    obj = {"error": str(exc), "field": getattr(exc, "field", None), "value": getattr(exc, "value", None),
           "fix": getattr(exc, "fix", str(exc)), "exit_code": exit_code}
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()
