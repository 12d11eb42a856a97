"""A traced step, measured, in the simulator's terms: the same events, the same parts of a step.

One row per pipeline rank, as the simulator draws it: the global rank rank_of(pp=i) (dp, cp and tp
coordinate 0) stands for its pp coordinate, whose other ranks move in lockstep with it. Times are
seconds from the start of the step on its earliest rank.

Parts of one rank's step (`step_parts`), in seconds per step, measured and simulated alike:
  (kind, stage)  the summed F, B, I or W actions of that stage;
  optimizer      the optimizer step;
  other          the rest of the rank's step: pipeline bubble, exposed communication (waiting for a
                 receive, the gradient reduction, the clipping all-reduce) and host work.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from fivefold.sim.engine import COMPUTE_KINDS, GRAD_REDUCE, OPTIMIZER, Event, SimResult
from fivefold.spec import Plan

STEP = "step"  # runtime/trace.py's span of a whole step
OTHER = "other"
KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)"}


@dataclass
class TracedStep:
    """Every rank's spans of one traced step."""

    step: int
    origin: float  # wall-clock start of the step on its earliest rank
    length: float  # from origin until the last rank's step ends
    spans: list[dict]


def pipeline_rows(plan: Plan) -> list[int]:
    """The global rank drawn for each pipeline rank."""
    return [plan.rank_of(pp=pp_rank) for pp_rank in range(plan.pp)]


def split_by_step(trace: list[dict], warmup_steps: int) -> list[TracedStep]:
    """The traced steps after the warm-up (all of them when every traced step is a warm-up step)."""
    by_step: dict[int, list[dict]] = {}
    for span in trace:
        by_step.setdefault(int(span["step"]), []).append(span)
    steps = []
    for step, spans in sorted(by_step.items()):
        whole = [s for s in spans if s["kind"] == STEP] or spans
        origin = min(s["start"] for s in whole)
        steps.append(TracedStep(step, origin, max(s["end"] for s in whole) - origin, spans))
    return [s for s in steps if s.step > warmup_steps] or steps


def typical_step(steps: list[TracedStep]) -> TracedStep:
    """The traced step of median length (the earlier one of the middle two)."""
    ordered = sorted(steps, key=lambda s: s.length)
    return ordered[(len(ordered) - 1) // 2]


def measured_events(plan: Plan, step: TracedStep) -> list[Event]:
    """The step's spans of the drawn ranks as simulator events (row = pp rank)."""
    row_of = {rank: row for row, rank in enumerate(pipeline_rows(plan))}
    events = []
    for span in step.spans:
        if span["rank"] not in row_of or span["kind"] == STEP:
            continue
        lane = "comm" if span["kind"] == GRAD_REDUCE else "compute"
        events.append(Event(row_of[span["rank"]], lane, span["kind"], span["start"] - step.origin,
                            span["end"] - step.origin, int(span["stage"]), int(span["micro_batch"])))
    return sorted(events, key=lambda e: (e.rank, e.start))


def _parts(events: list[Event], step_seconds: float) -> dict:
    parts: dict = {}
    for event in events:
        if event.kind in COMPUTE_KINDS:
            key = (event.kind, event.stage)
        elif event.kind == OPTIMIZER:
            key = OPTIMIZER
        else:
            continue
        parts[key] = parts.get(key, 0.0) + event.end - event.start
    parts[OTHER] = max(0.0, step_seconds - sum(parts.values()))
    return parts


def simulated_parts(result: SimResult) -> list[dict]:
    """step_parts of every pp rank of a simulated step."""
    return [_parts([e for e in result.events if e.rank == row], result.step_time_s) for row in range(len(result.ranks))]


def measured_parts(plan: Plan, steps: list[TracedStep]) -> list[dict]:
    """step_parts of every pp rank, the median over `steps` of each part."""
    per_step = []
    rows = pipeline_rows(plan)
    for step in steps:
        events = measured_events(plan, step)
        parts = []
        for row, rank in enumerate(rows):
            own = [s for s in step.spans if s["rank"] == rank and s["kind"] == STEP]
            seconds = own[0]["end"] - own[0]["start"] if own else step.length
            parts.append(_parts([e for e in events if e.rank == row], seconds))
        per_step.append(parts)
    medians = []
    for row in range(len(rows)):
        keys = dict.fromkeys(k for parts in per_step for k in parts[row])
        medians.append({k: statistics.median(parts[row].get(k, 0.0) for parts in per_step) for k in keys})
    return medians


def count_of(events: list[Event], row: int, key) -> int:
    """How many actions make up part `key` of a row (micro-batches of a stage; 1 for optimizer/other)."""
    if not isinstance(key, tuple):
        return 1
    return sum(1 for e in events if e.rank == row and (e.kind, e.stage) == key)


def part_name(key) -> str:
    if isinstance(key, tuple):
        return f"{KIND_NAMES.get(key[0], key[0])}, stage {key[1]}"
    return "optimizer" if key == OPTIMIZER else "other: bubble, exposed communication, host work"


def busiest_row(parts: list[dict]) -> int:
    """The pp rank with the most F/B/I/W seconds."""
    return max(range(len(parts)), key=lambda row: sum(v for k, v in parts[row].items() if isinstance(k, tuple)))
