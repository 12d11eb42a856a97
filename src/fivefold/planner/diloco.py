"""DiLoCo in the search: on a cluster of identical `+` groups joined by a link, one outer replica per group.

The inner plan is the best plan of one group alone (its share of the global batch, a search of its own);
the DiLoCo plan repeats it on every group (dp = groups x inner dp, each group's ranks on its own devices).
Its cost (cost/diloco.py) adds the exposed outer exchange per step; it is recommended only when its time
to the synchronous plan's loss (step time x the token factor of the convergence penalty) is lower than the
best synchronous plan's step time.

H is fixed at SYNC_EVERY (the penalty table does not depend on H, so the search would otherwise always pick
the largest H); Streaming DiLoCo is tried with FRAGMENTS fragments overlapped by one step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from fivefold.cost import estimate
from fivefold.cost.diloco import DiLoCoCost, diloco_cost
from fivefold.cost.stack import SoftwareStack
from fivefold.spec.cluster import ClusterSpec
from fivefold.spec.diloco import DiLoCoSpec
from fivefold.spec.model import ModelSpec
from fivefold.spec.plan import Plan
from fivefold.spec.train import TrainSpec

SYNC_EVERY = 100  # inner steps between syncs: the middle of the range Charles et al. 2025 sweep
FRAGMENTS = 4  # Streaming DiLoCo's fragments (Douillard et al. 2025 use a few)


@dataclass(frozen=True)
class DiLoCoChoice:
    """The best DiLoCo setting across the cluster's groups, and whether it beats synchronous training."""

    plan: Plan  # the whole-cluster plan whose dp blocks are the outer groups
    cost: DiLoCoCost
    recommended: bool  # time to the same loss below the best synchronous plan's

    def flags(self) -> str:
        spec = self.cost.spec
        text = f"--dp-sync diloco --sync-every {spec.sync_every}"
        if spec.fragments > 1:
            text += f" --fragments {spec.fragments} --overlap {spec.overlap}"
        return text

    def line(self) -> str:
        cost = self.cost
        verdict = "recommended" if self.recommended else "not recommended"
        return (f"DiLoCo across the link between the {cost.spec.groups} groups ({self.plan.describe()}, "
                f"{self.flags()}): step {cost.step_time_s:.2f} s ({cost.exposed_per_step_s * 1e3:.1f} ms of outer "
                f"exchange exposed per step, {cost.outer_bytes_per_rank / 1e6:,.1f} MB sent per rank per sync), "
                f"{(cost.token_factor - 1) * 100:+.1f}% tokens to the same loss (loss gap {cost.loss_gap:+.2%}, "
                f"Charles et al. 2025): time to loss {cost.time_to_loss_ratio:.2f}x the synchronous plan's: "
                f"{verdict}")


def identical_groups(cluster: ClusterSpec) -> bool:
    first = cluster.groups[0]
    return len(cluster.groups) > 1 and all(g.device == first.device and g.world_size == first.world_size
                                           for g in cluster.groups)


def replicated_plan(inner: Plan, cluster: ClusterSpec, train: TrainSpec, groups: int) -> Plan:
    """`inner` (a plan of one group) on every group: outer group g's ranks on group g's devices."""
    per_group = inner.world_size
    placement = []
    whole = dataclasses.replace(inner, cluster=cluster, train=train, dp=inner.dp * groups, placement=(),
                                replica_micro_batches=inner.replica_micro_batches * groups)
    for rank in range(whole.world_size):
        coords = whole.coords(rank)
        group, inner_dp = divmod(coords["dp"], inner.dp)
        placement.append(group * per_group + inner.placement[inner.rank_of(**{**coords, "dp": inner_dp})])
    return dataclasses.replace(whole, placement=tuple(placement))


def best_diloco(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, sync_step_s: float,
                stack: SoftwareStack, headroom: float, choices: Any, search: Callable[..., Any]) -> DiLoCoChoice | None:
    """The DiLoCo setting for this search (module docstring), one group searched with `search` (the
    planner's own, passed in: it calls this); None when the groups differ or do not split the batch."""
    from fivefold.errors import FivefoldError

    groups = len(cluster.groups)
    if groups < 2 or not identical_groups(cluster) or train.global_batch % groups:
        return None
    one_group = ClusterSpec(groups=(cluster.groups[0],))
    group_train = dataclasses.replace(train, global_batch=train.global_batch // groups)
    try:
        inner = search(model, one_group, group_train, choices, headroom=headroom, top=1, stack=stack).candidates[0]
    except FivefoldError:
        return None  # no plan of one group fits, or the fixed choices rule one group out
    plan = replicated_plan(inner.plan, cluster, train, groups)
    sync = estimate(plan, stack, headroom)
    costs = [diloco_cost(plan, DiLoCoSpec(groups, SYNC_EVERY, fragments=p, overlap=t), sync, stack)
             for p, t in ((1, 0), (FRAGMENTS, 1))]
    best = min(costs, key=lambda c: c.time_to_loss_ratio)
    best = dataclasses.replace(best, sync_step_time_s=sync_step_s)  # against the best synchronous plan
    return DiLoCoChoice(plan, best, best.fits and best.time_to_loss_ratio < 1)
