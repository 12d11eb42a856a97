"""From a Plan to a simulated step: the cost model's per-stage numbers become the engine's input.

`from_estimate(plan, estimate)` reads `fivefold.cost.estimate(plan)` (Estimate.stage_costs, one StageCost per
virtual stage; optimizer_s; rank_memory) and lays it on the plan's pipeline: stage -> pp rank by
Plan.stage_owner, rank labels from the plan's placement. The data-parallel collectives are timed per stage
with the cost model's own formulas and links (the Estimate only carries their per-rank total). `simulate_plan` runs it
(planner/rerank.py re-orders planner candidates by simulated step time).

Replicas: when the dp replicas differ (uneven `replica_micro_batches`, or pp ranks on different device types
per replica), every distinct one is simulated (sim/engine.simulate_replicas): its own micro-batches, its
stage compute scaled from the estimate's by the cost model's layer times on its own devices, gradient
reductions shared with the others. Replicas that are alike (same micro-batches, same device group on every
pp rank) are simulated once, as are all replicas of a homogeneous plan: a row then stands for all the
global ranks of one pp coordinate (tp and cp ranks of a stage move in lockstep).
"""

from __future__ import annotations

from typing import Any, Iterable

from fivefold.errors import SpecError
from fivefold.sim.engine import SimResult, StageTimes, StepInput, simulate_replicas
from fivefold.spec.plan import Plan


MAX_STAGE_SCALE = 1000.0  # a stage 1000x slower already leaves every other stage idle


def parse_stage_times(texts: Iterable[str], num_stages: int) -> dict[int, float]:
    """`--stage-time STAGE=SCALE` flags -> {stage: scale}; a later flag for the same stage wins."""
    scales: dict[int, float] = {}
    for text in texts:
        stage_text, sep, scale_text = text.partition("=")
        try:
            stage, scale = int(stage_text), float(scale_text)
        except ValueError:
            stage, scale = -1, 0.0
        if not sep or not 0 <= stage < num_stages or not 0 < scale <= MAX_STAGE_SCALE:
            raise SpecError("--stage-time", text, f"write STAGE=SCALE with STAGE in 0..{num_stages - 1} "
                                                  f"(virtual stages) and SCALE in (0, {MAX_STAGE_SCALE:g}], e.g. 0=1.5")
        scales[stage] = scale
    return scales


def rank_labels(plan: Plan, replicas: list[int] | None = None) -> tuple[str, ...]:
    """'pp0: ranks 0-3' per pp rank, with the device type(s) when the cluster mixes types; for the dp
    replicas `replicas` alone (alike ones, the first named) 'dp1 pp0: ranks 2-3 (+2 replicas alike)'."""
    mixed = len({g.device.name for g in plan.cluster.groups}) > 1
    labels = []
    for pp_rank in range(plan.pp):
        if replicas is None:  # every replica: pp is the outermost mesh dim
            block = plan.pipeline_ranks(pp_rank)
            first, count, name = block.start, len(block), f"pp{pp_rank}"
        else:
            first, count = plan.rank_of(pp=pp_rank, dp=replicas[0]), plan.cp * plan.tp
            name = f"dp{replicas[0]} pp{pp_rank}"
        ranks = [first + i for i in range(count)]
        text = f"{name}: rank {first}" if len(ranks) == 1 else f"{name}: ranks {ranks[0]}-{ranks[-1]}"
        if replicas is not None and len(replicas) > 1:
            text += f" (+{len(replicas) - 1} replicas alike)"
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
    owners = [plan.stage_owner(index) for index in range(plan.num_stages)]
    for index, layers in enumerate(plan.layers_per_stage):
        pp_rank = owners[index]
        # (vocabulary parallel: a rank's rows of both ends counted once, with its first stage)
        dense, expert = stage_params(layout, layers, index == 0, index == plan.num_stages - 1,
                                     holds_embedding=pp_rank == first_owner, vocab_rows=owners.index(pp_rank) == index)
        out.append(sync_seconds(layout, stack, envs[pp_rank], dense, expert))
    last_owner = plan.stage_owner(plan.num_stages - 1)
    devices = plan.placement or range(plan.world_size)
    tied = tied_embedding_seconds(layout, stack, topology, devices[plan.rank_of(pp=first_owner)],
                                  devices[plan.rank_of(pp=last_owner)])
    return out, tied


