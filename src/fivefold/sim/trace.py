"""Chrome trace JSON of a simulated step (opens in Perfetto or chrome://tracing).

One process per pp rank, named by its label; threads: 0 compute, 1 sends to a higher rank, 2 sends to
a lower rank, 3 gradient reductions (and the tied-embedding all-reduce), 4 parameter gathers. Bars are
complete ("X") events in microseconds; memory is a counter ("C") track per rank, in GiB.
"""

from __future__ import annotations

import json
from pathlib import Path

from fivefold.sim.engine import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, EMBEDDING_SYNC, FORWARD, GRAD_REDUCE,
                                 OPTIMIZER, PARAM_GATHER, Event, SimResult)

GIB = 2**30
THREADS = {0: "compute", 1: "send to next rank", 2: "send to previous rank", 3: "gradient reduce",
           4: "parameter gather"}
EVENT_NAMES = {FORWARD: "forward", BACKWARD: "backward", BACKWARD_INPUT: "backward (input)",
               BACKWARD_WEIGHT: "backward (weight)", OPTIMIZER: "optimizer", GRAD_REDUCE: "gradient reduce",
               PARAM_GATHER: "parameter gather", EMBEDDING_SYNC: "tied-embedding all-reduce"}


def _thread_of(event: Event) -> int:
    if event.lane == "compute":
        return 0
    if event.peer >= 0:
        return 1 if event.peer > event.rank else 2
    return 4 if event.kind == PARAM_GATHER else 3


def _name_of(event: Event) -> str:
    name = EVENT_NAMES.get(event.kind, event.kind)
    if event.micro_batch >= 0:
        return f"{event.kind} s{event.stage} mb{event.micro_batch}"
    if event.stage >= 0:
        return f"{name} s{event.stage}"
    return name


def _event_json(event: Event) -> str:
    """One complete ("X") event as JSON text: formatted directly, a big plan has hundreds of thousands."""
    args = f'"kind":"{event.kind}"'
    if event.stage >= 0:
        args += f',"stage":{event.stage}'
    if event.micro_batch >= 0:
        args += f',"micro_batch":{event.micro_batch}'
    if event.peer >= 0:
        args += f',"to_rank":{event.peer}'
    return (f'{{"name":"{_name_of(event)}","cat":"{event.lane}","ph":"X","pid":{event.rank},'
            f'"tid":{_thread_of(event)},"ts":{event.start * 1e6!r},"dur":{(event.end - event.start) * 1e6!r},'
            f'"args":{{{args}}}}}')


def _trace_json(result: SimResult) -> str:
    """The whole trace as JSON text (events in the order chrome_trace lists them)."""
    parts: list[str] = []
    for rank in result.ranks:
        parts.append(json.dumps({"ph": "M", "name": "process_name", "pid": rank.rank, "tid": 0,
                                 "args": {"name": rank.label}}))
        parts.append(json.dumps({"ph": "M", "name": "process_sort_index", "pid": rank.rank, "tid": 0,
                                 "args": {"sort_index": rank.rank}}))
        for tid, thread in THREADS.items():
            parts.append(json.dumps({"ph": "M", "name": "thread_name", "pid": rank.rank, "tid": tid,
                                     "args": {"name": thread}}))
    parts.extend(map(_event_json, result.events))
    for rank in result.ranks:
        parts.extend(f'{{"name":"memory","ph":"C","pid":{rank.rank},"ts":{time * 1e6!r},'
                     f'"args":{{"GiB":{round(level / GIB, 6)!r}}}}}' for time, level in rank.memory)
    other = json.dumps({"title": result.title, "step_time_s": result.step_time_s,
                        "bubble_fraction": result.bubble_fraction})
    return '{"traceEvents":[' + ",\n".join(parts) + '],"displayTimeUnit":"ms","otherData":' + other + "}"


def chrome_trace(result: SimResult) -> dict:
    """The {"traceEvents": [...]} object of a simulated step."""
    return json.loads(_trace_json(result))


def write_chrome_trace(result: SimResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_trace_json(result))
    return path
