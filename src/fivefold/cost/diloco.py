"""What DiLoCo / Streaming DiLoCo costs across the slow link, and what it saves (torch-free).

One outer group is the plan cut down to its own dp replicas on its own devices (`group_plan`): its inner
step is that plan's estimate (its dp traffic stays on the group's fast links). Every H steps each rank
all-reduces its shard of the outer gradient with its counterparts in the other groups, over the link
between the groups; Streaming DiLoCo sends 1/P of it at a time and hides each fragment behind `overlap`
steps of compute. Extra memory: the outer weights and momentum, fp32, of the rank's shard (the whole
replica's share of tp/pp, divided over the group's dp x cp ranks under ZeRO 1-3, as the runtime keeps it).

Convergence: DiLoCo with M replicas ends at a different loss than data-parallel training on the same tokens.
EVAL_LOSS is Table 4 of Charles et al. 2025, "Communication-Efficient Language Model Training Scales Reliably and
Robustly: Scaling Laws for DiLoCo" (arXiv:2503.09799v1): C4 validation loss of Data-Parallel and of DiLoCo with
M in {1, 2, 4, 8} (H = 30, outer Nesterov momentum 0.9, outer lr tuned over {0.2, ..., 1.0}, inner lr and batch
tuned per setting) at the Chinchilla token budget (20 tokens per parameter), for the seven swept sizes 35M to
2.4B, and the percentage difference Table 4 prints beside each (LOSS_GAP_PERCENT, what the gap interpolates;
the losses are kept to check it). Transcribed from a text copy of the paper's v1 PDF (section 4, Table 4). Beyond 2.4B the 2.4B row holds: the paper's
4B and 10B runs (Table 5, hyperparameters from its fits, M <= 4) agree (M = 2: -0.18% and -0.19%). H is
not an input: the laws fix H = 30, and its ablation (section 5.1, Figure 9) finds the loss rising with H once
H > 1, less steeply for larger models. `token_factor` turns the gap into the tokens DiLoCo needs to reach
data-parallel's loss, through the data term of the Chinchilla fit (Hoffmann et al. 2022, approach 3:
L = E + A / N^0.34 + B / D^0.28, E = 1.69, A = 406.4, B = 410.7): DiLoCo's curve is data-parallel's with
its tokens scaled by k. DiLoCo ending below data-parallel (M = 1, large models) is counted as no gain
(k >= 1): the planner never recommends it for a convergence benefit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fivefold.cost.comm import GroupLink, all_reduce_time, topology_of
from fivefold.cost.results import Estimate
from fivefold.cost.stack import SoftwareStack
from fivefold.errors import SpecError
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.diloco import DiLoCoSpec
from fivefold.spec.plan import Plan

# Charles et al. 2025 (arXiv:2503.09799v1), Table 4: evaluation loss of Data-Parallel, then of DiLoCo by
# replicas M, per model size (parameters).
EVAL_LOSS: dict[float, tuple[float, dict[int, float]]] = {
    35e6: (3.485, {1: 3.482, 2: 3.508, 4: 3.554, 8: 3.621}),
    90e6: (3.167, {1: 3.162, 2: 3.182, 4: 3.213, 8: 3.265}),
    180e6: (2.950, {1: 2.943, 2: 2.957, 4: 2.981, 8: 3.019}),
    335e6: (2.784, {1: 2.777, 2: 2.788, 4: 2.808, 8: 2.841}),
    550e6: (2.653, {1: 2.645, 2: 2.657, 4: 2.673, 8: 2.698}),
    1.3e9: (2.460, {1: 2.451, 2: 2.464, 4: 2.472, 8: 2.493}),
    2.4e9: (2.326, {1: 2.317, 2: 2.323, 4: 2.332, 8: 2.351}),
}
# Table 4's percentages as printed (from the unrounded losses, so a few differ by 0.1 from the rounded losses'
# ratio): what loss_gap interpolates.
LOSS_GAP_PERCENT: dict[float, dict[int, float]] = {
    35e6: {1: -0.1, 2: 0.7, 4: 2.0, 8: 3.9},
    90e6: {1: -0.1, 2: 0.5, 4: 1.5, 8: 3.1},
    180e6: {1: -0.2, 2: 0.3, 4: 1.1, 8: 2.3},
    335e6: {1: -0.3, 2: 0.1, 4: 0.9, 8: 2.0},
    550e6: {1: -0.3, 2: 0.2, 4: 0.7, 8: 1.7},
    1.3e9: {1: -0.4, 2: 0.2, 4: 0.5, 8: 1.3},
    2.4e9: {1: -0.4, 2: -0.1, 4: 0.3, 8: 1.1},
}
CHINCHILLA_E, CHINCHILLA_B, CHINCHILLA_BETA = 1.69, 410.7, 0.28
CHINCHILLA_A, CHINCHILLA_ALPHA = 406.4, 0.34
OUTER_STATE_BYTES_PER_PARAM = 8  # fp32 outer weights + fp32 momentum


def _interpolate(x: float, points: list[tuple[float, float]]) -> float:
    """Linear in x between the neighbouring points, clamped at the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def loss_gap(params: float, replicas: int) -> float:
    """DiLoCo's relative loss difference from data-parallel (0.007 = 0.7% higher), interpolated in log2 M
    and log N in LOSS_GAP_PERCENT; beyond 8 replicas the last doubling's step continues."""
    sizes = sorted(LOSS_GAP_PERCENT)

    def at_size(size: float) -> float:
        row = LOSS_GAP_PERCENT[size]
        points = [(math.log2(m), gap) for m, gap in sorted(row.items())]
        x = math.log2(max(1, replicas))
        if x > points[-1][0]:
            slope = points[-1][1] - points[-2][1]
            return points[-1][1] + slope * (x - points[-1][0])
        return _interpolate(x, points)
    return _interpolate(math.log(params), [(math.log(s), at_size(s)) for s in sizes]) / 100


