"""DiLoCo / Streaming DiLoCo in the simulator: the inner steps of every outer group and the outer exchanges.

`simulate --dp-sync diloco` replays one inner step of each outer group with the engine (each group is the plan
cut down to its own replicas and devices, cost/diloco.group_plan: its dp traffic stays on its own links), then
lays out one outer cycle: inner steps 1 .. H + T, every group stepping together at the pace of the slowest one.
After step s every fragment p with s mod H = its offset (spec/diloco.sends_at) starts its exchange: an all-reduce
of this rank's shard of that fragment's outer gradient with the other groups, over the link between them
(cost/diloco.outer_link), lasting the cost model's fragment time (cost/diloco.DiLoCoCost.fragment_exchange_s).
It is applied after step s + T, so the step after that waits for it when it has not landed: the only time the
outer loop costs. The last T steps drawn are the next cycle's first ones, where the fragments sent late in the
cycle land; the mean step of the cycle is therefore (drawn time - T inner steps) / H, which is the inner step +
P * max(0, fragment time - T * inner step) / H: the estimate's formula, with the simulated inner step.

Steps that neither send nor wait (nor apply) are drawn as one bar per rank ("inner steps"; one per step on a
group faster than the slowest, which waits after each), so a cycle of hundreds of steps stays a picture; the steps around each exchange are drawn pass by pass. Every rank of every
group shows the exchange on its communication row (thread "outer exchange" in the trace, with its bytes). The
memory curves include the outer weights and momentum (8 bytes per parameter of the rank's shard).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fivefold.cost.diloco import DiLoCoCost, group_plan, outer_link
from fivefold.errors import SpecError
from fivefold.sim.engine import SimResult, simulate_replicas
from fivefold.sim.from_plan import check_simulation_size, replica_inputs
from fivefold.sim.schedules import SPLIT_BACKWARD
from fivefold.sim.step_input import INNER_STEPS, OUTER_SYNC, Event
from fivefold.sim.summary import rank_result
from fivefold.spec.diloco import DiLoCoSpec, applies_at, sends_at
from fivefold.spec.plan import Plan


def group_labels(plan: Plan, groups: int, group: int) -> tuple[str, ...]:
    """'group 1 pp0: ranks 8-15' per pp rank of outer group `group`, with the ranks of the whole plan."""
    block = plan.dp // groups
    labels = []
    for pp_rank in range(plan.pp):
        ranks = sorted(plan.rank_of(pp=pp_rank, dp=group * block + d, cp=c, tp=t)
                       for d in range(block) for c in range(plan.cp) for t in range(plan.tp))
        span = (f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
                if ranks[-1] - ranks[0] == len(ranks) - 1 else f"{len(ranks)} ranks from {ranks[0]}")
        labels.append(f"group {group} pp{pp_rank}: {span}")
    return tuple(labels)


def cycle_starts(spec: DiLoCoSpec, inner_step: float, fragment_s: float) -> tuple[list[float], float, dict[int, tuple]]:
    """Start of each inner step 1 .. H + T of one outer cycle, the end of the drawing, and per fragment sent
    in the cycle (send step, apply step, exchange start, exchange end). Step s + 1 starts when step s ends and
    every fragment applied after step s has landed."""
    starts, exchanges, time = [], {}, 0.0
    for step in range(1, spec.sync_every + spec.overlap + 1):
        starts.append(time)
        end = time + inner_step
        if step <= spec.sync_every:
            for fragment in sends_at(step, spec):
                exchanges[fragment] = (step, step + spec.overlap, end, end + fragment_s)
        time = max([end] + [exchanges[p][3] for p in applies_at(step, spec) if p in exchanges])
    return starts, time, exchanges


def detailed_steps(spec: DiLoCoSpec, exchanges: dict[int, tuple]) -> set[int]:
    """Steps drawn pass by pass: every send step, every apply step and the step after it."""
    last = spec.sync_every + spec.overlap
    steps = {s for send, apply, _, _ in exchanges.values() for s in (send, apply, apply + 1)}
    return {s for s in steps if 1 <= s <= last}


def simulate_diloco(plan: Plan, cost: DiLoCoCost, stack: Any = None) -> SimResult:
    """One outer cycle of `plan` under DiLoCo (`cost` = cost/diloco.diloco_cost of the plan): module docstring."""
    from fivefold.cost import estimate

    spec = cost.spec
    inputs, inner = [], []
    for group in range(spec.groups):
        one = group_plan(plan, spec.groups, group)
        check_simulation_size(one)
        steps = replica_inputs(one, estimate(one, stack))
        labels = group_labels(plan, spec.groups, group) if len(steps) == 1 else None
        steps = [dataclasses.replace(s, rank_base_bytes=tuple(b + cost.memory_bytes for b in s.rank_base_bytes)
                                     if s.rank_base_bytes else (cost.memory_bytes,) * s.pp,
                                     rank_labels=labels or tuple(f"group {group} " + label for label in
                                                                 (s.rank_labels or [f"pp{r}" for r in range(s.pp)])))
                 for s in steps]
        inputs.append(steps)
        inner.append(simulate_replicas(steps))
    inner_step = max(result.step_time_s for result in inner)
    starts, drawn, exchanges = cycle_starts(spec, inner_step, cost.fragment_exchange_s)
    detailed = detailed_steps(spec, exchanges)
    last = len(starts)
    events: list[Event] = []
    rows: list[tuple[Any, int]] = []  # (StepInput, pp rank) of each row, in row order
    for steps, result in zip(inputs, inner):
        base = len(rows)
        rows.extend((steps[row // steps[0].pp], row % steps[0].pp) for row in range(len(result.ranks)))
        for row in range(len(result.ranks)):
            mine = [e for e in result.events if e.rank == row]
            step = 1
            while step <= last:
                if step in detailed:
                    shift = starts[step - 1]
                    events.extend(e._replace(rank=base + row, start=e.start + shift, end=e.end + shift) for e in mine)
                    step += 1
                    continue
                run_end = step
                while run_end + 1 <= last and run_end + 1 not in detailed:
                    run_end += 1
                # One bar for the run; a group faster than the pace waits after each step: a bar per step.
                paced = result.step_time_s >= inner_step * (1 - 1e-9)
                for first, final in ([(step, run_end)] if paced else [(s, s) for s in range(step, run_end + 1)]):
                    events.append(Event(base + row, "compute", INNER_STEPS, starts[first - 1],
                                        starts[final - 1] + result.step_time_s))
                step = run_end + 1
            events.extend(Event(base + row, "comm", OUTER_SYNC, start, end, stage=fragment)
                          for fragment, (_, _, start, end) in sorted(exchanges.items()))
    by_row: list[list[Event]] = [[] for _ in rows]
    for event in events:
        by_row[event.rank].append(event)
    for mine in by_row:
        mine.sort(key=lambda e: e.start)
    pipeline = max((e.end for e in events if e.lane == "compute"), default=0.0)
    split = inputs[0][0].schedule in SPLIT_BACKWARD
    # A row's pipeline bubble is its inner step's (over the cycle, the steps drawn as one bar have no passes).
    bubbles = [rank.bubble_fraction for result in inner for rank in result.ranks]
    ranks = [dataclasses.replace(rank_result(step, pp_rank, row, by_row[row], pipeline, drawn, split),
                                 bubble_fraction=bubbles[row]) for row, (step, pp_rank) in enumerate(rows)]
    mean_step = (drawn - spec.overlap * inner_step) / spec.sync_every
    link = outer_link(plan, spec.groups)
    fragment_bytes = cost.outer_bytes_per_rank / spec.fragments
    outer = {"groups": spec.groups, "sync_every": spec.sync_every, "fragments": spec.fragments,
             "overlap": spec.overlap, "outer_dtype": spec.outer_dtype, "steps_drawn": last,
             "inner_step_s": inner_step, "step_time_s": mean_step, "exposed_per_step_s": max(0.0, mean_step - inner_step),
             "fragment_bytes_per_rank": fragment_bytes, "fragment_exchange_s": cost.fragment_exchange_s,
             "link_ranks": link.size, "link_gbit_s": link.ring_bandwidth * 8 / 1e9,
             "exchanges": [{"fragment": p, "send_after_step": send, "apply_after_step": apply, "start_s": start,
                            "end_s": end} for p, (send, apply, start, end) in sorted(exchanges.items())]}
    title = (f"{inner[0].title} | DiLoCo: {spec.groups} groups, H={spec.sync_every}, {spec.fragments} fragment(s), "
             f"overlap {spec.overlap}; one cycle, steps 1-{last}")
    busiest = max(r.busiest_rank_s for r in inner)
    return SimResult(step_time_s=drawn, pipeline_time_s=pipeline, bubble_fraction=max(r.bubble_fraction for r in inner),
                     busiest_rank_s=busiest, ranks=ranks, events=[e for mine in by_row for e in mine], title=title,
                     schedule=inner[0].schedule, micro_batches=inner[0].micro_batches,
                     visits=sum(r.visits for r in inner), actions=sum(r.actions for r in inner),
                     replicas=sum(r.replicas for r in inner), outer=outer)


def simulate_diloco_plan(plan: Plan, spec: DiLoCoSpec, sync: Any, stack: Any = None,
                         stage_scale: dict[int, float] | None = None) -> tuple[SimResult, DiLoCoCost]:
    """`simulate --dp-sync diloco`: the cycle of `plan` under `spec` (DiLoCoSpec), and the cost model's DiLoCo
    numbers (`sync` = estimate(plan)) whose step_time_s the mean step is compared with."""
    from fivefold.cost.diloco import diloco_cost

    if stage_scale:
        raise SpecError("--stage-time", ",".join(f"{k}={v:g}" for k, v in stage_scale.items()),
                        "is not simulated with --dp-sync diloco (the groups' steps come from their own plans)")
    cost = diloco_cost(plan, spec, sync, stack)
    return simulate_diloco(plan, cost, stack), cost
