"""Shrinking and growing: a plan for another number of processes, keeping the training run the same.

When a run continues on M processes and its plan was made for another world size, the planner picks
the best plan for a cluster of M devices of the same type (one node, the same links), with the same
model and the same global batch: fewer data-parallel replicas mean more micro-batches each (more
gradient accumulation), so every step still trains on the same tokens and the loss curve continues.
The flags the user fixed are kept where they still fit M; the others are the planner's choice. The
micro-batch size is kept too (memory was sized for it). The
checkpoint is then resharded onto the new plan by the resume (runtime/checkpointing.py). No torch import.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from fivefold.errors import SpecError
from fivefold.planner import Choices, search
from fivefold.spec import ClusterSpec, Plan

DEGREES = ("dp", "tp", "pp")
CANDIDATES = 20  # plans the planner ranks; the first the runtime can run is taken


def cluster_of(plan: Plan, devices: int) -> ClusterSpec:
    """One node of `devices` devices of the plan's (first) device type, with its links."""
    group = dataclasses.replace(plan.cluster.groups[0], nodes=1, gpus_per_node=devices)
    return dataclasses.replace(plan.cluster, groups=(group,))


def fitting(fixed: Choices, devices: int) -> tuple[Choices, list[str]]:
    """`fixed` without the degrees that cannot fit `devices` processes, and what was dropped."""
    dropped, changes = [], {}
    product = 1
    for dim in DEGREES:
        value = getattr(fixed, dim)
        if value is not None and (devices % (product * value) != 0):
            dropped.append(f"--{dim} {value}")
            changes[dim] = None
        elif value is not None:
            product *= value
    if changes:
        changes["layers_per_stage"] = None
    return dataclasses.replace(fixed, **changes), dropped


def degrees_text(plan: Plan, other: Plan) -> str:
    shown = [dim for dim in DEGREES if dim == "dp" or getattr(plan, dim) > 1 or getattr(other, dim) > 1]
    return " ".join(f"{dim}{getattr(plan, dim)}" for dim in shown)


def replan_for_world(plan: Plan, nproc: int, fixed: Choices | None = None,
                     runnable: Callable[[Plan], None] | None = None) -> tuple[Plan, str]:
    """The best plan for `nproc` processes that `runnable` accepts (it raises SpecError otherwise), and
    the line that says what changed and why."""
    fixed = fixed or Choices()
    if fixed.sequence_parallel is None and plan.tp > 1 and not plan.sequence_parallel:
        fixed = dataclasses.replace(fixed, sequence_parallel=False)  # the run turned it off: keep it off
    # The micro-batch size is what memory was sized for: keep it, so fewer replicas mean more accumulation.
    micro_batch = fixed.micro_batch or plan.micro_batch
    fixed, dropped = fitting(dataclasses.replace(fixed, cp=1, ep=1, micro_batch=micro_batch), nproc)
    cluster = cluster_of(plan, nproc)
    result = search(plan.model, cluster, plan.train, fixed, top=CANDIDATES)
    chosen, first_problem = None, None
    for candidate in result.candidates:
        try:
            if runnable is not None:
                runnable(candidate.plan)
        except SpecError as exc:
            first_problem = first_problem or str(exc)
            continue
        chosen = candidate.plan
        break
    if chosen is None:
        raise SpecError("--nproc", nproc, f"no plan for {nproc} processes that the runtime can run was found "
                                          f"({first_problem or 'the planner found none that fits'})")
    before, after = plan.num_micro_batches, chosen.num_micro_batches
    accumulation = ("more" if after > before else "less" if after < before else "same") + \
        f" accumulation: {before} -> {after} micro-batches"
    line = (f"world size {plan.world_size} -> {nproc}: re-planned {degrees_text(plan, chosen)} -> "
            f"{degrees_text(chosen, plan)} ({accumulation}), global batch {plan.train.global_batch} kept")
    if dropped:
        line += f"; dropped {', '.join(dropped)} (does not fit {nproc} process{'es' if nproc > 1 else ''})"
    return chosen, line
