"""Mixed clusters: where the ranks of a plan go, and how much work each device gets.

A cluster is mixed when its groups differ (device type, NVLink or PCIe inside a node, NIC) or a slower
link joins them. Two ways to lay a plan over such groups; the search tries both, and the cost model,
which costs every pipeline rank on its own device and every collective on the links it crosses, decides:

- stages on groups (Holmes, Yang et al. 2024): ranks in pipeline-major order fill the groups one after
  another, so whole pipeline stages sit in one group, tensor- and data-parallel groups stay on the fast
  links inside it, and only point-to-point pipeline sends cross the slow link between groups. Layers
  per stage follow each stage's speed and memory (Metis, Um et al. 2024): a faster device gets more.
- replicas on groups (Cephalo, Guo et al. 2024): each data-parallel replica (a whole pipeline) sits in
  one group and gets micro-batches in proportion to its speed, so all replicas finish together. The
  gradient reduction crosses the slow link. The loss is divided by the global token count, so the
  summed gradients equal the even split's whatever each replica's share.

For stages on groups every group order is a candidate (up to 3 groups; beyond, identity, fastest-first
and slowest-first): the first stage holds the embedding and the most activations in flight, the last
the logits. The search screens the orders on the fastest variant (search._best_placement).
Sources: Holmes (Yang et al., ICPP 2024), Cephalo (Guo et al., arXiv 2411.01075, 2024), Metis (Um et
al., USENIX ATC 2024).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

from fivefold.cost.cache import IdentityCache
from fivefold.cost.comm import SELF, Topology, topology_of
from fivefold.cost.compute import Device
from fivefold.cost.layout import Layout, RankEnv, layer_costs, rank_envs, stage_owners
from fivefold.cost.stack import SoftwareStack
from fivefold.cost.results import Score
from fivefold.planner.space import balanced_layers, balanced_replicas
from fivefold.spec.cluster import ClusterSpec, NodeGroup
from fivefold.spec.plan import mesh_rank

STAGES, REPLICAS = "stages", "replicas"


@dataclass(frozen=True)
class PlacementOption:
    """One way to put a plan's ranks on a mixed cluster."""

    kind: str  # STAGES (whole pipeline stages per group) or REPLICAS (whole data-parallel replicas per group)
    order: tuple[int, ...]  # cluster groups in the order their devices are handed out
    devices: tuple[int, ...]  # rank -> cluster device (Plan.placement); () = identity


def _group_key(group: NodeGroup) -> tuple:
    device = group.device
    return (device.name, tuple(sorted(device.peak_flops.items())), device.memory_bytes, device.memory_bandwidth,
            group.gpus_per_node, group.intra_node_bandwidth, group.network_bandwidth, group.intra_node_latency,
            group.network_latency, id(group.calibration) if group.calibration else None)


def is_mixed(cluster: ClusterSpec) -> bool:
    """More than one kind of group, or a separate link between the groups."""
    if len(cluster.groups) < 2:
        return False
    between = cluster.between_groups_bandwidth is not None or cluster.between_groups_latency is not None
    return between or len({_group_key(g) for g in cluster.groups}) > 1


def _group_orders(cluster: ClusterSpec) -> list[tuple[int, ...]]:
    """Orders of the groups worth trying: all of them for up to 3 groups, else identity and by speed.
    Orders that only swap identical groups are the same layout and are left out."""
    count = len(cluster.groups)
    if count <= 3:
        orders = list(itertools.permutations(range(count)))
    else:
        by_speed = sorted(range(count), key=lambda g: -max(cluster.groups[g].device.peak_flops.values()))
        orders = [tuple(range(count)), tuple(by_speed), tuple(reversed(by_speed))]
    seen, out = set(), []
    for order in orders:
        kinds = tuple((_group_key(cluster.groups[g]), cluster.groups[g].nodes) for g in order)
        if kinds not in seen:
            seen.add(kinds)
            out.append(order)
    return out


def _devices_in_order(cluster: ClusterSpec, order: tuple[int, ...]) -> list[int]:
    starts = list(itertools.accumulate([0] + [g.world_size for g in cluster.groups]))
    return [d for g in order for d in range(starts[g], starts[g + 1])]


