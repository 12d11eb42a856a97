"""The command line's error path: argparse mistakes as one line (not the usage dump), and the JSON form of
any error for scripts (`--json`: an object on stdout, the line on stderr)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import NoReturn

from fivefold.errors import SpecError

_INVALID = re.compile(r"^argument (?P<flag>[^:]+): invalid (?P<kind>\w+) value: '(?P<value>.*)'$", re.S)
_CHOICE = re.compile(r"^argument (?P<flag>[^:]+): invalid choice: '?(?P<value>[^' ]*)'? \(choose from (?P<ok>.*)\)$")
_ONE = re.compile(r"^argument (?P<flag>[^:]+): (?P<what>expected .*)$")
_KINDS = {"int": "an integer", "float": "a number"}


class UsageError(SpecError):
    """A command line argparse could not read, as field / value / fix."""

    def __init__(self, field: str, value: object, fix: str) -> None:
        super().__init__(field, value, fix)
        if value is None:  # "--model: expected one argument", not "--model=None: ..."
            self.args = (f"{field}: {fix}",)


class OneLineParser(argparse.ArgumentParser):
    """argparse, except that a mistake raises UsageError (printed as one line by main) instead of printing
    the usage block and exiting."""

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