def token_factor(params: float, tokens: float, gap: float) -> float:
    """k >= 1: DiLoCo reaches data-parallel's loss at `tokens` after k x tokens (module docstring)."""
    if gap <= 0:
        return 1.0
    loss = CHINCHILLA_E + CHINCHILLA_A / params ** CHINCHILLA_ALPHA + CHINCHILLA_B / tokens ** CHINCHILLA_BETA
    data_term = CHINCHILLA_B / tokens ** CHINCHILLA_BETA
    return ((data_term + gap * loss) / data_term) ** (1 / CHINCHILLA_BETA)


@dataclass(frozen=True)
class DiLoCoCost:
    """One DiLoCo setting of a plan, against synchronous DP of the same plan."""

    spec: DiLoCoSpec
    inner_step_s: float  # one group's step (its dp traffic on its own links)
    outer_bytes_per_rank: float  # bytes one rank sends in one full outer exchange (all fragments)
    outer_exchange_s: float  # seconds of one full outer exchange over the slow link
    fragment_exchange_s: float  # seconds of one fragment's exchange (the whole one with one fragment)
    exposed_per_step_s: float  # outer time not hidden behind compute, per inner step
    step_time_s: float  # inner step + exposed outer time
    sync_step_time_s: float  # synchronous DP of the same plan
    memory_bytes: float  # outer weights + momentum on the busiest rank
    fits: bool
    loss_gap: float  # relative loss difference at equal tokens (Charles et al. 2025)
    token_factor: float  # tokens to reach data-parallel's loss, relative
    sync_bytes_per_step: float  # bytes one rank sends per step for dp under synchronous DP (ring rule)

    @property
    def time_to_loss_ratio(self) -> float:
        """DiLoCo's time to data-parallel's loss / synchronous DP's (below 1: DiLoCo pays)."""
        return self.step_time_s * self.token_factor / self.sync_step_time_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self.spec), "inner_step_s": self.inner_step_s,
                "outer_bytes_per_rank": self.outer_bytes_per_rank, "outer_exchange_s": self.outer_exchange_s,
                "fragment_exchange_s": self.fragment_exchange_s,
                "exposed_per_step_s": self.exposed_per_step_s, "step_time_s": self.step_time_s,
                "sync_step_time_s": self.sync_step_time_s, "outer_memory_gib": self.memory_bytes / 2**30,
                "fits": self.fits, "loss_gap": self.loss_gap, "token_factor": self.token_factor,
                "time_to_loss_ratio": self.time_to_loss_ratio,
                "outer_bytes_per_step": self.outer_bytes_per_rank / self.spec.sync_every,
                "sync_bytes_per_step": self.sync_bytes_per_step}