def placement_options(cluster: ClusterSpec, dp: int, tp: int, pp: int, cp: int) -> list[PlacementOption]:
    """Stages on groups in every useful group order, then (with dp > 1) replicas on groups. Without a
    pipeline there are no stages to place: replicas on groups (in the one, identity, order) is the plan."""
    identity = tuple(range(cluster.world_size))
    if pp == 1:
        return [PlacementOption(REPLICAS if dp > 1 else STAGES, tuple(range(len(cluster.groups))), ())]
    out = []
    for order in _group_orders(cluster):
        devices = tuple(_devices_in_order(cluster, order))  # pipeline-major ranks: rank i -> i-th device
        out.append(PlacementOption(STAGES, order, () if devices == identity else devices))
    if dp > 1:
        ordered = _devices_in_order(cluster, tuple(range(len(cluster.groups))))
        by_rank = [0] * cluster.world_size
        for p, d, c, t in itertools.product(range(pp), range(dp), range(cp), range(tp)):
            rank = mesh_rank(dp, cp, tp, p, d, c, t)
            by_rank[rank] = ordered[((d * pp + p) * cp + c) * tp + t]  # replica d on consecutive devices
        out.append(PlacementOption(REPLICAS, tuple(range(len(cluster.groups))),
                                   () if tuple(by_rank) == identity else tuple(by_rank)))
    return out


# --- per-group speed --------------------------------------------------------------------------------

_GROUP_ENVS: IdentityCache[list[RankEnv]] = IdentityCache(1024)


def group_envs(layout: Layout) -> list[RankEnv]:
    """A pipeline rank's view of each cluster group: its device, and tp/cp groups on the group's first
    devices (inside a node when they fit; running on into the next group when the group is smaller)."""
    topology = topology_of(layout.cluster)
    key = (layout.train.dtype, layout.tp, layout.cp)
    cached = _GROUP_ENVS.get(topology, key)
    if isinstance(cached, list):
        return cached
    envs: list[RankEnv] = []
    first, world = 0, layout.cluster.world_size
    for group in layout.cluster.groups:
        tp_link = topology.group_link([(first + i) % world for i in range(layout.tp)])
        cp_link = topology.group_link([(first + i * layout.tp) % world for i in range(layout.cp)])
        device = Device(group.device, layout.train.dtype, group.calibration)
        envs.append(RankEnv(device, group.device.memory_bytes, tp_link, cp_link, SELF, SELF, SELF))
        first += group.world_size
    return _GROUP_ENVS.put(topology, key, envs)


def group_costs(layout: Layout, stack: SoftwareStack) -> list[tuple]:
    """(layer, embedding, head) PassCosts of one micro-batch on each group's device. Expert all-to-all is
    left out (SELF), so for MoE layers these are lower bounds."""
    return [layer_costs(layout, env, stack)[:3] for env in group_envs(layout)]  # (layer, embedding, head)


def _seconds(cost) -> float:
    return cost.forward + cost.backward_input + cost.backward_weight + cost.recompute


def work_bound(layout: Layout, stack: SoftwareStack, micro_batches: int) -> tuple[float, list[float]]:
    """A lower bound on the step time of every placement and split, and the (F, B, W) of the whole model
    for one micro-batch on the fastest group (for the schedule bound).

    All micro-batches x layers of a step are shared by the world / (tp x cp) tensor-parallel groups; one
    in group g does a layer in t_g, so the step lasts at least M L / sum_g (n_g / t_g) (M = micro-batches
    over all replicas, n_g = tp groups in group g). For one device type this is m L / pp x t. A tp group
    straddling two groups runs at the slower one's pace, so counting each device at its own is optimistic."""
    costs = group_costs(layout, stack)
    width = layout.tp * layout.cp
    rate = sum(g.world_size / width / _seconds(c[0]) for g, c in zip(layout.cluster.groups, costs))
    bound = micro_batches * layout.dp * layout.model.layers / rate
    layer, embedding, head = min(costs, key=lambda c: _seconds(c[0]))
    sums = [layout.model.layers * getattr(layer, part) + getattr(embedding, part) + getattr(head, part)
            for part in ("forward", "backward_input", "backward_weight")]
    return bound, sums


# --- work in proportion to speed and memory ---------------------------------------------------------