def distinct_replicas(plan: Plan) -> list[list[int]]:
    """The dp replicas grouped by what they run: same micro-batches and the same device group (the slowest of
    its tp and cp ranks) on every pp rank. One group for a homogeneous plan."""
    from fivefold.cost.comm import topology_of

    topology, dtype = topology_of(plan.cluster), plan.train.dtype
    speed = [g.device.flops(dtype) for g in plan.cluster.groups]
    groups: dict[tuple, list[int]] = {}
    for replica in range(plan.dp):
        devices = tuple(min((topology.group_of[plan.placement[plan.rank_of(pp=r, dp=replica, cp=c, tp=t)]]
                             for c in range(plan.cp) for t in range(plan.tp)), key=lambda g: (speed[g], g))
                        for r in range(plan.pp))
        groups.setdefault((plan.micro_batches_of_replica(replica), devices), []).append(replica)
    return list(groups.values())


def _compute_ratios(plan: Plan, stack: Any, replica: int) -> list[tuple[float, float, float]]:
    """Per pp rank: (F, B, W) of one layer on `replica`'s device over the same on the device the estimate
    costed that rank on (the cost model's own layer times; 1 where they are the same device)."""
    from fivefold.cost.comm import topology_of
    from fivefold.cost.compute import Device
    from fivefold.cost.layout import Layout, RankEnv, layer_costs, rank_envs

    layout, topology = Layout.of_plan(plan), topology_of(plan.cluster)
    envs = rank_envs(layout, topology)
    speed = [g.device.flops(plan.train.dtype) for g in plan.cluster.groups]
    ratios: list[tuple[float, float, float]] = []
    for r, env in enumerate(envs):
        group = min((topology.group_of[plan.placement[plan.rank_of(pp=r, dp=replica, cp=c, tp=t)]]
                     for c in range(plan.cp) for t in range(plan.tp)), key=lambda g: (speed[g], g))
        spec = plan.cluster.groups[group]
        own = RankEnv(Device(spec.device, plan.train.dtype, spec.calibration), env.capacity, env.tp, env.cp, env.ep,
                      env.replicas, env.expert_replicas)
        mine, costed = layer_costs(layout, own, stack)[0], layer_costs(layout, env, stack)[0]
        forward, backward, weight = (a / b if b > 0 else 1.0 for a, b in (
            (mine.forward, costed.forward),
            (mine.backward_input + mine.recompute, costed.backward_input + costed.recompute),
            (mine.backward_weight, costed.backward_weight)))
        ratios.append((forward, backward, weight))
    return ratios


def replica_inputs(plan: Plan, estimate: Any, stage_scale: dict[int, float] | None = None) -> list[StepInput]:
    """One engine input per distinct dp replica (module docstring); just from_estimate's when all are alike."""
    replicas = distinct_replicas(plan)
    step = from_estimate(plan, estimate, stage_scale)
    if len(replicas) == 1:
        return [step]
    from dataclasses import replace

    from fivefold.cost.stack import DEFAULT_STACK, STACKS

    stack = STACKS.get(getattr(estimate, "stack", DEFAULT_STACK), STACKS[DEFAULT_STACK])
    inputs = []
    for members in replicas:
        ratios = _compute_ratios(plan, stack, members[0])
        stages = tuple(replace(times, forward=times.forward * ratios[owner][0],
                               backward_input=times.backward_input * ratios[owner][1],
                               backward_weight=times.backward_weight * ratios[owner][2])
                       for times, owner in zip(step.stages, (plan.stage_owner(i) for i in range(plan.num_stages))))
        inputs.append(replace(step, micro_batches=plan.micro_batches_of_replica(members[0]), stages=stages,
                              rank_labels=rank_labels(plan, members)))
    return inputs