def group_cluster(plan: Plan, groups: int, group: int) -> tuple[ClusterSpec, int]:
    """The devices of outer group `group` as a cluster of their own, and the index of its first device:
    one of the cluster's `+` groups, or an equal block of nodes (GPUs, on one node) of a one-group cluster."""
    cluster = plan.cluster
    if len(cluster.groups) == groups:
        first = sum(g.world_size for g in cluster.groups[:group])
        return ClusterSpec(groups=(cluster.groups[group],)), first
    only = cluster.groups[0]
    if len(cluster.groups) == 1 and only.nodes % groups == 0:
        block = dataclasses.replace(only, nodes=only.nodes // groups)
    elif len(cluster.groups) == 1 and only.nodes == 1 and only.gpus_per_node % groups == 0:
        block = dataclasses.replace(only, gpus_per_node=only.gpus_per_node // groups)
    else:
        raise SpecError("--diloco-groups", groups, f"outer groups must be the cluster's {len(cluster.groups)} "
                                                   "groups, or equal node blocks of a one-group cluster")
    return ClusterSpec(groups=(block,)), group * block.world_size


def group_plan(plan: Plan, groups: int, group: int) -> Plan:
    """Outer group `group` of `plan` alone: dp/groups replicas, its share of the batch, its own devices."""
    block = plan.dp // groups
    cluster, first = group_cluster(plan, groups, group)
    inner_ranks = [r for r in range(plan.world_size) if plan.coords(r)["dp"] // block == group]
    placement = tuple(plan.placement[r] - first for r in inner_ranks)
    if sorted(placement) != list(range(len(placement))):
        raise SpecError("--diloco-groups", groups, "the outer groups' ranks must sit on their own devices")
    replicas = plan.replica_micro_batches[group * block:(group + 1) * block] if plan.replica_micro_batches else ()
    rows = sum(plan.micro_batches_of_replica(r) * plan.micro_batch for r in range(group * block, (group + 1) * block))
    return dataclasses.replace(plan, cluster=cluster, dp=block, placement=placement, replica_micro_batches=replicas,
                               train=dataclasses.replace(plan.train, global_batch=rows))


def outer_link(plan: Plan, groups: int) -> GroupLink:
    """The link the outer all-reduce crosses: between the first rank of each group (its counterparts in the
    other groups sit on the same kind of link)."""
    block = plan.dp // groups
    return topology_of(plan.cluster).group_link([plan.placement[plan.rank_of(dp=g * block)] for g in range(groups)])


def diloco_cost(plan: Plan, spec: DiLoCoSpec, sync: Estimate, stack: SoftwareStack | None = None,
                total_tokens: float | None = None) -> DiLoCoCost:
    """DiLoCo of `plan` under `spec` against `sync` (estimate(plan)); `total_tokens` of the run (default:
    20 tokens per parameter, Chinchilla's compute-optimal budget) sets the convergence penalty."""
    from fivefold.cost.step import estimate

    inner = [estimate(group_plan(plan, spec.groups, g), stack) for g in range(spec.groups)]
    inner_step = max(e.step_time_s for e in inner)
    params = plan.model.num_params()
    # The outer state lives with the optimizer state: sharded over the group's dp x cp ranks under ZeRO.
    shard = params / (plan.tp * plan.pp * (plan.dp // spec.groups * plan.cp if plan.zero >= 1 else 1))
    outer_bytes = shard * spec.outer_bytes_per_element
    link = outer_link(plan, spec.groups)
    exchange = all_reduce_time(outer_bytes, link)
    per_fragment = all_reduce_time(outer_bytes / spec.fragments, link)
    exposed = spec.fragments * max(0.0, per_fragment - spec.overlap * inner_step) / spec.sync_every
    memory = shard * OUTER_STATE_BYTES_PER_PARAM
    busiest = max(inner, key=lambda e: e.memory.total)
    gap = loss_gap(params, spec.groups)
    tokens = total_tokens or 20.0 * params
    replica_bytes = 2 * (plan.dp * plan.cp - 1) / (plan.dp * plan.cp) * params / (plan.tp * plan.pp) * 4
    return DiLoCoCost(spec, inner_step, outer_bytes * 2 * (spec.groups - 1) / spec.groups, exchange, per_fragment,
                      exposed,
                      inner_step + exposed, sync.step_time_s, memory,
                      busiest.memory.total + memory <= busiest.capacity_bytes, gap, token_factor(params, tokens, gap),
                      replica_bytes)
