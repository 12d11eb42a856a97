"""Per-rank summary of a replayed step: busy, communication (exposed or not), idle, bubble, memory curve."""

from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.sim.schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from fivefold.sim.step_input import Event, StepInput

COMPUTE_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)


@dataclass
class RankResult:
    """What one pp rank did during the step."""

    rank: int
    label: str
    busy_s: float  # compute: F/B/I/W and the optimizer
    comm_s: float  # communication issued by this rank, overlapped or not
    exposed_comm_s: float  # communication while the compute stream had nothing to do
    idle_s: float  # neither computing nor communicating: waiting for other ranks
    bubble_fraction: float  # (pipeline time - own F/B/I/W time) / own F/B/I/W time
    peak_memory_bytes: float
    memory: list[tuple[float, float]] = field(default_factory=list)  # (time, bytes) steps
    busy_spans: list[tuple[float, float]] = field(default_factory=list)  # compute, merged where they touch
    comm_spans: list[tuple[float, float]] = field(default_factory=list)  # communication, merged likewise



def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping intervals."""
    merged: list[tuple[float, float]] = []
    low = high = 0.0
    for start, end in sorted(intervals):
        if merged and start <= high:
            if end > high:
                high = end
                merged[-1] = (low, high)
        elif end > start:
            low, high = start, end
            merged.append((low, high))
    return merged


def rank_result(step: StepInput, rank: int, row: int, mine: list[Event], pipeline_time: float, step_time: float,
                split: bool) -> RankResult:
    """Busy, communication, idle, bubble and memory of pp rank `rank` from its events (in start order),
    drawn as row `row` (replica * pp + rank). One pass over the events: a big plan has thousands per rank."""
    compute_spans, comm_spans, changes = [], [], []
    busy = own_pipeline = 0.0
    releases_activation = BACKWARD_WEIGHT if split else BACKWARD
    stages = step.stages
    held: set[int] = set()
    for _, lane, kind, start, end, stage, _, _ in mine:
        if lane != "compute":
            comm_spans.append((start, end))
            continue
        compute_spans.append((start, end))
        busy += end - start
        if kind in COMPUTE_KINDS:
            own_pipeline += end - start
        if stage < 0:
            continue
        held.add(stage)
        # Memory: activations live from the forward's start to the backward's (W's) end.
        if kind == FORWARD:
            changes.append((start, stages[stage].activation_bytes))
        elif kind == releases_activation:
            changes.append((end, -stages[stage].activation_bytes))
    compute = _merge(compute_spans)
    comm = _merge(comm_spans)
    comm_total = sum(end - start for start, end in comm)
    covered = sum(end - start for start, end in _merge(compute + comm))
    exposed = covered - sum(end - start for start, end in compute)
    label = step.rank_labels[rank] if step.rank_labels else f"pp{rank}"
    base = sum(stages[s].static_bytes for s in sorted(held))
    memory = _memory_curve(base + (step.rank_base_bytes[rank] if step.rank_base_bytes else 0.0), changes)
    return RankResult(rank=row, label=label, busy_s=busy, comm_s=comm_total, exposed_comm_s=exposed,
                      idle_s=max(0.0, step_time - covered),
                      bubble_fraction=(pipeline_time - own_pipeline) / own_pipeline if own_pipeline else 0.0,
                      peak_memory_bytes=max(b for _, b in memory), memory=memory, busy_spans=compute,
                      comm_spans=comm)


def _memory_curve(base: float, changes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(time, bytes) after each change, from `base` and (time, +/- bytes) changes."""
    changes.sort()  # by time; frees (negative) before allocations at the same instant
    curve, level = [(0.0, base)], base
    for time, delta in changes:
        level += delta
        if curve[-1][0] == time:  # one point per instant: frees and allocations at once net out
            curve[-1] = (time, level)
        else:
            curve.append((time, level))
    return curve
