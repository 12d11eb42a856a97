"""Paths the user names for output (--out, --out-dir, --metrics-file, --checkpoint-dir, --tensorboard): checked
before any work starts, without writing anything, and their missing parent folders made only when written.

A wrong kind (a folder where a file goes, a file where a folder goes, a file in the way of a parent folder)
or a place this user cannot write is one line: `error: --out=PATH: what is wrong; what would work`.
"""

from __future__ import annotations

import os
from pathlib import Path

from fivefold.errors import SpecError


def _nearest_existing(path: Path) -> Path:
    for parent in path.parents:
        if parent.exists():
            return parent
    return Path(".")


def _check_parent_chain(path: Path, flag: str, shown: str) -> None:
    """Every existing ancestor is a folder, and the nearest one is writable (the rest can be created)."""
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise SpecError(flag, shown, f"{parent} is a file, not a folder; choose a path under a folder")
    base = _nearest_existing(path)
    if not os.access(base, os.W_OK | os.X_OK):
        raise SpecError(flag, shown, f"cannot write into {base} (permission denied); choose a writable place")


def check_output_file(path: str | os.PathLike, flag: str, example: str = "out.toml") -> Path:
    """A file fivefold will write (or append to): not a folder; its folders exist or can be created."""
    file = Path(path)
    shown = str(path)
    if str(path).endswith(os.sep) or file.is_dir():
        raise SpecError(flag, shown, "is a folder; give a file name, e.g. " + str(file / example))
    if file.exists() and not os.access(file, os.W_OK):
        raise SpecError(flag, shown, "exists and is not writable; choose another file")
    _check_parent_chain(file, flag, shown)
    return file


def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """A folder fivefold will write into: not a file; it or its nearest existing parent is writable."""
    folder = Path(path)
    shown = str(path)
    if folder.exists() and not folder.is_dir():
        raise SpecError(flag, shown, "is a file; give a folder (it is created when missing)")
    if folder.is_dir():
        if not os.access(folder, os.W_OK | os.X_OK):
            raise SpecError(flag, shown, "is not writable; choose another folder")
        return folder
    _check_parent_chain(folder, flag, shown)
    return folder


def is_metrics_file(file: Path) -> bool:
    """Whether an existing file is one fivefold appends to: empty, or JSON lines whose first is a step record."""
    import json

    try:
        with open(file, "rb") as handle:
            first = handle.readline(1 << 20)
    except OSError:
        return False
    if not first.strip():
        return file.stat().st_size == len(first)
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and "step" in record


def check_metrics_file(path: str | os.PathLike, flag: str = "--metrics-file") -> Path:
    """An output file for step records that, when it exists, is already fivefold's own: a user's file (the
    training data, a notebook) is never appended to."""
    file = check_output_file(path, flag, "metrics.jsonl")
    if file.is_file() and not is_metrics_file(file):
        raise SpecError(flag, str(path), "exists and is not a fivefold metrics file (JSON lines of step records); "
                                         "give a new file name, fivefold only appends to its own")
    return file


def check_distinct_paths(outputs: list[tuple[str, str | None]], inputs: list[tuple[str, str | None]]) -> None:
    """No output is the same file or folder as another output or as an input (inputs may repeat: reading a
    file twice harms nothing): (flag, path) pairs, None for a flag not given."""
    seen: dict[Path, tuple[str, bool]] = {}  # path -> (first flag, whether it is an output)
    for number, (flag, path) in enumerate(outputs + inputs):
        if not path:
            continue
        resolved = Path(path).resolve()
        if resolved in seen and (number < len(outputs) or seen[resolved][1]):
            raise SpecError(flag, path, f"is the same path as {seen[resolved][0]}; give each its own place")
        seen.setdefault(resolved, (flag, number < len(outputs)))


def make_parents(path: str | os.PathLike, flag: str) -> Path:
    """Create the missing folders above `path` (call right before writing it)."""
    file = Path(path)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(flag, str(path), f"cannot create {file.parent} ({exc.strerror or exc})") from None
    return file


def make_dir(path: str | os.PathLike, flag: str) -> Path:
    """Create the folder `path` and its parents (call right before writing into it)."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(flag, str(path), f"cannot create it ({exc.strerror or exc})") from None
    return folder
