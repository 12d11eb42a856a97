"""The `--data` syntax: one source, or a weighted blend, each with an optional text field of its own.

    web/                                  one source; its text in --text-field
    0.7:web/,0.3:code.jsonl               a blend; weights are normalised
    0.7:a.jsonl@text,0.3:b.parquet@content  each source's own text field (the column of its rows)

Pure text handling, no torch and no file reading beyond "does this path exist" (a path that itself contains
'@' is read as a path when it exists), so the CLI, the run's checks and job files share one parser
(data/sources.py opens what it names; jobfile.py rewrites its paths relative to a job file).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable, NamedTuple

from fivefold.errors import SpecError

WEIGHTED = re.compile(r"^\s*([0-9.eE+-]+)\s*:(.+)$")


class DataSource(NamedTuple):
    weight: float  # as written (a single source: 1.0)
    path: str
    field: str | None  # the text column of this source's rows; None: --text-field


def split_field(item: str) -> tuple[str, str | None]:
    """'b.parquet@content' -> ('b.parquet', 'content'); 'b.parquet' -> ('b.parquet', None)."""
    head, at, field = item.rpartition("@")
    if not at or not head or not field or "/" in field or "\\" in field or Path(item).exists():
        return item, None
    return head, field


def parse_data_spec(spec: str, flag: str = "--data") -> list[DataSource]:
    """'0.7:web/,0.3:code.jsonl@content' -> [(0.7, 'web/', None), (0.3, 'code.jsonl', 'content')]; one path ->
    [(1.0, path, field)]."""
    items = spec.split(",")
    if len(items) == 1 and not WEIGHTED.match(items[0]):
        return [DataSource(1.0, *split_field(spec.strip()))]
    sources = []
    for item in items:
        match = WEIGHTED.match(item)
        if not match:
            raise SpecError(flag, spec, f"the blend item {item!r} has no weight; write WEIGHT:PATH for every "
                                        "source, e.g. 0.7:web/,0.3:code.jsonl")
        try:
            weight = float(match.group(1))
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise SpecError(flag, spec, f"the weight {match.group(1)!r} of {match.group(2)} must be a positive "
                                        "finite number")
        sources.append(DataSource(weight, *split_field(match.group(2).strip())))
    return sources


def format_data_spec(sources: list[DataSource], blended: bool) -> str:
    """The --data text of `sources` (parse_data_spec's inverse); `blended`: write the weights."""
    def item(source: DataSource) -> str:
        text = source.path + (f"@{source.field}" if source.field else "")
        return f"{source.weight!r}:{text}" if blended else text
    return ",".join(item(source) for source in sources)


def map_data_paths(spec: str, change: Callable[[str], str]) -> str:
    """The same --data with every path passed through `change` (weights and fields kept)."""
    sources = parse_data_spec(spec)
    blended = len(sources) > 1 or bool(WEIGHTED.match(spec.split(",")[0]))
    return format_data_spec([source._replace(path=change(source.path)) for source in sources], blended)


def data_paths(spec: str | None) -> list[str]:
    """The files and folders --data names (fields and weights left out); [] for None (the built-in corpus)."""
    if not spec:
        return []
    try:
        return [source.path for source in parse_data_spec(spec)]
    except SpecError:  # a bad blend is named by the data checks, with the fix
        return []
