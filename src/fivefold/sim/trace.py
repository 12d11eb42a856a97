"""Chrome trace JSON of a simulated step (opens in Perfetto or chrome://tracing).

One process per pp rank, named by its label; threads: 0 compute, 1 sends to a higher rank, 2 sends to
a lower rank, 3 gradient reductions (and the tied-embedding all-reduce), 4 parameter gathers, 6 DiLoCo's outer
exchanges (sim/diloco.py; args: the fragment and the bytes this rank sends). Bars are
complete ("X") events in microseconds (to the nanosecond); memory is a counter ("C") track per rank, in GiB.
"""

from __future__ import annotations

import json
from pathlib import Path

from fivefold.sim.engine import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, EMBEDDING_SYNC, FORWARD, GRAD_REDUCE,
                                 OPTIMIZER, PARAM_GATHER, Event, SimResult)
from fivefold.sim.step_input import INNER_STEPS, OUTER_SYNC
from fivefold.spec.units import GIB

THREADS = {0: "compute", 1: "send to next rank", 2: "send to previous rank", 3: "gradient reduce",
           4: "parameter gather", 5: "context-parallel / vocabulary collectives (inside compute)",
           6: "outer exchange (DiLoCo, between the groups)"}
EVENT_NAMES = {FORWARD: "forward", BACKWARD: "backward", BACKWARD_INPUT: "backward (input)",
               BACKWARD_WEIGHT: "backward (weight)", OPTIMIZER: "optimizer", GRAD_REDUCE: "gradient reduce",
               PARAM_GATHER: "parameter gather", EMBEDDING_SYNC: "tied-embedding all-reduce",
               OUTER_SYNC: "outer exchange fragment", INNER_STEPS: "inner steps"}


def _events_json(events: list[Event], outer_bytes: float = 0.0) -> list[str]:
    """Complete ("X") events as JSON text, formatted directly: a big plan has hundreds of thousands, so one
    loop and no call per event. Thread as in the module docstring; name "F s3 mb7" for a pass of a
    micro-batch, else the collective's name and its stage."""
    out: list[str] = []
    append = out.append
    for rank, lane, kind, start, end, stage, micro_batch, peer in events:
        # Whole nanoseconds, so that a bar ending where the next one starts is written ending there.
        start_ns = int(start * 1e9 + 0.5)
        ts, dur = start_ns / 1e3, (int(end * 1e9 + 0.5) - start_ns) / 1e3
        if lane == "compute" and micro_batch >= 0:  # most events: one f-string each
            append(f'{{"name":"{kind} s{stage} mb{micro_batch}","cat":"compute","ph":"X","pid":{rank},"tid":0,'
                   f'"ts":{ts:.3f},"dur":{dur:.3f},"args":{{"kind":"{kind}","stage":{stage},'
                   f'"micro_batch":{micro_batch}}}}}')
            continue
        if peer >= 0:  # a send of one micro-batch's activation or gradient
            append(f'{{"name":"{kind} s{stage} mb{micro_batch}","cat":"comm","ph":"X","pid":{rank},'
                   f'"tid":{1 if peer > rank else 2},"ts":{ts:.3f},"dur":{dur:.3f},"args":{{"kind":"{kind}",'
                   f'"stage":{stage},"micro_batch":{micro_batch},"to_rank":{peer}}}}}')
            continue
        tid = (0 if lane == "compute" else 5 if lane == "cp" else 4 if kind == PARAM_GATHER else 6 if kind == OUTER_SYNC
               else 3)
        if micro_batch >= 0:
            name = f"{kind} s{stage} mb{micro_batch}"
            args = f'"kind":"{kind}","stage":{stage},"micro_batch":{micro_batch}'
        elif kind == OUTER_SYNC:  # stage = the fragment; the bytes this rank sends for it
            name = f"{EVENT_NAMES[kind]} {stage}"
            args = f'"kind":"{kind}","fragment":{stage},"bytes":{outer_bytes:.0f}'
        else:
            name = EVENT_NAMES.get(kind, kind) + (f" s{stage}" if stage >= 0 else "")
            args = f'"kind":"{kind}"' + (f',"stage":{stage}' if stage >= 0 else "")
        append(f'{{"name":"{name}","cat":"{lane}","ph":"X","pid":{rank},"tid":{tid},"ts":{ts:.3f},'
               f'"dur":{dur:.3f},"args":{{{args}}}}}')
    return out


def _trace_json(result: SimResult) -> list[str]:
    """The whole trace as JSON text, in pieces to concatenate (events in the order chrome_trace lists them)."""
    parts: list[str] = []
    for rank in result.ranks:
        parts.append(json.dumps({"ph": "M", "name": "process_name", "pid": rank.rank, "tid": 0,
                                 "args": {"name": rank.label}}))
        parts.append(json.dumps({"ph": "M", "name": "process_sort_index", "pid": rank.rank, "tid": 0,
                                 "args": {"sort_index": rank.rank}}))
        for tid, thread in THREADS.items():
            parts.append(json.dumps({"ph": "M", "name": "thread_name", "pid": rank.rank, "tid": tid,
                                     "args": {"name": thread}}))
    parts.extend(_events_json(result.events, result.outer["fragment_bytes_per_rank"] if result.outer else 0.0))
    for rank in result.ranks:
        parts.extend(f'{{"name":"memory","ph":"C","pid":{rank.rank},"ts":{time * 1e6:.3f},'
                     f'"args":{{"GiB":{level / GIB:.6f}}}}}' for time, level in rank.memory)
    other = json.dumps({"title": result.title, "step_time_s": result.step_time_s,
                        "bubble_fraction": result.bubble_fraction})
    # Three pieces, so that a big trace is written without copying its tens of megabytes once more.
    return ['{"traceEvents":[', ",\n".join(parts), '],"displayTimeUnit":"ms","otherData":' + other + "}"]


def chrome_trace(result: SimResult) -> dict:
    """The {"traceEvents": [...]} object of a simulated step."""
    return json.loads("".join(_trace_json(result)))


def write_chrome_trace(result: SimResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for piece in _trace_json(result):
            handle.write(piece)
    return path