def replica_shares(layout: Layout, stack: SoftwareStack, micro_batches: int) -> tuple[int, ...] | None:
    """Micro-batches per replica in proportion to the speed of the slowest group each replica touches;
    () when all are as fast, None when the schedule's rules leave no uneven split."""
    topology = topology_of(layout.cluster)
    per_group = [_seconds(c[0]) for c in group_costs(layout, stack)]
    seconds = []
    for d in range(layout.dp):
        ranks = layout.replica_ranks(d)
        groups = {topology.group_of[layout.placement[r] if layout.placement else r] for r in ranks}
        seconds.append(max(per_group[g] for g in groups))
    if max(seconds) <= min(seconds) * 1.0001:
        return ()  # every replica is as fast: the even split is the plan
    stages = layout.pp * layout.virtual_stages
    unit = layout.pp if layout.schedule in ("interleaved-1f1b", "zb-h1") and layout.pp > 1 else 1
    minimum = stages if layout.schedule in ("1f1b", "zbv") and layout.pp > 1 else 1
    return balanced_replicas(micro_batches * layout.dp, seconds, unit, minimum)


def speed_balanced_layers(layout: Layout, stack: SoftwareStack,
                          max_layers: list[int] | None = None) -> tuple[int, ...] | None:
    """Layers per stage so the slowest pipeline rank, on its own device, is as fast as possible."""
    envs = rank_envs(layout, topology_of(layout.cluster))
    owners = stage_owners(layout.schedule, layout.pp, layout.virtual_stages)
    costs = [layer_costs(layout, env, stack) for env in envs]
    per_rank = [_seconds(c[0]) for c in costs]
    scale = min(per_rank)
    first = _seconds(costs[owners[0]].embedding) / scale
    last = _seconds(costs[owners[-1]].head) / scale
    return balanced_layers(layout.model.layers, len(owners), round(first, 2), round(last, 2), owners,
                           [round(t / scale, 3) for t in per_rank], max_layers)


MEMORY_REFITS = 3  # layer moves tried before a stage that overflows memory gives the variant up


def fit_memory(score: Score, layout: Layout, stack: SoftwareStack,
               cost: Callable[[Layout], Score]) -> tuple[Score, Layout]:
    """A speed-balanced split that overflows some stage's memory moves layers to the stages with room
    (Metis: work in proportion to speed, subject to memory); `cost` scores a layout. The fullest rank is capped
    at the layers that would fit if its memory were proportional to its layers (an underestimate of the
    cut, as part of its memory is fixed), the rest re-balanced by speed, a few times. Hopeless cases are
    skipped: moving layers brings the fullest rank about down to an even share of them, no further, so a
    rank over its memory by more than its layers over that share (with 25% slack) is left as it is."""
    if score.fits or layout.num_stages == 1:
        return score, layout
    owners = stage_owners(layout.schedule, layout.pp, layout.virtual_stages)
    peak = [n for n, owner in zip(layout.layers_per_stage, owners) if owner == score.peak_pp_rank]
    even_share = layout.model.layers * len(peak) / layout.num_stages
    if score.peak_ratio > 1.25 * max(1.0, sum(peak) / even_share):
        return score, layout
    caps = [layout.model.layers] * layout.pp
    trial_score, trial = score, layout
    for _ in range(MEMORY_REFITS):
        rank = trial_score.peak_pp_rank
        held = sum(n for n, owner in zip(trial.layers_per_stage, owners) if owner == rank)
        caps[rank] = held - max(1, math.ceil(held * (1 - 1 / trial_score.peak_ratio)))
        split = speed_balanced_layers(trial, stack, caps)
        if split is None:
            break
        trial = copy_layout(trial, layers_per_stage=split)
        trial_score = cost(trial)
        if trial_score.fits:
            return trial_score, trial
    return score, layout


def roomier(a: Score, b: Score) -> bool:
    """Whether `a` is the better start for the variant search: it fits and is faster, or neither fits and
    it needs less of its memory."""
    if a.fits or b.fits:
        return a.fits and (not b.fits or a.step_time_s < b.step_time_s)
    return a.peak_ratio < b.peak_ratio


def copy_layout(layout: Layout, **changes: object) -> Layout:
    """A Layout with some fields changed (Layouts have no dataclasses.replace)."""
    return Layout(**{**{name: getattr(layout, name) for name in Layout.__slots__}, **changes})
