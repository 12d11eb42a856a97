"""From a Plan to a simulated step: the cost model's per-stage numbers become the engine's input.

`from_estimate(plan, estimate)` reads `fivefold.cost.estimate(plan)` (Estimate.stage_costs, one StageCost per
virtual stage; optimizer_s; rank_memory) and lays it on the plan's pipeline: stage -> pp rank by
Plan.stage_owner, rank labels from the plan's placement. The data-parallel collectives are timed per stage
with the cost model's own formulas and links (the Estimate only carries their per-rank total). `simulate_plan` runs it,
`rerank` re-orders planner candidates by simulated step time.

One pipeline (one dp replica) is simulated; tp and cp ranks of a stage move in lockstep, so a row of the
picture stands for all the global ranks of one pp coordinate.
"""

from __future__ import annotations

from typing import Any, Iterable

from fivefold.errors import SpecError
from fivefold.sim.engine import SimResult, StageTimes, StepInput, simulate
from fivefold.spec.plan import Plan


def parse_stage_times(texts: Iterable[str], num_stages: int) -> dict[int, float]:
    """`--stage-time STAGE=SCALE` flags -> {stage: scale}; a later flag for the same stage wins."""
    scales: dict[int, float] = {}
    for text in texts:
        stage_text, sep, scale_text = text.partition("=")
        try:
            stage, scale = int(stage_text), float(scale_text)
        except ValueError:
            stage, scale = -1, 0.0
        if not sep or not 0 <= stage < num_stages or not scale > 0:
            raise SpecError("--stage-time", text, f"write STAGE=SCALE with STAGE in 0..{num_stages - 1} "
                                                  "(virtual stages) and SCALE > 0, e.g. 0=1.5")
        scales[stage] = scale
    return scales


def rank_labels(plan: Plan) -> tuple[str, ...]:
    """'pp0: ranks 0-3' per pp rank, with the device type(s) when the cluster mixes types."""
    mixed = len({g.device.name for g in plan.cluster.groups}) > 1
    labels = []
    for pp_rank in range(plan.pp):
        first = plan.rank_of(pp=pp_rank)
        ranks = [first + i for i in range(plan.dp * plan.cp * plan.tp)]  # pp is the outermost mesh dim
        text = f"pp{pp_rank}: rank {first}" if len(ranks) == 1 else f"pp{pp_rank}: ranks {ranks[0]}-{ranks[-1]}"
        if mixed:
            devices = dict.fromkeys(plan.cluster.group_of(plan.placement[r]).device.name for r in ranks)
            text += "\n" + "/".join(devices)
        labels.append(text)
    return tuple(labels)


def _schedule_of(plan: Plan) -> str:
    # Without a pipeline the runtime accumulates gradients micro-batch by micro-batch: forward then
    # backward of each, which is the 1F1B order on one rank.
    if plan.pp == 1 and plan.virtual_stages == 1 and plan.schedule == "gpipe":
        return "1f1b"
    return plan.schedule


def _collectives(plan: Plan, stack: Any) -> tuple[list[tuple[float, float]], float]:
    """Per virtual stage (one gradient reduction, one parameter gather) in seconds, and the tied-embedding
    all-reduce: the cost model's own collective formulas (cost/dataparallel.py) over the same links."""
    from fivefold.cost.comm import topology_of
    from fivefold.cost.dataparallel import sync_seconds, tied_embedding_seconds
    from fivefold.cost.layout import Layout, rank_envs, stage_params

    layout, topology = Layout.of_plan(plan), topology_of(plan.cluster)
    envs = rank_envs(layout, topology)
    first_owner = plan.stage_owner(0)
    out = []
    for index, layers in enumerate(plan.layers_per_stage):
        pp_rank = plan.stage_owner(index)
        dense, expert = stage_params(layout, layers, index == 0, index == plan.num_stages - 1,
                                     holds_embedding=pp_rank == first_owner)
        out.append(sync_seconds(layout, stack, envs[pp_rank], dense, expert))
    last_owner = plan.stage_owner(plan.num_stages - 1)
    devices = plan.placement or range(plan.world_size)
    tied = tied_embedding_seconds(layout, stack, topology, devices[plan.rank_of(pp=first_owner)],
                                  devices[plan.rank_of(pp=last_owner)])
    return out, tied