def from_estimate(plan: Plan, estimate: Any, stage_scale: dict[int, float] | None = None) -> StepInput:
    """The engine input of `plan` from its cost-model Estimate (the replica it costs: the slowest device of
    each pp rank, the pacing replica's micro-batches); `stage_scale` scales stage compute times."""
    costs = list(estimate.stage_costs)
    if len(costs) != plan.num_stages:
        raise SpecError("estimate.stage_costs", len(costs), f"needs one per virtual stage ({plan.num_stages})")
    stage_scale = stage_scale or {}
    for stage in stage_scale:
        if not 0 <= stage < plan.num_stages:
            raise SpecError("--stage-time", stage, f"the plan has virtual stages 0..{plan.num_stages - 1}")
    from fivefold.cost.stack import DEFAULT_STACK, STACKS, data_parallel_sync

    # The software stack the estimate assumed decides which collectives run when and what overlaps: the
    # same DataParallelSync the estimate follows.
    stack = STACKS.get(getattr(estimate, "stack", DEFAULT_STACK), STACKS[DEFAULT_STACK])
    sync = data_parallel_sync(stack, plan.zero, plan.pp)
    collectives, tied = _collectives(plan, stack)
    stages = []
    # The estimate carries each stage's CP seconds per micro-batch (forward + backward, with the forward's
    # again under full recompute); forward and backward exchange about the same volume.
    forward_share = 1.0 / (3.0 if plan.recompute == "full" else 2.0)
    vocab = _vocab_collectives(plan)
    for index, cost in enumerate(costs):
        scale = stage_scale.get(index, 1.0)
        reduce, gather = collectives[index]
        cp_seconds = float(getattr(cost, "cp_comm", 0.0) or 0.0)
        stages.append(StageTimes(
            forward=cost.forward * scale, backward_input=cost.backward_input * scale,
            backward_weight=cost.backward_weight * scale, send_activation=cost.send_activation,
            activation_bytes=cost.activation_bytes, static_bytes=cost.static_bytes,
            grad_reduce=reduce, reduce_every_micro_batch=sync.reduce_every_micro_batch, param_gather=gather,
            reshard_after_forward=sync.reshard_after_forward, reshard_after_backward=sync.reshard_after_backward,
            buckets=plan.layers_per_stage[index], cp_forward=cp_seconds * forward_share * scale,
            cp_backward=cp_seconds * (1.0 - forward_share) * scale,
            vocab_forward=vocab[index][0] * scale, vocab_backward=vocab[index][1] * scale))
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


def _vocab_collectives(plan: Plan) -> list[tuple[float, float]]:
    """Per virtual stage, the (forward, backward) seconds of vocabulary parallelism's collectives inside its
    passes: each rank's per micro-batch spread over its stages as the estimate spreads them (cost/vocab.py)."""
    if not plan.vocab_parallel or plan.pp <= 1:
        return [(0.0, 0.0)] * plan.num_stages
    from fivefold.cost.comm import topology_of
    from fivefold.cost.layout import Layout
    from fivefold.cost.vocab import pp_group_link, vocab_parallel_comm

    layout = Layout.of_plan(plan)
    comm = vocab_parallel_comm(layout, pp_group_link(layout, topology_of(plan.cluster)),
                               4 if plan.train.dtype == "fp32" else 2)
    owners = [plan.stage_owner(index) for index in range(plan.num_stages)]
    return [(comm.forward / owners.count(owner), comm.backward / owners.count(owner)) for owner in owners]


# Micro-batch x stage pairs of one step the simulator replays (each is a forward and a backward per rank, and
# a bar in the trace and picture): ~25 s on one core at the limit. A larger step is refused at once.
# The replay is linear in the passes (sim/engine.py): the 1T GPT's 65,536 (512 micro-batches x 128 stages) take
# ~3 s with the trace and picture; 500,000 take ~20 s and write a ~400 MB trace, past which a step is refused.
MAX_SIMULATED_PASSES = 500_000


def check_simulation_size(plan: Plan) -> None:
    passes = plan.num_micro_batches * plan.num_stages
    if passes > MAX_SIMULATED_PASSES:
        raise SpecError("plan.num_micro_batches", plan.num_micro_batches,
                        f"x {plan.num_stages} stages = {passes:,} passes per step, more than the simulator replays "
                        f"({MAX_SIMULATED_PASSES:,}); raise --micro-batch or lower --global-batch")


def simulate_plan(plan: Plan, stage_scale: dict[int, float] | None = None, estimate: Any = None) -> SimResult:
    """Simulate one step of `plan` with the cost model's durations (estimate computed unless given)."""
    check_simulation_size(plan)
    if estimate is None:
        from fivefold.cost import estimate as estimate_plan

        estimate = estimate_plan(plan)
    return simulate_replicas(replica_inputs(plan, estimate, stage_scale))