def from_estimate(plan: Plan, estimate: Any, stage_scale: dict[int, float] | None = None) -> StepInput:
    """The engine input of `plan` from its cost-model Estimate; `stage_scale` scales stage compute times."""
    costs = list(estimate.stage_costs)
    if len(costs) != plan.num_stages:
        raise SpecError("estimate.stage_costs", len(costs), f"needs one per virtual stage ({plan.num_stages})")
    stage_scale = stage_scale or {}
    for stage in stage_scale:
        if not 0 <= stage < plan.num_stages:
            raise SpecError("--stage-time", stage, f"the plan has virtual stages 0..{plan.num_stages - 1}")
    from fivefold.cost.stack import STACKS, data_parallel_sync

    # The software stack the estimate assumed decides which collectives run when and what overlaps: the
    # same DataParallelSync the estimate follows.
    stack = STACKS.get(getattr(estimate, "stack", "modern"), STACKS["modern"])
    sync = data_parallel_sync(stack, plan.zero, plan.pp)
    collectives, tied = _collectives(plan, stack)
    stages = []
    for index, cost in enumerate(costs):
        scale = stage_scale.get(index, 1.0)
        reduce, gather = collectives[index]
        stages.append(StageTimes(
            forward=cost.forward * scale, backward_input=cost.backward_input * scale,
            backward_weight=cost.backward_weight * scale, send_activation=cost.send_activation,
            activation_bytes=cost.activation_bytes, static_bytes=cost.static_bytes,
            grad_reduce=reduce, reduce_every_micro_batch=sync.reduce_every_micro_batch, param_gather=gather,
            reshard_after_forward=sync.reshard_after_forward, reshard_after_backward=sync.reshard_after_backward,
            buckets=plan.layers_per_stage[index]))
    base = tuple(m.transient + m.reserved for m in getattr(estimate, "rank_memory", ()))
    optimizer = float(getattr(estimate, "optimizer_s", 0.0) or 0.0)
    title = plan.describe() + f" on {plan.cluster.label}, {plan.model.name}"
    if stage_scale:
        title += " | what-if: " + ", ".join(f"stage {s} x{v:g}" for s, v in sorted(stage_scale.items()))
    # With uneven micro-batches per replica the estimate costs the replica that sets the pace; replay that one.
    micro_batches = int(getattr(estimate, "micro_batches", 0) or plan.num_micro_batches)
    return StepInput(schedule=_schedule_of(plan), pp=plan.pp, virtual_stages=plan.virtual_stages,
                     micro_batches=micro_batches, stages=tuple(stages),
                     optimizer=(optimizer,) * plan.pp, tied_embedding_sync=tied,
                     rank_base_bytes=base if len(base) == plan.pp else (), rank_labels=rank_labels(plan),
                     title=title, overlap_grad_reduce=sync.reduce_overlapped,
                     overlap_param_gather=sync.gather_overlapped, async_p2p=stack.async_p2p)


def simulate_plan(plan: Plan, stage_scale: dict[int, float] | None = None, estimate: Any = None) -> SimResult:
    """Simulate one step of `plan` with the cost model's durations (estimate computed unless given)."""
    if estimate is None:
        from fivefold.cost import estimate as estimate_plan

        estimate = estimate_plan(plan)
    return simulate(from_estimate(plan, estimate, stage_scale))


def rerank(candidates: list[Plan], n: int) -> list[tuple[Plan, SimResult]]:
    """Simulate the first `n` candidates and return them fastest first by simulated step time."""
    if n < 0:
        raise SpecError("--simulate-top", n, "must be >= 0")
    simulated = [(plan, simulate_plan(plan)) for plan in candidates[:n]]
    return sorted(simulated, key=lambda pair: pair[1].step_time_s)
